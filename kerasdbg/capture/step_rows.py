"""`StepRows`: the records of a fit merged into one row per step, for rules.

The capture hands its records per request kind (`step`, `gradients`,
`weights`, `classes`), the taps hand theirs per layer, and the callback adds
what it reads itself (the replicas' spread): each goes into the row of its
optimizer step, keyed by tag, and the rows are handed out in step order for
the rules to check. Backend-neutral: it reads the records and Keras's
optimizers, never a framework.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import keras
import numpy as np

from kerasdbg.capture import keras_objects
from kerasdbg.capture.requests import Record, Request
from kerasdbg.records import tags as _tags
from kerasdbg.records.step_record import StepRecord
from kerasdbg.rules._decay import DECAY

LOSS_TAG = _tags.step_scalar("loss")

FirstStep = Callable[[Dict[str, float], List[str], Optional[str]], None]
"""Called once, at the first step row: `(its values, the names of the scalars
the train step returns, where the loss was read or None)`."""


class StepRows:
    """One row of tagged values per optimizer step, filled from the records
    of one fit and handed out in step order (`pop_in_order`).

    Args:
        model: the model being trained (its optimizers' learning rate and
            weight decay give `step/weight_decay_fraction`).
        loss: the name of a scalar the train step returns to read as the
            loss of each step, or None (see `StopOnRule`'s `loss`).
        loss_captured: whether the traced train step called `compute_loss`
            (read at the first step row).
        on_first_step: see `FirstStep`.
    """

    def __init__(self, model, loss: Optional[str], loss_captured: Callable[[], bool],
                 on_first_step: FirstStep):
        self._model = model
        self._loss = loss
        self._loss_captured = loss_captured
        self._on_first_step = on_first_step
        self._rows: Dict[int, Dict[str, float]] = {}
        self._decaying = None
        self._first_seen = False
        # The last step the capture's step records reached: the rows after it
        # may still lack what the next read brings (taps flush on their own).
        self._read_through = 0
        self._orders: Dict[tuple, tuple] = {}

    def take(self, request: Request, records: List[Record]) -> None:
        """Merges the capture's records of `request` (a request's consumer)."""
        kind = request.kind
        for record in records:
            # A step the loss scaler skipped shares its number with the next
            # one; only its loss is kept, and a non-finite one is not overwritten.
            if record.values is None or (record.skipped and kind != "step"):
                continue
            if not record.applied and kind == "weights":
                continue  # gradient accumulation: no update at this batch
            row = self._rows.setdefault(record.step, {})
            values = dict(zip(record.tags, np.asarray(record.values, np.float64).tolist()))
            values.pop(None, None)  # a value recorded for no tag
            if kind == "step":
                self._read_through = max(self._read_through, record.step)
                values = self._step_values(values)
            elif kind == "weights" and self._decays():
                values.update(self._decay_fractions(record.step))
            loss = row.get(LOSS_TAG)
            row.update(values)
            if loss is not None and not math.isfinite(loss) and LOSS_TAG in values:
                row[LOSS_TAG] = loss  # a non-finite loss is not overwritten

    def take_tap(self, tap, rows) -> None:
        """Merges the rows a `TapLayer` flushed (a tap's listener)."""
        for row, _ in rows:
            record = self._rows.setdefault(row["step"], {})
            record.update(
                (_tags.statistic(_tags.ACTIVATIONS, tap.name, k), float(v))
                for k, v in row.items() if k not in ("step", "mode")
            )

    def add(self, step: int, values: Dict[str, float]) -> None:
        """Merges `values` (by tag) into the row of `step`."""
        self._rows.setdefault(step, {}).update(values)

    def pop_in_order(self, final: bool = True) -> Iterator[Tuple[int, StepRecord]]:
        """Takes out the rows there are, in step order, each in tag order (as
        offline, so that verdicts list tensors alike) as a `StepRecord`. Rows merged while this
        runs wait for the next call. With `final=False` (during an epoch)
        only the rows up to the last step the capture's step records
        reached: the others (a tap's, flushed before the capture read its
        step) wait for the read that completes them."""
        for step in sorted(self._rows):
            if not final and step > self._read_through:
                break
            row = self._rows.pop(step)
            order = self._orders.get(tuple(row))
            if order is None:
                # The rows of a fit repeat their tags in one order: sorted once.
                if len(self._orders) >= 64:
                    self._orders.clear()
                order = self._orders[tuple(row)] = tuple(sorted(row))
            yield step, StepRecord(zip(order, map(row.__getitem__, order)))

    def _decays(self) -> list:
        """`(name or None, optimizer)` of each optimizer of the model that
        decays its weights (found once)."""
        if self._decaying is None:
            found = [(name, keras_objects.inner_optimizer(o))
                     for name, o in keras_objects.find_optimizers(self._model)]
            several = len(found) > 1
            self._decaying = [(name if several else None, o) for name, o in found
                              if getattr(o, "weight_decay", None)]
        return self._decaying

    def _decay_fractions(self, step: int) -> Dict[str, float]:
        """`step/weight_decay_fraction`: learning rate x weight decay of each
        optimizer that decays (`step/<optimizer>/...` with several), at
        `step`, for `VanishingGradient` to tell the decay's part of an update
        from the gradient's. Left out where not known (absent, never a guess)."""
        fractions = {}
        for name, optimizer in self._decays():
            try:
                fraction = learning_rate_at(self._model, optimizer, step) * \
                    float(optimizer.weight_decay)
            except Exception:  # noqa: BLE001 - not known: absent
                continue
            if math.isfinite(fraction):
                fractions[_tags.per_optimizer(_tags.STEP, DECAY, name)] = fraction
        return fractions

    def _step_values(self, values: Dict[str, float]) -> Dict[str, float]:
        """`step/loss` from the loss this was told to read, else from
        `compute_loss`, else from the train step's `loss`."""
        named = _tags.step_scalar(self._loss) if self._loss else None
        returned = None if self._first_seen else sorted(
            _tags.scalar_name(t) for t in values
            if t not in (_tags.step_scalar("frozen"), _tags.step_scalar("fault")))
        if named is not None and named in values:
            values[LOSS_TAG] = values[named]
            source = f"the train step's {self._loss!r}"
        elif named is not None:
            # The scalar asked for is not there: no other loss stands in for it.
            values.pop(LOSS_TAG, None)
            source = None
        elif LOSS_TAG in values:
            source = "compute_loss" if self._loss_captured() else "the train step's 'loss'"
        else:
            source = None
        if not self._first_seen:
            self._first_seen = True
            self._on_first_step(values, returned, source)
        return values


def learning_rate_at(model, optimizer, step: int) -> float:
    """The learning rate `optimizer` applied at optimizer step `step` (its
    schedule at the iterations before the step; else its current value, as
    the fit holds it)."""
    rate = keras_objects.learning_rate_as_set(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return float(keras.ops.convert_to_numpy(rate(max(int(step) - 1, 0))))
    if isinstance(rate, keras.Variable):
        return float(keras_objects.current_value(model, rate))
    if callable(rate):
        rate = rate()
    return float(keras.ops.convert_to_numpy(rate))
