"""`LearnedRange`: a statistic of a tensor outside the range a healthy run gave it."""

from __future__ import annotations

import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from kerasdbg import _validation as check
from kerasdbg.rules.rule import COLLECTIONS, Record, Rule, values_of

MAGNITUDES = ("l2_norm", "mean_abs", "std", "update_ratio", "distance_from_start")
"""Statistics that are non-negative scales: widened by a factor, `[low / margin,
high * margin]`."""
FRACTIONS = ("zero_fraction", "dead_fraction", "saturated_fraction")
"""Statistics that are fractions (0-1): widened by a factor on the fraction below
and on its complement above, `[low / margin, 1 - (1 - high) / margin]`."""
STATISTICS = {
    "gradients": ("l2_norm", "mean_abs", "std", "zero_fraction"),
    "weights": ("l2_norm", "mean_abs", "std", "zero_fraction", "update_ratio",
                "distance_from_start"),
    "activations": ("l2_norm", "mean_abs", "std", "zero_fraction", "dead_fraction",
                    "saturated_fraction"),
}
"""What `LearnedRange` can watch, by collection."""
DEFAULT_MARGIN = 10.0
"""The default `margin` of `LearnedRange` and `kerasdbg.calibrate` (see `calibrate`
for the measurements behind it)."""
DEFAULT_FIRST_STEPS = 10
"""Steps `1..10` are judged against the whole calibrated run: the steps that the
default schedule records at every step (`kerasdbg.schedule.DEFAULT`)."""

Bounds = List[Optional[float]]
"""`[low, high]` of a tensor, as calibrated (before the margin); None: no bound
on that side."""


class Measurement:
    """What a `LearnedRange` compares, step by step, for one `(collection,
    statistic)`: the recorded values, by tensor, except the update ratio.

    The update ratio ||update|| / ||weights before|| is taken over the
    largest norm the weights have had (when the norm of the step before is
    recorded), as `WeightUpdateRatio` reads it: a healthy bias passing near
    zero (the one bias of a one-unit output layer) has a ratio of 20 for a
    step and says nothing then. A zero tensor that moved keeps its infinite
    ratio. `kerasdbg.calibrate` measures the healthy run through this class,
    so a run is judged on the values its range was learned from.

    Args:
        collection: "gradients", "weights" or "activations".
        statistic: the statistic, e.g. "l2_norm".

    Examples:
        >>> from kerasdbg.rules.learned_range import Measurement
        >>> measure = Measurement("weights", "update_ratio")
        >>> measure(1, {"weights/m/b/l2_norm": 2.0, "weights/m/b/update_ratio": 0.5})
        {'m/b': 0.5}
        >>> measure(2, {"weights/m/b/l2_norm": 0.1, "weights/m/b/update_ratio": 0.95})
        {'m/b': 0.95}
        >>> measure(3, {"weights/m/b/l2_norm": 0.2, "weights/m/b/update_ratio": 4.0})  # 4 * 0.1 / 2
        {'m/b': 0.2}
    """

    def __init__(self, collection: str, statistic: str):
        self.collection = collection
        self.statistic = statistic
        self._normalized = (collection, statistic) == ("weights", "update_ratio")
        self._last: Dict[str, Tuple[int, float]] = {}  # tensor -> (step, its norm then)
        self._peak: Dict[str, float] = {}  # tensor -> the largest norm recorded so far

    def __call__(self, step: int, record: Record) -> Dict[str, float]:
        """`{tensor: value}` of the statistic at `step` (NaN kept)."""
        values = dict(values_of(record, self.collection, self.statistic))
        if not self._normalized:
            return values
        for name, ratio in values.items():
            last = self._last.get(name)
            if last is not None and last[0] == int(step) - 1 and last[1] > 0.0:
                values[name] = ratio * last[1] / max(last[1], self._peak[name])
        for name, norm in values_of(record, "weights", "l2_norm"):
            if math.isfinite(norm):
                self._peak[name] = max(self._peak.get(name, 0.0), norm)
                self._last[name] = (int(step), norm)
        return values


