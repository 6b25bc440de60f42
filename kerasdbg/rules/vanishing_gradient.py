"""`VanishingGradient`: gradients too small for the optimizer to move the weights."""

from __future__ import annotations

import math

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.rules._construction import Construction
from kerasdbg.rules._decay import decay_fractions, still
from kerasdbg.rules.rule import Rule, values_of


class VanishingGradient(Rule):
    """Fires when a variable's gradient has vanished and its weights stopped moving.

    A variable's gradient has vanished at a step when both hold:

    - its mean |gradient| over the elements the batch touched is below
      `threshold`: `gradients/<variable>/mean_abs` divided by the fraction
      of non-zero elements (`zero_fraction`), so the rows of an `Embedding`
      table that the batch did not use do not make the mean small;
    - the optimizer does not move the weights: `weights/<variable>/
      update_ratio` (||update|| / ||weights||) is below `update_threshold`.
      A small gradient that Adam, RMSprop or a large learning rate still
      turns into a real update is not vanishing (keras.io's CycleGAN, whose
      instance-norm scales start at N(0, 0.02), trains its convolutions with
      gradients of 1e-9 to 1e-12). Decoupled weight decay (`AdamW`, any
      optimizer with a `weight_decay`) moves every decayed weight by
      learning rate x weight decay of itself at each step, whatever its
      gradient, and the ratio cannot tell what the gradient did beside it
      (|ratio - lr x wd| only bounds it from below: updates of 1e-7 of the
      weights look like none): the weights count as still only where the
      ratio plus lr x wd, from `step/weight_decay_fraction` (recorded by
      `StopOnRule` for each optimizer that has a `weight_decay`;
      `step/<optimizer>/weight_decay_fraction` with several), is below
      `update_threshold`. Under `AdamW`'s defaults (lr x wd = 4e-6) a
      vanished gradient is therefore not found (a miss, never a false
      alarm), nor in a run recorded without the fraction. A variable whose ratio is not recorded
      at a step is not judged at that step; where it is infinite (weights
      that were exactly zero before the step: no ratio can say how much
      they moved), the gradient decides. A run that records no update ratio
      at all cannot be judged by this rule (`kerasdbg check` leaves it out,
      and says so):
      the gradient's magnitude alone cannot tell a vanished gradient from a
      small one the optimizer still turns into updates.

    A variable that meets them at its first recorded step is not a fault
    unless it meets them again at its next recorded step: a
    zero-initialised output layer (keras.io's DDIM) makes every other
    gradient exactly 0 at the first step only. This allowance is the
    training's: given when the rule watches the training from its first
    optimizer step (step 1), not by a rule that first sees it later (from
    a later `fit`), as `kerasdbg check` on the whole run. Gradients that are zero by
    construction in a healthy network are not a fault either: rounding noise
    1000 times below another variable of their layer at every step the rule
    has seen (the bias of a layer followed by a normalization, the key bias
    of `MultiHeadAttention`), or exactly zero from the first step while most
    variables learn (an output head the loss does not use). Each is reported
    once, as an "info" verdict, and watched again once it learns. A gradient
    that was healthy and then vanished, or a whole layer that does not learn
    (the first layers of a deep sigmoid stack under SGD), is a fault.
    NaN values are left to `ExplodingTensor`.

    Args:
        threshold: the mean |gradient| below which a variable's gradient
            may have vanished (SageMaker Debugger's default). Defaults to `1e-7`.
        require: "any" fires when any variable's gradient vanished, "all"
            only when every variable's did. Defaults to `"any"`.
        update_threshold: the update/weight ratio below which the weights
            do not move (at 1e-8 per step, a hundred million steps change
            them by 100%). Defaults to `1e-8`.

    Examples:
        >>> from kerasdbg.rules import VanishingGradient
        >>> rule = VanishingGradient(threshold=1e-7)
        >>> rule.check(1, {"gradients/m/d1/kernel/mean_abs": 0.2,
        ...                "gradients/m/d2/kernel/mean_abs": 0.1}) is None
        True
        >>> rule.check(2, {"gradients/m/d1/kernel/mean_abs": 2e-9,
        ...                "weights/m/d1/kernel/update_ratio": 4e-11,
        ...                "gradients/m/d2/kernel/mean_abs": 0.1}).reason
        'VanishingGradient at step 2: mean |gradient| below 1e-07 and update/weight ratio below 1e-08 for 1 of 2 variables: m/d1/kernel=2e-09'
        >>> rule.check(3, {"gradients/m/d1/kernel/mean_abs": 2e-9,  # Adam still moves it
        ...                "weights/m/d1/kernel/update_ratio": 1e-4}) is None
        True
        >>> rule.check(4, {"gradients/m/d1/kernel/mean_abs": 2e-9,  # AdamW: the decay
        ...                "weights/m/d1/kernel/update_ratio": 4e-6,  # hides the rest
        ...                "step/weight_decay_fraction": 4e-6}) is None
        True
        >>> rule = VanishingGradient()  # a bias followed by BatchNormalization:
        >>> rule.check(1, {"gradients/m/conv/kernel/mean_abs": 0.01,
        ...                "gradients/m/conv/bias/mean_abs": 3e-11,
        ...                "weights/m/conv/bias/update_ratio": 0.0}) is None
        True
        >>> print(rule.take_notes()[0].reason)
        VanishingGradient at step 1: zero by construction, not a fault (mean |gradient| below 1e-07, and at every step 1000 times below another variable of its layer or exactly 0 from the first): m/conv/bias=3e-11
    """

    requires = (("gradients", "mean_abs"), ("gradients", "zero_fraction"),
                ("weights", "update_ratio"))

    def __init__(self, threshold: float = 1e-7, require: str = "any",
                 update_threshold: float = 1e-8):
        owner = type(self).__name__
        self.threshold = check.number(owner, "threshold", threshold, minimum=0.0)
        self.require = check.one_of(owner, "require", require, ("any", "all"))
        self.update_threshold = check.number(owner, "update_threshold", update_threshold,
                                             minimum=0.0)
        self.reset()

    def reset(self):
        self._construction = Construction()

    def can_check(self, present):
        # The gradients' magnitudes and the updates: a small gradient alone
        # is no verdict (offline as online, where both are recorded).
        return ("gradients", "mean_abs") in present and ("weights", "update_ratio") in present

    def _magnitudes(self, block):
        """`(names, magnitudes)` of `block`: each gradient's mean |gradient|
        over its non-zero elements, as `check` computes it."""
        names = block.names("gradients", "mean_abs")
        values = block.column("gradients", "mean_abs")
        zeros = dict(zip(block.names("gradients", "zero_fraction"),
                         block.column("gradients", "zero_fraction").T))
        magnitudes = values.copy()
        with np.errstate(invalid="ignore", divide="ignore"):
            for column, name in enumerate(names):
                zero = zeros.get(name)
                if zero is not None:
                    partial = (zero > 0.0) & (zero < 1.0)
                    magnitudes[:, column] = np.where(
                        partial, values[:, column] / (1.0 - zero), values[:, column])
        return names, values, magnitudes

    def screen(self, block):
        _, values, magnitudes = self._of_block(block, self._magnitudes, screening=True)
        # A step with a gradient not recorded (NaN) is judged as it is.
        with np.errstate(invalid="ignore"):
            return np.isnan(values).any(axis=1) | (magnitudes < self.threshold).any(axis=1)

    def advance(self, block):
        names, _, magnitudes = self._of_block(block, self._magnitudes, screening=False)
        if names:
            self._construction.quiet("gradients", names, magnitudes)

    def check(self, step, record):
        values = {k: v for k, v in values_of(record, "gradients", "mean_abs") if not math.isnan(v)}
        if not values:
            return None
        zeros = dict(values_of(record, "gradients", "zero_fraction"))
        ratios = dict(values_of(record, "weights", "update_ratio"))
        # Over the non-zero elements: untouched embedding rows are no gradient at all.
        magnitudes = {k: v / (1.0 - zeros[k]) if 0.0 < zeros.get(k, 0.0) < 1.0 else v
                      for k, v in values.items()}
        decays = decay_fractions(record)
        low = {k: values[k] for k, v in magnitudes.items() if v < self.threshold
               and (math.isinf(ratios.get(k, 0.0))
                    or still(ratios.get(k), decays, self.update_threshold))}
        low, exempt = self._construction.split(
            "gradients", low, values, magnitudes=magnitudes,
            exact={k for k in low if values[k] == 0.0}, step=step, defer_first=True)
        self.note(step, f"zero by construction, not a fault (mean |gradient| below "
                  f"{self.threshold:g}, and at every step 1000 times below another variable "
                  "of its layer or exactly 0 from the first)", exempt)
        if self.require == "all" and len(low) < len(values):
            return None
        return self.verdict_on(
            step, f"mean |gradient| below {self.threshold:g} and update/weight ratio below "
            f"{self.update_threshold:g} for {len(low)} of {len(values)} variables", low)

    def get_config(self):
        return {"threshold": self.threshold, "require": self.require,
                "update_threshold": self.update_threshold}
