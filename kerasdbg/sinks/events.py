"""Writes TensorBoard event files from the host, once per execution.

An event file is a TFRecord file of serialized `Event` protos (TensorBoard's
summary protos), written by `kerasdbg.sinks.tfrecord`: through TensorFlow's
`tf.io.TFRecordWriter` (C++ framing and CRC) where TensorFlow is loaded,
else framed in Python with the C CRC32C of `google-crc32c`, without
TensorFlow. TensorBoard's own Python `EventFileWriter` computes the record
CRC in pure Python, which cost about 2 ms per step of a small CNN with 180
scalars; either writer here makes it negligible (`docs/performance.md`).

One `Event` per step carries every scalar and histogram of that step: one
proto per step rather than one summary op per value. The same values go to
the analysis store beside the event file (`kerasdbg.sinks.store`), which
`load_run` reads instead of the event file. Scalars are written as
`simple_value` (TensorBoard's scalar dashboard and reader take them as
`tf.summary.scalar` data); histograms and text carry their plugin metadata
on the first write of each tag.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import json
import math
import os
import re
import shutil
import socket
import struct
import time
import warnings
from typing import Callable, Dict, Hashable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2, types_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.text import metadata as text_metadata

from kerasdbg.sinks import store as _store
from kerasdbg.sinks import tfrecord as _tfrecord
from kerasdbg import errors

_FILE_IDS = itertools.count()
# A full disk, a read-only file system, a run directory removed: the event
# file beside the store cannot go on either.
_FILE_SYSTEM_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOENT)
FLUSH_SECONDS = 30.0
WALL_TICK = 1e-6
"""Seconds between the wall times of two rows of a writer, at the least:
every row it writes has its own wall time, later than the one before."""

EVENTS = errors.EVENTS
STORE = errors.STORE
failure_message = errors.failure_message
RecordingError = errors.RecordingError

_SCALAR_SHAPE = tensor_shape_pb2.TensorShapeProto()


def _histogram_tensor(counts: np.ndarray, low: float, high: float) -> tensor_pb2.TensorProto:
    bins = len(counts)
    edges = np.linspace(low, high, bins + 1)
    buckets = np.stack([edges[:-1], edges[1:], counts], axis=1)
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=bins),
             tensor_shape_pb2.TensorShapeProto.Dim(size=3)]
    )
    return tensor_pb2.TensorProto(
        dtype=types_pb2.DT_DOUBLE, tensor_shape=shape, double_val=buckets.ravel().tolist()
    )


class EventWriter:
    """Writes steps of scalars, histograms and text to `log_dir`.

    Args:
        log_dir: the run directory (e.g. `<log_dir>/train`); created if needed.
    """

    def __init__(self, log_dir: str, tolerant: bool = False):
        self.log_dir = log_dir
        # The name TensorBoard looks for ("tfevents"), unique per writer.
        name = "events.out.tfevents.%010d.%s.%d.%d.kerasdbg" % (
            time.time(), socket.gethostname(), os.getpid(), next(_FILE_IDS)
        )
        self.path = os.path.join(log_dir, name)
        self._writer = None
        # The analysis store beside the event file (local directories only).
        self._store: Optional[_store.StoreWriter] = None
        self._described = set()
        # tag -> (step, value) of the last scalar written with `unique=True`.
        self._unique: Dict[str, Tuple[int, float]] = {}
        self._unique_through = None  # the latest step in `_unique`
        # The scalar and view tags of a step -> its event serialized with a
        # slot for each value (`_ScalarTemplate`): a callback writes the same
        # tags every step, and filling 80 slots with NumPy costs a tenth of
        # setting 80 floats of a proto.
        self._templates: Dict[Tuple[Tuple[str, ...], Tuple[str, ...]], _ScalarTemplate] = {}
        # The callbacks writing here (key -> (name, strict)), told of a failure once.
        self._owners: Dict[Hashable, Tuple[str, bool]] = {}
        self._told: Dict[str, set] = {EVENTS: set(), STORE: set()}
        # what -> (path, error) of the sinks that failed.
        self.failures: Dict[str, Tuple[str, BaseException]] = {}
        self._last_flush = time.monotonic()
        # The wall time of the last row written (`_walls`).
        self._last_wall = -math.inf
        # Functions of a step's scalars -> views, added by the layout (`derive`).
        self._derived: List[Callable[[Mapping[str, float]], Dict[str, float]]] = []
        try:
            _tfrecord.makedirs(log_dir)
            self._writer = _tfrecord.record_writer(self.path)
            if "://" not in self.path:
                try:
                    self._store = _store.StoreWriter(self.path)
                except OSError as error:
                    self._drop_store(error, report=False)
            self._writer.write(event_pb2.Event(
                wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            self._writer.flush()
        except Exception as error:  # noqa: BLE001 - tf.errors of every kind
            self._fail(error, report=False)
            if not tolerant:
                raise

    # ------------------------------------------------------------ owners
    def attach(self, key: Hashable, owner: str, strict: bool = False) -> None:
        """Registers a callback writing here for this fit: a failure names
        it, once, and raises a `RecordingError` when one of them is `strict`.
        Attaching a strict callback to a writer that failed raises at once.

        Args:
            key: the callback (or anything standing for it).
            owner: its name, for messages.
            strict: whether it raises on a failure. Defaults to `False`.
        """
        self._owners[key] = (owner, bool(strict))
        if strict and self.failures:
            self._report()

    def detach(self, key: Hashable) -> None:
        """Ends a callback's fit here (a failure not said yet is said now)."""
        self._report()
        self._owners.pop(key, None)

    def forget(self, key: Hashable) -> None:
        """Ends the fit of a callback whose `fit` raised: it writes here no
        more, and a failure not said yet is left to the callbacks to come
        (the fit's own exception is what the user sees)."""
        self._owners.pop(key, None)

    def owns(self, key: Hashable) -> bool:
        return key in self._owners

    @property
    def failed(self) -> bool:
        """Whether the event file failed (the writer then writes nothing)."""
        return EVENTS in self.failures

    def _names(self) -> List[str]:
        return list(dict.fromkeys(name for name, _ in self._owners.values()))

    def _report(self) -> None:
        """Says each failure once to the callbacks not told yet, in one
        warning naming all of them; raises when one of them is strict."""
        for what, (path, error) in self.failures.items():
            told = self._told[what]
            keys = [k for k in self._owners if k not in told]
            if not keys:
                continue
            told.update(keys)
            names = self._names()
            if any(strict for _, strict in self._owners.values()):
                # The fit ends here, without `on_train_end`: the next one starts anew.
                self._owners.clear()
                raise RecordingError(names, what, path, error)
            untold = list(dict.fromkeys(self._owners[k][0] for k in keys))
            warnings.warn(failure_message(untold, what, path, error),
                          RuntimeWarning, stacklevel=4)

    def _fail(self, error: BaseException, report: bool = True) -> None:
        """The event file could not be written: close everything (no handle
        is left open; what was flushed stays readable), write nothing more,
        and say so (`report`)."""
        if EVENTS not in self.failures:
            writer, self._writer = self._writer, None
            self.failures[EVENTS] = (self.log_dir, error)
            if writer is not None:
                try:
                    writer.close()
                except Exception:  # noqa: BLE001 - closing what already failed
                    pass
            # What the store flushed stays (its marker says how much of the
            # event file it covers; the reader reads the rest from the event
            # file): every step written up to the failure stays readable.
            store, self._store = self._store, None
            if store is not None:
                store.abandon()
            if _WRITERS.get(_key(self.log_dir)) is self:
                del _WRITERS[_key(self.log_dir)]
        if report and not self._owners:
            raise error  # written directly, not by a callback: the caller decides
        if report:
            self._report()

    def _metadata(self, tag: str, plugin) -> Optional[summary_pb2.SummaryMetadata]:
        if tag in self._described:
            return None
        self._described.add(tag)
        return plugin.create_summary_metadata(display_name=tag, description="")

    def derive(self, function: Callable[[Mapping[str, float]], Dict[str, float]]) -> None:
        """Adds `views` that `write` derives from the scalars of every write:
        `function(scalars) -> {tag: value}` (the log10 of the loss, which
        `kerasdbg.sinks.layout` draws). Added once however often given."""
        if function not in self._derived:
            self._derived.append(function)

    def write(
        self,
        step: int,
        scalars: Mapping[str, float] = (),
        histograms: Mapping[str, Tuple[np.ndarray, float, float]] = (),
        texts: Mapping[str, str] = (),
        wall_time: Optional[float] = None,
        unique: bool = False,
        views: Mapping[str, float] = (),
    ) -> None:
        """Writes one event holding every value of `step`.

        Args:
            step: the step (x axis in TensorBoard).
            scalars: tag -> value.
            histograms: tag -> (counts, low, high) for equal-width bins.
            texts: tag -> markdown text.
            wall_time: seconds since the epoch. Defaults to now. Moved on
                to just after this writer's last write where it is not later
                (see `_walls`).
            unique: leave out each scalar that this writer already wrote at
                this step with the same value (several `StopOnRule`s in one
                log directory each record `step/loss`). Defaults to `False`.
            views: tag -> value of scalars derived for TensorBoard's charts
                (`kerasdbg.sinks.layout.views`): written to the event file
                only, not to the analysis store (they are not records),
                with those of the functions given to `derive`; `unique`
                applies to them too. Defaults to `()`.
        """
        if self.failures:
            self._report()
            if self._writer is None:
                return
        scalars, views = dict(scalars), dict(views)
        for function in self._derived:
            views.update(function(scalars))
        if unique:
            self._drop_repeated(int(step), scalars, views)
        wall_time = float(self._walls(1, wall_time)[0])
        histograms, texts = dict(histograms), dict(texts)
        values = None
        if scalars or views:
            values = np.fromiter(itertools.chain(scalars.values(), views.values()), np.float64,
                                 count=len(scalars) + len(views))
            data = self._scalar_template(tuple(scalars), tuple(views)).event(
                step, wall_time, values)
        elif not (histograms or texts):
            return
        if histograms or texts:
            event = event_pb2.Event.FromString(data) if values is not None else \
                event_pb2.Event(wall_time=wall_time, step=int(step))
            for tag, (counts, low, high) in histograms.items():
                event.summary.value.add(
                    tag=tag,
                    metadata=self._metadata(tag, histogram_metadata),
                    tensor=_histogram_tensor(np.asarray(counts), low, high),
                )
            for tag, text in texts.items():
                event.summary.value.add(
                    tag=tag,
                    metadata=self._metadata(tag, text_metadata),
                    tensor=tensor_pb2.TensorProto(
                        dtype=types_pb2.DT_STRING,
                        tensor_shape=_SCALAR_SHAPE,
                        string_val=[text.encode("utf-8")],
                    ),
                )
            data = event.SerializeToString()
        try:
            _tfrecord.write_all(self._writer, [data])
        except Exception as error:  # noqa: BLE001 - tf.errors of every kind
            self._fail(error)
            return
        if self._store is not None:
            try:
                if scalars:
                    self._store.scalar_row(int(step), wall_time, tuple(scalars),
                                           values[:len(scalars)])
                if histograms:
                    self._store.histograms(int(step), wall_time, histograms)
                if texts:
                    self._store.texts(int(step), wall_time, texts)
            except OSError as error:
                self._drop_store(error)
        if time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self.flush()

    def write_rows(self, rows: "List[ScalarRow]", wall_time: Optional[float] = None,
                   unique: bool = False) -> None:
        """Writes one event per row, in the rows' order: `write(step, scalars,
        views=views, unique=unique)` for each, serialized as one array per tag
        layout (the steps of a read repeat their tags) and handed to the file
        in one call.

        Args:
            rows: the rows (`ScalarRow`: the step, the scalar tags, their
                values as an array in the tags' order, the views `{tag:
                value}`).
            wall_time: seconds since the epoch of the first row; each later
                row a tick (`WALL_TICK`) later, so that every row keeps its
                place in the order of writes (`_walls`). Defaults to now.
            unique: as `write`'s, row after row. Defaults to `False`.
        """
        if self.failures:
            self._report()
            if self._writer is None:
                return
        if not rows:
            return
        if self._derived or unique:
            rows = [self._prepared(row, unique) for row in rows]
        walls = self._walls(len(rows), wall_time)
        layouts: Dict[tuple, List[int]] = {}
        for i, row in enumerate(rows):
            layouts.setdefault((row.tags, tuple(row.views)), []).append(i)
        data: List[Optional[bytes]] = [None] * len(rows)
        for (tags, view_tags), chosen in layouts.items():
            values = np.empty((len(chosen), len(tags) + len(view_tags)), np.float64)
            for k, i in enumerate(chosen):
                values[k, :len(tags)] = rows[i].values
                if view_tags:
                    values[k, len(tags):] = list(rows[i].views.values())
            if not values.shape[1]:
                continue
            events = self._scalar_template(tags, view_tags).events(
                [rows[i].step for i in chosen], walls[chosen], values)
            for i, event in zip(chosen, events):
                data[i] = event
        if self._store is not None:
            # The store's rows of a tag set in step order (the views' tags,
            # which change from step to step, are not in the store).
            sets: Dict[tuple, List[int]] = {}
            for i, row in enumerate(rows):
                if row.tags:
                    sets.setdefault(row.tags, []).append(i)
            try:
                for tags, chosen in sets.items():
                    self._store.scalar_rows(
                        [rows[i].step for i in chosen], walls[chosen], tags,
                        np.asarray([rows[i].values for i in chosen], np.float64))
            except OSError as error:
                self._drop_store(error)
        self._write_events(data)

    def write_block(self, steps: np.ndarray, tags: Tuple[str, ...], values: np.ndarray,
                    views: Sequence[Tuple[Tuple[str, ...], np.ndarray, np.ndarray]] = (),
                    wall_time: Optional[float] = None, unique: bool = False) -> None:
        """`write_rows` of steps of the same scalar tags, as arrays: an
        event per step, in the steps' order, with no object per step.

        Args:
            steps: the steps, `[n]`.
            tags: the scalars' tags.
            values: their values, `[n, len(tags)]`.
            views: the views, as `kerasdbg.sinks.layout.view_groups` gives
                them: `(view tags, the positions of the steps that have
                them, their values [steps, view tags])`; a step in no group
                has none.
            wall_time: as `write_rows`'s.
            unique: as `write_rows`'s (steps in order after every one written
                with it are written as they are; others row by row).
        """
        steps = np.asarray(steps, np.int64).reshape(-1)
        count = steps.shape[0]
        values = np.asarray(values, np.float64).reshape(count, len(tags))
        fresh = not unique or not count or (
            (self._unique_through is None or int(steps[0]) > self._unique_through)
            and bool(np.all(steps[1:] > steps[:-1])))
        if count and self._derived and fresh and all(
                hasattr(f, "of_block") for f in self._derived):
            # The views the functions derive, as blocks too, after the given ones.
            for function in self._derived:
                views = _joined(count, views, function.of_block(tuple(tags), values))
        elif self._derived or not fresh:
            # The views of a function (`derive`) are worked out per step.
            rows = [{} for _ in range(count)]
            for view_tags, positions, found in views:
                for k, row in zip(positions.tolist(), found.tolist()):
                    rows[k] = dict(zip(view_tags, row))
            self.write_rows([ScalarRow(step, tags, row, view)
                             for step, row, view in zip(steps.tolist(), values, rows)],
                            wall_time, unique)
            return
        if unique and count:
            # Every step is after those written: remembered as `_drop_repeated` does.
            last = int(steps[-1])
            self._unique_through = last
            self._unique.update(zip(tags, zip(itertools.repeat(last),
                                              values[-1].tolist())))
            # A view's last step (views come and go from step to step).
            for view_tags, positions, found in sorted(
                    (v for v in views if len(v[1])), key=lambda v: int(v[1][-1])):
                self._unique.update(zip(view_tags, zip(
                    itertools.repeat(int(steps[positions[-1]])), found[-1].tolist())))
        if self.failures:
            self._report()
            if self._writer is None:
                return
        if not count:
            return
        walls = self._walls(count, wall_time)
        groups = list(views)
        covered = np.zeros(count, bool)
        for _, positions, _ in groups:
            covered[positions] = True
        if not covered.all():
            positions = np.flatnonzero(~covered)
            groups.append(((), positions, np.empty((positions.size, 0))))
        data: List[Optional[bytes]] = [None] * count
        for view_tags, positions, found in groups:
            if not len(tags) + len(view_tags):
                continue
            events = self._scalar_template(tuple(tags), tuple(view_tags)).events(
                steps[positions].tolist(), walls[positions],
                np.concatenate([values[positions], found], axis=1))
            for k, event in zip(positions.tolist(), events):
                data[k] = event
        if self._store is not None and tags:
            try:
                self._store.scalar_rows(steps, walls, tuple(tags), values)
            except OSError as error:
                self._drop_store(error)
        self._write_events(data)

    def _write_events(self, data: List[Optional[bytes]]) -> None:
        """Hands the serialized events (None: a row with nothing to write)
        to the file in one call; flushes when it is time."""
        try:
            _tfrecord.write_all(self._writer, [d for d in data if d is not None])
        except Exception as error:  # noqa: BLE001 - tf.errors of every kind
            self._fail(error)
            return
        if time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self.flush()

    def _walls(self, count: int, wall_time: Optional[float] = None) -> np.ndarray:
        """The wall times of the next `count` rows: from `wall_time` (now
        where `None`), each a tick after the one before and after every row
        this writer wrote before.

        A reader orders the writes of a tag by wall time (a step written again
        after a later one is a rollback, `kerasdbg.reader`), and a tag's
        writes may lie in several of the store's tag sets (the full
        statistics' set at a scheduled step, the every-step set around it):
        with one wall time for a read's rows, the order between sets was
        lost and a scheduled step read as rewritten.
        """
        start = time.time() if wall_time is None else float(wall_time)
        tick = max(WALL_TICK, 4 * float(np.spacing(abs(start))))
        # Added one after the other (as `count` calls of one row would).
        walls = np.full(count, tick, np.float64)
        walls[0] = max(start, self._last_wall + tick)
        walls = np.cumsum(walls)
        self._last_wall = float(walls[-1])
        return walls

    def _prepared(self, row: "ScalarRow", unique: bool) -> "ScalarRow":
        """`row` as `write` would write it: with the views the functions given
        to `derive` add, and with `unique`, without the values this writer
        already wrote at the row's step (`_drop_repeated`)."""
        values = np.asarray(row.values, np.float64)
        scalars = dict(zip(row.tags, values.tolist()))
        views = dict(row.views)
        for function in self._derived:
            views.update(function(scalars))
        if unique and self._drop_repeated(int(row.step), scalars, views):
            return ScalarRow(row.step, tuple(scalars),
                             np.fromiter(scalars.values(), np.float64, len(scalars)), views)
        return ScalarRow(row.step, row.tags, values, views)

    def _drop_repeated(self, step: int, scalars: Dict[str, float],
                       views: Dict[str, float]) -> bool:
        """`write`'s `unique`: takes out of `scalars` and `views` each value
        this writer already wrote at `step` with the same value (NaN equal to
        NaN), and remembers the rest; returns whether a scalar was taken out."""
        if self._unique_through is None or step > self._unique_through:
            # A step after every one written: nothing can be written again.
            self._unique_through = step
            for values in (scalars, views):
                self._unique.update(zip(values, zip(itertools.repeat(step),
                                                    map(float, values.values()))))
            return False
        count = len(scalars)
        for values in (scalars, views):
            for tag in list(values):
                last = (step, float(values[tag]))
                if _same(self._unique.get(tag), last):
                    del values[tag]
                self._unique[tag] = last
        return len(scalars) < count

    def _scalar_template(self, scalars: Tuple[str, ...],
                         views: Tuple[str, ...]) -> "_ScalarTemplate":
        """The serialized event of these scalar and view tags (in this order),
        worked out once: the steps of a callback repeat their tags."""
        key = (scalars, views)
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= 64:  # tags that change every step
                self._templates.clear()
            template = self._templates[key] = _ScalarTemplate(scalars + views)
        return template

    def flush(self, events_only: bool = False) -> None:
        """Writes what is buffered (the event file, then the store); with
        `events_only`, the event file alone (after each read of the records,
        so that a killed run loses at most the steps since the last read:
        the store keeps its rows for its own flushes)."""
        if self._writer is not None:
            try:
                self._writer.flush()
                if "://" not in self.path and not os.path.exists(self.path):
                    # Removed during the fit: what it writes would be lost unseen.
                    raise FileNotFoundError(errno.ENOENT, "the event file was removed",
                                            self.path)
            except Exception as error:  # noqa: BLE001 - tf.errors of every kind
                self._fail(error)
                return
        if events_only:
            if self.failures:
                self._report()
            return
        if self._store is not None:
            try:
                self._store.flush()
            except OSError as error:
                self._drop_store(error)
        self._last_flush = time.monotonic()
        if self.failures:
            self._report()

    def close(self) -> None:
        """Flushes and closes the event file and the store (a failure is
        said as `flush`'s)."""
        self.flush()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as error:  # noqa: BLE001 - tf.errors of every kind
                self._fail(error)
        if self._store is not None:
            try:
                self._store.close()
            except OSError as error:
                self._drop_store(error)
        if _WRITERS.get(_key(self.log_dir)) is self:
            del _WRITERS[_key(self.log_dir)]

    def _drop_store(self, error: OSError, report: bool = True) -> None:
        """An analysis store that could not be written is removed, whole, so
        that the reader reads the event file instead; the event file goes on,
        unless the file system is full or read-only: then the writer stops
        (one failure, not two)."""
        if getattr(error, "errno", None) in _FILE_SYSTEM_ERRORS:
            self._fail(error, report=report)
            return
        store, self._store = self._store, None
        path = _store.store_path(self.path)
        if store is not None:
            store.drop()
        else:  # it failed while being created
            try:
                os.remove(os.path.join(path, _store.MARKER))
            except OSError:
                pass
            shutil.rmtree(path, ignore_errors=True)
        self.failures.setdefault(STORE, (path, error))
        if not report:
            return
        if not self._owners:
            warnings.warn(failure_message([], STORE, path, error), RuntimeWarning, stacklevel=3)
            self._told[STORE].add(None)
            return
        self._report()

    def write_summary(self, step: int, summary: summary_pb2.Summary) -> None:
        """Writes one event holding `summary` as given, its values carrying
        their own plugin metadata (the custom-scalars layout of
        `kerasdbg.sinks.layout`), and flushes it. Event file only: the values are
        for TensorBoard's plugins, not records. A failure is said at the next
        `write`, `flush` or `detach`, once for every callback of the fit
        (raised at once when one is strict).

        Args:
            step: the step of the event.
            summary: the values, with their `metadata`.
        """
        if self._writer is None:
            return
        event = event_pb2.Event(wall_time=float(self._walls(1)[0]), step=int(step))
        event.summary.CopyFrom(summary)
        try:
            self._writer.write(event.SerializeToString())
            self._writer.flush()
        except Exception as error:  # noqa: BLE001 - tf.errors of every kind
            strict = any(strict for _, strict in self._owners.values())
            self._fail(error, report=strict or not self._owners)
        self._last_flush = time.monotonic()


