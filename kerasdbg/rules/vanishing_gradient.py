"""`VanishingGradient`: gradients whose mean magnitude is below a threshold."""

from __future__ import annotations

import math

from kerasdbg import _validation as check
from kerasdbg.rules.rule import Rule, values_of


class VanishingGradient(Rule):
    """Fires when the mean |gradient| of variables falls below `threshold`.

    Reads `gradients/<variable>/mean_abs` (record it with
    `GradientStatistics(stats=[..., "mean_abs"])`, one of the defaults).
    NaN values are left to `ExplodingTensor`.

    Args:
        threshold: the mean |gradient| below which a variable's gradient has
            vanished (SageMaker Debugger's default). Defaults to `1e-7`.
        require: "any" fires when any variable's gradient vanished, "all"
            only when every variable's did. Defaults to `"any"`.

    Example:

    >>> from kerasdbg.rules import VanishingGradient
    >>> rule = VanishingGradient(threshold=1e-7)
    >>> rule.check(3, {"gradients/m/d/kernel/mean_abs": 2e-9,
    ...                "gradients/m/d/bias/mean_abs": 0.1}).reason
    'VanishingGradient at step 3: mean |gradient| below 1e-07 for 1 of 2 variables: m/d/kernel=2e-09'
    """

    requires = (("gradients", "mean_abs"),)

    def __init__(self, threshold: float = 1e-7, require: str = "any"):
        owner = type(self).__name__
        self.threshold = check.number(owner, "threshold", threshold, minimum=0.0)
        self.require = check.one_of(owner, "require", require, ("any", "all"))

    def check(self, step, record):
        values = {k: v for k, v in values_of(record, "gradients", "mean_abs") if not math.isnan(v)}
        low = {k: v for k, v in values.items() if v < self.threshold}
        if self.require == "all" and len(low) < len(values):
            return None
        return self.verdict_on(
            step, f"mean |gradient| below {self.threshold:g} for {len(low)} of {len(values)} "
            "variables", low)

    def get_config(self):
        return {"threshold": self.threshold, "require": self.require}
