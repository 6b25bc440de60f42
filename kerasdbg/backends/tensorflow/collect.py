"""The host side of the capture: reads the buffers and hands out the records.

When the read clock says so (`kerasdbg.capture.reads`: after the first
execution, then once per interval, before a ring could overflow, and at
each epoch's end) the host reads the rows the train steps wrote since the
last read (once: the callbacks that collect later at the same batch end
find nothing new, and a buffer no step of these wrote is not read),
turns them into `Record`s in the order the steps ran and hands them to each
request's consumer. It also numbers the steps, and says once per fit why a
request recorded nothing by construction.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.records import tags as _tags
from kerasdbg.records.capture_record import CaptureBlock
from kerasdbg.capture import blocks as _blocks
from kerasdbg.capture import keras_objects
from kerasdbg.capture import reads
from kerasdbg.backends.tensorflow.channels import Channel
from kerasdbg.capture.requests import CLASS_COLUMNS, MAX_CLASSES, Record, Request, _STEP_FIXED

if TYPE_CHECKING:
    from kerasdbg.backends.tensorflow.engine import EngineView
    from kerasdbg.backends.tensorflow.faults import Faults


class Collector:
    """What the host reads of one engine's buffers; owned by the `Engine`,
    whose `collect` (at each batch end) calls it while the fit is prepared.

    It reads the engine through `view` only, and reports the faults the step
    rows say were found late to `faults`."""

    def __init__(self, view: "EngineView", faults: "Faults"):
        self._view = view
        self._faults = faults
        self._last_call = 0
        self._first_call = 0
        self._step_base = 0
        self._diagnosed = False
        self._saw_steps = False
        self._steps_done = 0  # the last step collected, over the fits
        self.clock = reads.ReadClock()

    def begin_fit(self, iterations: List[int], calls: int) -> None:
        """At the start of a fit: `iterations` of the model's optimizers and
        `calls`, the train steps run so far, number its steps."""
        # Without an optimizer that ever stepped (nothing trainable), the
        # steps continue from the last fit's, not from 1 again.
        self._step_base = min([i for i in iterations if i > 0], default=self._steps_done)
        self._last_call = self._first_call = calls
        self._diagnosed = False
        self._saw_steps = False
        self.clock.begin_fit()

    def step_of(self, train_id: int) -> int:
        """The step of a train step that ran (host read of the step buffer)."""
        view = self._view
        if view.step_values is None:
            return self.fit_step(train_id)
        row = _buffers.read(view.step_values)[(train_id - 1) % view.rows]
        return self.fit_step(train_id, row[1] if row[0] == train_id else np.nan)

    def fit_step(self, train_id: int, step: float = np.nan) -> int:
        """The step of a train step: that of the first optimizer apply in it
        (so that a model trained by one optimizer numbers its train steps as
        the optimizer does, and a fault found by that apply and the train
        step's loss share a step), else counted from `_step_base`."""
        if not np.isnan(step):
            number = int(step)
        else:
            number = self._step_base + train_id - self._first_call
        self._steps_done = max(self._steps_done, number)
        return number

    def train_steps(self) -> int:
        """The train-step id of the last train step run (host read)."""
        calls = self._view.calls
        return int(_buffers.read(calls)) if calls is not None else 0

    def collect(self, final: bool = True, batch: Optional[int] = None) -> None:
        """Reads the rows written since the last call and hands them out.

        With `final=False` (a batch end), when the buffers hold more rows
        than an execution writes (`Request.deferred`), the rows wait there
        until the next execution could overwrite one, except the first
        execution's (so that a request that records nothing says so at
        once). At the batch end `batch` the first call reads; the callbacks
        that call again at the same batch end read nothing."""
        view = self._view
        n, rows = view.steps_per_execution, view.rows
        if not final:
            if not self.clock.first_at(batch):
                return
            # Each callback collects at each batch end: the first one counts
            # the execution, the clock says whether the host reads now
            # (`kerasdbg.capture.reads`); no device read before it says so.
            self.clock.executed()
            if self._saw_steps and not self.clock.due(
                    self.clock.waiting() * n, n, rows,
                    every_execution=not all(r.deferred for r in view.requests)):
                return
        else:
            self.clock.final()
        for request in view.requests:
            if request.kind == "tensors" and request.channel is not None:
                request.collect()
        # The callbacks that read later at the same batch end find nothing new.
        calls = int(_buffers.read(view.calls))
        if calls <= self._last_call:
            return
        self.clock.read()
        variants = view.variants
        if variants is not None:
            variants.read(calls)
        first = max(self._last_call + 1, calls - rows + 1)
        if first > self._last_call + 1 and view.wants(
                "gradients", "weights", "step", "classes"):
            warnings.warn(
                f"kerasdbg lost {first - self._last_call - 1} step records: the "
                f"train function ran more than {rows} steps between two callback "
                "events.",
                RuntimeWarning,
                stacklevel=3,  # the caller of `Engine.collect`
            )
        ids = list(range(first, calls + 1))
        records: Dict[int, List[Record]] = {id(r): [] for r in view.requests}
        self._collect_steps(ids, records)
        several = view.several_optimizers
        ordered: Dict[int, list] = {id(r): [] for r in view.requests}
        for channel in view.channels:
            if channel.slots:
                self._collect_channel(channel, ids, ordered, several)
        for key, entries in ordered.items():
            # In the order the steps ran: train step, then apply in it.
            records[key] += [record for _, _, record in sorted(entries, key=lambda e: e[:2])]
        self._last_call = calls
        self._saw_steps = True
        for request in view.requests:
            request.deliver(records[id(request)])
        if not self._diagnosed:
            self._diagnosed = True
            self._diagnose()

    def _collect_steps(self, ids, records) -> None:
        view = self._view
        requests = [r for r in view.requests if r.kind in ("step", "classes")]
        if not requests or view.step_values is None:
            return
        self._faults.forget_guard_read()  # read once per collect, when needed
        n = view.rows
        replicas = _buffers.read_replicas(view.step_values)
        table = replicas[0]
        steps = [r for r in requests if r.kind == "step"]
        if steps:
            # As blocks; `Request.deliver` makes a record a step of them for
            # a request that takes none.
            self._step_blocks(ids, replicas, steps, records)
        for request in requests:
            if request.kind == "classes":
                totals = _buffers.read(request.totals)
                tags = tuple(_tags.statistic(_tags.CLASSES, str(k), c) if request.present[k] else None
                             for k in range(MAX_CLASSES) for c in CLASS_COLUMNS)
                last = [table[(i - 1) % n] for i in ids if table[(i - 1) % n][0] == i]
                if last:
                    records[id(request)].append(Record(
                        step=self.fit_step(int(last[-1][0]), last[-1][1]), skipped=False,
                        values=totals.reshape(-1), histograms=None, tags=tags))

    def _step_blocks(self, ids, replicas, requests, records) -> None:
        """The records of the "step" `requests` of train steps `ids`: the
        steps with no fault and nothing skipped as `CaptureBlock`s (their
        values as arrays), the others a record each, in step order."""
        view = self._view
        n = view.rows
        table = replicas[0]
        names = view.step_names
        ids = np.asarray(ids, np.int64)
        rows = table[(ids - 1) % n]
        present = rows[:, 0] == ids  # (NaN: a row never written, a call that ran no step)
        ids, rows = ids[present], rows[present]
        if not len(ids):
            return
        steps = np.asarray([self.fit_step(int(i), s) for i, s in zip(ids.tolist(), rows[:, 1])],
                           np.int64)
        scalars = np.mean([r[(ids - 1) % n][:, _STEP_FIXED:_STEP_FIXED + len(names)]
                           for r in replicas], axis=0) if names else np.zeros((len(ids), 0))
        captured, frozen, fault = rows[:, 3] > 0, ~np.isnan(rows[:, 4]), ~np.isnan(rows[:, 5])
        # The guard's values (`Faults.guard_scalars`): a step the guard skipped
        # (a reason given) or left no row for says more: a record of its own.
        guard_tags, guard_values, guarded = (), np.zeros((len(ids), 0)), np.ones(len(ids), bool)
        faults = self._faults
        if faults._guard is not None and faults.guard_names:
            tables = getattr(faults, "_guard_table", None)
            if tables is None:
                tables = faults._guard_table = _buffers.read_replicas(faults._guard)
            found = np.stack([t[(ids - 1) % t.shape[0]] for t in tables])
            mine = found[:, :, 0] == ids
            guarded = mine.all(axis=0)
            values = np.max(found, axis=0)[:, 1:]
            several = view.several_optimizers
            kept = []
            for k, (name, qualifier, kind) in enumerate(faults.guard_names):
                if kind == "reason":
                    guarded &= ~(values[:, k] > 0)
                    continue
                if kind == "optimizer":
                    qualifier = qualifier if several else None
                guard_tags += (_tags.per_optimizer(_tags.STEP, name, qualifier),)
                kept.append(k)
            guard_values = values[:, kept]
        blockable = guarded & ~(rows[:, 5] > 0) & ~(rows[:, 6] > 0)
        codes = captured.astype(np.int64) + 2 * frozen + 4 * fault

        def block(chosen, code):
            has_loss, has_frozen, has_fault = bool(code & 1), bool(code & 2), bool(code & 4)
            tags = [_tags.step_scalar("loss") if has_loss else None,
                    _tags.step_scalar("frozen") if has_frozen else None,
                    _tags.step_scalar("fault") if has_fault else None]
            columns = [k for k, name in enumerate(names) if not (name == "loss" and has_loss)]
            tags += [_tags.step_scalar(names[k]) for k in columns]
            values = np.concatenate([rows[chosen][:, [2, 4, 5]], scalars[chosen][:, columns],
                                     guard_values[chosen]], axis=1)
            return CaptureBlock(steps[chosen], values, tuple(tags) + guard_tags)

        def record(i):
            train_id, row = int(ids[i]), rows[i]
            if row[6] > 0:  # a fault found after other applies of this train step
                faults.late_fault(int(steps[i]), int(row[6]))
            tags = [_tags.step_scalar("loss") if captured[i] else None,
                    _tags.step_scalar("frozen") if frozen[i] else None,
                    _tags.step_scalar("fault") if fault[i] else None]
            values = [row[2], row[4], row[5]]
            for name, value in zip(names, scalars[i]):
                if name == "loss" and captured[i]:
                    continue  # compute_loss's loss of the step comes first
                tags.append(_tags.step_scalar(name))
                values.append(value)
            step = int(steps[i])
            for tag, value in list(faults.scalars(step, row).items()) + list(
                    faults.guard_scalars(train_id, view.several_optimizers).items()):
                tags.append(tag)
                values.append(value)
            return Record(step=step, skipped=False, values=np.asarray(values, np.float64),
                          histograms=None, tags=tuple(tags))

        for request in requests:
            records[id(request)].extend(_blocks.items_of(
                codes, np.ones(len(ids), bool), blockable, block, record))

    def _collect_channel(self, channel: Channel, ids, records, several: bool) -> None:
        n = self._view.rows
        meta = _buffers.read(channel.meta)
        rows = [((i - 1) % n, i) for i in ids if meta[(i - 1) % n, 0] == i]
        if not rows:
            return
        steps = [int(meta[row, 1]) for row, _ in rows]
        variants = self._view.variants
        if variants is not None:
            # A step a loss scaler skipped is made again under its number.
            variants.seen(channel.hook.index, rows[-1][1],
                          steps[-1] - bool(meta[rows[-1][0], 2]))
        name = channel.hook.name
        for slot in channel.slots.values():
            request = slot.request
            if request.blocks and not several and sum(
                    id(request) in c.slots for c in self._view.channels) == 1:
                # One apply a step records it: its steps as blocks (`Request.blocks`).
                records[id(request)].extend(self._channel_blocks(channel, slot, meta, rows,
                                                                 steps))
                continue
            # A buffer no step of these wrote is not read (10-30 us each).
            has_values, has_histograms = request.written_at(steps)
            values = ids_ = applied = applied_ids = hist = None
            if has_values:
                table = _buffers.read(slot.values)
                ids_, values = table[:, 0], table[:, 1:]
                if slot.applied_values is not None:
                    table = _buffers.read(slot.applied_values)
                    applied_ids, applied = table[:, 0], table[:, 1:]
            if has_histograms:
                hist = [_buffers.read(b) for b in (slot.hist_ids, slot.hist_counts,
                                                   slot.hist_ranges)]
            histogram_tags = slot.histogram_tags()
            for (row, train_id), step in zip(rows, steps):
                histograms = None
                if hist is not None and hist[0][row] == train_id:
                    histograms = (hist[1][row], hist[2][row])
                columns = request.columns_at(step)
                row_values, row_tags = None, slot.tags(several, columns)
                if values is not None and ids_[row] == train_id:
                    row_values = values[row].copy()
                    if applied is not None and applied_ids[row] == train_id:
                        row_values = np.concatenate([row_values, applied[row]])
                        row_tags = row_tags + slot.applied_tags(several, columns)
                records[id(request)].append((train_id, channel.number, Record(
                    step=step, skipped=bool(meta[row, 2]), values=row_values,
                    histograms=histograms, tags=row_tags, histogram_tags=histogram_tags,
                    optimizer=name, applied=bool(meta[row, 3]))))

    def _channel_blocks(self, channel: Channel, slot, meta, rows, steps) -> list:
        """`_collect_channel`'s entries of one slot as `CaptureBlock`s (a
        record of its own where a step has a histogram or no values), each
        keyed by its first step's train id and the channel."""
        request = slot.request
        positions = np.asarray([row for row, _ in rows], np.int64)
        train_ids = np.asarray([train_id for _, train_id in rows], np.int64)
        applied_steps = np.asarray(steps, np.int64)
        has_values, has_histograms = request.written_at(steps)
        codes = request.column_sets(applied_steps)
        blockable = codes > 0
        values = applied = applied_written = None
        if has_values:
            table = _buffers.read(slot.values)
            written = table[positions, 0] == train_ids
            values = table[positions, 1:]
            blockable &= written
            if slot.applied_values is not None:
                table = _buffers.read(slot.applied_values)
                applied, applied_written = table[positions, 1:], table[positions, 0] == train_ids
                blockable &= applied_written
        else:
            blockable[:] = False
        hist = None
        drawn = np.zeros(len(rows), bool)  # the steps with a histogram
        if has_histograms:
            hist = [_buffers.read(b) for b in (slot.hist_ids, slot.hist_counts,
                                               slot.hist_ranges)]
            drawn = hist[0][positions] == train_ids
            blockable &= ~drawn
        skipped = meta[positions, 2].astype(bool)
        updated = meta[positions, 3].astype(bool)
        name = channel.hook.name
        histogram_tags = slot.histogram_tags()

        def block(chosen, code):
            columns = request.columns_of(code)
            tags = slot.tags(False, columns)
            chosen_values = values[chosen]
            if applied is not None:
                chosen_values = np.concatenate([chosen_values, applied[chosen]], axis=1)
                tags = tags + slot.applied_tags(False, columns)
            return (int(train_ids[chosen[0]]), channel.number, CaptureBlock(
                applied_steps[chosen], chosen_values, tags, skipped[chosen], updated[chosen],
                name))

        def record(i):
            row, train_id = rows[i]
            step = int(applied_steps[i])
            histograms = None
            if hist is not None and hist[0][row] == train_id:
                histograms = (hist[1][row], hist[2][row])
            columns = request.columns_at(step)
            row_values, row_tags = None, slot.tags(False, columns)
            if values is not None and written[i]:
                row_values = values[i].copy()
                if applied is not None and applied_written[i]:
                    row_values = np.concatenate([row_values, applied[i]])
                    row_tags = row_tags + slot.applied_tags(False, columns)
            return (train_id, channel.number, Record(
                step=step, skipped=bool(skipped[i]), values=row_values, histograms=histograms,
                tags=row_tags, histogram_tags=histogram_tags, optimizer=name,
                applied=bool(updated[i])))

        # A step that records nothing of it says nothing, but a skip, a
        # histogram or a batch that only accumulated.
        valued = codes > 0
        valued &= False if values is None else written
        return _blocks.items_of(codes, valued | skipped | drawn | ~updated, blockable, block,
                                record)

    def _bypassed(self, model) -> str:
        """Why the optimizers whose `apply` did not pass through kerasdbg
        (`Engine.bypassed`) are not recorded; "" when there is none."""
        bypassed = self._view.bypassed
        if not bypassed:
            return ""
        names = {id(o): n for n, o in keras_objects.find_optimizers(model)}
        said = []
        for key, optimizer in bypassed.items():
            name = names.get(key, getattr(optimizer, "name", "?"))
            own = vars(optimizer).get("apply")
            how = (f"the optimizer holds an `apply` of its own ({_qualname(own)}) that reaches "
                   "Keras's update without the class's `apply`, where kerasdbg records"
                   if own is not None else
                   "something reaches Keras's update without the class's `apply`, where "
                   "kerasdbg records")
            said.append(f"{name} ({type(optimizer).__name__}) applied gradients without its "
                        f"`apply` passing through kerasdbg: {how}")
        return "; ".join(said)

    def _diagnose(self) -> None:
        """After the first execution with steps: says once, for each request
        that recorded nothing by construction, why."""
        view = self._view
        model = view.model
        applied = [h for h in view.hooks.values() if h.channels]
        bypassed = self._bypassed(model)
        silent: Dict[tuple, List[Request]] = {}
        for request in view.requests:
            if not request.per_variable:
                continue
            if request.kind == "tensors" and request.channel is not None and (
                    request.variables or not {"gradients", "weights"} & set(request.record)):
                continue
            if bypassed and not view.routed:
                why = bypassed  # its channel may exist (built before the trace), never written
            elif any(id(request) in c.slots for c in view.channels):
                continue
            elif not view.channels:
                if not model.trainable_variables:
                    why = (f"the model {model.name!r} has no trainable variables, so no "
                           "optimizer applied gradients")
                else:
                    found = [name for name, _ in keras_objects.find_optimizers(model)]
                    why = ("no optimizer applied gradients in the train step (kerasdbg sees "
                           "every Keras optimizer's `apply`/`apply_gradients` called inside "
                           f"`train_step`; the model holds: {', '.join(found) or 'none'}). "
                           "If the train step updates the weights another way (assign, a "
                           "non-Keras optimizer), there is nothing to record")
            else:
                names = ", ".join(h.name for h in applied)
                paths = sorted({p for c in view.channels for p in c.paths})
                listing = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more"
                                                  if len(paths) > 8 else "")
                why = (f"none of the variables that {names} applied matches "
                       f"include={request.include!r}, exclude={request.exclude!r}: "
                       f"{listing}")
            silent.setdefault((request.owner, why), []).append(request)
        watching = [r for r in view.requests if r.per_variable]
        if bypassed and not silent and watching:
            # The others are recorded; this one is not.
            message = f"kerasdbg records nothing of an optimizer this fit: {bypassed}."
            if any(r.strict for r in watching):
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=5)
        # One message per callback and cause, whatever its number of requests.
        for (owner, why), requests in silent.items():
            if any(r.for_rules for r in requests):
                kinds = " or ".join(dict.fromkeys(r.kind for r in requests))
                message = (f"{owner} records no {kinds} this fit: {why}; the rules that read "
                           "them have nothing to read and will not fire.")
            else:
                message = f"{owner} records nothing this fit: {why}."
            if any(r.strict for r in requests):
                raise ValueError(message)
            # The frame it named from `Engine` (one more between: `Engine.collect`).
            warnings.warn(message, RuntimeWarning, stacklevel=5)


def _qualname(function) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__