def _joined(count: int, first, second) -> list:
    """Two sets of view groups (`EventWriter.write_block`'s `views`) of the
    same `count` steps as one: each step's views of the first, then of the
    second."""
    labels = []
    for groups in (first, second):
        label = np.full(count, len(groups), np.int64)  # (a step in no group: none)
        for g, (_, positions, _) in enumerate(groups):
            label[positions] = g
        labels.append(label)
    combined = labels[0] * (len(second) + 1) + labels[1]
    out = []
    for key in dict.fromkeys(combined.tolist()):
        rows = np.flatnonzero(combined == key)
        a, b = divmod(key, len(second) + 1)
        parts_tags, parts_values = [], []
        for g, groups in ((a, first), (b, second)):
            if g < len(groups):
                view_tags, positions, found = groups[g]
                parts_tags += list(view_tags)
                parts_values.append(found[np.searchsorted(positions, rows)])
        out.append((tuple(parts_tags), rows,
                    np.concatenate(parts_values, axis=1) if parts_values
                    else np.empty((len(rows), 0))))
    return out


def _varint(value: int) -> bytes:
    """`value` as a protobuf varint (an int64: a negative one in ten bytes)."""
    value = int(value) & 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_NO_WALL_TIME = struct.pack("<d", 0.0)


class _ScalarTemplate:
    """The serialized `Event` of one layout of scalar tags, with a slot for
    each value: the bytes `Event(wall_time, step, summary=Summary(value=
    [Value(tag, simple_value), ...])).SerializeToString()` gives, field by
    field (an Event's `wall_time` is field 1, a double; `step` field 2, a
    varint; `summary` field 5; a Summary's values field 1; a Value's `tag`
    field 1 and `simple_value` field 2, a float that, being in a oneof, is
    written when 0 too), with each value rounded to float32 as the proto
    rounds it."""

    __slots__ = ("_summary", "_slots", "_head")

    def __init__(self, tags: Tuple[str, ...]):
        parts, slots, at = [], [], 0
        for tag in tags:
            name = tag.encode("utf-8")
            value = b"\x0a" + _varint(len(name)) + name + b"\x15"
            value = b"\x0a" + _varint(len(value) + 4) + value
            parts.append(value + bytes(4))
            slots.append(at + len(value))
            at += len(value) + 4
        summary = b"".join(parts)
        self._summary = np.frombuffer(summary, np.uint8)
        self._slots = (np.asarray(slots, np.int64)[:, None] + np.arange(4)).ravel()
        self._head = b"\x2a" + _varint(len(summary))

    def event(self, step: int, wall_time: float, values: np.ndarray) -> bytes:
        """The serialized event of one step, `values` in the tags' order."""
        body = self._summary.copy()
        with np.errstate(over="ignore"):  # beyond float32: +-inf, as the proto makes it
            body[self._slots] = values.astype("<f4").view(np.uint8)
        wall = struct.pack("<d", wall_time)
        step = int(step)
        return b"".join((b"" if wall == _NO_WALL_TIME else b"\x09" + wall,
                         b"\x10" + _varint(step) if step else b"",
                         self._head, body.tobytes()))


    def events(self, steps: List[int], walls: np.ndarray, values: np.ndarray) -> List[bytes]:
        """The serialized events of several steps (`walls[k]`, `values[k]`:
        step k's wall time, and its values in the tags' order), the slots of
        all filled at once."""
        body = np.tile(self._summary, (len(steps), 1))
        with np.errstate(over="ignore"):
            body[:, self._slots] = np.ascontiguousarray(values, "<f4").view(np.uint8)
        walls = np.ascontiguousarray(np.broadcast_to(walls, (len(steps),)), "<f8")
        heads = [b"" if wall == _NO_WALL_TIME else b"\x09" + wall
                 for wall in map(bytes, walls.view(np.uint8).reshape(-1, 8))]
        tail = self._head
        return [b"".join((head, b"\x10" + _varint(int(step)) if step else b"", tail, row))
                for head, step, row in zip(heads, steps, map(bytes, body))]


