"""Rules on the loss: `NonFiniteLoss`, `LossNotDecreasing`, `Overfit`, `Overtraining`.

They read `step/loss` (the loss of each optimizer step) and the epoch logs
`epoch/loss` and `epoch/val_loss`, which `StopOnRule` records (and writes to
TensorBoard with `log_dir`).
"""

from __future__ import annotations

import collections
import math
from typing import Optional

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.records.tags import LOSS, epoch_scalar, is_loss_name, scalar_parts, step_losses
from kerasdbg.records.tags import STEP, prefix, step_scalar
from kerasdbg.rules.rule import Rule

TRAIN_LOSS = epoch_scalar("loss")
VAL_LOSS = epoch_scalar("val_loss")


class NonFiniteLoss(Rule):
    """Fires at the first step whose loss is NaN or infinite.

    Per optimizer step, also within one execution of `steps_per_execution >
    1` (Keras's logs, and `TerminateOnNaN`, only see running means once per
    execution). Reads `step/loss`. With `StopOnRule`, the weights are frozen
    at that step by default, so they stay those before the faulty step.

    A train step with no single loss (a GAN's `d_loss` and `g_loss`, and no
    `loss`) is watched through every scalar it returns whose name says it is
    a loss (`step/<name>` with "loss" as a word of the name): the verdict
    names the one that is not finite.

    Examples:
        >>> from kerasdbg.rules import NonFiniteLoss
        >>> rule = NonFiniteLoss()
        >>> rule.check(4, {"step/loss": 0.25}) is None
        True
        >>> rule.check(5, {"step/loss": float("inf")}).reason
        'NonFiniteLoss at step 5: the loss is inf'
        >>> NonFiniteLoss().check(3, {"step/d_loss": float("nan"), "step/g_loss": 0.7}).reason
        'NonFiniteLoss at step 3: the loss d_loss is nan (no single loss: d_loss, g_loss watched)'
    """

    requires = (scalar_parts(LOSS),)
    watches_nonfinite = True

    def can_check(self, present):
        return super().can_check(present) or any(
            collection == STEP and is_loss_name(name) for collection, name in present)

    def screen(self, block):
        loss = block.tag(LOSS)
        if loss is not None:
            return ~np.isfinite(loss)
        # No single loss: a step any of whose step/ scalars is not finite.
        return ~np.isfinite(block.starting(prefix(STEP))).all(axis=1)

    def advance(self, block):
        pass  # no memory

    def check(self, step, record):
        loss = record.get(LOSS)
        if loss is not None:
            if math.isfinite(loss):
                return None
            return self.verdict(step, f"the loss is {loss:g}", {LOSS: loss})
        # No single loss: each loss the train step returns.
        losses = step_losses(record)
        bad = {name: value for name, value in losses.items() if not math.isfinite(value)}
        if not bad:
            return None
        said = ", ".join(f"{name} is {value:g}" for name, value in bad.items())
        return self.verdict(
            step, f"the loss {said} (no single loss: {', '.join(losses)} watched)",
            {step_scalar(name): value for name, value in bad.items()})


