"""`StepBlock`: the records of consecutive steps with the same tags, as arrays.

The steps of a fit repeat their tags: a block holds their step numbers and
one row of values per step, so that a rule screens every step of a read in
a few NumPy calls (`Rule.screen`) and judges one by one only the steps that
may make it fire (`kerasdbg.rules._runner.RuleRunner.check_block`).
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from kerasdbg.records.step_record import StepRecord, _layout

__all__ = ("StepBlock", "blocks_of")


class StepBlock:
    """Steps with the same tags: `steps` (int64, `[n]`), `tags` (a tuple, the
    records' order) and `values` (float64, `[n, len(tags)]`).

    Examples:
        >>> from kerasdbg.records.step_block import StepBlock
        >>> block = StepBlock([4, 5], ("weights/d/kernel/max", "step/loss"),
        ...                   [[1.0, 0.5], [2.0, 0.4]])
        >>> block.names("weights", "max"), block.column("weights", "max").tolist()
        (('d/kernel',), [[1.0], [2.0]])
        >>> block.tag("step/loss").tolist(), block.record(1)
        ([0.5, 0.4], {'weights/d/kernel/max': 2.0, 'step/loss': 0.4})
    """

    __slots__ = ("steps", "tags", "values", "_plan")

    def __init__(self, steps, tags: Tuple[str, ...], values):
        self.steps = np.asarray(steps, np.int64).reshape(-1)
        self.tags = tuple(tags)
        self.values = np.asarray(values, np.float64).reshape(len(self.steps), len(self.tags))
        self._plan = _layout(self.tags)

    def __len__(self) -> int:
        return len(self.steps)

    def rows(self, start: int, end: int) -> "StepBlock":
        """The steps `start` to `end` (excluded) as a block (a view of the
        values; the block itself for all of its steps)."""
        if start == 0 and end >= len(self.steps):
            return self
        part = StepBlock.__new__(StepBlock)
        part.steps, part.tags, part._plan = self.steps[start:end], self.tags, self._plan
        part.values = self.values[start:end]
        return part

    def names(self, collection: str, statistic: str) -> Tuple[str, ...]:
        """The tensors of the tags `<collection>/<tensor>/<statistic>`, in order."""
        return tuple(tensor for tensor, _ in self._plan.by_statistic.get(
            (collection, statistic), ()))

    def column(self, collection: str, statistic: str) -> np.ndarray:
        """The values `[n, tensors]` of the tags `<collection>/<tensor>/<statistic>`
        (in the order of `names`)."""
        return self.values[:, self._plan.columns(collection, statistic)]

    def tag(self, tag: str) -> Optional[np.ndarray]:
        """The values `[n]` of one tag, or None where the block has no such tag."""
        position = self._plan.position(tag)
        return None if position is None else self.values[:, position]

    def starting(self, prefix: str) -> np.ndarray:
        """The values `[n, k]` of the tags that start with `prefix`."""
        return self.values[:, self._plan.positions_starting(prefix)]

    def record(self, index: int) -> StepRecord:
        """The record of one step (for a rule that judges it)."""
        return StepRecord(zip(self.tags, self.values[index].tolist()))


def blocks_of(rows: Iterable[Tuple[int, Mapping[str, float]]]) -> Iterator[StepBlock]:
    """`(step, record)` pairs, in order, as blocks of consecutive steps with
    the same tags in the same order."""
    tags: Optional[tuple] = None
    steps: List[int] = []
    values: List[list] = []
    for step, record in rows:
        mine = tuple(record)
        if mine != tags and steps:
            yield StepBlock(steps, tags, values)
            steps, values = [], []
        tags = mine
        steps.append(int(step))
        values.append(list(record.values()))
    if steps:
        yield StepBlock(steps, tags, values)