class ScalarRow(NamedTuple):
    """One event of scalars for `EventWriter.write_rows`."""

    step: int
    tags: Tuple[str, ...]
    """The scalars' tags."""
    values: np.ndarray
    """Their values, in the tags' order."""
    views: Mapping[str, float]
    """The views (`EventWriter.write`'s `views`)."""


def _same(old: Optional[Tuple[int, float]], new: Tuple[int, float]) -> bool:
    if old is None or old[0] != new[0]:
        return False
    return old[1] == new[1] or (math.isnan(old[1]) and math.isnan(new[1]))


# ------------------------------------------------------------------ runs
RUN_MARKER = "kerasdbg-run.json"
"""The file in a run directory that names the training writing it (`Training`)."""
PROCESS = "%s:%d:%d" % (socket.gethostname(), os.getpid(), time.time_ns())
"""This process, as a run's marker names it (the time: a pid is reused)."""


def _start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, Linux's
    `/proc/<pid>/stat`), or None where not known: with its pid, it names a
    process (a pid is reused)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as stream:
            stat = stream.read()
        # The fields after the command (which may hold spaces), from the 3rd:
        # the 22nd is the start time.
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


STARTED = _start_time(os.getpid())
"""When this process started, as `_start_time` gives it."""


def _alive(marker: dict) -> bool:
    """Whether the process a run's marker names may still be running: True
    unless it is known to have ended (a process of this host whose pid is
    gone, or taken by a process started at another time). A process of
    another host cannot be looked at: it may be running."""
    host, _, rest = str(marker.get("process", "")).rpartition(":")
    host, _, pid = host.rpartition(":")
    try:
        pid = int(pid)
    except ValueError:
        return True
    if host != socket.gethostname() or os.name == "nt":
        return True  # (os.kill on Windows ends the process: not asked there)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # e.g. another user's process: it exists
    started = marker.get("started")
    if started is not None:
        now = _start_time(pid)
        if now is not None and now != started:
            return False  # the pid was reused
    return True


