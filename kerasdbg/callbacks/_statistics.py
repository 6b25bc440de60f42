"""Shared machinery of the gradient and weight statistics callbacks."""

from __future__ import annotations

import collections
import warnings
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np
import pandas as pd

from kerasdbg import capture as _capture
from kerasdbg.capture import blocks as _blocks
from kerasdbg.capture import unique_paths
from kerasdbg.sinks import events as _events
from kerasdbg.sinks import layout as _layout
from kerasdbg.records import tags as _tags
from kerasdbg.records.capture_record import CaptureBlock
from kerasdbg.capture import keras_objects
from kerasdbg.callbacks._executions import AfterEachExecution
from kerasdbg.callbacks._recording import RecordingCallback, release_writer, selected
from kerasdbg import _validation as check
from kerasdbg import schedule as schedule_lib
from kerasdbg import stats as stats_lib


def trainable_float_variables(model) -> list:
    """The model's trainable floating-point variables, in model order."""
    return [v for v in model.trainable_variables if keras_objects.is_float(v)]


def select_variables(model, include: Optional[str], exclude: Optional[str]):
    """`(variables, paths)`: the trainable float variables whose unique path
    passes `include` / `exclude` (none for a model not built yet)."""
    variables = trainable_float_variables(model)
    paths = unique_paths(variables)
    chosen = [(v, p) for v, p in zip(variables, paths) if selected(p, include, exclude)]
    return [v for v, _ in chosen], [p for _, p in chosen]


def _same_step(records: List[_capture.Record]) -> List[List[_capture.Record]]:
    """`records` cut into runs of the same step, one record per optimizer
    each (the optimizers of a train step apply in a row)."""
    runs: List[List[_capture.Record]] = []
    for record in records:
        run = runs[-1] if runs else None
        if run is not None and run[0].step == record.step \
                and all(r.optimizer != record.optimizer for r in run):
            run.append(record)
        else:
            runs.append([record])
    return runs


