"""`PoorWeightInitialization`: signs of a bad start in the first steps of a run."""

from __future__ import annotations

import math
import re
from typing import Optional

from kerasdbg import _validation as check
from kerasdbg.records.tags import LOSS
from kerasdbg.rules.loss_rules import Plateau
from kerasdbg.rules.rule import Rule, values_of


class PoorWeightInitialization(Rule):
    """Fires when the first `steps` optimizer steps show a poorly initialized model.

    A good initialization keeps the variance of the activations commensurate
    from layer to layer and gives every weight a useful gradient; a bad one
    shows in the first steps, before anything else goes visibly wrong. At
    each of the optimizer steps 1 to `steps` of the run (a run resumed later
    is not checked), the rule fires at the first of these signs:

    - **activation variances**: among the taps matched by `activations`,
      the largest variance (`activations/<tap>/std` squared) is more than
      `threshold` times the smallest (a zero variance counts as infinitely
      smaller). Weights drawn too wide or too narrow for their fan-in
      multiply the variance at each layer.
    - **gradient spread**: a gradient of a variable matched by `gradients`
      whose 5th to 95th percentile range (`gradients/<variable>/p95` minus
      `p05`) is below `distribution_range`: its weights get (almost) the
      same, or no, update. Kernels only by default: the gradient of a
      one-element bias has no spread, and that of an `Embedding` is mostly
      zeros by nature.
    - **loss**: `patience` steps in a row without a new lowest loss
      (`step/loss`).

    `StopOnRule` records the quantiles only for the first `steps` steps (they
    sort each gradient); offline, record them with
    `GradientStatistics(stats=[..., "p05", "p95"])`.

    Args:
        threshold: the largest ratio of two tapped activations' variances
            that is still fine. Defaults to `10.0`.
        distribution_range: the smallest 5th-95th percentile range of a
            gradient that is still fine. Defaults to `0.001`.
        patience: steps without a new lowest loss that fire; None to leave
            the loss out. Defaults to `5`.
        steps: the optimizer steps checked, from the first. Defaults to `10`.
        activations: regex (`re.search`) on the names of the taps to compare;
            None to leave activations out (no taps needed). Defaults to
            `".*"`, all taps.
        gradients: regex (`re.search`) on the variable paths whose gradient
            spread is checked; None to leave gradients out. Defaults to
            `"kernel"`.

    Examples:
        >>> from kerasdbg.rules import PoorWeightInitialization
        >>> rule = PoorWeightInitialization(gradients=None, patience=None)
        >>> rule.check(1, {"activations/hidden_tap/std": 0.5,
        ...                "activations/logits_tap/std": 8.0}).reason
        'PoorWeightInitialization at step 1: the variance of logits_tap is 256 times that of hidden_tap (more than 10): logits_tap=64, hidden_tap=0.25'
    """

    def __init__(self, threshold: float = 10.0, distribution_range: float = 0.001,
                 patience: Optional[int] = 5, steps: int = 10,
                 activations: Optional[str] = ".*", gradients: Optional[str] = "kernel"):
        owner = type(self).__name__
        self.threshold = check.number(owner, "threshold", threshold, minimum=1.0)
        self.distribution_range = check.number(
            owner, "distribution_range", distribution_range, minimum=0.0)
        self.patience = None if patience is None else check.positive_int(
            owner, "patience", patience)
        self.steps = check.positive_int(owner, "steps", steps)
        self.activations = check.optional_regex(owner, "activations", activations)
        self.gradients = check.optional_regex(owner, "gradients", gradients)
        if activations is None and gradients is None and patience is None:
            raise ValueError(
                f"{owner}: nothing to check; give `activations`, `gradients` or "
                "`patience`. Received: activations=None, gradients=None, patience=None"
            )
        self.reset()

    @property
    def last_step(self) -> int:
        return self.steps

    @property
    def requires(self):
        needs = []
        if self.activations is not None:
            needs.append(("activations", "std"))
        if self.gradients is not None:
            needs += [("gradients", "p05"), ("gradients", "p95")]
        if self.patience is not None:
            needs.append(("step", "loss"))
        return tuple(needs)

    def reset(self):
        self._loss = Plateau()

    def check(self, step, record):
        if step > self.steps:
            return None
        return (self._check_activations(step, record)
                or self._check_gradients(step, record)
                or self._check_loss(step, record))

    def _check_activations(self, step, record):
        if self.activations is None:
            return None
        variances = {
            tap: std ** 2 for tap, std in values_of(record, "activations", "std")
            if math.isfinite(std) and re.search(self.activations, tap)
        }
        if len(variances) < 2:
            return None
        low = min(variances, key=variances.get)
        high = max(variances, key=variances.get)
        if variances[high] <= self.threshold * variances[low]:
            return None
        ratio = variances[high] / variances[low] if variances[low] > 0 else math.inf
        return self.verdict_on(
            step, f"the variance of {high} is {ratio:.4g} times that of {low} "
            f"(more than {self.threshold:g})", {high: variances[high], low: variances[low]})

    def _check_gradients(self, step, record):
        if self.gradients is None:
            return None
        low = dict(values_of(record, "gradients", "p05"))
        narrow = {}
        for name, high in values_of(record, "gradients", "p95"):
            if name in low and re.search(self.gradients, name):
                spread = high - low[name]
                if math.isfinite(spread) and spread < self.distribution_range:
                    narrow[name] = spread
        return self.verdict_on(
            step, f"5th-95th percentile range of the gradient below "
            f"{self.distribution_range:g}", narrow)

    def _check_loss(self, step, record):
        loss = record.get(LOSS)
        if self.patience is None or loss is None or not math.isfinite(loss):
            return None
        if self._loss.update(step, loss) or self._loss.waits < self.patience:
            return None
        return self.verdict(
            step, f"no new lowest loss for {self._loss.waits} steps (lowest "
            f"{self._loss.best:.4g} at step {self._loss.best_step}, now {loss:.4g})",
            {LOSS: loss})

    def get_config(self):
        return {"threshold": self.threshold, "distribution_range": self.distribution_range,
                "patience": self.patience, "steps": self.steps,
                "activations": self.activations, "gradients": self.gradients}