class Training(NamedTuple):
    """Which training writes a run: what tells a continued training (the same
    run) from another one (a run of its own)."""

    model: str
    """A token of the model object, unique in its process."""
    name: str
    """The model's name, for messages."""
    fresh: bool
    """Whether it starts at optimizer step 0 (not a continued or resumed training)."""
    fingerprint: Optional[str] = None
    """Of the weights and the optimizer's configuration at step 0 (`fresh` only)."""
    process: str = PROCESS
    started: Optional[int] = STARTED
    """When the process started (see `_start_time`), None where not known."""


def _marker(run: str) -> dict:
    try:
        with open(os.path.join(run, RUN_MARKER)) as stream:
            marker = json.load(stream)
        return marker if isinstance(marker, dict) else {}
    except (OSError, ValueError):
        return {}


def _holds_events(run: str) -> bool:
    """Whether kerasdbg wrote events there (those of Keras's `TensorBoard`
    callback, which writes `<log_dir>/train` too, are of the same training)."""
    try:
        return any("tfevents" in name and name.endswith(".kerasdbg") for name in os.listdir(run))
    except OSError:
        return False


def _claimed(run: str) -> bool:
    """Whether a training claimed the run (its marker file exists, even while
    it is being written)."""
    return os.path.exists(os.path.join(run, RUN_MARKER))


