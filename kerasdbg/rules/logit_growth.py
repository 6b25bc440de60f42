"""`LogitGrowth`: attention logits that grow until a transformer diverges."""

from __future__ import annotations

import collections
import math
from typing import Dict, Optional

from kerasdbg import _validation as check
from kerasdbg.records import tags as _tags
from kerasdbg.rules.rule import Rule, listing

ATTENTION = "max_attention_logit"
OUTPUT = "max_output_logit"


class LogitGrowth(Rule):
    """Fires when the largest attention logit grows too large, or too fast.

    Reads `step/max_attention_logit`: the largest logit `q k^T / sqrt(key_dim)`
    of a `MultiHeadAttention` layer at each step (over the positions its mask
    lets through; `step/<layer>/max_attention_logit` per layer when the model
    has several), which `StopOnRule` records at every step when this rule is
    among its rules (on TensorFlow). Attention logits that keep growing make
    the softmax one-hot and precede the loss divergence of large
    transformers. The rule fires at the first step where a layer's largest
    logit is above `max_logit`, or (`factor`) above `min_logit` and more than
    `factor` times its value `window` steps before. With `max_output_logit`,
    the largest output of the model (`step/max_output_logit`: the logits
    when the model outputs logits) above it fires too.

    Args:
        max_logit: the largest attention logit allowed. Defaults to `50.0`.
        factor: the growth over `window` steps that fires, or None. Defaults
            to `10.0`.
        window: the steps the growth is measured over. Defaults to `100`.
        min_logit: growth counts only from this logit up: logits start near
            0 and grow while a model learns to attend (a two-layer GPT-2
            learning a copy task: from 0.5 to 5.5 in 100 steps, healthy).
            Defaults to `25.0`.
        max_output_logit: the largest output allowed, or None to leave the
            output alone. Defaults to `None`.

    Examples:
        >>> from kerasdbg.rules import LogitGrowth
        >>> rule = LogitGrowth(window=2)
        >>> [rule.check(s, {"step/max_attention_logit": v}) for s, v in [(1, 2.0), (2, 3.0)]]
        [None, None]
        >>> rule.check(3, {"step/max_attention_logit": 60.0}).reason
        'LogitGrowth at step 3: the largest attention logit is above 50: step/max_attention_logit=60'
        >>> LogitGrowth(window=2).check(9, {"step/max_output_logit": 1e4}) is None
        True
    """

    every_step = True

    def __init__(self, max_logit: float = 50.0, factor: Optional[float] = 10.0,
                 window: int = 100, min_logit: float = 25.0,
                 max_output_logit: Optional[float] = None):
        owner = type(self).__name__
        self.max_logit = check.number(owner, "max_logit", max_logit, minimum=0.0,
                                      exclusive_minimum=True)
        self.factor = None if factor is None else check.number(
            owner, "factor", factor, minimum=1.0, exclusive_minimum=True)
        self.window = check.positive_int(owner, "window", window)
        self.min_logit = check.number(owner, "min_logit", min_logit, minimum=0.0,
                                      exclusive_minimum=True)
        self.max_output_logit = None if max_output_logit is None else check.number(
            owner, "max_output_logit", max_output_logit, minimum=0.0, exclusive_minimum=True)
        self.reset()

    @property
    def requires(self):
        needed = ((_tags.STEP, ATTENTION),)
        return needed + (((_tags.STEP, OUTPUT),) if self.max_output_logit is not None else ())

    def reset(self) -> None:
        self._history: Dict[str, collections.deque] = {}

    def get_config(self) -> dict:
        return {"max_logit": self.max_logit, "factor": self.factor, "window": self.window,
                "min_logit": self.min_logit, "max_output_logit": self.max_output_logit}

    def check(self, step, record):
        above, grown = {}, {}
        for tag, value in record.items():
            if not _tags.is_per_optimizer(tag, _tags.STEP, ATTENTION):
                continue
            value = float(value)
            history = self._history.setdefault(tag, collections.deque(maxlen=self.window + 1))
            history.append(value)
            if not math.isfinite(value):
                continue  # -inf: every position masked; NaN: the NaN rules' to say
            if value > self.max_logit:
                above[tag] = value
            elif self.factor is not None and len(history) == self.window + 1 and \
                    value >= self.min_logit and value > self.factor * max(history[0], 0.0):
                grown[tag] = value
        said = []
        if above:
            said.append(f"the largest attention logit is above {self.max_logit:g}: "
                        f"{listing(above)}")
        if grown:
            said.append(f"the largest attention logit grew more than {self.factor:g} x in "
                        f"{self.window} steps (to at least {self.min_logit:g}): "
                        f"{listing(grown)}")
        output = record.get(_tags.step_scalar(OUTPUT))
        if self.max_output_logit is not None and output is not None and \
                math.isfinite(output) and output > self.max_output_logit:
            said.append(f"the largest output is above {self.max_output_logit:g}: "
                        f"{_tags.step_scalar(OUTPUT)}={output:.4g}")
            above[_tags.step_scalar(OUTPUT)] = float(output)
        if not said:
            return None
        return self.verdict(step, "; ".join(said), {**above, **grown})
