"""`CaptureRecord`: what the capture hands a callback for one step of one request."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

__all__ = ("CaptureBlock", "CaptureRecord", "records_of")


class CaptureRecord(NamedTuple):
    """What one step recorded for one request.

    Attributes:
        step: the step: for gradients and weights, the applying optimizer's
            step (its `iterations` after the update, 1-based; with gradient
            accumulation, the batch it accumulated); for "step" requests the
            step of the first optimizer apply in that train step (counted on
            from the last fit when nothing is applied). A step the loss scaler
            skipped carries the number the update would have had.
        skipped: whether the loss scaler skipped the update.
        values: the request's values for this step, or None if the step was
            not recorded (`every_n_steps`, or no update to describe).
        histograms: `(counts [V, bins], ranges [V, 2])`, or None.
        tags: the TensorBoard tag of each value (`kerasdbg.records.tags`);
            None for a value left out (a variable without a gradient, a loss
            that was not captured).
        histogram_tags: the tag of each histogram row, None likewise.
        optimizer: the name of the optimizer that applied the step, or None
            for a "step" request.
        applied: whether the step updated the weights (False: a batch whose
            gradient the optimizer only accumulated).

    Examples:
        >>> from kerasdbg.records import CaptureRecord
        >>> record = CaptureRecord(step=3, skipped=False, values=[0.5], histograms=None,
        ...                        tags=("step/loss",))
        >>> dict(zip(record.tags, record.values)), record.applied
        ({'step/loss': 0.5}, True)
    """

    step: int
    skipped: bool
    values: Optional[Any]
    histograms: Optional[tuple]
    tags: Tuple[Optional[str], ...] = ()
    histogram_tags: Tuple[Optional[str], ...] = ()
    optimizer: Optional[str] = None
    applied: bool = True


class CaptureBlock:
    """What consecutive steps recorded for one request, as arrays: the
    `CaptureRecord`s of steps of one optimizer with the same tags and no
    histogram, in one object (what a read hands a consumer that takes blocks,
    `Request(blocks=True)`, instead of an object per step).

    Attributes:
        steps: the steps, `int64 [n]`, in the order they ran (as
            `CaptureRecord.step`).
        values: the values of each step in the order of `tags`,
            `float64 [n, len(tags)]`.
        tags: as `CaptureRecord.tags`, the same at every step.
        skipped: whether the loss scaler skipped each step, `bool [n]`.
        applied: whether each step updated the weights, `bool [n]`.
        optimizer: as `CaptureRecord.optimizer`.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.records.capture_record import CaptureBlock
        >>> block = CaptureBlock(np.array([4, 5]), np.array([[1.0], [2.0]]), ("step/loss",))
        >>> len(block), [(r.step, float(r.values[0])) for r in block.records()]
        (2, [(4, 1.0), (5, 2.0)])
        >>> block[1:].steps.tolist()
        [5]
    """

    __slots__ = ("steps", "values", "tags", "skipped", "applied", "optimizer")

    def __init__(self, steps, values, tags: Tuple[Optional[str], ...], skipped=None,
                 applied=None, optimizer: Optional[str] = None):
        self.steps = np.asarray(steps, np.int64).reshape(-1)
        count = self.steps.shape[0]
        self.values = np.asarray(values, np.float64).reshape(count, len(tags))
        self.tags = tuple(tags)
        self.skipped = np.zeros(count, bool) if skipped is None else \
            np.asarray(skipped, bool).reshape(count)
        self.applied = np.ones(count, bool) if applied is None else \
            np.asarray(applied, bool).reshape(count)
        self.optimizer = optimizer

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def __getitem__(self, rows) -> "CaptureBlock":
        """The steps `rows` selects (a slice or a boolean mask) as a block."""
        return CaptureBlock(self.steps[rows], self.values[rows], self.tags, self.skipped[rows],
                            self.applied[rows], self.optimizer)

    def __repr__(self) -> str:
        span = f"{self.steps[0]}-{self.steps[-1]}" if len(self) else "none"
        return (f"CaptureBlock(steps {span}, {len(self)} steps x {len(self.tags)} values, "
                f"optimizer={self.optimizer!r})")

    def records(self) -> list:
        """The block as one `CaptureRecord` per step (for a consumer that
        reads steps one at a time)."""
        return [CaptureRecord(step=step, skipped=skipped, values=values, histograms=None,
                              tags=self.tags, optimizer=self.optimizer, applied=applied)
                for step, skipped, values, applied in zip(
                    self.steps.tolist(), self.skipped.tolist(), self.values,
                    self.applied.tolist())]


def records_of(items) -> list:
    """`items` (`CaptureRecord`s and `CaptureBlock`s, in step order) as
    `CaptureRecord`s only.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.records.capture_record import CaptureBlock, CaptureRecord, records_of
        >>> first = CaptureRecord(step=1, skipped=False, values=[0.5], histograms=None,
        ...                       tags=("step/loss",))
        >>> later = CaptureBlock(np.array([2, 3]), np.array([[0.4], [0.3]]), ("step/loss",))
        >>> [r.step for r in records_of([first, later])]
        [1, 2, 3]
    """
    out = []
    for item in items:
        if isinstance(item, CaptureBlock):
            out.extend(item.records())
        else:
            out.append(item)
    return out