def _same_training(marker: dict, training: Training) -> bool:
    """Whether a run's marker names `training`: the same model object in this
    process, or, started from step 0, the same weights and optimizer in a
    process that has ended (a training restarted from scratch). The same
    weights in a process still running (a seeded sweep, two scripts at once)
    are another training."""
    same_model = marker.get("process") == training.process and marker.get("model") == training.model
    if not training.fresh:
        return same_model
    if marker.get("fingerprint") != training.fingerprint:
        return False
    return same_model or (marker.get("process") != training.process and not _alive(marker))


def run_directory(log_dir: str, training: Training, base: str = "train") -> Tuple[str, str]:
    """The run directory of `training` under `log_dir`, and a note when it is
    not `<log_dir>/<base>` because that one holds another training (else "").

    The run is `<base>` while it is free or holds this training; another
    training (another model, or an optimizer that restarted at step 0 with
    other weights) gets `<base>-2`, `<base>-3`, ... A training that does not
    start at step 0 (a second `fit` continuing the optimizer's steps, a
    `BackupAndRestore` resume) continues the run its model wrote in this
    process, else the latest run. Each run's marker (`RUN_MARKER`) names its
    training: its process (host, pid, start time), model and fingerprint.

    A free run is claimed by creating its marker atomically (a hard link
    that fails when the marker exists, else an exclusive create), so two
    processes starting at once in one `log_dir` never both take it: the
    one that loses looks again and takes the next. A remote directory
    (`gs://...`) has no atomic create and no markers: its callbacks write
    to `<log_dir>/<base>` as given.

    Args:
        log_dir: the callbacks' `log_dir`.
        training: the training about to write.
        base: the run's name. Defaults to `"train"`.
    """
    first = os.path.join(log_dir, base)
    if "://" in log_dir:
        return first, ""
    for _ in range(_CLAIMS):
        numbered = []
        try:
            for name in os.listdir(log_dir):
                match = re.fullmatch(re.escape(base) + r"-(\d+)", name)
                if match and int(match.group(1)) >= 2:
                    numbered.append((int(match.group(1)), os.path.join(log_dir, name)))
        except OSError:
            pass
        runs = [first] + [path for _, path in sorted(numbered)]
        markers = {run: _marker(run) for run in runs}
        chosen = next((run for run in reversed(runs)
                       if _same_training(markers[run], training)), None)
        if chosen is None and not training.fresh:
            used = [run for run in runs if _holds_events(run) or markers[run] or _claimed(run)]
            chosen = used[-1] if used else first
        if chosen is not None:
            break
        chosen = next((run for run in runs
                       if not _holds_events(run) and not _claimed(run)), None)
        if chosen is None:
            chosen = os.path.join(log_dir, f"{base}-{max([1] + [k for k, _ in numbered]) + 1}")
        if _claim(chosen, training):
            return chosen, _another(first, chosen, markers, training)
        # Another process claimed it between our look and our claim: look again.
    _mark(chosen, markers.get(chosen, {}), training)
    return chosen, _another(first, chosen, markers, training)


