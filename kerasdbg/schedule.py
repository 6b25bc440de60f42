"""`Schedule`: the steps at which a statistic is recorded.

Plain Python (no TensorFlow): the capture evaluates the same rule in the
graph (`kerasdbg.capture`), the host and the readers evaluate it here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from kerasdbg import _validation as check


class Schedule(NamedTuple):
    """Record at steps `1..first_steps`, then at every `every_n_steps`-th step.

    Steps are the optimizer's, numbered from 1. A step after `last_step`
    (when not None) is never recorded.

    Attributes:
        every_n_steps: record at steps divisible by this.
        first_steps: also record at every step up to this one (0: none).
        last_step: record at no step after this one, or None.

    Examples:
        >>> from kerasdbg.schedule import Schedule
        >>> [step for step in range(1, 300) if Schedule(100, first_steps=3).at(step)]
        [1, 2, 3, 100, 200]
    """

    every_n_steps: int = 1
    first_steps: int = 0
    last_step: Optional[int] = None

    def at(self, step: int) -> bool:
        """Whether `step` is recorded."""
        if self.last_step is not None and step > self.last_step:
            return False
        return step <= self.first_steps or step % self.every_n_steps == 0

    @property
    def every_step(self) -> bool:
        """Whether every step (up to `last_step`) is recorded."""
        return self.every_n_steps == 1 or (
            self.last_step is not None and self.first_steps >= self.last_step)

    def describe(self) -> str:
        """The schedule in words, for messages and docs."""
        if self.every_step:
            words = "every step"
        elif self.first_steps:
            words = f"steps 1-{self.first_steps} and every {self.every_n_steps}th step"
        else:
            words = f"every {self.every_n_steps}th step"
        return words if self.last_step is None else f"{words} up to step {self.last_step}"


DEFAULT = Schedule(every_n_steps=50, first_steps=10)
"""When the statistics callbacks and `StopOnRule` record the full statistics
by default: steps 1-10, then every 50th step. The l2 norms and the NaN/Inf
counts (`EVERY_STEP_STATISTICS`) are recorded at every step."""

EVERY_STEP_STATISTICS = ("l2_norm", "nan_count", "inf_count")
"""What the default schedule records at every step: one pass over each tensor
gives them all (the counts come free when the norm is finite)."""


def resolve(owner: str, every_n_steps, first_steps) -> "tuple[Schedule, bool]":
    """`(schedule, default)` from a callback's `every_n_steps` (None: the
    default schedule) and `first_steps` (None: the default's, with the
    default schedule, else 0); `default` says whether the every-step
    statistics are recorded at the other steps."""
    first = None if first_steps is None else check.non_negative_int(
        owner, "first_steps", first_steps)
    if every_n_steps is None:
        return Schedule(DEFAULT.every_n_steps,
                        DEFAULT.first_steps if first is None else first), True
    every = check.positive_int(owner, "every_n_steps", every_n_steps)
    return Schedule(every, 0 if first is None else first), False
