"""Spike rules: `LossSpike`, `GradientNormSpike`, and `SkippedStep`, which
reports the steps an in-graph fault skipped.

A spike is a value far above the recent ones: more than `sigmas` standard
deviations above the mean of the last `window` values (the test of the skip
guards of large-model training, 6 standard deviations over 128 steps by
default), or more than `factor` times the largest of them. With
`StopOnRule`, the same test runs inside the compiled train step, before the
update, so that the step can be skipped (`action="skip"`) or the weights
frozen at it; the rule runs the test again on the records (online and
offline alike) to say what it found, with the window's statistics.
"""

from __future__ import annotations

import collections
import math
from typing import Dict, Optional, Tuple

from kerasdbg import _validation as check
from kerasdbg.quantities.spikes import MIN_RELATIVE_STD, Spike
from kerasdbg.records import tags as _tags
from kerasdbg.records.tags import LOSS, STEP, step_losses, step_scalar
from kerasdbg.rules.rule import Rule

ACTIONS = ("skip", "stop")
"""What a rule's own `action` can ask of `StopOnRule` at a step where it fires."""
FAULT = _tags.step_scalar("fault")
FROZEN = _tags.step_scalar("frozen")
SKIPPED = "skipped"
AFTER_ROLLBACK = "skipped_after_rollback"
GRADIENT_NORM = "gradient_norm"


class _SpikeRule(Rule):
    """A spike test on one quantity of each optimizer step (see the module)."""

    quantity = ""
    what = ""
    repeats = True

    def __init__(self, window: int = 128, sigmas: Optional[float] = 6.0,
                 factor: Optional[float] = None, action: Optional[str] = None):
        owner = type(self).__name__
        self.window = check.positive_int(owner, "window", window)
        if self.window < 2:
            raise ValueError(f"{owner}: `window` must be at least 2 (a standard deviation "
                             f"needs two values). Received: window={window!r}")
        self.sigmas = None if sigmas is None else check.number(
            owner, "sigmas", sigmas, minimum=0.0, exclusive_minimum=True)
        self.factor = None if factor is None else check.number(
            owner, "factor", factor, minimum=1.0, exclusive_minimum=True)
        if self.sigmas is None and self.factor is None:
            raise ValueError(f"{owner}: give `sigmas`, `factor` or both; with neither the "
                             "rule tests nothing. Received: sigmas=None, factor=None")
        self.action = None if action is None else check.one_of(owner, "action", action, ACTIONS)
        self.reset()

    @property
    def requires(self):
        return ((STEP, self.quantity),)

    def spike(self) -> Spike:
        """The in-graph test `StopOnRule` arms for this rule."""
        return Spike(self.quantity, self.window, self.sigmas, self.factor)

    def reset(self) -> None:
        self._windows: Dict[str, collections.deque] = {}

    def get_config(self) -> dict:
        return {"window": self.window, "sigmas": self.sigmas, "factor": self.factor,
                "action": self.action}

    def _values(self, record) -> Dict[str, float]:
        """The watched values of the step, by tag."""
        raise NotImplementedError

    def test(self, value: float, values) -> Optional[Tuple[str, Dict[str, float]]]:
        """`(how, statistics)` when `value` spikes against `values` (a full
        window), else None: the in-graph test's, in float64."""
        count = len(values)
        mean = math.fsum(values) / count
        how = []
        std = largest = None
        if self.sigmas is not None:
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / count)
            std = max(std, MIN_RELATIVE_STD * abs(mean))
            if value > mean + self.sigmas * std:
                how.append(f"more than {self.sigmas:g} standard deviations above the mean")
        if self.factor is not None:
            largest = max(values)
            if largest > 0 and value > self.factor * largest:
                how.append(f"more than {self.factor:g} x the largest value")
        if not how:
            return None
        statistics = {"mean": mean}
        if std is not None:
            statistics["std"] = std
        statistics["max"] = largest if largest is not None else max(values)
        return " and ".join(how), statistics

    def check(self, step, record):
        # A value enters its window when its step had no fault (this spike,
        # a NaN/Inf, a norm above a limit) and was not frozen, as in the graph.
        frozen = bool(record.get(FROZEN))
        faulty = bool(record.get(FAULT)) or frozen or any(
            value for tag, value in record.items()
            if _tags.is_per_optimizer(tag, STEP, SKIPPED))
        fired = []
        for tag, value in self._values(record).items():
            owner = _optimizer_of(tag)
            if owner is not None:
                # One optimizer's value, tested in its own apply: its own
                # skip says whether its step had a fault.
                faulty = frozen or bool(record.get(_tags.per_optimizer(STEP, SKIPPED, owner)))
            window = self._windows.setdefault(tag, collections.deque(maxlen=self.window))
            found = None
            if math.isfinite(value) and len(window) == self.window:
                found = self.test(value, window)
            if found is not None:
                fired.append((tag, value, found))
            elif not faulty and math.isfinite(value):
                window.append(value)
        if not fired:
            return None
        said = []
        for tag, value, (how, stats) in fired:
            spread = f", standard deviation {stats['std']:.4g}" if "std" in stats else ""
            said.append(
                f"{self._name(tag)} {value:.4g} is {how} of the last {self.window} steps "
                f"(mean {stats['mean']:.4g}{spread}, largest {stats['max']:.4g})")
        return self.verdict(step, "; ".join(said), {tag: value for tag, value, _ in fired})

    def _name(self, tag: str) -> str:
        return self.what


