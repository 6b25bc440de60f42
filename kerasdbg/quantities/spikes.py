"""The spike test's definition, shared by the in-graph tests of the
capture and the spike rules (`kerasdbg.rules.LossSpike`,
`GradientNormSpike`), which run it again on the records."""

from __future__ import annotations

from typing import NamedTuple, Optional


class Spike(NamedTuple):
    """An in-graph spike test of one quantity of each optimizer step.

    A value spikes when it is more than `sigmas` standard deviations above the
    mean of the last `window` accepted values, or (`factor`) more than
    `factor` times their largest; only once `window` values were accepted.
    A value is accepted into the window when its step had no fault (a spike,
    a NaN/Inf, a gradient norm above a limit) and was not frozen.

    Attributes:
        quantity: "loss" (the step's loss, summed over replicas) or
            "gradient_norm" (the global norm of the gradients an optimizer
            applies, summed over replicas).
        window: the number of previous values the statistics are taken on.
        sigmas: the mean + sigmas x standard deviation test, or None.
        factor: the factor x largest test, or None.
    """

    quantity: str
    window: int
    sigmas: Optional[float] = None
    factor: Optional[float] = None


SPIKE_QUANTITIES = ("loss", "gradient_norm")
"""What a `Spike` can watch."""
MIN_RELATIVE_STD = 1e-3
"""A window's standard deviation counts as at least this times its |mean|:
over a window of nearly constant values (a plateau), a spike must still be
a change of the value, not of its last digits."""
