"""`CaptureRecord`: what the capture hands a callback for one step of one request."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

__all__ = ("CaptureRecord",)


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