def _optimizer_of(tag: str) -> Optional[str]:
    """The optimizer of a `step/<optimizer>/<name>` tag, else None."""
    parts = tag.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == STEP else None


class LossSpike(_SpikeRule):
    """Fires at each step whose loss spikes above the last `window` steps.

    A spike: a loss more than `sigmas` standard deviations above the mean of
    the losses of the last `window` steps, or (`factor`) more than `factor`
    times the largest of them; tested once `window` losses were seen. The
    standard deviation counts as at least 0.001 x |mean| (a plateau's last
    digits are not a spread). The losses of steps with a fault (a spike, a
    NaN/Inf, a gradient norm above a limit) or frozen do not enter the window,
    so a skipped spike leaves it as if its batch had not come. Reads
    `step/loss`; a train step with no single loss (a GAN's `d_loss` and
    `g_loss`) has each loss it returns watched on the records.

    With `StopOnRule`, the test also runs inside the compiled train step on
    the loss summed over replicas, before the update: `action="skip"` (the
    rule's, or `StopOnRule`'s) skips the step, else the weights are frozen at
    it and training stops. The defaults are the skip guards of large-model
    training (6 standard deviations over 128 steps); `factor=10.0,
    window=100, sigmas=None` is the "10 x the largest of the last 100" form.
    Unlike most rules it fires at every spike, not once per `fit`.

    Args:
        window: the number of previous steps. Defaults to `128`.
        sigmas: the standard deviations above the mean, or None. Defaults
            to `6.0`.
        factor: the multiple of the window's largest value, or None.
            Defaults to `None`.
        action: "skip" to skip the steps where it fires, "stop", or None for
            `StopOnRule`'s action. Defaults to `None`.

    Examples:
        >>> from kerasdbg.rules import LossSpike
        >>> rule = LossSpike(window=4)
        >>> [rule.check(s, {"step/loss": v}) for s, v in enumerate([1.0, 0.9, 1.1, 1.0], 1)]
        [None, None, None, None]
        >>> rule.check(5, {"step/loss": 50.0}).reason
        'LossSpike at step 5: the loss 50 is more than 6 standard deviations above the mean of the last 4 steps (mean 1, standard deviation 0.07071, largest 1.1)'
    """

    quantity = "loss"
    what = "the loss"

    def can_check(self, present):
        return super().can_check(present) or any(
            collection == STEP and _tags.is_loss_name(name) for collection, name in present)

    def _values(self, record):
        loss = record.get(LOSS)
        if loss is not None:
            return {LOSS: float(loss)}
        return {step_scalar(name): value for name, value in step_losses(record).items()}

    def _name(self, tag):
        return "the loss" if tag == LOSS else f"the loss {_tags.scalar_name(tag)}"


