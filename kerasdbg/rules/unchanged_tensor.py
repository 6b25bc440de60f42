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
from kerasdbg.rules.rule import COLLECTIONS, Rule, caches

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
        """What `check` reads of the block's steps, every tensor at once: the
        tensors `keys` (in the records' order), and per group of tensors
        with the same compared statistics `(positions in keys, names, values
        [steps, tensors, names])`; `moved` (`[steps, keys]`: whether the
        gradient moved each weight at each step; False for gradients)."""
        keys, groups, decay_columns, ratios = self._columns(block._plan)
        series = [(positions, names, block.values[:, columns])
                  for positions, names, columns in groups]
        decays = block.values[:, decay_columns]
        moved = np.zeros((len(block), len(keys)), bool)
        if ratios:
            with np.errstate(invalid="ignore"):
                kept = np.where(np.isfinite(decays) & (decays > 0.0), decays, 0.0)
                largest = kept.max(axis=1, initial=0.0) + np.where(
                    (kept > 0.0).any(axis=1), ROUNDING, 0.0)
                indexes, columns = (list(c) for c in zip(*ratios))
                ratio = block.values[:, columns]
                still_ = np.isfinite(ratio) & (ratio + largest[:, None] < MOVED)
                moved[:, indexes] = ~np.isnan(ratio) & ~still_
        return keys, series, moved

    def _columns(self, plan):
        """Where `_series` reads a block of the layout `plan` (the records'
        tags; worked out once per layout): `(keys, [(positions in keys,
        names, columns [tensors, names])], the decay fractions' columns,
        [(position in keys, the update ratio's column)] of the weights)`."""
        known = caches(self).setdefault("columns", {})
        found = known.get(id(plan))
        if found is not None and found[0] is plan:
            return found[1]
        by_key: dict = {}
        for key, stat, tag in plan.by_tensor(tuple(self.collections), COMPARED):
            by_key.setdefault(key, {})[stat] = plan.position(tag)
        keys = list(by_key)
        groups: dict = {}
        for index, key in enumerate(keys):
            groups.setdefault(tuple(sorted(by_key[key])), []).append(index)
        series = [(positions, names, np.array([[by_key[keys[k]][n] for n in names]
                                               for k in positions], np.int64))
                  for names, positions in groups.items()]
        decays = np.array([plan.position(t) for t in plan.per_optimizer(STEP, DECAY)], np.int64)
        ratios = []
        for index, key in enumerate(keys):
            if key[0] == "weights":
                column = plan.position(statistic("weights", key[1], "update_ratio"))
                if column is not None:
                    ratios.append((index, column))
        if len(known) > 64:  # (layouts that never repeat)
            known.clear()
        value = (keys, series, decays, ratios)
        known[id(plan)] = (plan, value)
        return value

    def _judged(self, block):
        """`(keys, evaluated, fires)`, `[steps, keys]`: whether each tensor's
        window is judged at each step (it holds `num_steps` entries with the
        step's statistics) and whether it would fire there (every entry equal
        to the step's within the tolerances, and no move of the weights)."""
        keys, series, moved = self._series(block)
        count, size = len(block), self.num_steps
        evaluated = np.zeros((count, len(keys)), bool)
        fires = np.zeros((count, len(keys)), bool)
        earlier = size - 1
        for positions, names, values in series:
            wanted = set(names)
            before = np.full((earlier, len(positions), len(names)), np.nan)
            matches = np.zeros((earlier + count, len(positions)), bool)
            matches[earlier:] = True
            counts = np.zeros(len(positions), np.int64)
            for column, index in enumerate(positions):
                window = self._windows.get(keys[index], ())
                counts[column] = len(window)
                prior = list(window)[-earlier:] if earlier else []
                for row, entry in enumerate(prior, earlier - len(prior)):
                    matches[row, column] = set(entry) == wanted
                    before[row, column] = [entry.get(n, np.nan) for n in names]
            full = (counts[None, :] + np.arange(1, count + 1)[:, None]) >= size
            joined = np.concatenate([before, values])
            judged = full.copy()
            close = full & np.isfinite(values).all(axis=2)
            with np.errstate(invalid="ignore"):
                for back in range(1, size):
                    other = joined[earlier - back:earlier - back + count]
                    same = matches[earlier - back:earlier - back + count]
                    judged &= same
                    close &= same & (np.abs(other - values) <= self.atol + self.rtol * np.abs(
                        values)).all(axis=2)
            evaluated[:, positions] = judged
            fires[:, positions] = judged & close
        # The moves `check` keeps: the window's last `num_steps - 1` steps.
        flags = np.concatenate([np.zeros((earlier, len(keys)), bool), moved])
        for index, key in enumerate(keys):
            prior = list(self._moved.get(key, ()))
            if prior:
                flags[earlier - len(prior):earlier, index] = prior
        cumulative = np.concatenate([np.zeros((1, len(keys)), np.int64),
                                     np.cumsum(flags, axis=0)])
        ends = earlier + np.arange(1, count + 1)
        recent = (cumulative[ends] - cumulative[ends - earlier]) > 0 if earlier \
            else np.zeros((count, len(keys)), bool)
        return keys, series, moved, evaluated, fires & ~recent

    def screen(self, block):
        return self._of_block(block, self._judged, screening=True)[4].any(axis=1)

    def advance(self, block):
        keys, series, moved, evaluated, _ = self._of_block(block, self._judged, screening=False)
        size = self.num_steps
        for index in np.flatnonzero(evaluated.any(axis=0)).tolist():
            self._checked.add(keys[index])
        for positions, names, values in series:
            for column, index in enumerate(positions):
                window = self._windows[keys[index]]
                for row in values[-size:, column].tolist():
                    window.append(dict(zip(names, row)))
        for index, key in enumerate(keys):
            if key[0] == "weights":
                self._moved[key].extend(moved[-(size - 1):, index].tolist())
        norms = {}
        for positions, names, values in series:
            if "l2_norm" in names:
                at = names.index("l2_norm")
                for column, index in enumerate(positions):
                    norms[index] = values[:, column, at]
        for collection in ("gradients", "weights"):
            mine = [index for index, key in enumerate(keys) if key[0] == collection]
            if not mine:
                continue
            weights = collection == "weights" and any(index in norms for index in mine)
            # The steps that judge the same tensors are one call of `quiet`.
            patterns, rows = np.unique(evaluated[:, mine], axis=0, return_inverse=True)
            for number, pattern in enumerate(patterns):
                judged = [mine[k] for k in np.flatnonzero(pattern).tolist()]
                chosen = np.flatnonzero(rows.reshape(-1) == number)
                magnitudes = np.stack(
                    [norms[index][chosen] if index in norms else np.zeros(len(chosen))
                     for index in judged], axis=1) if weights and judged else None
                self._construction.quiet(collection, [keys[index][1] for index in judged],
                                         magnitudes if weights else None)

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