_CLAIMS = 64
"""How many times a training looks for a free run that other processes keep
claiming first (each claim takes one run)."""


def _another(first: str, chosen: str, markers: Dict[str, dict], training: Training) -> str:
    """The note when `training` does not write to the first run, else ""."""
    note = ""
    if chosen != first and not _same_training(markers.get(chosen, {}), training):
        other = markers[first]
        whose = (f"model {other.get('name')!r}" if other.get("name") else "an earlier training")
        if other.get("process") and other.get("process") != training.process:
            whose += " of another process"
        note = (f"{first!r} holds another training ({whose}); this one (model "
                f"{training.name!r}) writes its records to {chosen!r}.")
    return note


def _content(marker: dict, training: Training) -> dict:
    fingerprint = training.fingerprint if training.fresh else marker.get("fingerprint")
    return {"format": 1, "process": training.process, "started": training.started,
            "model": training.model, "name": training.name, "fingerprint": fingerprint}


def _claim(run: str, training: Training) -> bool:
    """Creates the marker of a free run, atomically: False when another
    training's marker is there first. A directory that cannot be written
    is this training's (its writer says what fails)."""
    marker = os.path.join(run, RUN_MARKER)
    try:
        os.makedirs(run, exist_ok=True)
        temporary = os.path.join(run, f".{RUN_MARKER}.{os.getpid()}.{time.time_ns()}.tmp")
        with open(temporary, "w") as stream:
            json.dump(_content({}, training), stream)
        try:
            # Whole at once, and only when there is none yet.
            os.link(temporary, marker)
        except FileExistsError:
            return False
        except OSError:
            # No hard links there: an exclusive create (whole a moment later).
            try:
                descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w") as stream:
                json.dump(_content({}, training), stream)
        finally:
            try:
                os.remove(temporary)
            except OSError:
                pass
    except OSError:
        pass  # a directory that cannot be written: its writer says so
    return True