class GradientNormSpike(_SpikeRule):
    """Fires at each step whose global gradient norm spikes above the last
    `window` steps (see `LossSpike` for the test).

    Reads `step/gradient_norm`, the global norm of the gradients an
    optimizer applies (summed over replicas, before clipping), which
    `StopOnRule` records at every step for this rule; with several
    optimizers each has its own (`step/<optimizer>/gradient_norm`) and its
    own window, and `action="skip"` skips only the step of the optimizer
    whose norm spiked.

    Args:
        window: the number of previous steps. Defaults to `128`.
        sigmas: the standard deviations above the mean, or None. Defaults
            to `6.0`.
        factor: the multiple of the window's largest value, or None.
            Defaults to `None`.
        action: "skip" to skip the steps where it fires, "stop", or None for
            `StopOnRule`'s action. Defaults to `None`.

    Examples:
        >>> from kerasdbg.rules import GradientNormSpike
        >>> rule = GradientNormSpike(window=3, sigmas=None, factor=10.0)
        >>> [rule.check(s, {"step/gradient_norm": v}) for s, v in enumerate([2.0, 3.0, 2.5], 1)]
        [None, None, None]
        >>> rule.check(4, {"step/gradient_norm": 40.0}).reason
        'GradientNormSpike at step 4: the gradient norm 40 is more than 10 x the largest value of the last 3 steps (mean 2.5, largest 3)'
    """

    quantity = GRADIENT_NORM
    what = "the gradient norm"

    def _values(self, record):
        return {tag: float(value) for tag, value in record.items()
                if _tags.is_per_optimizer(tag, STEP, GRADIENT_NORM)}

    def _name(self, tag):
        parts = tag.split("/")
        return "the gradient norm" if len(parts) == 2 else f"the gradient norm of {parts[1]}"


class SkippedStep(Rule):
    """Reports a step that an in-graph fault skipped, when no other rule
    fired at that step.

    With `StopOnRule(action="skip")` (or a rule's own `action="skip"`), a
    step whose fault is decided in the graph (a NaN/Inf, a spike, a gradient
    norm above `max_gradient_norm`) applies no update: `step/skipped` is 1
    there. The rule whose test found it says why; this rule speaks only
    when none did, and not for the batches skipped after a rollback
    (`step/skipped_after_rollback`, said by the rollback) (the rules on the host see the records a little
    differently from the graph, e.g. a rule left out of the run), so that
    no skipped step goes unsaid. Added to `StopOnRule`'s rules when a skip
    is armed.

    Examples:
        >>> from kerasdbg.rules import SkippedStep
        >>> SkippedStep().check(9, {"step/skipped": 1.0, "step/loss": 3e4}).reason
        'SkippedStep at step 9: the optimizer step was skipped (in-graph fault); loss=3e+04'
    """

    requires = ((STEP, SKIPPED),)
    follows = True
    repeats = True

    def check(self, step, record):
        skipped = [tag for tag, value in record.items()
                   if _tags.is_per_optimizer(tag, STEP, SKIPPED) and value]
        if not skipped or self.others or any(
                value for tag, value in record.items()
                if _tags.is_per_optimizer(tag, STEP, AFTER_ROLLBACK)):
            return None  # said by another rule, or by the rollback itself
        whose = ""
        if any(tag != step_scalar(SKIPPED) for tag in skipped):
            whose = " of " + ", ".join(tag.split("/")[1] for tag in skipped)
        values = {tag: 1.0 for tag in skipped}
        loss = record.get(LOSS)
        said = "" if loss is None else f"; loss={loss:.4g}"
        return self.verdict(step, f"the optimizer step{whose} was skipped (in-graph fault)"
                            f"{said}", values)
