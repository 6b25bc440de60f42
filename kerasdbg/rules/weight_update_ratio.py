"""`WeightUpdateRatio`: updates far too large or far too small for the weights."""

from __future__ import annotations

import math

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.rules._construction import initial
from kerasdbg.rules.rule import Rule, values_of


class WeightUpdateRatio(Rule):
    """Fires when ||update|| / ||weight|| of a variable leaves [small, large].

    Reads `weights/<variable>/update_ratio` (`WeightStatistics`, a default
    statistic) and `weights/<variable>/l2_norm`: variables whose norm is
    below `epsilon` are left out (their ratio says nothing), and so are
    infinite ratios, those of variables that were zero before the step
    (biases at their initial zeros). Steps the optimizer skipped record no ratio.

    An update is large against the largest the weights have been, not
    against their norm of the moment: a healthy bias passing near zero has
    a ratio of 20 for a step, and is not a fault (the update over the
    largest norm recorded before, when the norms are recorded).

    The first update of a variable is out of range in healthy networks, at
    their initial weights: the first SGD update of a
    convolution followed by `BatchNormalization` (whose output does not
    depend on the kernel's scale) is measured at 306 times the kernel
    (ResNet50's `conv1_conv`, 32x32 inputs, batch 4, SGD 0.01) and 30
    times in MobileNetV2, every ratio below 7 from the next step on; a
    zero-initialised output layer makes the first update of every other
    variable exactly 0. So a variable's first update out of range fires only
    when its next recorded update is out of range too (a learning rate too
    large for the model); any later update out of range fires at its step.
    The allowance is given by a rule that watches the training from its
    first optimizer step (step 1; a bias at its initial zeros has its first
    finite ratio later), not by one that first sees the training later (a
    `StopOnRule` attached from a later `fit` on), as `kerasdbg check` on the
    whole run.

    Args:
        large_threshold: a ratio above this fires. Defaults to `10.0`.
        small_threshold: a ratio below this fires. Defaults to `1e-8`.
        epsilon: weights with a smaller l2 norm are left out. Defaults to `1e-9`.

    Examples:
        >>> from kerasdbg.rules import WeightUpdateRatio
        >>> rule = WeightUpdateRatio()
        >>> rule.check(1, {"weights/m/d/kernel/update_ratio": 35.0}) is None  # the first
        True
        >>> rule.check(2, {"weights/m/d/kernel/update_ratio": 41.0}).reason
        'WeightUpdateRatio at step 2: update/weight ratio outside [1e-08, 10]: m/d/kernel=41'
        >>> rule.check(3, {"weights/m/d/kernel/update_ratio": 0.01}) is None
        True
        >>> rule.check(4, {"weights/m/d/kernel/update_ratio": 35.0}).reason
        'WeightUpdateRatio at step 4: update/weight ratio outside [1e-08, 10]: m/d/kernel=35'
    """

    requires = (("weights", "update_ratio"), ("weights", "l2_norm"))

    def __init__(self, large_threshold: float = 10.0, small_threshold: float = 1e-8,
                 epsilon: float = 1e-9):
        owner = type(self).__name__
        self.large_threshold = check.number(owner, "large_threshold", large_threshold,
                                            minimum=0.0, exclusive_minimum=True)
        self.small_threshold = check.number(owner, "small_threshold", small_threshold,
                                            minimum=0.0, maximum=self.large_threshold)
        self.epsilon = check.number(owner, "epsilon", epsilon, minimum=0.0)
        self.reset()

    def reset(self):
        self._last: dict = {}  # tensor -> (step, its norm after that recorded update)
        self._peak: dict = {}  # tensor -> the largest norm recorded before this step
        self._seen: dict = {}  # tensor -> its recorded updates
        self._from_start = None  # whether the rule watches the training from step 1

    def _counted(self, block):
        """`(names, ratios, counted)`: the update ratios of `block` and where
        `check` reads them (finite, of weights not below `epsilon`)."""
        names = block.names("weights", "update_ratio")
        ratios = block.column("weights", "update_ratio")
        norms = dict(zip(block.names("weights", "l2_norm"),
                         block.column("weights", "l2_norm").T))
        counted = np.isfinite(ratios)
        with np.errstate(invalid="ignore"):
            for column, name in enumerate(names):
                norm = norms.get(name)
                if norm is not None:
                    counted[:, column] &= ~(norm < self.epsilon)
        return names, ratios, counted

    def screen(self, block):
        _, ratios, counted = self._of_block(block, self._counted, screening=True)
        with np.errstate(invalid="ignore"):
            out = (ratios < self.small_threshold) | (ratios > self.large_threshold)
        return (counted & out).any(axis=1)

    def advance(self, block):
        if self._from_start is None:
            self._from_start = initial(int(block.steps[0]))
        names, _, counted = self._of_block(block, self._counted, screening=False)
        for name, count in zip(names, counted.sum(axis=0).tolist()):
            if count:
                self._seen[name] = self._seen.get(name, 0) + count
        norms = block.column("weights", "l2_norm")
        for column, name in enumerate(block.names("weights", "l2_norm")):
            finite = np.flatnonzero(np.isfinite(norms[:, column]))
            if len(finite):
                self._peak[name] = max(self._peak.get(name, 0.0),
                                       float(norms[finite, column].max()))
                last = finite[-1]
                self._last[name] = (int(block.steps[last]), float(norms[last, column]))

    def check(self, step, record):
        if self._from_start is None:
            self._from_start = initial(step)
        norms = dict(values_of(record, "weights", "l2_norm"))
        bad = {}
        for name, ratio in values_of(record, "weights", "update_ratio"):
            if not math.isfinite(ratio) or norms.get(name, math.inf) < self.epsilon:
                continue
            last = self._last.get(name)
            if ratio > self.large_threshold and last is not None and last[0] == step - 1:
                # ||update|| / ||before||, made ||update|| / the largest norm so far
                # (the norm before the update is the last step's, when recorded).
                before, peak = last[1], self._peak[name]
                ratio = ratio * before / max(before, peak) if before > 0 else ratio
            self._seen[name] = self._seen.get(name, 0) + 1
            if self.small_threshold <= ratio <= self.large_threshold:
                continue
            if self._seen[name] == 1 and self._from_start:
                continue  # the first: a fault if the next one is out of range too
            bad[name] = ratio
        for name, norm in norms.items():
            if math.isfinite(norm):
                self._peak[name] = max(self._peak.get(name, 0.0), norm)
                self._last[name] = (int(step), norm)
        return self.verdict_on(
            step, f"update/weight ratio outside [{self.small_threshold:g}, "
            f"{self.large_threshold:g}]", bad)

    def get_config(self):
        return {"large_threshold": self.large_threshold,
                "small_threshold": self.small_threshold, "epsilon": self.epsilon}
