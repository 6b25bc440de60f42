"""`UnchangedTensor`: tensors whose statistics stop changing."""

from __future__ import annotations

import collections
import functools
import math
from typing import Sequence

import numpy as np

from kerasdbg import _validation as check
from kerasdbg.rules._construction import Construction
from kerasdbg.records.step_record import statistics_by_tensor
from kerasdbg.records.tags import STEP, statistic
from kerasdbg.rules._decay import DECAY, ROUNDING, decay_fractions, still
from kerasdbg.rules.rule import COLLECTIONS, Rule

# Statistics compared between steps, where recorded.
COMPARED = ("l2_norm", "mean", "std", "min", "max", "mean_abs", "zero_fraction")
MOVED = 1e-8
"""The update/weight ratio from which weights moved at a step (that of
`WeightUpdateRatio`'s `small_threshold` and `VanishingGradient`'s
`update_threshold`)."""


class UnchangedTensor(Rule):
    """Fires when a tensor's statistics are the same over `num_steps` recorded steps.

    kerasdbg records statistics, not whole tensors, so "unchanged" means:
    every recorded statistic among l2_norm, mean, std, min, max, mean_abs and
    zero_fraction equal (`np.allclose` with `rtol`, `atol`) over the last
    `num_steps` recorded steps. Weights that stop moving (a learning rate of
    0, a frozen layer behind dead units), gradients stuck at one value, or
    activations that no longer depend on the batch show up this way.

    Tensors constant by construction in a healthy network are not a fault:
    unchanged from the first steps while their layer changes, or weights
    that a sibling of their layer (the kernel beside a bias) outweighs a
    thousand times at every step, such as the key bias of
    `MultiHeadAttention`, whose gradient is zero up to rounding. Each is
    reported once, as an "info" verdict.

    Where the weights' update ratio is recorded (`weights/<variable>/
    update_ratio`, read when recorded), it decides for weights: a variable
    that its gradient moved (a ratio of at least `MOVED`, less the part of
    decoupled weight decay, see `VanishingGradient`) at a step of the window
    has changed, however little its statistics did (Adam moving a kernel by
    1e-5 of itself per step, under the default `rtol`).

    Args:
        num_steps: recorded steps that must agree. Defaults to `3`.
        rtol: relative tolerance. Defaults to `1e-5`.
        atol: absolute tolerance. Defaults to `1e-8`.
        collections: which of "gradients", "weights", "activations" to
            watch. Defaults to `("weights",)`.

    Examples:
        >>> from kerasdbg.rules import UnchangedTensor
        >>> rule = UnchangedTensor(num_steps=2)
        >>> rule.check(1, {"weights/m/d/kernel/l2_norm": 1.5}) is None
        True
        >>> rule.check(2, {"weights/m/d/kernel/l2_norm": 1.5}).reason
        'UnchangedTensor at step 2: statistics unchanged over 2 recorded steps in weights: m/d/kernel=1.5'
    """

    def __init__(self, num_steps: int = 3, rtol: float = 1e-5, atol: float = 1e-8,
                 collections: Sequence[str] = ("weights",)):
        owner = type(self).__name__
        self.num_steps = check.positive_int(owner, "num_steps", num_steps)
        if self.num_steps < 2:
            raise ValueError(
                f"{owner}: `num_steps` must be at least 2 (steps to compare). "
                f"Received: num_steps={num_steps}"
            )
        self.rtol = check.number(owner, "rtol", rtol, minimum=0.0)
        self.atol = check.number(owner, "atol", atol, minimum=0.0)
        self.collections = check.choices(owner, "collections", collections, COLLECTIONS)
        self.reset()

    @property
    def requires(self):
        compared = tuple((c, s) for c in self.collections for s in COMPARED)
        return compared + ((("weights", "update_ratio"),) if "weights" in self.collections else ())

    def can_check(self, present):
        # The update ratio refines the statistics; alone it is not enough.
        return any((c, s) in present for c in self.collections for s in COMPARED)

    def reset(self):
        # A partial, not a lambda: a rule deep-copies and pickles (KerasTuner copies callbacks).
        self._windows = collections.defaultdict(
            functools.partial(collections.deque, maxlen=self.num_steps))
        self._checked = set()  # tensors whose window was full once
        # Per tensor, whether its gradient moved it at each of the last steps
        # (the changes between the window's steps), where the ratio is recorded.
        self._moved = collections.defaultdict(
            functools.partial(collections.deque, maxlen=self.num_steps - 1))
        self._construction = Construction()

    # ---------------------------------------------------- a block of steps
    def _series(self, block):
        """Per tensor of `block` (in the records' order): `(key, names, values,
        moved)`: its compared statistics (sorted names, `[steps, names]`) and
        whether its gradient moved it at each step (weights), as `check`
        reads them."""
        plan = block._plan
        found: dict = {}
        for key, stat, tag in plan.by_tensor(tuple(self.collections), COMPARED):
            found.setdefault(key, {})[stat] = plan.position(tag)
        decays = block.values[:, [plan.position(t) for t in plan.per_optimizer(STEP, DECAY)]]
        with np.errstate(invalid="ignore"):
            kept = np.where(np.isfinite(decays) & (decays > 0.0), decays, 0.0)
            largest = kept.max(axis=1, initial=0.0) + np.where(
                (kept > 0.0).any(axis=1), ROUNDING, 0.0)
        out = []
        for key, stats in found.items():
            names = sorted(stats)
            values = block.values[:, [stats[n] for n in names]]
            moved = None
            if key[0] == "weights":
                ratio = block.tag(statistic("weights", key[1], "update_ratio"))
                if ratio is None:
                    moved = np.zeros(len(block), bool)
                else:
                    with np.errstate(invalid="ignore"):
                        still_ = np.isfinite(ratio) & (ratio + largest < MOVED)
                    moved = ~np.isnan(ratio) & ~still_
            out.append((key, names, values, moved))
        return out

    def _windows_of(self, key, names, values):
        """`(full, evaluated, close)` per step of the block: the tensor's window
        holds `num_steps` entries, they share the step's statistics (the window
        is judged), and every entry equals the step's within the tolerances."""
        count, size = len(values), self.num_steps
        prior = list(self._windows.get(key, ()))[-(size - 1):]
        keys = set(names)
        before = np.array([[w.get(n, np.nan) for n in names] for w in prior],
                          np.float64).reshape(len(prior), len(names))
        matches = np.array([set(w) == keys for w in prior] + [True] * count, bool)
        series = np.concatenate([before, values])
        start = len(prior)
        seen = len(self._windows.get(key, ())) + np.arange(1, count + 1)
        full = seen >= size
        evaluated = full.copy()
        close = full & np.isfinite(values).all(axis=1)
        rows = np.arange(count)
        with np.errstate(invalid="ignore"):
            for back in range(1, size):
                at = start + rows - back
                inside = at >= 0
                other = series[np.maximum(at, 0)]
                same = inside & matches[np.maximum(at, 0)]
                evaluated &= same | ~full  # (rows not full are not evaluated anyway)
                close &= same & np.isfinite(other).all(axis=1) & (
                    np.abs(other - values) <= self.atol + self.rtol * np.abs(values)).all(axis=1)
        return full, evaluated & full, close

    def _moved_within(self, key, moved):
        """Per step: whether the gradient moved the weights at one of the
        window's last `num_steps - 1` steps (the moves `check` keeps)."""
        prior = list(self._moved.get(key, ()))
        flags = np.concatenate([np.asarray(prior, bool), moved])
        window = self.num_steps - 1
        cumulative = np.concatenate([[0], np.cumsum(flags)])
        ends = len(prior) + np.arange(1, len(moved) + 1)
        return (cumulative[ends] - cumulative[np.maximum(ends - window, 0)]) > 0

    def screen(self, block):
        flagged = np.zeros(len(block), bool)
        for key, names, values, moved in self._series(block):
            _, evaluated, close = self._windows_of(key, names, values)
            fires = evaluated & close
            if moved is not None:
                fires &= ~self._moved_within(key, moved)
            flagged |= fires
        return flagged

    def advance(self, block):
        series = self._series(block)
        evaluated_at = {}
        for key, names, values, moved in series:
            _, evaluated, _ = self._windows_of(key, names, values)
            evaluated_at[key] = evaluated
            if evaluated.any():
                self._checked.add(key)
            window = self._windows[key]
            for row in values[-self.num_steps:].tolist():
                window.append(dict(zip(names, row)))
            if moved is not None:
                self._moved[key].extend(moved[-(self.num_steps - 1):].tolist())
        steps = len(block)
        for collection in ("gradients", "weights"):
            keys = [entry for entry in series if entry[0][0] == collection]
            norms = {key[1]: values[:, names.index("l2_norm")]
                     for key, names, values, _ in keys if "l2_norm" in names} \
                if collection == "weights" else {}
            # The steps that judge the same tensors are one call of `quiet`.
            groups: dict = {}
            for row in range(steps):
                judged = tuple(key[1] for key, *_ in keys if evaluated_at[key][row])
                groups.setdefault(judged, []).append(row)
            for tensors, rows in groups.items():
                magnitudes = np.stack([norms.get(t, np.zeros(steps))[rows] for t in tensors],
                                      axis=1) if norms and tensors else None
                self._construction.quiet(collection, tensors,
                                         magnitudes if norms else None)

    def check(self, step, record):
        current = statistics_by_tensor(record, self.collections, COMPARED)
        fired, evaluated, first_chance = {}, collections.defaultdict(list), set()
        decays = decay_fractions(record) if "weights" in self.collections else ()
        for key, stats in current.items():
            window = self._windows[key]
            window.append(stats)
            if key[0] == "weights":
                ratio = record.get(statistic("weights", key[1], "update_ratio"))
                self._moved[key].append(ratio is not None and not math.isnan(ratio)
                                        and not still(ratio, decays, MOVED))
            if len(window) < self.num_steps or any(w.keys() != stats.keys() for w in window):
                continue
            evaluated[key[0]].append(key[1])
            if key not in self._checked:
                self._checked.add(key)
                first_chance.add(key)
            names = sorted(stats)
            # numpy.allclose against the last step, in plain Python: a few
            # numbers per tensor, thousands of tensors per step.
            if not any(self._moved.get(key, ())) and all(
                    math.isfinite(w[n]) and abs(w[n] - stats[n]) <= self.atol + self.rtol * abs(
                        stats[n]) for w in window for n in names):
                first = stats.get("l2_norm", stats[names[0]])
                fired[key] = first
        for collection in ("gradients", "weights"):
            failing = {t: v for (c, t), v in fired.items() if c == collection}
            # Weights judged by their size too: a tensor that a sibling of its layer dwarfs
            # (RATIO times larger) at every step is near zero by construction (the key bias
            # of an attention layer, whose gradient is 0 up to rounding) and barely moves.
            norms = {t: s["l2_norm"] for (c, t), s in current.items()
                     if c == collection and "l2_norm" in s} if collection == "weights" else {}
            faults, exempt = self._construction.split(
                collection, failing, evaluated[collection],
                first_chance={t for c, t in first_chance if c == collection},
                magnitudes=norms or None, step=step)
            for tensor in set(failing) - set(faults):
                del fired[(collection, tensor)]
            self.note(step, f"constant by construction, not a fault (statistics unchanged in "
                      f"{collection} from the first steps while its layer changes)", exempt)
        if not fired:
            return None
        collection = sorted(fired)[0][0]
        values = {name: v for (c, name), v in sorted(fired.items()) if c == collection}
        return self.verdict_on(
            step, f"statistics unchanged over {self.num_steps} recorded steps in {collection}",
            values)

    def get_config(self):
        return {"num_steps": self.num_steps, "rtol": self.rtol, "atol": self.atol,
                "collections": list(self.collections)}
