"""`StepRows`: the records of a fit merged into one row per step, for rules.

The capture hands its records per request kind (`step`, `gradients`,
`weights`, `classes`), the taps hand theirs per layer, and the callback adds
what it reads itself (the replicas' spread): each goes into the row of its
optimizer step, keyed by tag, and the rows are handed out in step order for
the rules to check. Backend-neutral: it reads the records and Keras's
optimizers, never a framework.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import keras
import numpy as np

from kerasdbg.capture import keras_objects
from kerasdbg.capture.interface import LOSS_FROM_COMPUTE_LOSS
from kerasdbg.capture.requests import Record, Request
from kerasdbg.records.capture_record import CaptureBlock, CaptureRecord
from kerasdbg.records.step_block import StepBlock
from kerasdbg.records import tags as _tags
from kerasdbg.records.step_record import StepRecord
from kerasdbg.rules._decay import DECAY

LOSS_TAG = _tags.step_scalar("loss")

FirstStep = Callable[[Dict[str, float], List[str], Optional[str]], None]
"""Called once, at the first step row: `(its values, the names of the scalars
the train step returns, where the loss was read or None)`."""


class StepRows:
    """One row of tagged values per optimizer step, filled from the records
    of one fit and handed out in step order, as blocks (`pop_blocks`).

    What comes in is kept as pieces: the steps of a capture's block (or of
    records with the same tags) and their values as arrays, a tap's or the
    callback's own rows. At a pop the steps with the same pieces (most steps
    of a read) are merged as one array: no object per step.

    Args:
        model: the model being trained (its optimizers' learning rate and
            weight decay give `step/weight_decay_fraction`).
        loss: the name of a scalar the train step returns to read as the
            loss of each step, or None (see `StopOnRule`'s `loss`).
        loss_captured: whether the traced train step called `compute_loss`
            or gave its loss to its metric named "loss" (read at the first
            step row).
        on_first_step: see `FirstStep`.
        loss_origin: which of the two (`Capture.loss_origin`). Defaults to
            `compute_loss`.
    """

    def __init__(self, model, loss: Optional[str], loss_captured: Callable[[], bool],
                 on_first_step: FirstStep,
                 loss_origin: Callable[[], str] = lambda: LOSS_FROM_COMPUTE_LOSS):
        self._model = model
        self._loss = loss
        self._loss_captured = loss_captured
        self._loss_origin = loss_origin
        self._on_first_step = on_first_step
        # `(steps [n], tags, values [n, len(tags)])`, in the order they came.
        self._pieces: List[Tuple[np.ndarray, Tuple[str, ...], np.ndarray]] = []
        self._decaying = None
        self._first_seen = False
        # The last step the capture's step records reached: the rows after it
        # may still lack what the next read brings (taps flush on their own).
        self._read_through = 0
        self._plans: Dict[tuple, tuple] = {}

    @property
    def waiting(self) -> bool:
        """Whether rows wait to be popped."""
        return bool(self._pieces)

    def take(self, request: Request, records: list) -> None:
        """Merges the capture's records and blocks (`CaptureBlock`) of
        `request` (a request's consumer)."""
        kind = request.kind
        run: List[Record] = []  # records of the same tags in a row: one piece
        for item in list(records) + [None]:
            if isinstance(item, CaptureRecord) and item.values is not None and (
                    not run or run[0].tags == item.tags):
                run.append(item)
                continue
            if run:
                self._take(kind, np.asarray([r.step for r in run], np.int64), run[0].tags,
                           np.stack([np.asarray(r.values, np.float64) for r in run]),
                           np.asarray([r.skipped for r in run], bool),
                           np.asarray([r.applied for r in run], bool))
                run = []
            if isinstance(item, CaptureBlock):
                self._take(kind, item.steps, item.tags, item.values, item.skipped, item.applied)
            elif isinstance(item, CaptureRecord) and item.values is not None:
                run.append(item)

    def _take(self, kind: str, steps: np.ndarray, tags: tuple, values: np.ndarray,
              skipped: np.ndarray, applied: np.ndarray) -> None:
        # A step the loss scaler skipped shares its number with the next
        # one; only its loss is kept, and a non-finite one is not overwritten.
        kept = np.ones(len(steps), bool) if kind == "step" else ~skipped
        if kind == "weights":
            kept &= applied  # gradient accumulation: no update at this batch
        if not kept.all():
            steps, values = steps[kept], values[kept]
        if not len(steps):
            return
        held = [i for i, tag in enumerate(tags) if tag is not None]  # a value for no tag: out
        if len(held) < len(tags):
            tags, values = tuple(tags[i] for i in held), values[:, held]
        if kind == "step":
            self._read_through = max(self._read_through, int(steps.max()))
            tags, values = self._step_values(tuple(tags), values)
        elif kind == "weights" and self._decays():
            fractions = self._decay_fractions(steps)
            if fractions:
                # Absent where not finite: the steps of each pattern a piece.
                found = np.stack(list(fractions.values()), axis=1)
                finite = np.isfinite(found)
                pattern = finite @ (1 << np.arange(finite.shape[1]))
                for code in np.unique(pattern).tolist():
                    rows = pattern == code
                    held = np.flatnonzero(finite[rows][0])
                    self._pieces.append((np.asarray(steps[rows], np.int64), tuple(tags) + tuple(
                        list(fractions)[k] for k in held.tolist()), np.concatenate(
                            [values[rows], found[rows][:, held]], axis=1)))
                return
        self._pieces.append((np.asarray(steps, np.int64), tuple(tags),
                             np.asarray(values, np.float64)))

    def take_tap(self, tap, rows) -> None:
        """Merges the rows a `TapLayer` flushed (a tap's listener)."""
        for row, _ in rows:
            self.add(row["step"], {_tags.statistic(_tags.ACTIVATIONS, tap.name, k): float(v)
                                   for k, v in row.items() if k not in ("step", "mode")})

    def add(self, step: int, values: Dict[str, float]) -> None:
        """Merges `values` (by tag) into the row of `step`."""
        self._pieces.append((np.asarray([int(step)], np.int64), tuple(values),
                             np.asarray([list(values.values())], np.float64).reshape(1, -1)))

    def pop_blocks(self, final: bool = True) -> List[StepBlock]:
        """Takes out the rows there are, in step order, as blocks of steps
        with the same tags, each in tag order (as offline, so that verdicts
        list tensors alike). Rows merged while this runs wait for the next
        call. With `final=False` (during an epoch) only the rows up to the
        last step the capture's step records reached: the others (a tap's,
        flushed before the capture read its step) wait for the read that
        completes them."""
        pieces, self._pieces = self._pieces, []
        if not final:
            out = []
            for steps, tags, values in pieces:
                later = steps > self._read_through
                if later.any():
                    self._pieces.append((steps[later], tags, values[later]))
                    steps, values = steps[~later], values[~later]
                if len(steps):
                    out.append((steps, tags, values))
            pieces = out
        if not pieces:
            return []
        return _merged(pieces, self._plans)

    def pop_in_order(self, final: bool = True) -> Iterator[Tuple[int, StepRecord]]:
        """`pop_blocks`, one `(step, StepRecord)` at a time."""
        for block in self.pop_blocks(final):
            for i, step in enumerate(block.steps.tolist()):
                yield step, block.record(i)

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

    def _decay_fractions(self, steps: np.ndarray) -> Dict[str, np.ndarray]:
        """`step/weight_decay_fraction`: learning rate x weight decay of each
        optimizer that decays (`step/<optimizer>/...` with several), at each
        of `steps`, for `VanishingGradient` to tell the decay's part of an
        update from the gradient's. Left out where not known (absent, never
        a guess): an optimizer whose rate could not be found; a step where
        it is not finite holds NaN or an infinity here."""
        fractions = {}
        for name, optimizer in self._decays():
            try:
                rate = keras_objects.learning_rate_as_set(optimizer)
                if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
                    # A schedule: its rate at each step (once per step number).
                    unique, inverse = np.unique(steps, return_inverse=True)
                    rates = np.asarray([learning_rate_at(self._model, optimizer, int(step))
                                        for step in unique.tolist()])[inverse.reshape(-1)]
                else:
                    rates = np.full(len(steps), learning_rate_at(self._model, optimizer,
                                                                 int(steps[-1])))
                fraction = rates * float(optimizer.weight_decay)
            except Exception:  # noqa: BLE001 - not known: absent
                continue
            fractions[_tags.per_optimizer(_tags.STEP, DECAY, name)] = fraction
        return fractions

    def _step_values(self, tags: Tuple[str, ...], values: np.ndarray
                     ) -> Tuple[Tuple[str, ...], np.ndarray]:
        """`step/loss` from the loss this was told to read, else from
        `compute_loss`, else from the train step's `loss` (steps of the same
        tags: `values [n, len(tags)]`)."""
        named = _tags.step_scalar(self._loss) if self._loss else None
        returned = None if self._first_seen else sorted(
            _tags.scalar_name(t) for t in tags
            if t not in (_tags.step_scalar("frozen"), _tags.step_scalar("fault")))
        if named is not None and named in tags:
            if LOSS_TAG in tags:
                values = values.copy()
                values[:, tags.index(LOSS_TAG)] = values[:, tags.index(named)]
            else:
                tags, values = tags + (LOSS_TAG,), np.concatenate(
                    [values, values[:, [tags.index(named)]]], axis=1)
            source = f"the train step's {self._loss!r}"
        elif named is not None:
            # The scalar asked for is not there: no other loss stands in for it.
            if LOSS_TAG in tags:
                held = [i for i, tag in enumerate(tags) if tag != LOSS_TAG]
                tags, values = tuple(tags[i] for i in held), values[:, held]
            source = None
        elif LOSS_TAG in tags:
            source = self._loss_origin() if self._loss_captured() \
                else "the train step's 'loss'"
        else:
            source = None
        if not self._first_seen:
            self._first_seen = True
            self._on_first_step(dict(zip(tags, values[0].tolist())), returned, source)
        return tags, values


def _merged(pieces: List[Tuple[np.ndarray, Tuple[str, ...], np.ndarray]],
            plans: Dict[tuple, tuple]) -> List[StepBlock]:
    """`pieces` merged into one row per step (a tag given twice at a step:
    the later value, but a non-finite loss is kept), as blocks of steps in
    order with the same tags in tag order. The steps that have the same
    pieces are merged as one array; `plans` keeps each merge's plan (per
    layouts of the pieces) for the next reads."""
    sizes = np.asarray([len(steps) for steps, _, _ in pieces], np.int64)
    steps = np.concatenate([steps for steps, _, _ in pieces])
    owner = np.repeat(np.arange(len(pieces)), sizes)  # the piece of each entry
    row = np.arange(len(steps)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    order = np.lexsort((owner, steps))  # by step, then in the order the pieces came
    steps, owner, row = steps[order], owner[order], row[order]
    starts = np.flatnonzero(np.concatenate([[True], steps[1:] != steps[:-1]]))
    counts = np.diff(np.concatenate([starts, [len(steps)]]))
    width = int(counts.max())
    # Per step: its pieces in order (-1 past the last), and the row in each.
    rank = np.arange(len(steps)) - np.repeat(starts, counts)
    which = np.full((len(starts), width), -1, np.int64)
    rows = np.zeros((len(starts), width), np.int64)
    at = np.repeat(np.arange(len(starts)), counts)
    which[at, rank], rows[at, rank] = owner, row
    unique = steps[starts]
    # Consecutive steps with the same pieces: one block.
    cuts = np.flatnonzero((which[1:] != which[:-1]).any(axis=1)) + 1
    out: List[StepBlock] = []
    for start, end in zip(np.concatenate([[0], cuts]).tolist(),
                          np.concatenate([cuts, [len(unique)]]).tolist()):
        chosen = [int(p) for p in which[start] if p >= 0]
        layouts = tuple(pieces[p][1] for p in chosen)
        plan = plans.get(layouts)
        if plan is None:
            if len(plans) >= 64:
                plans.clear()
            plan = plans[layouts] = _merge_plan(layouts)
        tags, sources, losses = plan
        values = np.empty((end - start, len(tags)), np.float64)
        for column, (k, position) in enumerate(sources):
            values[:, column] = pieces[chosen[k]][2][rows[start:end, k], position]
        if losses is not None:
            # The first non-finite loss of the step, else the last one.
            found = np.stack([pieces[chosen[k]][2][rows[start:end, k], position]
                              for k, position in losses[1]], axis=1)
            bad = ~np.isfinite(found)
            values[:, losses[0]] = np.where(bad.any(axis=1),
                                            found[np.arange(len(found)), bad.argmax(axis=1)],
                                            found[:, -1])
        out.append(StepBlock(unique[start:end], tags, values))
    return out


def _merge_plan(layouts: Tuple[Tuple[str, ...], ...]) -> tuple:
    """Of the tags of a step's pieces in order: the row's tags (sorted),
    where each value comes from (`(piece, position)`: the last that gives
    it), and for a loss given more than once, its column and every source."""
    last: Dict[str, Tuple[int, int]] = {}
    given: Dict[str, List[Tuple[int, int]]] = {}
    for k, tags in enumerate(layouts):
        for position, tag in enumerate(tags):
            last[tag] = (k, position)
            given.setdefault(tag, []).append((k, position))
    tags = tuple(sorted(last))
    losses = (tags.index(LOSS_TAG), tuple(given[LOSS_TAG])) \
        if len(given.get(LOSS_TAG, ())) > 1 else None
    return tags, tuple(last[tag] for tag in tags), losses


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