class LossNotDecreasing(Rule):
    """Fires when the loss has not decreased by `min_decrease` over `num_steps`.

    Every `num_steps` recorded values, the mean of the last `num_steps`
    values is compared with the mean of the `num_steps` before them (means of
    windows rather than two single mini-batch losses, which are noisy); the
    rule fires when it fell by `min_decrease` (a fraction of the earlier
    window's mean) or less. So the first check is after `2 * num_steps`
    values. Windows holding a non-finite loss are left to `NonFiniteLoss`.

    Args:
        num_steps: values per window. Defaults to `10`.
        min_decrease: the least decrease, as a fraction (0-1) of the earlier
            window's mean, that counts as decreasing. Defaults to `0.0`.
            (`diff_percent`, a percent, is its deprecated name.)
        split: "train" reads the loss of each step (`step/loss`); "val" the
            validation loss of each epoch (`epoch/val_loss`), so windows
            count epochs. Defaults to `"train"`. (`mode` is its deprecated
            name.)

    Examples:
        >>> from kerasdbg.rules import LossNotDecreasing
        >>> rule = LossNotDecreasing(num_steps=2)
        >>> [rule.check(s, {"step/loss": v}) for s, v in [(1, 1.0), (2, 0.9), (3, 0.8)]]
        [None, None, None]
        >>> rule.check(4, {"step/loss": 1.2}).reason
        'LossNotDecreasing at step 4: mean train loss of steps 3-4 is 1 against 0.95 for steps 1-2 (relative decrease -0.053, needed > 0)'
    """

    def __init__(self, num_steps: int = 10, *, min_decrease: float = 0.0,
                 split: str = "train", **deprecated):
        # Keyword-only after `num_steps`: the second value was a percent before.
        owner = type(self).__name__
        renamed = check.deprecated(owner, deprecated, {
            "diff_percent": ("min_decrease", check.from_percent, "a fraction 0-1, not a percent"),
            "mode": ("split", None, "`mode` is the Keras call (fit, evaluate, ...) everywhere "
                     "else"),
        }, {"min_decrease": (min_decrease, 0.0), "split": (split, "train")})
        check.no_other_arguments(owner, deprecated)
        min_decrease = renamed.get("min_decrease", min_decrease)
        split = renamed.get("split", split)
        self.num_steps = check.positive_int(owner, "num_steps", num_steps)
        self.min_decrease = check.number(owner, "min_decrease", min_decrease,
                                         minimum=0.0, maximum=1.0)
        self.split = check.one_of(owner, "split", split, ("train", "val"))
        self.reset()

    @property
    def tag(self) -> str:
        return LOSS if self.split == "train" else VAL_LOSS

    @property
    def requires(self):
        return (scalar_parts(self.tag),)

    def reset(self):
        self._values = collections.deque(maxlen=2 * self.num_steps)
        self._new = 0

    def check(self, step, record):
        value = record.get(self.tag)
        if value is None:
            return None
        self._values.append((int(step), float(value)))
        self._new += 1
        if len(self._values) < 2 * self.num_steps or self._new < self.num_steps:
            return None
        self._new = 0
        window = list(self._values)
        before, now = window[:self.num_steps], window[self.num_steps:]
        past = sum(v for _, v in before) / self.num_steps
        current = sum(v for _, v in now) / self.num_steps
        if not (math.isfinite(past) and math.isfinite(current)) or past == 0:
            return None
        decrease = (past - current) / abs(past)
        if decrease > self.min_decrease:
            return None
        return self.verdict(
            step, f"mean {self.split} loss of steps {now[0][0]}-{now[-1][0]} is {current:.4g} "
            f"against {past:.4g} for steps {before[0][0]}-{before[-1][0]} "
            f"(relative decrease {decrease:.2g}, needed > {self.min_decrease:g})",
            {self.tag: current})

    def get_config(self):
        return {"num_steps": self.num_steps, "min_decrease": self.min_decrease,
                "split": self.split}


class Plateau:
    """The lowest value so far, where it was, and the values since it last
    fell by more than `delta` (a fraction of it): what "not improving" means
    for the loss rules.

    Examples:
        >>> from kerasdbg.rules.loss_rules import Plateau
        >>> plateau = Plateau()
        >>> [plateau.update(s, v) for s, v in [(1, 1.0), (2, 0.8), (3, 0.9)]]
        [True, True, False]
        >>> plateau.best, plateau.best_step, plateau.waits
        (0.8, 2, 1)
    """

    def __init__(self, delta: float = 0.0):
        self.delta = delta
        self.reset()

    def reset(self) -> None:
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.waits = 0

    def update(self, step: int, value: float) -> bool:
        """Takes the value of `step`; returns whether it improved on the best."""
        if self.best is None or value < self.best - self.delta * abs(self.best):
            self.best, self.best_step, self.waits = value, step, 0
            return True
        self.waits += 1
        return False


def _epoch_losses(record):
    train, val = record.get(TRAIN_LOSS), record.get(VAL_LOSS)
    if train is None or val is None or not (math.isfinite(train) and math.isfinite(val)):
        return None
    return float(train), float(val)


