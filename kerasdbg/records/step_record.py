"""`StepRecord`: the scalars of one step that rules read, by tag, indexed
once by `(collection, statistic)`; `values_of` reads one statistic of it."""

from __future__ import annotations

from typing import Iterator, List, Mapping, Tuple

from kerasdbg.records.tags import tag_parts

__all__ = ("Record", "StepRecord", "values_of")

Record = Mapping[str, float]
"""The scalars of one step, by TensorBoard tag: `gradients/<variable>/<stat>`,
`weights/<variable>/<stat>`, `activations/<tap>/<stat>`, `gradients/global_norm`,
`step/loss`, `step/frozen`; or of one epoch: `epoch/loss`, `epoch/val_loss`, ..."""


class StepRecord(dict):
    """The scalars of one step, by tag (a `dict`), indexed once by
    `(collection, statistic)` for the rules: `values_of` then reads the
    values of one statistic without looking at the other tags.

    Examples:
        >>> from kerasdbg.records import StepRecord, values_of
        >>> record = StepRecord({"gradients/d/kernel/l2_norm": 2.0, "step/loss": 0.5})
        >>> list(values_of(record, "gradients", "l2_norm"))
        [('d/kernel', 2.0)]
    """

    __slots__ = ("_index",)

    def by_statistic(self, collection: str, statistic: str) -> List[Tuple[str, float]]:
        """`(tensor, value)` of every tag `<collection>/<tensor>/<statistic>`.

        Examples:
            >>> from kerasdbg.records import StepRecord
            >>> StepRecord({"weights/d/bias/max": 1.0}).by_statistic("weights", "max")
            [('d/bias', 1.0)]
        """
        index = getattr(self, "_index", None)
        if index is None:
            index = {}
            for tag, value in self.items():
                parts = tag_parts(tag)
                if parts:
                    index.setdefault((parts[0], parts[2]), []).append((parts[1], float(value)))
            self._index = index
        return index.get((collection, statistic), [])


def values_of(record: Record, collection: str, statistic: str) -> Iterator[Tuple[str, float]]:
    """`(tensor, value)` for each finite or non-finite value of one statistic.

    Args:
        record: the scalars of one step, by tag (a `StepRecord` is read
            through its index).
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
