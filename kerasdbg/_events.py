"""Writes TensorBoard event files from the host, once per execution.

Built on TensorBoard's own `EventFileWriter` and summary protos. One `Event`
per step carries every scalar and histogram of that step, so the cost is one
proto per step rather than one summary op per value. Scalars and histograms
carry the scalars / histograms plugin metadata (on the first write of each
tag), so TensorBoard's dashboards show them as if written by `tf.summary`.
"""

from __future__ import annotations

import os
import time
from typing import Dict, Mapping, Optional, Tuple

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2, types_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

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
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._writer = EventFileWriter(
            log_dir, max_queue_size=1000, flush_secs=30, filename_suffix=".kerasdbg"
        )
        self._described = set()

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
    ) -> None:
        """Writes one event holding every value of `step`.

        Args:
            step: the step (x axis in TensorBoard).
            scalars: tag -> value.
            histograms: tag -> (counts, low, high) for equal-width bins.
            texts: tag -> markdown text.
            wall_time: seconds since the epoch. Defaults to now.
        """
        values = []
        for tag, value in dict(scalars).items():
            values.append(
                summary_pb2.Summary.Value(
                    tag=tag,
                    metadata=self._metadata(tag, scalar_metadata),
                    tensor=tensor_pb2.TensorProto(
                        dtype=types_pb2.DT_FLOAT,
                        tensor_shape=_SCALAR_SHAPE,
                        float_val=[float(value)],
                    ),
                )
            )
        for tag, (counts, low, high) in dict(histograms).items():
            values.append(
                summary_pb2.Summary.Value(
                    tag=tag,
                    metadata=self._metadata(tag, histogram_metadata),
                    tensor=_histogram_tensor(np.asarray(counts), low, high),
                )
            )
        for tag, text in dict(texts).items():
            values.append(
                summary_pb2.Summary.Value(
                    tag=tag,
                    metadata=self._metadata(tag, text_metadata),
                    tensor=tensor_pb2.TensorProto(
                        dtype=types_pb2.DT_STRING,
                        tensor_shape=_SCALAR_SHAPE,
                        string_val=[text.encode("utf-8")],
                    ),
                )
            )
        if not values:
            return
        event = event_pb2.Event(
            wall_time=time.time() if wall_time is None else wall_time,
            step=int(step),
            summary=summary_pb2.Summary(value=values),
        )
        self._writer.add_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


_WRITERS: Dict[str, EventWriter] = {}


def writer_for(log_dir: str) -> EventWriter:
    """One writer per directory in this process (shared by callbacks)."""
    key = os.path.abspath(log_dir)
    writer = _WRITERS.get(key)
    if writer is None:
        writer = _WRITERS[key] = EventWriter(key)
    return writer