class Overfit(Rule):
    """Fires when the validation loss exceeds the training loss by a ratio.

    At each epoch with validation, `(val_loss - loss) / |loss|` from Keras's
    epoch logs (`epoch/loss`, `epoch/val_loss`); the rule fires when it has
    been above `ratio_threshold` for `patience` evaluations in a row.

    Args:
        patience: evaluations in a row above the threshold. Defaults to `1`.
        ratio_threshold: the largest accepted `(val - train) / train`.
            Defaults to `0.1`.

    Examples:
        >>> from kerasdbg.rules import Overfit
        >>> rule = Overfit(patience=2)
        >>> rule.check(10, {"epoch/loss": 0.5, "epoch/val_loss": 0.6}) is None
        True
        >>> rule.check(20, {"epoch/loss": 0.4, "epoch/val_loss": 0.7}).reason
        'Overfit at step 20: validation loss 0.7 above the training loss 0.4 by 0.75 of it (more than 0.1 for 2 evaluations)'
    """

    requires = (("epoch", "val_loss"),)

    def __init__(self, patience: int = 1, ratio_threshold: float = 0.1):
        owner = type(self).__name__
        self.patience = check.positive_int(owner, "patience", patience)
        self.ratio_threshold = check.number(owner, "ratio_threshold", ratio_threshold,
                                            minimum=0.0)
        self.reset()

    def reset(self):
        self._count = 0

    def check(self, step, record):
        losses = _epoch_losses(record)
        if losses is None:
            return None
        train, val = losses
        ratio = (val - train) / abs(train) if train != 0 else math.inf
        self._count = self._count + 1 if ratio > self.ratio_threshold else 0
        if self._count < self.patience:
            return None
        return self.verdict(
            step, f"validation loss {val:.4g} above the training loss {train:.4g} by "
            f"{ratio:.3g} of it (more than {self.ratio_threshold:g} for {self.patience} "
            f"evaluation{'s' if self.patience > 1 else ''})",
            {TRAIN_LOSS: train, VAL_LOSS: val})

    def get_config(self):
        return {"patience": self.patience, "ratio_threshold": self.ratio_threshold}


class Overtraining(Rule):
    """Fires when neither the training nor the validation loss improves any more.

    At each epoch with validation (`epoch/loss`, `epoch/val_loss`): a loss
    improves when it falls below its best value so far by more than `delta`
    (a fraction of that best value). The rule fires when the training loss
    has not improved for `patience_train` evaluations and the validation loss
    for `patience_validation`: training goes on without making the model
    better.

    Args:
        patience_train: evaluations without improvement of the training
            loss. Defaults to `5`.
        patience_validation: evaluations without improvement of the
            validation loss. Defaults to `10`.
        delta: the relative drop below the best value that counts as an
            improvement. Defaults to `0.1`.

    Examples:
        >>> from kerasdbg.rules import Overtraining
        >>> rule = Overtraining(patience_train=1, patience_validation=2)
        >>> steps = [(1, 1.0, 1.0), (2, 0.99, 0.98), (3, 0.98, 0.99)]
        >>> [rule.check(s, {"epoch/loss": t, "epoch/val_loss": v}) for s, t, v in steps][-1].reason
        'Overtraining at step 3: no improvement by more than 0.1 of the training loss for 2 evaluations (best 1) nor of the validation loss for 2 (best 1)'
    """

    requires = (("epoch", "val_loss"),)

    def __init__(self, patience_train: int = 5, patience_validation: int = 10,
                 delta: float = 0.1):
        owner = type(self).__name__
        self.patience_train = check.positive_int(owner, "patience_train", patience_train)
        self.patience_validation = check.positive_int(
            owner, "patience_validation", patience_validation)
        self.delta = check.number(owner, "delta", delta, minimum=0.0, maximum=1.0)
        self.reset()

    def reset(self):
        self._train, self._val = Plateau(self.delta), Plateau(self.delta)

    def check(self, step, record):
        losses = _epoch_losses(record)
        if losses is None:
            return None
        self._train.update(step, losses[0])
        self._val.update(step, losses[1])
        if self._train.waits < self.patience_train or self._val.waits < self.patience_validation:
            return None
        return self.verdict(
            step, f"no improvement by more than {self.delta:g} of the training loss "
            f"for {self._train.waits} evaluations (best {self._train.best:.4g}) nor of the "
            f"validation loss for {self._val.waits} (best {self._val.best:.4g})",
            {TRAIN_LOSS: losses[0], VAL_LOSS: losses[1]})

    def get_config(self):
        return {"patience_train": self.patience_train,
                "patience_validation": self.patience_validation, "delta": self.delta}
