"""`StepRecord`: the scalars of one step that rules read, by tag, indexed
once per layout by `(collection, statistic)`; `values_of` reads one
statistic of it."""

from __future__ import annotations

import functools
from typing import Dict, Iterator, List, Mapping, Sequence, Tuple

import numpy as np

from kerasdbg.records.tags import is_per_optimizer, tag_parts

__all__ = ("Record", "StepRecord", "values_of", "statistics_by_tensor", "per_optimizer_values")

Record = Mapping[str, float]
"""The scalars of one step, by TensorBoard tag: `gradients/<variable>/<stat>`,
`weights/<variable>/<stat>`, `activations/<tap>/<stat>`, `gradients/global_norm`,
`step/loss`, `step/frozen`; or of one epoch: `epoch/loss`, `epoch/val_loss`, ..."""


class _Layout:
    """Where each statistic is in the records of one tag layout (the tags of
    a step, in their order): the steps of a fit repeat their tags, so this
    is worked out once for all of them."""

    __slots__ = ("tags", "by_statistic", "_cached")

    def __init__(self, tags: Tuple[str, ...]):
        self.tags = tags
        by_statistic: Dict[Tuple[str, str], List[Tuple[str, str]]] = {}
        for tag in tags:
            parts = tag_parts(tag)
            if parts:
                by_statistic.setdefault((parts[0], parts[2]), []).append((parts[1], tag))
        self.by_statistic = {k: tuple(v) for k, v in by_statistic.items()}
        self._cached: dict = {}

    def per_optimizer(self, kind: str, name: str) -> Tuple[str, ...]:
        """The tags `<kind>/<name>` and `<kind>/<optimizer>/<name>`, in order."""
        key = ("per_optimizer", kind, name)
        found = self._cached.get(key)
        if found is None:
            found = self._cached[key] = tuple(
                t for t in self.tags if is_per_optimizer(t, kind, name))
        return found

    def columns(self, collection: str, statistic: str) -> np.ndarray:
        """The positions, among the tags, of `<collection>/<tensor>/<statistic>`."""
        key = ("columns", collection, statistic)
        found = self._cached.get(key)
        if found is None:
            position = {tag: i for i, tag in enumerate(self.tags)}
            found = self._cached[key] = np.asarray(
                [position[tag] for _, tag in self.by_statistic.get((collection, statistic), ())],
                np.int64)
        return found

    def position(self, tag: str):
        """The position of `tag` among the tags, or None."""
        found = self._cached.get("positions")
        if found is None:
            found = self._cached["positions"] = {t: i for i, t in enumerate(self.tags)}
        return found.get(tag)

    def positions_starting(self, prefix: str) -> np.ndarray:
        """The positions of the tags that start with `prefix`."""
        key = ("positions_starting", prefix)
        found = self._cached.get(key)
        if found is None:
            found = self._cached[key] = np.asarray(
                [i for i, t in enumerate(self.tags) if t.startswith(prefix)], np.int64)
        return found

    def starting(self, prefixes: Tuple[str, ...]) -> Tuple[str, ...]:
        """The tags that start with one of `prefixes`, in order."""
        key = ("starting", prefixes)
        found = self._cached.get(key)
        if found is None:
            found = self._cached[key] = tuple(t for t in self.tags if t.startswith(prefixes))
        return found

    def by_tensor(self, collections: Tuple[str, ...], statistics: Tuple[str, ...]
                  ) -> Tuple[Tuple[Tuple[str, str], str, str], ...]:
        """`((collection, tensor), statistic, tag)` of each tag of one of
        `statistics` in one of `collections`, in tag order."""
        key = ("by_tensor", collections, statistics)
        found = self._cached.get(key)
        if found is None:
            entries = []
            for tag in self.tags:
                parts = tag_parts(tag)
                if parts and parts[0] in collections and parts[2] in statistics:
                    entries.append((parts[:2], parts[2], tag))
            found = self._cached[key] = tuple(entries)
        return found


@functools.lru_cache(maxsize=256)
def _layout(tags: Tuple[str, ...]) -> _Layout:
    return _Layout(tags)