class LearnedRange(Rule):
    """Fires when a tensor's statistic leaves the range a healthy run gave it.

    Holds, for one `(collection, statistic)`, a range per tensor, learned by
    `kerasdbg.calibrate` from a healthy run of the same model, and fires at
    the first step where a recorded value of a calibrated tensor falls
    outside its range widened by `margin`: `[low / margin, high * margin]`
    for the scales (`MAGNITUDES`: norms, update ratios), `[low / margin,
    1 - (1 - high) / margin]` for the fractions 0-1 (`FRACTIONS`: dead,
    saturated and zero fractions), so that a fraction never exceeds 1. A
    side whose bound is None is not checked. The steps up to `first_steps`
    are judged against `first_ranges` (a healthy training's first steps are
    unlike its later ones), the later ones against `ranges`.

    The update ratio is read over the largest norm the weights have had
    (`Measurement`), so the rule also reads `weights/<variable>/l2_norm`.
    A recorded tensor the ranges do not name is matched by its place in
    the model where its name differs from a calibrated one only by the
    numbers Keras adds to names (`by_place`: the same model built again in
    a process is `sequential_1`, its layers `dense_2`, ...); other tensors
    are not checked. A NaN is left to
    `NonFiniteLoss` and `ExplodingTensor`, an infinite value (an explosion,
    weights that were zero before an update) is out of any finite range.
    When no recorded tensor is one it was calibrated on (a model with other
    names), the rule says so once, as an "info" verdict, and checks nothing.

    With `every_step` (the default), `StopOnRule` records what the rule
    reads at every step, not only at steps 1-10 and every 50th (its default
    schedule), so a fault is caught at its step: the l2 norms cost one
    pass over each tensor, the update ratio a copy of the weights at each step.

    Args:
        collection: "gradients", "weights" or "activations".
        statistic: what to watch, one of `STATISTICS[collection]`.
        ranges: `{tensor: (low, high)}`, the calibrated range of each tensor
            at the steps after `first_steps`, without the margin; None for a
            side that is not checked.
        first_ranges: the same for the steps up to `first_steps`, or None for
            `ranges` at every step. Defaults to `None`.
        first_steps: the last step judged against `first_ranges`. Defaults to `10`.
        margin: the factor (at least 1) by which each range is widened.
            Defaults to `10.0`.
        every_step: whether `StopOnRule` records what the rule reads at every
            step. Defaults to `True`.

    Examples:
        >>> from kerasdbg.rules import LearnedRange
        >>> rule = LearnedRange("gradients", "l2_norm", {"m/d/kernel": (0.5, 2.0)}, margin=10.0)
        >>> rule.check(12, {"gradients/m/d/kernel/l2_norm": 15.0}) is None  # below 2 * 10
        True
        >>> rule.check(13, {"gradients/m/d/kernel/l2_norm": 35.0}).reason
        'LearnedRange at step 13: gradients l2_norm outside its calibrated range (margin 10): m/d/kernel=35 > 20'
    """

    every_step = True  # an argument here (the base class derives it)

    def __init__(self, collection: str, statistic: str, ranges: Mapping[str, Sequence],
                 first_ranges: Optional[Mapping[str, Sequence]] = None,
                 first_steps: int = DEFAULT_FIRST_STEPS, margin: float = DEFAULT_MARGIN,
                 every_step: bool = True):
        owner = type(self).__name__
        self.collection = check.one_of(owner, "collection", collection, COLLECTIONS)
        allowed = STATISTICS[collection]
        if statistic not in allowed:
            raise ValueError(
                f"{owner}: `statistic` must be one of {', '.join(map(repr, allowed))} for "
                f"collection {collection!r}. Received: statistic={statistic!r}")
        self.statistic = statistic
        fraction = statistic in FRACTIONS
        self.ranges = _ranges(owner, "ranges", ranges, fraction)
        self.first_ranges = None if first_ranges is None else _ranges(
            owner, "first_ranges", first_ranges, fraction)
        self.first_steps = check.non_negative_int(owner, "first_steps", first_steps)
        self.margin = check.number(owner, "margin", margin, minimum=1.0)
        self.every_step = check.boolean(owner, "every_step", every_step)
        self.reset()

    @property
    def requires(self):
        if (self.collection, self.statistic) == ("weights", "update_ratio"):
            return (("weights", "update_ratio"), ("weights", "l2_norm"))
        return ((self.collection, self.statistic),)

    def reset(self):
        self._measure = Measurement(self.collection, self.statistic)
        self._looked = False  # whether a record named a tensor (calibrated or not)
        self._seen: set = set()  # the recorded names so far
        self._alias: Dict[str, str] = {}  # a recorded name -> the calibrated one, by place

    def widened(self, bounds: Sequence[Optional[float]]) -> Tuple[float, float]:
        """`(low, high)` of a range widened by `margin`; -inf or inf where
        there is no bound.

        Examples:
            >>> from kerasdbg.rules import LearnedRange
            >>> LearnedRange("activations", "dead_fraction", {"t": (0.0, 0.2)}, margin=4.0
            ...              ).widened((None, 0.2))
            (-inf, 0.8)
        """
        low, high = bounds
        low = -math.inf if low is None else low / self.margin
        if high is None:
            high = math.inf
        elif self.statistic in FRACTIONS:
            high = 1.0 - (1.0 - high) / self.margin
        else:
            high = high * self.margin
        return low, high

    def check(self, step, record):
        values = self._measure(step, record)
        if not values:
            return None
        table = self.ranges if self.first_ranges is None or step > self.first_steps \
            else self.first_ranges
        if not self._seen.issuperset(values):
            self._seen.update(values)
            self._alias = by_place(list(self.ranges) + [
                name for name in self.first_ranges or {} if name not in self.ranges],
                self._seen)
        if not self._looked:
            self._looked = True
            if not any(name in self.ranges or name in (self.first_ranges or {})
                       or name in self._alias for name in values):
                self.note(step, f"{self.collection} {self.statistic}: none of the recorded "
                          f"tensors is one it was calibrated on ({_names(self.ranges)}), so it "
                          "checks nothing (a model with other names?); recorded", values)
        bad, said = {}, []
        for name, value in values.items():
            bounds = table.get(name, table.get(self._alias.get(name)))
            if bounds is None or math.isnan(value):
                continue
            low, high = self.widened(bounds)
            if value < low:
                bad[name] = value
                said.append(f"{name}={value:.4g} < {low:.4g}")
            elif value > high:
                bad[name] = value
                said.append(f"{name}={value:.4g} > {high:.4g}")
        if not bad:
            return None
        more = f" and {len(said) - 5} more" if len(said) > 5 else ""
        return self.verdict(
            step, f"{self.collection} {self.statistic} outside its calibrated range (margin "
            f"{self.margin:g}): {', '.join(said[:5])}{more}", bad)

    def get_config(self):
        return {
            "collection": self.collection, "statistic": self.statistic,
            "ranges": {name: list(bounds) for name, bounds in self.ranges.items()},
            "first_ranges": None if self.first_ranges is None else {
                name: list(bounds) for name, bounds in self.first_ranges.items()},
            "first_steps": self.first_steps, "margin": self.margin,
            "every_step": self.every_step,
        }


