"""An event file and its analysis store read as one: the store's rows, then
the steps of the event file beyond them.

kerasdbg's event writer appends each step to its event file, and the same
values to the analysis store beside it (`kerasdbg.sinks.store`), whose rows it
keeps in memory until it flushes (every 30 s, at the end of each epoch and
of the fit). A process killed between two flushes (`kill -9`, an
out-of-memory kill, a lost machine), or a fit still running, leaves steps in
the event file that the store does not hold: the store is an index, never
the only copy of a step.

At each flush the store's marker says how many bytes of the event file its
rows stand for, and how many rows each tag set had then (`_store.Coverage`).
`EventSource` reads the store for what it holds and the event file from that
byte on for the rest, so a complete run costs one `stat` more than its store,
and a killed one the tail of its event file, not all of it. The rows a set
gained after the last marker (a set's buffer is written when it is full, and
a crash can fall between the rows and the marker) stand for that set's first
events of the tail, which are left out.

TensorBoard's reader cannot start at an offset, so the records are framed
here as TensorFlow writes them (a length, its checksum, the data, the data's
checksum) and read as TensorBoard's reader reads them: up to the first
record that is cut short (the one being written when the process died, or
while a fit writes) or damaged, which ends what is readable. The checksum of
each length is verified, and each record must parse as an `Event`; the
data's own checksum is not (a pure-Python CRC-32C costs 0.3 s a megabyte, and
a killed process cuts a record short, it does not garble it).

Values read from the event file are its float32 scalars; the store holds
them as float64.
"""

from __future__ import annotations

import os
import struct
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, types_pb2
from tensorboard.util import tensor_util

from kerasdbg.records import tags as _tags
from kerasdbg.sinks import store as _store
from kerasdbg.sinks.tfrecord import masked_crc32c

_LENGTH = struct.Struct("<Q")
_CHECKSUM = struct.Struct("<I")
_HEADER = _LENGTH.size + _CHECKSUM.size


_VIEWS = _tags.VIEWS + "/"


def records(path: str, offset: int = 0) -> Iterator[Tuple[bytes, int]]:
    """`(data, end)` of each whole record of a TFRecord file from byte
    `offset` on (`end`: the byte after the record), up to the end of the
    file, a record cut short, or a length whose checksum is wrong.

    Args:
        path: the file.
        offset: where a record starts. Defaults to `0`.

    Examples:
        >>> import os, tempfile
        >>> from tensorboard.summary.writer.record_writer import RecordWriter
        >>> from kerasdbg.sinks.event_tail import records
        >>> path = os.path.join(tempfile.mkdtemp(), "records")
        >>> with open(path, "wb") as stream:
        ...     writer = RecordWriter(stream)
        ...     writer.write(b"first")
        ...     writer.write(b"second")
        ...     writer.flush()
        >>> [data for data, _ in records(path)]
        [b'first', b'second']
        >>> with open(path, "r+b") as stream:  # the second record cut short
        ...     _ = stream.truncate(os.path.getsize(path) - 3)
        >>> [(data, end) for data, end in records(path)]
        [(b'first', 21)]
        >>> [data for data, _ in records(path, 21)]
        []
    """
    try:
        stream = open(path, "rb")
    except OSError:
        return
    with stream:
        stream.seek(offset)
        while True:
            header = stream.read(_HEADER)
            if len(header) < _HEADER:
                return
            length_bytes = header[:_LENGTH.size]
            if _CHECKSUM.unpack(header[_LENGTH.size:])[0] != masked_crc32c(length_bytes):
                return
            (length,) = _LENGTH.unpack(length_bytes)
            body = stream.read(length + _CHECKSUM.size)
            if len(body) < length + _CHECKSUM.size:
                return
            offset += _HEADER + length + _CHECKSUM.size
            yield body[:length], offset


def _key(table: _store.Table) -> tuple:
    if table.kind == "histograms":
        return ("histograms", tuple(zip(table.columns, table.bins)))
    return (table.kind, tuple(table.columns))