class StepRecord(dict):
    """The scalars of one step, by tag (a `dict`), indexed by `(collection,
    statistic)` for the rules: `values_of` then reads the values of one
    statistic without looking at the other tags. The index is that of the
    record's tag layout, shared by every record with the same tags in the
    same order (the steps of a fit), found at the first read: a record is not
    changed once the rules read it.

    Examples:
        >>> from kerasdbg.records import StepRecord, values_of
        >>> record = StepRecord({"gradients/d/kernel/l2_norm": 2.0, "step/loss": 0.5})
        >>> list(values_of(record, "gradients", "l2_norm"))
        [('d/kernel', 2.0)]
    """

    __slots__ = ("_plan", "_array")

    def _layout(self) -> _Layout:
        # Found at the first read, as the rules read a record (never changed then).
        plan = getattr(self, "_plan", None)
        if plan is None:
            plan = self._plan = _layout(tuple(self))
        return plan

    def column(self, collection: str, statistic: str) -> np.ndarray:
        """The values of every tag `<collection>/<tensor>/<statistic>`, in
        order, as float64 (those of `by_statistic`, as one array).

        Examples:
            >>> from kerasdbg.records import StepRecord
            >>> StepRecord({"weights/a/max": 1.0, "step/loss": 3.0, "weights/b/max": 2.0}
            ...            ).column("weights", "max").tolist()
            [1.0, 2.0]
        """
        values = getattr(self, "_array", None)
        if values is None:
            values = self._array = np.fromiter(self.values(), np.float64, count=len(self))
        return values[self._layout().columns(collection, statistic)]

    def starting(self, prefixes: Tuple[str, ...]) -> Dict[str, float]:
        """`{tag: value}` of the tags that start with one of `prefixes`.

        Examples:
            >>> from kerasdbg.records import StepRecord
            >>> StepRecord({"step/loss": 3.0, "weights/a/max": 1.0}).starting(("step/",))
            {'step/loss': 3.0}
        """
        return {tag: self[tag] for tag in self._layout().starting(prefixes)}

    def by_statistic(self, collection: str, statistic: str) -> List[Tuple[str, float]]:
        """`(tensor, value)` of every tag `<collection>/<tensor>/<statistic>`.

        Examples:
            >>> from kerasdbg.records import StepRecord
            >>> StepRecord({"weights/d/bias/max": 1.0}).by_statistic("weights", "max")
            [('d/bias', 1.0)]
        """
        entries = self._layout().by_statistic.get((collection, statistic), ())
        return [(tensor, float(self[tag])) for tensor, tag in entries]


def _plan_of(record: Record) -> _Layout:
    """The layout of `record`'s tags: a `StepRecord`'s own, else that of its
    tags found afresh (shared by records of the same tags)."""
    return record._layout() if isinstance(record, StepRecord) else _layout(tuple(record))


def values_of(record: Record, collection: str, statistic: str) -> Iterator[Tuple[str, float]]:
    """`(tensor, value)` for each finite or non-finite value of one statistic.

    Args:
        record: the scalars of one step, by tag (a `StepRecord` is read
            through its layout's index).
        collection: `gradients`, `weights`, `activations`, `classes` or
            `replicas`.
        statistic: the last part of the tags (`l2_norm`, `seen`, ...).

    Examples:
        >>> from kerasdbg.records import values_of
        >>> list(values_of({"activations/tap/std": 0.5, "step/loss": 1.0}, "activations", "std"))
        [('tap', 0.5)]
    """
    if isinstance(record, StepRecord):
        yield from record.by_statistic(collection, statistic)
        return
    for tag, value in record.items():
        parts = tag_parts(tag)
        if parts and parts[0] == collection and parts[2] == statistic:
            yield parts[1], float(value)


def statistics_by_tensor(record: Record, collections: Sequence[str],
                         statistics: Sequence[str]) -> Dict[Tuple[str, str], Dict[str, float]]:
    """`{(collection, tensor): {statistic: value}}` of the tags of `statistics`
    in `collections`, in the record's order.

    Examples:
        >>> from kerasdbg.records.step_record import statistics_by_tensor
        >>> statistics_by_tensor({"weights/d/bias/max": 1.0, "weights/d/bias/min": -1.0,
        ...                       "step/loss": 2.0}, ["weights"], ["max", "min"])
        {('weights', 'd/bias'): {'max': 1.0, 'min': -1.0}}
    """
    found: Dict[Tuple[str, str], Dict[str, float]] = {}
    for key, stat, tag in _plan_of(record).by_tensor(tuple(collections), tuple(statistics)):
        found.setdefault(key, {})[stat] = float(record[tag])
    return found


def per_optimizer_values(record: Record, kind: str, name: str) -> List[float]:
    """The values of `<kind>/<name>` and of every `<kind>/<optimizer>/<name>`
    in `record` (see `kerasdbg.records.tags.per_optimizer`).

    Examples:
        >>> from kerasdbg.records.step_record import per_optimizer_values
        >>> per_optimizer_values({"step/g/skipped": 1.0, "step/d/skipped": 0.0,
        ...                       "step/loss": 2.0}, "step", "skipped")
        [1.0, 0.0]
    """
    return [float(record[tag]) for tag in _plan_of(record).per_optimizer(kind, name)]
