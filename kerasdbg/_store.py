"""The analysis store: what an event file holds, as fixed-width binary rows beside it.

TensorBoard's event files are made for its viewer: reading one tag means
parsing every record of the file, so the first query of a large run took
minutes and gigabytes. The event writer therefore also appends each step's
values to a store next to its event file (`<run>/kerasdbg-store/<id>/`):

- scalars: one pair of files per *tag set* (the tags written together at a
  step, which a callback repeats from step to step): `sN.json` names the
  columns and is written once, before any row (to a temporary name, then
  renamed); `sN.f64` holds one row of float64 per write: the step, the wall
  time, then one value per tag, NaN and infinities as written;
- histograms: the same, `hN.json` / `hN.f64`, a row holding per tag its
  range and its bin counts;
- text: `texts.jsonl`, one JSON object per line.

Rows are appended (buffered, flushed with the event file), never rewritten,
so a crash leaves complete rows followed at most by part of one row (or of
one line), which the reader ignores: what was written up to the last
complete row stays readable. A query reads only the files whose columns it
needs, through a memory map, and copies only the matching columns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

DIRECTORY = "kerasdbg-store"
"""The stores of a run's event files are sub-directories of `<run>/DIRECTORY`
(no "tfevents" in their names: TensorBoard takes any path holding it for an
event file)."""
FORMAT = 1
MARKER = "store.json"
"""Written when a store is created, removed first when it is dropped."""
_ROW_HEAD = 2  # step, wall time


def store_path(events_path: str) -> str:
    """The store directory of an event file.

    Examples:
        >>> from kerasdbg._store import store_path
        >>> store_path("logs/train/events.out.tfevents.17.host.9.0.kerasdbg")
        'logs/train/kerasdbg-store/17.host.9.0.kerasdbg'
    """
    directory, name = os.path.split(events_path)
    return os.path.join(directory, DIRECTORY, name.replace("events.out.tfevents.", "", 1))


class StoreWriter:
    """Appends the values an `EventWriter` writes to its event file's store.

    Rows are kept in memory and appended at `flush()` (the event writer
    flushes at least every 30 s, and at the end of each epoch and fit), or
    when a set holds `BUFFER_BYTES`: a file is open only while it is
    appended to, so a process with many writers and tag sets holds no file
    descriptors between flushes.

    Args:
        events_path: the event file's path; the store is created beside it.
    """

    BUFFER_BYTES = 4 << 20

    def __init__(self, events_path: str):
        self.path = store_path(events_path)
        os.makedirs(self.path, exist_ok=True)
        # The marker says the store is whole: the reader uses a store only with it,
        # and a store being dropped loses it first.
        with open(os.path.join(self.path, MARKER), "w") as stream:
            json.dump({"format": FORMAT}, stream)
        self._sets: Dict[tuple, str] = {}  # key -> data file
        self._pending: Dict[str, List[bytes]] = {}  # data file -> rows
        self._sizes: Dict[str, int] = {}
        self._texts: List[str] = []
        self._count = 0

    def _data(self, key: tuple, prefix: str, header: dict) -> str:
        data = self._sets.get(key)
        if data is None:
            name = f"{prefix}{self._count}"
            self._count += 1
            # The header first, whole (a rename is atomic): a set without one is not read.
            temporary = os.path.join(self.path, f".{name}.json.tmp")
            with open(temporary, "w") as stream:
                json.dump({"format": FORMAT, **header}, stream)
            os.replace(temporary, os.path.join(self.path, f"{name}.json"))
            data = self._sets[key] = os.path.join(self.path, f"{name}.f64")
        return data

    def _append(self, data: str, row: bytes) -> None:
        self._pending.setdefault(data, []).append(row)
        self._sizes[data] = self._sizes.get(data, 0) + len(row)
        if self._sizes[data] >= self.BUFFER_BYTES:
            self._write(data)

    def _write(self, data: str) -> None:
        rows = self._pending.pop(data, None)
        self._sizes.pop(data, None)
        if rows:
            with open(data, "ab") as stream:
                stream.write(b"".join(rows))

    def scalars(self, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        """Appends one row of the tag set `values` holds."""
        key = tuple(values)
        data = self._data(("s", key), "s", {"kind": "scalars", "columns": list(key)})
        row = np.empty(_ROW_HEAD + len(key), np.float64)
        row[0], row[1] = step, wall_time
        row[_ROW_HEAD:] = np.fromiter(values.values(), np.float64, count=len(key))
        self._append(data, row.tobytes())

    def histograms(self, step: int, wall_time: float,
                   values: Mapping[str, Tuple[np.ndarray, float, float]]) -> None:
        """Appends one row of `tag -> (counts, low, high)`."""
        counts = {tag: np.asarray(c, np.float64).ravel() for tag, (c, _, _) in values.items()}
        key = tuple((tag, len(c)) for tag, c in counts.items())
        data = self._data(("h", key), "h", {
            "kind": "histograms", "columns": [t for t, _ in key], "bins": [b for _, b in key]})
        parts = [np.array([step, wall_time], np.float64)]
        for tag, (_, low, high) in values.items():
            parts += [np.array([low, high], np.float64), counts[tag]]
        self._append(data, np.concatenate(parts).tobytes())

    def texts(self, step: int, wall_time: float, values: Mapping[str, str]) -> None:
        """Appends one line per text."""
        for tag, text in values.items():
            self._texts.append(json.dumps({"step": int(step), "wall_time": wall_time,
                                           "tag": tag, "text": text}) + "\n")

    def flush(self) -> None:
        for data in list(self._pending):
            self._write(data)
        if self._texts:
            lines, self._texts = self._texts, []
            with open(os.path.join(self.path, "texts.jsonl"), "a", encoding="utf-8") as stream:
                stream.write("".join(lines))

    def close(self) -> None:
        self.flush()

    def drop(self) -> None:
        """Removes the store, its marker first (then no reader uses what is left)."""
        self._pending, self._sizes, self._texts = {}, {}, []
        try:
            os.remove(os.path.join(self.path, MARKER))
        except OSError:
            pass
        shutil.rmtree(self.path, ignore_errors=True)


def usable(path: str) -> bool:
    """Whether a store directory can stand for its event file: its marker says
    it is whole and of this format, and every set header is of this format
    (a store of a later version, or one half removed, is not: the reader
    reads the event file instead)."""
    try:
        with open(os.path.join(path, MARKER)) as stream:
            if json.load(stream).get("format") != FORMAT:
                return False
        for name in os.listdir(path):
            if name.endswith(".json") and name != MARKER and not name.startswith("."):
                with open(os.path.join(path, name)) as stream:
                    if json.load(stream).get("format") != FORMAT:
                        return False
    except (OSError, ValueError):
        return False
    return True


class _Set(NamedTuple):
    kind: str
    columns: List[str]
    bins: List[int]
    data: str


def _sets(path: str) -> Iterator[_Set]:
    """The complete tag sets of one store (a set whose header is missing or
    unreadable is left out: its writer stopped before its first row)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return
    for name in names:
        if not name.endswith(".json") or name.startswith(".") or name == MARKER:
            continue
        try:
            with open(os.path.join(path, name)) as stream:
                header = json.load(stream)
        except (OSError, ValueError):
            continue
        if header.get("format") != FORMAT:
            continue
        yield _Set(header["kind"], list(header["columns"]), list(header.get("bins", [])),
                   os.path.join(path, name[:-5] + ".f64"))


