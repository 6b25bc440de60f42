"""Writes TensorBoard event files from the host, once per execution.

An event file is a TFRecord file of serialized `Event` protos, so the file is
written with TensorFlow's `tf.io.TFRecordWriter` (C++ framing and CRC) and
TensorBoard's summary protos. TensorBoard's own Python `EventFileWriter`
computes the record CRC in pure Python, which cost about 2 ms per step of a
small CNN with 180 scalars; the C++ writer makes it negligible.

One `Event` per step carries every scalar and histogram of that step: one
proto per step rather than one summary op per value. The same values go to
the analysis store beside the event file (`kerasdbg._store`), which
`load_run` reads instead of the event file. Scalars are written as
`simple_value` (TensorBoard's scalar dashboard and reader take them as
`tf.summary.scalar` data); histograms and text carry their plugin metadata
on the first write of each tag.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import shutil
import socket
import time
import warnings
from typing import Dict, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2, types_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.text import metadata as text_metadata

from kerasdbg import _store

_FILE_IDS = itertools.count()
FLUSH_SECONDS = 30.0

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

    def __init__(self, log_dir: str):
        tf.io.gfile.makedirs(log_dir)
        self.log_dir = log_dir
        # The name TensorBoard looks for ("tfevents"), unique per writer.
        name = "events.out.tfevents.%010d.%s.%d.%d.kerasdbg" % (
            time.time(), socket.gethostname(), os.getpid(), next(_FILE_IDS)
        )
        self.path = os.path.join(log_dir, name)
        self._writer = tf.io.TFRecordWriter(self.path)
        # The analysis store beside the event file (local directories only).
        self._store: Optional[_store.StoreWriter] = None
        if "://" not in self.path:
            try:
                self._store = _store.StoreWriter(self.path)
            except OSError as error:
                self._drop_store(error)
        self._writer.write(
            event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
        )
        self._writer.flush()
        self._last_flush = time.monotonic()
        self._described = set()
        # tag -> (step, value) of the last scalar written with `unique=True`.
        self._unique: Dict[str, Tuple[int, float]] = {}
        # The scalar tags of a step -> a Summary holding them, whose values
        # are overwritten at each step: a callback writes the same tags every
        # step, and setting 80 floats costs 40 us where making 80 protos
        # costs 100 us.
        self._templates: Dict[Tuple[str, ...], summary_pb2.Summary] = {}

    def _metadata(self, tag: str, plugin) -> Optional[summary_pb2.SummaryMetadata]:
        if tag in self._described:
            return None
        self._described.add(tag)
        return plugin.create_summary_metadata(display_name=tag, description="")

    def write(
        self,
        step: int,
        scalars: Mapping[str, float] = (),
        histograms: Mapping[str, Tuple[np.ndarray, float, float]] = (),
        texts: Mapping[str, str] = (),
        wall_time: Optional[float] = None,
        unique: bool = False,
    ) -> None:
        """Writes one event holding every value of `step`.

        Args:
            step: the step (x axis in TensorBoard).
            scalars: tag -> value.
            histograms: tag -> (counts, low, high) for equal-width bins.
            texts: tag -> markdown text.
            wall_time: seconds since the epoch. Defaults to now.
            unique: leave out each scalar that this writer already wrote at
                this step with the same value (several `StopOnRule`s in one
                log directory each record `step/loss`). Defaults to `False`.
        """
        scalars = dict(scalars)
        if unique:
            for tag in list(scalars):
                last = (int(step), float(scalars[tag]))
                if _same(self._unique.get(tag), last):
                    del scalars[tag]
                self._unique[tag] = last
        event = event_pb2.Event(
            wall_time=time.time() if wall_time is None else wall_time, step=int(step)
        )
        if scalars:
            event.summary.CopyFrom(self._scalar_summary(scalars))
        for tag, (counts, low, high) in dict(histograms).items():
            event.summary.value.add(
                tag=tag,
                metadata=self._metadata(tag, histogram_metadata),
                tensor=_histogram_tensor(np.asarray(counts), low, high),
            )
        for tag, text in dict(texts).items():
            event.summary.value.add(
                tag=tag,
                metadata=self._metadata(tag, text_metadata),
                tensor=tensor_pb2.TensorProto(
                    dtype=types_pb2.DT_STRING,
                    tensor_shape=_SCALAR_SHAPE,
                    string_val=[text.encode("utf-8")],
                ),
            )
        if not event.summary.value:
            return
        self._writer.write(event.SerializeToString())
        if self._store is not None:
            try:
                if scalars:
                    self._store.scalars(event.step, event.wall_time, scalars)
                if histograms:
                    self._store.histograms(event.step, event.wall_time, histograms)
                if texts:
                    self._store.texts(event.step, event.wall_time, texts)
            except OSError as error:
                self._drop_store(error)
        if time.monotonic() - self._last_flush > FLUSH_SECONDS:
            self.flush()

    def _scalar_summary(self, scalars: Mapping[str, float]) -> summary_pb2.Summary:
        """The cached Summary of these tags, holding these values."""
        key = tuple(scalars)
        summary = self._templates.get(key)
        if summary is None:
            if len(self._templates) >= 64:  # tags that change every step
                self._templates.clear()
            summary = self._templates[key] = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=tag) for tag in key]
            )
        for proto, value in zip(summary.value, scalars.values()):
            proto.simple_value = float(value)
        return summary

    def flush(self) -> None:
        self._writer.flush()
        if self._store is not None:
            try:
                self._store.flush()
            except OSError as error:
                self._drop_store(error)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self._writer.close()
        if self._store is not None:
            try:
                self._store.close()
            except OSError as error:
                self._drop_store(error)

    def _drop_store(self, error: OSError) -> None:
        """An analysis store that could not be written is removed, whole, so
        that the reader reads the event file instead; the event file goes on."""
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
        warnings.warn(
            f"kerasdbg could not write the analysis store {path!r} ({type(error).__name__}: "
            f"{error}); the event file goes on, and load_run reads it instead (slower on "
            "large runs).", RuntimeWarning, stacklevel=3)

    def write_summary(self, step: int, summary: summary_pb2.Summary) -> None:
        """Writes one event holding `summary` as given, its values carrying
        their own plugin metadata (the custom-scalars layout of
        `kerasdbg._layout`), and flushes it. Event file only: the values are
        for TensorBoard's plugins, not records.

        Args:
            step: the step of the event.
            summary: the values, with their `metadata`.
        """
        event = event_pb2.Event(wall_time=time.time(), step=int(step))
        event.summary.CopyFrom(summary)
        self._writer.write(event.SerializeToString())
        self.flush()


def _same(old: Optional[Tuple[int, float]], new: Tuple[int, float]) -> bool:
    if old is None or old[0] != new[0]:
        return False
    return old[1] == new[1] or (math.isnan(old[1]) and math.isnan(new[1]))


_WRITERS: Dict[str, EventWriter] = {}


def writer_for(log_dir: str) -> EventWriter:
    """One writer per directory in this process (shared by callbacks)."""
    key = log_dir if "://" in log_dir else os.path.abspath(log_dir)
    writer = _WRITERS.get(key)
    if writer is None or not tf.io.gfile.exists(writer.path):
        # A new writer also when the directory was removed under the old one.
        writer = _WRITERS[key] = EventWriter(key)
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