class EventSource:
    """One event file kerasdbg wrote, with its analysis store: what
    `_store`'s reading functions take (`tables`, `text_lines`), holding
    every step of the event file.

    `refresh()` reads what the event file gained since the last call (or,
    after a flush, since the store's new marker); the store itself is read
    (memory-mapped) at each call of `tables`.

    Args:
        events_path: the event file.
        store: its store directory (`_store.store_path(events_path)`).

    Examples:
        >>> import os, tempfile
        >>> from kerasdbg.sinks import events as _events, store as _store
        >>> from kerasdbg.sinks.event_tail import EventSource
        >>> writer = _events.EventWriter(tempfile.mkdtemp())
        >>> writer.write(1, {"a/x": 1.0})
        >>> writer.flush()
        >>> writer.write(2, {"a/x": 2.0})  # in the event file, not yet in the store
        >>> writer._writer.flush()
        >>> source = EventSource(writer.path, _store.store_path(writer.path))
        >>> source.refresh()
        >>> [(t.columns, t.column(0).tolist()) for t in source.tables()]
        [(['a/x'], [1.0, 2.0])]
    """

    def __init__(self, events_path: str, store: str):
        self.events_path = events_path
        self.store = store
        self._coverage: Optional[_store.Coverage] = None
        self._position = 0
        # The tail's rows, in the store's layout: set key -> rows.
        self._rows: Dict[tuple, List[list]] = {}
        self._arrays: Dict[tuple, np.ndarray] = {}
        self._texts: List[dict] = []
        # Events of a set (and text values) left out while reading because the
        # store holds their rows beyond its marker (a store of 0.1.0: all).
        self._dropped: Dict[tuple, int] = {}
        self._dropped_texts = 0

    def refresh(self) -> None:
        """Reads the records the event file gained."""
        coverage = _store.coverage(self.store) or _store.Coverage(0, {}, 0)
        if self._coverage is None or coverage.events_bytes != self._coverage.events_bytes:
            # A flush since: the store now holds what was read, read on from its end.
            self._rows, self._arrays, self._texts = {}, {}, []
            self._dropped, self._dropped_texts = {}, 0
            self._position = coverage.events_bytes
        self._coverage = coverage
        try:
            if os.path.getsize(self.events_path) <= self._position:
                return  # nothing new (a complete run: its store holds everything)
        except OSError:
            return
        # The rows each set holds beyond the marker: its first events of the tail.
        held = {_key(t): t.rows - coverage.rows.get(t.name, 0) for t in _store.tables(self.store)}
        held_texts = len(_store.text_lines(self.store)) - coverage.texts
        for data, end in records(self.events_path, self._position):
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                break  # not an event: the end of what is readable, as a damaged record
            self._position = end
            if event.HasField("summary"):
                self._add(event, held, held_texts)

    def _keep(self, key: tuple, row: list, held: Dict[tuple, int]) -> None:
        """A set's row, unless the store holds it."""
        if self._dropped.get(key, 0) < held.get(key, 0) and not self._rows.get(key):
            self._dropped[key] = self._dropped.get(key, 0) + 1
        else:
            self._rows.setdefault(key, []).append(row)

    def _add(self, event, held: Dict[tuple, int], held_texts: int) -> None:
        """One event's values, as the event writer put them: the scalars in
        the order of their set, then the histograms, then the texts."""
        step, wall = float(event.step), event.wall_time
        scalars, values, histograms, buckets = [], [step, wall], [], [step, wall]
        for value in event.summary.value:
            which = value.WhichOneof("value")
            if which == "simple_value":
                if value.tag.startswith(_VIEWS):
                    continue  # TensorBoard's charts only: not records, never in the store
                scalars.append(value.tag)
                values.append(value.simple_value)
                continue
            if which != "tensor":
                continue
            plugin = value.metadata.plugin_data.plugin_name
            tensor = value.tensor
            # The plugin is named on a tag's first write only (which may be in the store).
            if plugin == "histograms" or (not plugin and tensor.dtype == types_pb2.DT_DOUBLE
                                          and len(tensor.tensor_shape.dim) == 2):
                array = tensor_util.make_ndarray(tensor).reshape(-1, 3)
                histograms.append((value.tag, len(array)))
                low, high = (array[0, 0], array[-1, 1]) if len(array) else (np.nan, np.nan)
                buckets += [low, high, *array[:, 2]]
            elif plugin == "text" or (not plugin and tensor.dtype == types_pb2.DT_STRING):
                if self._dropped_texts < held_texts and not self._texts:
                    self._dropped_texts += 1
                    continue
                text = tensor_util.make_ndarray(tensor).reshape(-1)
                text = text[0] if text.size else b""
                self._texts.append({
                    "step": event.step, "wall_time": wall, "tag": value.tag,
                    "text": text.decode("utf-8") if isinstance(text, bytes) else str(text)})
            # Another plugin's value (the custom-scalars layout) is not a record.
        if scalars:
            self._keep(("scalars", tuple(scalars)), values, held)
        if histograms:
            self._keep(("histograms", tuple(histograms)), buckets, held)

    def _tail(self, key: tuple, skip: int) -> Optional[np.ndarray]:
        """The tail's rows of a set from row `skip` on (None when none)."""
        rows = self._rows.get(key)
        if not rows or skip >= len(rows):
            return None
        array = self._arrays.get(key)
        if array is None or len(array) != len(rows):
            array = self._arrays[key] = np.array(rows, np.float64)
        return array[max(skip, 0):]

    def tables(self) -> List[_store.Table]:
        """The store's sets with the tail's rows after theirs, then the sets
        of the tail that the store has no header for."""
        coverage = self._coverage or _store.Coverage(0, {}, 0)
        out, seen = [], set()
        for table in _store.tables(self.store):
            key = _key(table)
            seen.add(key)
            # The rows written since the marker stand for the set's first events of the
            # tail, those not left out while reading.
            tail = self._tail(key, table.rows - coverage.rows.get(table.name, 0)
                              - self._dropped.get(key, 0))
            out.append(table if tail is None else table._replace(blocks=table.blocks + [tail]))
        for key in self._rows:
            tail = None if key in seen else self._tail(key, 0)
            if tail is not None:
                kind, columns = key
                if kind == "histograms":
                    columns, bins = [c for c, _ in columns], [b for _, b in columns]
                else:
                    columns, bins = list(columns), []
                out.append(_store.Table("", kind, columns, bins, [tail]))
        return out

    def text_lines(self) -> List[dict]:
        """The store's text lines, then the tail's."""
        lines = _store.text_lines(self.store)
        coverage = self._coverage or _store.Coverage(0, {}, 0)
        return lines + self._texts[max(len(lines) - coverage.texts - self._dropped_texts, 0):]