def _rows(data: str, width: int) -> Optional[np.ndarray]:
    """The complete rows of a data file as a read-only memory map (None when empty)."""
    try:
        size = os.path.getsize(data)
    except OSError:
        return None
    rows = size // (8 * width)
    if rows == 0:
        return None
    return np.memmap(data, np.float64, mode="r", shape=(rows, width))


def sequences(path: str) -> Iterator[Tuple[str, List[str], np.ndarray, np.ndarray]]:
    """`(kind, tags, steps, wall_times)` of each set of a store (the tags of
    a set share its rows), the text's per tag."""
    for entry in _sets(path):
        width = _ROW_HEAD + (len(entry.columns) if entry.kind == "scalars"
                             else sum(2 + b for b in entry.bins))
        rows = _rows(entry.data, width)
        if rows is not None:
            yield entry.kind, entry.columns, np.array(rows[:, 0]), np.array(rows[:, 1])
    by_tag: Dict[str, List[Tuple[int, float]]] = {}
    for line in _text_lines(path):
        by_tag.setdefault(line["tag"], []).append((int(line["step"]), float(line["wall_time"])))
    for tag, written in by_tag.items():
        yield "text", [tag], np.array([s for s, _ in written], np.float64), np.array(
            [w for _, w in written])


def scalar_sets(path: str) -> Iterator[Tuple[List[str], np.ndarray]]:
    """`(tags, rows)` of each scalar set of a store: `rows` a read-only memory
    map of its complete rows (step, wall time, one value per tag)."""
    for entry in _sets(path):
        if entry.kind == "scalars":
            rows = _rows(entry.data, _ROW_HEAD + len(entry.columns))
            if rows is not None:
                yield entry.columns, rows


