"""Decoupled weight decay in an update: what the gradient moved, and what the decay did.

`AdamW` (any optimizer with a `weight_decay`) moves each decayed weight by
learning rate x weight decay of itself at every step, whatever its gradient,
so a variable whose gradient vanished still shows an update/weight ratio of
lr x wd (1e-3 x 4e-3 = 4e-6). `StopOnRule` records lr x wd at each step it
records weights (`step/weight_decay_fraction`, or
`step/<optimizer>/weight_decay_fraction` with several optimizers); a rule on
update ratios counts weights as still only where the ratio proves it with the
decay added (`still`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

from kerasdbg.records import tags as _tags
from kerasdbg.records.step_record import Record, per_optimizer_values

DECAY = "weight_decay_fraction"
"""The step scalar: learning rate x weight decay at a step, the fraction of
each decayed weight that decoupled weight decay removed."""


def decay_fractions(record: Record) -> Tuple[float, ...]:
    """The weight-decay fractions a step's record holds (one per optimizer
    that decays; none without weight decay or where not recorded)."""
    values = per_optimizer_values(record, _tags.STEP, DECAY)
    return tuple(v for v in values if math.isfinite(v) and v > 0.0)


ROUNDING = 2.0 ** -24
"""How far float32 rounding moves a decayed ratio from lr x wd: each weight
rounded to the nearest float32 after the decay is off by at most half a unit
in the last place, 2**-24 of itself, so ||error|| <= 2**-24 ||weights||
(measured 8e-9 for a 16-element kernel, 1e-9 for 256 elements)."""


def still(ratio: Optional[float], decays: Tuple[float, ...], threshold: float) -> bool:
    """Whether an update/weight ratio proves that the gradient did not move
    the weights by `threshold` of themselves: the ratio is below it, and so
    is the largest part of the update the gradient can have made beside a
    decay fraction (the triangle inequality bounds it by ratio + lr x wd,
    plus `ROUNDING`). Under `AdamW`'s defaults (lr x wd = 4e-6) no ratio
    proves that against a `threshold` of 1e-8: the decay hides what the
    gradient did (|ratio - lr x wd| is only a lower bound of it, which
    took updates of 1e-7 of the weights for none), so the weights count as
    moved (a miss, never a false alarm). False when the ratio is not known
    (None, NaN) or infinite (zero weights that moved).

    Examples:
        >>> from kerasdbg.rules._decay import still
        >>> still(4e-6, (4e-6,), 1e-8), still(4e-6, (), 1e-8), still(0.0, (), 1e-8)
        (False, False, True)
        >>> still(1e-9, (1e-10,), 1e-6)  # with float32's rounding, 2**-24
        True
    """
    if ratio is None or not math.isfinite(ratio):
        return False
    return ratio + max(decays, default=0.0) + (ROUNDING if decays else 0.0) < threshold
