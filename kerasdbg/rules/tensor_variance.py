"""`TensorVariance`: tensors whose variance is too small or too large."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from kerasdbg import _validation as check
from kerasdbg.rules.rule import COLLECTIONS, Rule, values_of


class TensorVariance(Rule):
    """Fires when a tensor's variance (std squared) leaves [min_threshold, max_threshold].

    Reads `<collection>/<tensor>/std`. A tensor of one element (a bias of
    one unit) has variance 0, so a `min_threshold` fires on it; narrow
    `collections` or raise `min_threshold` only where tensors have several
    elements.

    Args:
        min_threshold: a variance below this fires; None for no lower bound.
            Defaults to `None`.
        max_threshold: a variance above this fires; None for no upper bound.
            Defaults to `None`. At least one of the two is required.
        collections: which of "gradients", "weights", "activations" to
            watch. Defaults to all three.

    Examples:
        >>> from kerasdbg.rules import TensorVariance
        >>> TensorVariance(max_threshold=100.0).check(
        ...     9, {"activations/dense_tap/std": 20.0}).reason
        'TensorVariance at step 9: variance outside [-inf, 100] in activations: dense_tap=400'
    """

    def __init__(self, min_threshold: Optional[float] = None,
                 max_threshold: Optional[float] = None,
                 collections: Sequence[str] = COLLECTIONS):
        owner = type(self).__name__
        if min_threshold is None and max_threshold is None:
            raise ValueError(
                f"{owner}: give `min_threshold`, `max_threshold` or both. "
                "Received: min_threshold=None, max_threshold=None"
            )
        self.min_threshold = None if min_threshold is None else check.number(
            owner, "min_threshold", min_threshold, minimum=0.0)
        self.max_threshold = None if max_threshold is None else check.number(
            owner, "max_threshold", max_threshold, minimum=self.min_threshold or 0.0)
        self.collections = check.choices(owner, "collections", collections, COLLECTIONS)

    @property
    def requires(self):
        return tuple((c, "std") for c in self.collections)

    def check(self, step, record):
        low = -math.inf if self.min_threshold is None else self.min_threshold
        high = math.inf if self.max_threshold is None else self.max_threshold
        for collection in self.collections:
            variances = {
                name: std ** 2 for name, std in values_of(record, collection, "std")
                if math.isfinite(std)
            }
            bad = {name: v for name, v in variances.items() if not low <= v <= high}
            if bad:
                return self.verdict_on(
                    step, f"variance outside [{low:g}, {high:g}] in {collection}", bad)
        return None

    def get_config(self):
        return {"min_threshold": self.min_threshold, "max_threshold": self.max_threshold,
                "collections": list(self.collections)}