def tags(path: str, kind: str) -> List[str]:
    """The tags of `kind` ("scalars", "histograms" or "text") in a store."""
    found = set()
    if kind == "text":
        found.update(t["tag"] for t in _text_lines(path))
    else:
        for entry in _sets(path):
            width = _ROW_HEAD + (len(entry.columns) if entry.kind == "scalars"
                                 else sum(2 + b for b in entry.bins))
            # A set whose rows were not flushed yet (or never: a crash) has no tag yet.
            if entry.kind == kind and _rows(entry.data, width) is not None:
                found.update(entry.columns)
    return sorted(found)


def scalars(path: str, wanted) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(tag, step, wall_time, value)` arrays of the scalars whose tag
    `wanted(tag)` accepts, in the order they were written within each set."""
    tags_out, steps, walls, values = [], [], [], []
    for entry in _sets(path):
        if entry.kind != "scalars":
            continue
        columns = [i for i, tag in enumerate(entry.columns) if wanted(tag)]
        if not columns:
            continue
        rows = _rows(entry.data, _ROW_HEAD + len(entry.columns))
        if rows is None:
            continue
        block = np.asarray(rows[:, [_ROW_HEAD + i for i in columns]])  # rows x columns
        count = len(rows)
        tags_out.append(np.repeat(np.array([entry.columns[i] for i in columns], object), count))
        steps.append(np.tile(np.asarray(rows[:, 0]), len(columns)))
        walls.append(np.tile(np.asarray(rows[:, 1]), len(columns)))
        values.append(block.T.ravel())
        del rows
    if not tags_out:
        empty = np.zeros(0)
        return np.zeros(0, object), empty, empty, empty
    return (np.concatenate(tags_out), np.concatenate(steps), np.concatenate(walls),
            np.concatenate(values))


def histograms(path: str, wanted) -> List[Tuple[str, int, float, np.ndarray, np.ndarray]]:
    """`(tag, step, wall_time, edges, counts)` of the histograms `wanted` accepts."""
    out = []
    for entry in _sets(path):
        if entry.kind != "histograms" or not any(wanted(t) for t in entry.columns):
            continue
        rows = _rows(entry.data, _ROW_HEAD + sum(2 + b for b in entry.bins))
        if rows is None:
            continue
        offset = _ROW_HEAD
        for tag, bins in zip(entry.columns, entry.bins):
            if wanted(tag):
                for row in rows:
                    low, high = row[offset], row[offset + 1]
                    out.append((tag, int(row[0]), float(row[1]),
                                np.linspace(low, high, bins + 1),
                                np.array(row[offset + 2: offset + 2 + bins])))
            offset += 2 + bins
    return out


def _text_lines(path: str) -> List[dict]:
    lines = []
    try:
        with open(os.path.join(path, "texts.jsonl"), encoding="utf-8") as stream:
            for line in stream:
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    break  # a line cut by a crash: the last one
    except OSError:
        pass
    return lines


def texts(path: str, wanted) -> List[Tuple[str, int, float, str]]:
    """`(tag, step, wall_time, text)` of the texts `wanted` accepts."""
    return [(t["tag"], int(t["step"]), float(t["wall_time"]), t["text"])
            for t in _text_lines(path) if wanted(t["tag"])]


def matcher(tag_or_regex: str):
    """`tag -> bool`: the tag itself, or a regular expression the whole tag matches."""
    pattern = re.compile(tag_or_regex)
    return lambda tag: tag == tag_or_regex or pattern.fullmatch(tag) is not None