def _mark(run: str, marker: dict, training: Training) -> None:
    """Writes the run's marker (whole: a rename): this training's process and
    model; the fingerprint of the training that started the run is kept."""
    updated = _content(marker, training)
    if updated == marker:
        return
    try:
        os.makedirs(run, exist_ok=True)
        temporary = os.path.join(run, f".{RUN_MARKER}.{os.getpid()}.tmp")
        with open(temporary, "w") as stream:
            json.dump(updated, stream)
        os.replace(temporary, os.path.join(run, RUN_MARKER))
    except OSError:
        pass  # a directory that cannot be written: its writer says so


_WRITERS: Dict[str, EventWriter] = {}


def _key(log_dir: str) -> str:
    return log_dir if "://" in log_dir else os.path.abspath(log_dir)


def writer_for(log_dir: str, key: Optional[Hashable] = None) -> EventWriter:
    """One writer per directory in this process (shared by callbacks).

    A writer whose directory was removed, or whose event file failed, is
    replaced by a new one when a callback opens it for a new fit (`key`
    already writing there, or no callback left). A writer that cannot be
    opened is returned failed: the callbacks of the fit attach to it, and
    the failure is said once for all of them."""
    path = _key(log_dir)
    writer = _WRITERS.get(path)
    stale = writer is None or (
        (writer.failed and (key is None or writer.owns(key) or not writer._owners))
        or (not writer.failed and not _tfrecord.exists(writer.path)))
    if stale:
        # Kept also when it failed: the other callbacks of this fit share the failure.
        writer = _WRITERS[path] = EventWriter(path, tolerant=True)
    return writer


def flush_all() -> None:
    """Flushes every shared writer (before a callback ends `fit` with an
    exception, and when the process exits: the stores keep rows in memory)."""
    for writer in list(_WRITERS.values()):
        try:
            writer.flush()
        except Exception:  # noqa: BLE001 - one writer's failure spares the others
            pass


atexit.register(flush_all)