class StatisticsCallback(AfterEachExecution, RecordingCallback):
    """Records per-variable statistics at each optimizer step (base class).

    Subclasses set `kind` ("gradients" or "weights") and `allowed_stats`.
    """

    kind = ""
    allowed_stats: Sequence[str] = stats_lib.ALL_STATISTICS

    def __init__(
        self,
        log_dir: Optional[str] = None,
        every_n_steps: Optional[int] = None,
        histogram_every_n_steps: Optional[int] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        stats: Sequence[str] = stats_lib.STATISTICS,
        histogram_bins: int = stats_lib.DEFAULT_HISTOGRAM_BINS,
        history_size: int = 1000,
        strict: bool = False,
        first_steps: Optional[int] = None,
    ):
        super().__init__()
        owner = type(self).__name__
        _capture.supported(owner)  # a backend with a capture, said when made
        self.log_dir = check.log_dir(owner, "log_dir", log_dir)
        self.schedule, self._default_schedule = schedule_lib.resolve(
            owner, every_n_steps, first_steps)
        self.every_n_steps = None if every_n_steps is None else self.schedule.every_n_steps
        self.first_steps = None if first_steps is None else self.schedule.first_steps
        self.histogram_every_n_steps = check.optional_positive_int(
            owner, "histogram_every_n_steps", histogram_every_n_steps
        )
        self.include = check.optional_regex(owner, "include", include)
        self.exclude = check.optional_regex(owner, "exclude", exclude)
        self.stats = check.choices(owner, "stats", stats, self.allowed_stats)
        self.histogram_bins = check.positive_int(owner, "histogram_bins", histogram_bins)
        self.history_size = check.non_negative_int(owner, "history_size", history_size)
        self.strict = check.boolean(owner, "strict", strict)
        self._request: Optional[_capture.Request] = None
        # The latest records and blocks (`CaptureBlock`), `_kept` rows in all.
        self._rows: collections.deque = collections.deque()
        self._kept = 0
        self._columns: Dict[str, None] = {}
        self._layouts: dict = {}  # a record layout (its tags) -> `_layout`
        self._clipped = 0
        self._several = False
        self._accumulating = False
        self._writer: Optional[_events.EventWriter] = None
        self._failed = False
        self._views_failed = False
        self._names: Optional[tuple] = None  # the variables the views group, with several optimizers
        self._skipped = 0

    # ------------------------------------------------------------ config
    def get_config(self) -> dict:
        return {
            "log_dir": self.log_dir,
            "every_n_steps": self.every_n_steps,
            "first_steps": self.first_steps,
            "histogram_every_n_steps": self.histogram_every_n_steps,
            "include": self.include,
            "exclude": self.exclude,
            "stats": list(self.stats),
            "histogram_bins": self.histogram_bins,
            "history_size": self.history_size,
            "strict": self.strict,
        }

    # ------------------------------------------------------- selection
    # --------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        self._rows.clear()
        self._kept = 0
        self._columns = {}
        self._layouts = {}
        self._failed = False
        self._views_failed = False
        self._names = None
        self._skipped = 0
        self._clipped = 0
        self._several = False
        self._accumulating = False
        self._request = _capture.Request(
            kind=self.kind,
            stats=self.stats,
            schedule=self.schedule,
            frequent=schedule_lib.EVERY_STEP_STATISTICS if self._default_schedule else (),
            histogram_every_n_steps=self.histogram_every_n_steps,
            consumer=self._consume,
            blocks=True,
            include=self.include,
            exclude=self.exclude,
            bins=self.histogram_bins,
            strict=self.strict,
            owner=type(self).__name__,
            # Nothing decides on these records during the fit: the host
            # reads them every few dozen steps (and at each epoch's end).
            deferred=True,
        )
        self._writer = self._open_writer()
        # Per-variable charts only for a few variables (known once the model is built).
        count = len(select_variables(self.model, self.include, self.exclude)[1]) \
            if self.model.built else None
        _layout.add(type(self).__name__, self._writer,
                    _layout.statistics_lines(self.kind, self.stats, count), self.strict)
        _capture.engine_for(self.model).attach(self._request)
        self._begin_executions()

    def _before_execution(self, batch: int) -> None:
        self._engine.prepare()

    def _after_execution(self, batch: int) -> None:
        self._engine.collect(final=False, batch=batch)

    def on_epoch_end(self, epoch, logs=None):
        self._executions_read()
        _capture.engine_for(self.model).collect()
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._request is not None:
            _capture.engine_for(self.model).detach(self._request)
        release_writer(self, self._writer)

    # -------------------------------------------------------- records
    def _consume(self, items: list) -> None:
        # The records and blocks (`CaptureBlock`) of a read, in step order.
        # A block's steps are kept and written as arrays; the records one at
        # a time, so that a write that fails (a full disk) loses no other
        # record of a deferred read from `history`. The views of a step are
        # computed from the records of every optimizer at that step (one
        # point per step of "the largest of all variables"), and written
        # with the last of them.
        engine = _capture.engine_for(self.model)
        several = engine.several_optimizers
        # The events of scalars only, written together (`write_rows`).
        rows: List[_events.ScalarRow] = []
        records: List[_capture.Record] = []
        blocks: List[CaptureBlock] = []
        for item in list(items) + [None]:
            if isinstance(item, CaptureBlock):
                if records:
                    self._write_records(records, several, engine, rows)
                    records = []
                blocks.append(item)
                continue
            if blocks:
                self._write_blocks(blocks, several, engine, rows)
                blocks = []
            if item is not None:
                records.append(item)
        if records:
            self._write_records(records, several, engine, rows)
        if rows:
            self._guarded(self._writer.write_rows, rows)
        if self._writer is not None:
            # Once a read: a killed run keeps every step up to its last read.
            self._guarded(self._writer.flush, events_only=True)

    def _keep(self, item) -> None:
        """Adds a record or a block to `history`, which keeps the latest
        `history_size` rows (a block cut where it must)."""
        if not self.history_size:
            return
        self._rows.append(item)
        self._kept += len(item) if isinstance(item, CaptureBlock) else 1
        while self._kept > self.history_size:
            first = self._rows[0]
            size = len(first) if isinstance(first, CaptureBlock) else 1
            excess = self._kept - self.history_size
            if size <= excess:
                self._rows.popleft()
                self._kept -= size
            else:
                # A copy: the rest of the block is not kept alive.
                rest = first[excess:]
                rest.values = rest.values.copy()
                self._rows[0] = rest
                self._kept -= excess

    def _write_records(self, records: List[_capture.Record], several: bool, engine,
                       rows: List[_events.ScalarRow]) -> None:
        """`_write` of consecutive records, each step's views computed from
        the records of every optimizer at that step."""
        groups = _same_step(records)
        for group, views in zip(groups, self._views(groups, several)):
            last = max((i for i, r in enumerate(group) if not r.skipped), default=-1)
            for i, record in enumerate(group):
                self._guarded(self._write, [record], views if i == last else {},
                              several, engine, rows)

    def _write_blocks(self, blocks: List[CaptureBlock], several: bool, engine,
                      rows: List[_events.ScalarRow]) -> None:
        """`_write` of consecutive blocks (one optimizer, the same tags, no
        histogram each): each kept in `history` as it came, their steps'
        events written after `rows` (the records' before them) in as few
        writes as their tags allow (`blocks.parts`: a read of a schedule
        alternates two layouts, and each write costs its views and events
        a fixed share)."""
        written: List[Optional[tuple]] = []
        for block in blocks:
            kept: list = []
            self._guarded(self._keep_block, block, several, kept)
            written.append(kept[0] if kept else None)
        if self._writer is None or not any(w is not None for w in written):
            return
        # Steps no write takes (none recorded, or a block that failed) leave
        # the parts: a block left out of a part is written alone.
        shown = [i for i, w in enumerate(written) if w is not None]
        chosen = [written[i][0] for i in shown]
        for tags, positions, whole in _blocks.parts(chosen):
            self._guarded(self._write_part, [written[shown[p]] for p in positions], tags,
                          whole, several, engine, rows)

    def _keep_block(self, block: CaptureBlock, several: bool, out: list) -> None:
        """Keeps `block` in `history` and adds to `out` its steps to write
        (those the loss scaler did not skip, with the skipped updates
        counted up to each), if any."""
        if not len(block):
            return
        self._several = self._several or several
        counts = self._skipped + np.cumsum(block.skipped)
        self._skipped = int(counts[-1])
        self._accumulating = self._accumulating or not bool(block.applied.all())
        _, _, clipped = self._layout(block.tags)
        self._keep(block)
        if clipped is not None:
            self._clipped += int(np.count_nonzero(block.values[:, clipped] > 0))
        written = ~block.skipped
        if written.any():
            out.append((block[written], counts[written]))

    def _write_part(self, parts: List[tuple], tags: tuple, whole: bool, several: bool,
                    engine, rows: List[_events.ScalarRow]) -> None:
        """Writes the columns `tags` names (None: not this part's) of the
        steps of `parts` (`(block, skipped updates up to each step)`, in
        step order); `whole`: the part that gives each step once, which
        carries the step's count of skipped updates."""
        if rows:
            pending = list(rows)
            rows.clear()  # (written once, whatever happens here)
            self._writer.write_rows(pending)
        blocks = [block for block, _ in parts]
        if len(blocks) == 1:
            steps, values, counts = blocks[0].steps, blocks[0].values, parts[0][1]
        else:
            steps = np.concatenate([block.steps for block in blocks])
            values = np.concatenate([block.values for block in blocks])
            counts = np.concatenate([count for _, count in parts])
        positions, names, _ = self._layout(tags)
        chosen = values[:, positions]
        if whole and self.kind == "gradients" and isinstance(
                self._optimizer(blocks[0].optimizer, engine), keras.optimizers.LossScaleOptimizer):
            names = names + (_tags.per_optimizer(self.kind, "skipped_updates",
                                                 blocks[0].optimizer if several else None),)
            chosen = np.concatenate([chosen, counts[:, None].astype(np.float64)], axis=1)
        self._writer.write_block(steps, names, chosen, self._view_groups(tags, values))

    def _view_groups(self, tags: tuple, values: np.ndarray) -> list:
        """The views of a block's steps (`_layout.view_groups`); a failure as
        `_views`'s."""
        try:
            return _layout.view_groups(self.kind, tags, values)
        except Exception as error:  # noqa: BLE001 - a chart must not stop fit
            self._views_failure(error)
            return []

    def _views(self, groups: List[List[_capture.Record]],
               several: bool = False) -> List[Dict[str, float]]:
        """The TensorBoard views of each step's records (a group of
        `_same_step`), the steps of one layout computed as one array
        (`_layout.views_of_steps`); a failure warns once (`strict` raises)
        and the records are written without them."""
        out: List[Dict[str, float]] = [{} for _ in groups]
        if self._writer is None:
            return out
        try:
            names = ()
            if several:
                # Groups of the variables of all optimizers, the same at every step.
                if self._names is None:
                    self._names = tuple(
                        select_variables(self.model, self.include, self.exclude)[1])
                names = self._names
            layouts: Dict[tuple, List[int]] = {}
            rows: Dict[tuple, list] = {}
            for k, group in enumerate(groups):
                recorded = [r for r in group if r.values is not None and not r.skipped]
                if not recorded:
                    continue
                if len(recorded) == 1:
                    tags, values = recorded[0].tags, recorded[0].values
                else:
                    tags = tuple(t for r in recorded for t in r.tags)
                    values = np.concatenate([np.asarray(r.values, np.float64) for r in recorded])
                layouts.setdefault(tags, []).append(k)
                rows.setdefault(tags, []).append(values)
            for tags, steps in layouts.items():
                found = _layout.views_of_steps(
                    self.kind, tags, np.asarray(rows[tags], np.float64), names)
                for k, views in zip(steps, found):
                    out[k] = views
            return out
        except Exception as error:  # noqa: BLE001 - a chart must not stop fit
            self._views_failure(error)
            return [{} for _ in groups]

    def _views_failure(self, error: Exception) -> None:
        """The views could not be computed: warns once (`strict` raises)."""
        if self.strict:
            raise _events.RecordingError(
                [type(self).__name__], f"the TensorBoard views (views/{self.kind}/...) to",
                self._writer.log_dir, error) from error
        if not self._views_failed:
            self._views_failed = True
            # Worded as the other failures to record (`_guarded`).
            warnings.warn(
                f"{type(self).__name__} could not record: it could not compute its "
                f"TensorBoard views (views/{self.kind}/..., the Custom Scalars charts); its "
                "records are written without them, and training goes on. Cause: "
                f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=4)

    def _layout(self, tags: tuple) -> tuple:
        """Of a record's tags: the positions and tags of its values, and the
        position of the clipped flag (or None). Records of one layout share
        their tags: worked out once per layout."""
        found = self._layouts.get(tags)
        if found is None:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            kept = [i for i, tag in enumerate(tags) if tag is not None]
            clipped = next((i for i in kept if _tags.is_per_optimizer(
                tags[i], _tags.GRADIENTS, _tags.CLIPPED)), None) \
                if self.kind == "gradients" else None
            found = self._layouts[tags] = (np.asarray(kept, np.int64),
                                           tuple(tags[i] for i in kept), clipped)
            if self.history_size:
                # Records of one layout repeat their tags: their columns once.
                for tag in found[1]:
                    self._columns.setdefault(_tags.column(tag, self.kind), None)
        return found

    def _write(self, records: List[_capture.Record], views: Dict[str, float],
               several: Optional[bool] = None, engine=None,
               rows: Optional[List[_events.ScalarRow]] = None) -> None:
        """Keeps `records` (`history`) and writes their events; with `rows`,
        an event of scalars only is added there (to be written with the
        others of a read: `EventWriter.write_rows`), and the rows there are
        written first where an event of histograms comes."""
        if several is None:
            several = _capture.engine_for(self.model).several_optimizers
        self._several = self._several or several
        for record in records:
            if record.skipped:
                self._skipped += 1
            self._accumulating = self._accumulating or not record.applied
            layout = self._layout(record.tags) if record.values is not None else None
            if record.values is not None or record.skipped:
                self._keep(record)
            if layout is not None and layout[2] is not None:
                self._clipped += int(record.values[layout[2]] > 0)
            if self._writer is None or record.skipped:
                continue
            tags, values = (), np.empty(0)
            if record.values is not None:
                tags, values = layout[1], np.asarray(record.values, np.float64)[layout[0]]
                if self.kind == "gradients" and isinstance(
                        self._optimizer(record.optimizer, engine),
                        keras.optimizers.LossScaleOptimizer):
                    tags = tags + (_tags.per_optimizer(self.kind, "skipped_updates",
                                                       record.optimizer if several else None),)
                    values = np.append(values, float(self._skipped))
            if rows is not None and record.histograms is None:
                if tags or views:
                    rows.append(_events.ScalarRow(record.step, tags, values, views))
                continue
            if rows:
                pending = list(rows)
                rows.clear()  # (written once, whatever happens here)
                self._writer.write_rows(pending)
            scalars = dict(zip(tags, values.tolist()))
            histograms = {}
            if record.histograms is not None:
                counts, ranges = record.histograms
                for i, tag in enumerate(record.histogram_tags):
                    if tag is not None and np.all(np.isfinite(ranges[i])):
                        histograms[tag] = (counts[i], *ranges[i])
            self._writer.write(record.step, scalars, histograms, views=views)

    def _optimizer(self, name: Optional[str], engine=None):
        engine = engine or _capture.engine_for(self.model)
        for hook in engine.hooks.values():
            if hook.name == name:
                return hook.optimizer
        return None

    # --------------------------------------------------------- results
    def _read_pending(self) -> None:
        # During a fit the host reads the buffers every few dozen steps: asked
        # in between (another callback at a batch end), read the steps the
        # buffers hold first, so that the answer is up to date.
        if self._request is None or self.model is None:
            return
        engine = _capture.engine_for(self.model)
        if self._request in engine.requests:
            engine.collect()

    @property
    def history(self) -> pd.DataFrame:
        """The latest recorded steps (at most `history_size`), one row each.

        Columns: `step` (the step of the optimizer that applied it), with
        several optimizers `optimizer` (its name), with gradient
        accumulation `applied` (whether the step updated the weights), then
        `skipped`, then the recorded values: `<variable path>/<stat>` (and
        for gradients `global_norm`, or `<optimizer>/global_norm` with
        several optimizers; `clipped` and `applied_gradients/...` under
        clipping or accumulation). Steps the loss scaler skipped have
        `skipped=True` and NaN statistics.
        """
        self._read_pending()
        columns = list(self._columns)
        index = {c: i for i, c in enumerate(columns)}
        values = np.full((self._kept, len(columns)), np.nan)
        steps = np.empty(self._kept, np.int64)
        skipped = np.zeros(self._kept, bool)
        applied = np.ones(self._kept, bool)
        optimizers = np.empty(self._kept, object)
        row = 0
        for item in self._rows:
            if isinstance(item, CaptureBlock):
                size = len(item)
                chosen = slice(row, row + size)
                steps[chosen], skipped[chosen] = item.steps, item.skipped
                applied[chosen], optimizers[chosen] = item.applied, item.optimizer
                held = [(k, index[_tags.column(tag, self.kind)])
                        for k, tag in enumerate(item.tags) if tag is not None]
                if held:
                    source, target = (np.asarray(c, np.int64) for c in zip(*held))
                    values[chosen, target] = item.values[:, source]
                row += size
                continue
            steps[row], skipped[row] = item.step, item.skipped
            applied[row], optimizers[row] = item.applied, item.optimizer
            if item.values is not None:
                for tag, value in zip(item.tags, item.values):
                    if tag is not None:
                        values[row, index[_tags.column(tag, self.kind)]] = value
            row += 1
        frame = pd.DataFrame(values, columns=columns)
        frame.insert(0, "skipped", skipped.tolist())
        if self._accumulating:
            frame.insert(0, "applied", applied.tolist())
        if self._several:
            frame.insert(0, "optimizer", optimizers.tolist())
        frame.insert(0, "step", steps)
        return frame

    @property
    def latest(self) -> Dict[str, float]:
        """The last recorded step as `{"step": ..., "<path>/<stat>": ...}`
        (with several optimizers, the last step of each one merged)."""
        self._read_pending()
        latest: Dict[str, float] = {}
        seen = set()
        for record in reversed(self._rows):
            if isinstance(record, CaptureBlock):
                record = record[len(record) - 1:].records()[0]  # (a block: one optimizer)
            if record.values is None or record.optimizer in seen:
                continue
            seen.add(record.optimizer)
            latest.setdefault("step", record.step)
            for tag, value in zip(record.tags, record.values.tolist()):
                if tag is not None:
                    latest.setdefault(_tags.column(tag, self.kind), value)
            if not self._several:
                break
        return latest

    @property
    def clipped_steps(self) -> int:
        """Recorded steps at which gradient clipping changed the gradient."""
        return self._clipped
