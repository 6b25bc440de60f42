"""`AllZero`: tensors that are (almost) entirely zero."""

from __future__ import annotations

import math
from typing import Sequence

from kerasdbg import _validation as check
from kerasdbg.rules._construction import Construction
from kerasdbg.rules.rule import COLLECTIONS, Rule, values_of


class AllZero(Rule):
    """Fires when at least `threshold` percent of a tensor's values are zero.

    Reads `<collection>/<tensor>/zero_fraction` (a default statistic of the
    statistics callbacks and of `TapLayer`).

    Gradients and weights that are zero by construction in a healthy
    network (the key bias of `MultiHeadAttention`: an exactly zero gradient,
    so weights that stay at their zero initial value) are not a fault: all
    zero from the first step the rule sees them while another variable of
    their layer is not, or while most variables are not. Each is reported
    once, as an "info" verdict (see `VanishingGradient`).

    Args:
        threshold: percent of zeros that fires. Defaults to `100.0`.
        collections: which of "gradients", "weights", "activations" to
            watch. Defaults to all three.

    Example:

    >>> from kerasdbg.rules import AllZero
    >>> AllZero().check(1, {"gradients/m/d/kernel/zero_fraction": 1.0}).reason
    'AllZero at step 1: at least 100% zeros in gradients: m/d/kernel=100'
    """

    def __init__(self, threshold: float = 100.0, collections: Sequence[str] = COLLECTIONS):
        owner = type(self).__name__
        self.threshold = check.number(owner, "threshold", threshold, minimum=0.0, maximum=100.0)
        self.collections = check.choices(owner, "collections", collections, COLLECTIONS)
        self.reset()

    def reset(self):
        self._construction = Construction()

    @property
    def requires(self):
        return tuple((c, "zero_fraction") for c in self.collections)

    def check(self, step, record):
        for collection in self.collections:
            fractions = dict(values_of(record, collection, "zero_fraction"))
            bad = {
                name: 100.0 * value for name, value in fractions.items()
                if not math.isnan(value) and 100.0 * value >= self.threshold
            }
            if collection != "activations":
                bad, exempt = self._construction.split(collection, bad, fractions, step=step)
                self.note(step, f"zero by construction, not a fault (all zero in {collection} "
                          "from the first step while its layer is not)", exempt)
            verdict = self.verdict_on(step, f"at least {self.threshold:g}% zeros in {collection}", bad)
            if verdict is not None:
                return verdict
        return None

    def get_config(self):
        return {"threshold": self.threshold, "collections": list(self.collections)}
