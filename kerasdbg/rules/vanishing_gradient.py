"""`VanishingGradient`: gradients whose mean magnitude is below a threshold."""

from __future__ import annotations

import math

from kerasdbg import _validation as check
from kerasdbg.rules._construction import Construction
from kerasdbg.rules.rule import Rule, values_of


class VanishingGradient(Rule):
    """Fires when the mean |gradient| of variables falls below `threshold`.

    Reads `gradients/<variable>/mean_abs` (record it with
    `GradientStatistics(stats=[..., "mean_abs"])`, one of the defaults) and,
    when recorded, `zero_fraction`: the mean is then taken over the non-zero
    elements, so the rows of an embedding that the batch did not touch do
    not count as vanishing. NaN values are left to `ExplodingTensor`.

    Gradients that are zero by construction in a healthy network are not a
    fault: rounding noise, 1000 times below another variable of their layer
    at every step the rule has seen (the bias of a layer followed by a
    normalization, the key bias of `MultiHeadAttention`), or exactly zero
    from the first step while most variables learn (an output head the loss
    does not use). Each is reported once, as an "info" verdict, and watched
    again once it learns. A gradient that was healthy and then vanished, or
    a whole layer too small (a deep sigmoid stack), is a fault.

    Args:
        threshold: the mean |gradient| below which a variable's gradient has
            vanished (SageMaker Debugger's default). Defaults to `1e-7`.
        require: "any" fires when any variable's gradient vanished, "all"
            only when every variable's did. Defaults to `"any"`.

    Examples:
        >>> from kerasdbg.rules import VanishingGradient
        >>> rule = VanishingGradient(threshold=1e-7)
        >>> rule.check(1, {"gradients/m/d1/kernel/mean_abs": 0.2,
        ...                "gradients/m/d2/kernel/mean_abs": 0.1}) is None
        True
        >>> rule.check(2, {"gradients/m/d1/kernel/mean_abs": 2e-9,
        ...                "gradients/m/d2/kernel/mean_abs": 0.1}).reason
        'VanishingGradient at step 2: mean |gradient| below 1e-07 for 1 of 2 variables: m/d1/kernel=2e-09'
        >>> rule = VanishingGradient()  # a bias followed by BatchNormalization:
        >>> rule.check(1, {"gradients/m/conv/kernel/mean_abs": 0.01,
        ...                "gradients/m/conv/bias/mean_abs": 3e-11}) is None
        True
        >>> print(rule.take_notes()[0].reason)
        VanishingGradient at step 1: zero by construction, not a fault (mean |gradient| below 1e-07, and at every step 1000 times below another variable of its layer or exactly 0 from the first): m/conv/bias=3e-11
    """

    requires = (("gradients", "mean_abs"),)

    def __init__(self, threshold: float = 1e-7, require: str = "any"):
        owner = type(self).__name__
        self.threshold = check.number(owner, "threshold", threshold, minimum=0.0)
        self.require = check.one_of(owner, "require", require, ("any", "all"))
        self.reset()

    def reset(self):
        self._construction = Construction()

    def check(self, step, record):
        values = {k: v for k, v in values_of(record, "gradients", "mean_abs") if not math.isnan(v)}
        zeros = dict(values_of(record, "gradients", "zero_fraction"))
        # Over the non-zero elements: untouched embedding rows are no gradient at all.
        magnitudes = {k: v / (1.0 - zeros[k]) if 0.0 < zeros.get(k, 0.0) < 1.0 else v
                      for k, v in values.items()}
        low = {k: values[k] for k, v in magnitudes.items() if v < self.threshold}
        low, exempt = self._construction.split(
            "gradients", low, values, magnitudes=magnitudes,
            exact={k for k in low if values[k] == 0.0}, step=step)
        self.note(step, f"zero by construction, not a fault (mean |gradient| below "
                  f"{self.threshold:g}, and at every step 1000 times below another variable "
                  "of its layer or exactly 0 from the first)", exempt)
        if self.require == "all" and len(low) < len(values):
            return None
        return self.verdict_on(
            step, f"mean |gradient| below {self.threshold:g} for {len(low)} of {len(values)} "
            "variables", low)

    def get_config(self):
        return {"threshold": self.threshold, "require": self.require}
