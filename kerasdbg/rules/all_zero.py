"""`AllZero`: tensors that are (almost) entirely zero."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.rules._construction import Construction
from kerasdbg.rules.rule import COLLECTIONS, Rule, values_of


class AllZero(Rule):
    """Fires when the fraction of a tensor's values that are zero is at least `zero_fraction`.

    Reads `<collection>/<tensor>/zero_fraction` (a default statistic of the
    statistics callbacks and of `TapLayer`).

    Gradients and weights that are zero by construction in a healthy
    network (the key bias of `MultiHeadAttention`: an exactly zero gradient,
    so weights that stay at their zero initial value) are not a fault: all
    zero from the first step the rule sees them while another variable of
    their layer is not, or while most variables are not. Each is reported
    once, as an "info" verdict (see `VanishingGradient`). A gradient or an
    activation all zero at its first recorded step fires only when it is
    all zero at its next recorded step too (when the rule watches the
    training from its first optimizer step, step 1): a zero-initialised output
    layer (keras.io's DDIM) outputs zeros, and makes every other gradient
    exactly 0, at the first step only.

    Args:
        zero_fraction: the fraction (0-1) of zeros that fires. Defaults to
            `1.0` (all zero). (`threshold`, a percent, is its deprecated name.)
        collections: which of "gradients", "weights", "activations" to
            watch. Defaults to all three.

    Examples:
        >>> from kerasdbg.rules import AllZero
        >>> rule = AllZero()
        >>> rule.check(1, {"gradients/m/d/kernel/zero_fraction": 1.0}) is None  # the first
        True
        >>> rule.check(2, {"gradients/m/d/kernel/zero_fraction": 1.0}).reason
        'AllZero at step 2: zero_fraction at or above 1 in gradients: m/d/kernel=1'
    """

    def __init__(self, *, zero_fraction: float = 1.0, collections: Sequence[str] = COLLECTIONS,
                 **deprecated):
        # Keyword-only: a positional value was a percent before.
        owner = type(self).__name__
        renamed = check.deprecated(owner, deprecated, {
            "threshold": ("zero_fraction", check.from_percent, "a fraction 0-1, not a percent"),
        }, {"zero_fraction": (zero_fraction, 1.0)})
        check.no_other_arguments(owner, deprecated)
        zero_fraction = renamed.get("zero_fraction", zero_fraction)
        self.zero_fraction = check.number(owner, "zero_fraction", zero_fraction,
                                          minimum=0.0, maximum=1.0)
        self.collections = check.choices(owner, "collections", collections, COLLECTIONS)
        self.reset()

    def reset(self):
        self._construction = Construction()
        self._taps: set = set()  # the taps seen so far

    @property
    def requires(self):
        return tuple((c, "zero_fraction") for c in self.collections)

    def screen(self, block):
        flagged = np.zeros(len(block), bool)
        with np.errstate(invalid="ignore"):
            for collection in self.collections:
                flagged |= (block.column(collection, "zero_fraction")
                            >= self.zero_fraction).any(axis=1)
        return flagged

    def advance(self, block):
        self._construction.started(int(block.steps[0]))
        for collection in self.collections:
            names = block.names(collection, "zero_fraction")
            if collection == "activations":
                self._taps.update(names)
            else:
                self._construction.quiet(collection, names)

    def check(self, step, record):
        self._construction.started(step)
        for collection in self.collections:
            fractions = dict(values_of(record, collection, "zero_fraction"))
            bad = {
                name: value for name, value in fractions.items()
                if not math.isnan(value) and value >= self.zero_fraction
            }
            if collection == "activations":
                # All zero at its first step only is no fault (the output of a
                # zero-initialised layer); at the next recorded step too, it is.
                bad = {name: value for name, value in bad.items()
                       if name in self._taps or not self._construction.started(step)}
                self._taps.update(fractions)
            else:
                # A gradient all zero at the first step only is not a fault: a
                # zero-initialised output layer zeroes every other one then.
                bad, exempt = self._construction.split(
                    collection, bad, fractions, step=step, defer_first=collection == "gradients")
                self.note(step, f"zero by construction, not a fault (all zero in {collection} "
                          "from the first step while its layer is not)", exempt)
            verdict = self.verdict_on(
                step, f"zero_fraction at or above {self.zero_fraction:g} in {collection}", bad)
            if verdict is not None:
                return verdict
        return None

    def get_config(self):
        return {"zero_fraction": self.zero_fraction, "collections": list(self.collections)}
