"""`ExplodingTensor`: NaN or infinite values, or magnitudes above a threshold."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.rules.rule import COLLECTIONS, Rule, StepRecord, values_of


class ExplodingTensor(Rule):
    """Fires when a tensor holds NaN or Inf, or (with `threshold`) a value larger than it.

    Reads `<collection>/<tensor>/nan_count` and `inf_count`, and with a
    threshold `min` and `max`, for each collection ("gradients", "weights",
    "activations" — the latter from `TapLayer`s).

    Args:
        collections: which collections to watch. Defaults to `("gradients",)`.
        threshold: also fire when max |value| of a tensor exceeds this; None
            watches non-finite values only. Defaults to `None`.
        only_nan: count NaN only, not infinities. Defaults to `False`.

    Examples:
        >>> from kerasdbg.rules import ExplodingTensor
        >>> ExplodingTensor().check(12, {"gradients/m/d/kernel/nan_count": 3.0,
        ...                              "gradients/m/d/kernel/inf_count": 0.0}).reason
        'ExplodingTensor at step 12: non-finite values in gradients: m/d/kernel=3'
    """

    def __init__(
        self, collections: Sequence[str] = ("gradients",), threshold: Optional[float] = None,
        only_nan: bool = False,
    ):
        owner = type(self).__name__
        self.collections = check.choices(owner, "collections", collections, COLLECTIONS)
        self.threshold = None if threshold is None else check.number(
            owner, "threshold", threshold, minimum=0.0, exclusive_minimum=True)
        self.only_nan = check.boolean(owner, "only_nan", only_nan)

    @property
    def watches_nonfinite(self) -> bool:
        return "gradients" in self.collections

    @property
    def requires(self):
        stats = ["nan_count"] + ([] if self.only_nan else ["inf_count"])
        stats += ["min", "max"] if self.threshold is not None else []
        return tuple((c, s) for c in self.collections for s in stats)

    def screen(self, block):
        flagged = np.zeros(len(block), bool)
        with np.errstate(invalid="ignore"):
            for collection in self.collections:
                flagged |= (block.column(collection, "nan_count") > 0).any(axis=1)
                if not self.only_nan:
                    flagged |= (block.column(collection, "inf_count") > 0).any(axis=1)
                if self.threshold is not None:
                    for stat in ("min", "max"):
                        flagged |= (np.abs(block.column(collection, stat))
                                    > self.threshold).any(axis=1)
        return flagged

    def advance(self, block):
        pass  # no memory

    def check(self, step, record):
        for collection in self.collections:
            if self.threshold is None and isinstance(record, StepRecord) and not (
                    (record.column(collection, "nan_count") > 0).any() or (
                        not self.only_nan and (record.column(collection, "inf_count") > 0).any())):
                # Every count 0 (a count is never negative): nothing is non-finite, read
                # as one array (the rule reads every step of every variable).
                continue
            bad = dict(values_of(record, collection, "nan_count"))
            if not self.only_nan:
                for name, count in values_of(record, collection, "inf_count"):
                    bad[name] = bad.get(name, 0.0) + count
            bad = {k: v for k, v in bad.items() if v > 0}
            if bad:
                return self.verdict_on(step, f"non-finite values in {collection}", bad)
            if self.threshold is not None:
                peaks = {}
                for stat in ("min", "max"):
                    for name, value in values_of(record, collection, stat):
                        if not math.isnan(value):
                            peaks[name] = max(peaks.get(name, 0.0), abs(value))
                large = {k: v for k, v in peaks.items() if v > self.threshold}
                if large:
                    return self.verdict_on(
                        step, f"|values| above {self.threshold:g} in {collection}", large)
        return None

    def get_config(self):
        return {"collections": list(self.collections), "threshold": self.threshold,
                "only_nan": self.only_nan}