_NUMBER = re.compile(r"_(\d+)(?=_|$)")


def _numbered(component: str) -> Tuple[str, Tuple[int, ...]]:
    """A path component without the numbers Keras's naming adds, and those
    numbers: `("dense", (3,))` of "dense_3", `("dense_tap", (3,))` of a
    tap's "dense_3_tap", `("dense", ())` of "dense"."""
    return _NUMBER.sub("", component), tuple(int(n) for n in _NUMBER.findall(component))


def by_place(calibrated: Sequence[str], recorded) -> Dict[str, str]:
    """`{recorded name: calibrated name}` for the recorded tensors whose
    name was not calibrated on, matched by their place in the model: Keras
    numbers the objects it names in their order of creation ("dense",
    "dense_1", ...; a second model of a process is "sequential_1" and its
    layers "dense_2", ...), so the names that differ only by those numbers
    are paired in that order. A family whose tensors are not as many in
    both is left unmatched (another model).

    Examples:
        >>> from kerasdbg.rules.learned_range import by_place
        >>> by_place(["sequential/dense/kernel", "sequential/dense_1/kernel"],
        ...          ["sequential_1/dense_3/kernel", "sequential_1/dense_2/kernel"])
        {'sequential_1/dense_2/kernel': 'sequential/dense/kernel', \
'sequential_1/dense_3/kernel': 'sequential/dense_1/kernel'}
    """
    known = set(calibrated)

    def families(names) -> Dict[tuple, List[Tuple[tuple, str]]]:
        out: Dict[tuple, List[Tuple[tuple, str]]] = {}
        for name in names:
            parts = [_numbered(part) for part in name.split("/")]
            out.setdefault(tuple(p for p, _ in parts), []).append(
                (tuple(n for _, n in parts), name))
        return out

    left = families(calibrated)
    alias = {}
    for family, members in families(sorted(set(recorded) - known)).items():
        theirs = left.get(family)
        if theirs is None:
            continue
        # Only those of the family the run did not record by their own name.
        theirs = [m for m in theirs if m[1] not in recorded]
        if len(theirs) != len(members):
            continue
        for (_, name), (_, calibrated_name) in zip(sorted(members), sorted(theirs)):
            alias[name] = calibrated_name
    return alias


def _names(ranges: Mapping[str, Bounds], limit: int = 3) -> str:
    names = list(ranges)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _ranges(owner: str, name: str, value, fraction: bool) -> Dict[str, Bounds]:
    """`value` as `{tensor: [low, high]}`, each bound None or a finite number
    (0-1 for a fraction, else at least 0), low <= high; else raises."""
    what = (f"a non-empty mapping from tensor names to (low, high) pairs of numbers "
            f"{'0-1' if fraction else '>= 0'} or None")
    if not isinstance(value, Mapping):
        raise TypeError(f"{owner}: `{name}` must be {what}. Received: {name}={value!r} of type "
                        f"{type(value).__name__}")
    if not value:
        raise ValueError(f"{owner}: `{name}` must be {what}. Received: {name}={value!r}")
    ranges = {}
    for tensor, bounds in value.items():
        entry = f"{name}[{tensor!r}]"
        if not isinstance(tensor, str) or not tensor:
            raise TypeError(f"{owner}: `{name}` must be {what}. Received the key {tensor!r}")
        if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence) \
                or len(bounds) != 2:
            raise TypeError(f"{owner}: `{entry}` must be a (low, high) pair. "
                            f"Received: {entry}={bounds!r}")
        low, high = (None if b is None else check.number(
            owner, entry, b, minimum=0.0, maximum=1.0 if fraction else None) for b in bounds)
        if low is not None and high is not None and low > high:
            raise ValueError(f"{owner}: `{entry}` must have low <= high. "
                             f"Received: {entry}={bounds!r}")
        ranges[tensor] = [low, high]
    return ranges
