"""`AllZero`: tensors that are (almost) entirely zero."""

from __future__ import annotations

import math
from typing import Sequence

from kerasdbg import _validation as check
from kerasdbg.rules.rule import COLLECTIONS, Rule, values_of


class AllZero(Rule):
    """Fires when at least `threshold` percent of a tensor's values are zero.

    Reads `<collection>/<tensor>/zero_fraction` (a default statistic of the
    statistics callbacks and of `TapLayer`).

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

    @property
    def requires(self):
        return tuple((c, "zero_fraction") for c in self.collections)

    def check(self, step, record):
        for collection in self.collections:
            bad = {
                name: 100.0 * value
                for name, value in values_of(record, collection, "zero_fraction")
                if not math.isnan(value) and 100.0 * value >= self.threshold
            }
            verdict = self.verdict_on(step, f"at least {self.threshold:g}% zeros in {collection}", bad)
            if verdict is not None:
                return verdict
        return None

    def get_config(self):
        return {"threshold": self.threshold, "collections": list(self.collections)}
