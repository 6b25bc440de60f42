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
one line), which the reader ignores. The marker, `store.json`, rewritten
whole at each flush, says how much of the event file the rows stand for
(`Coverage`): the store is an index, never the only copy of a step, and the
reader reads the steps of the event file beyond it from the event file
(`kerasdbg.sinks.event_tail`). A query reads only the files whose columns it
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
        >>> from kerasdbg.sinks.store import store_path
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
        self._events_path = events_path
        os.makedirs(self.path, exist_ok=True)
        self._sets: Dict[tuple, str] = {}  # key -> data file
        self._pending: Dict[str, List[bytes]] = {}  # data file -> rows
        self._sizes: Dict[str, int] = {}
        self._counts: Dict[str, int] = {}  # data file -> rows kept
        self._texts: List[str] = []
        self._count = 0
        self._written: Dict[str, int] = {}  # set name -> rows appended
        self._lines = 0  # text lines appended
        # The marker says the store is whole: the reader uses a store only with it,
        # and a store being dropped loses it first.
        self._mark(0)

    def _mark(self, events_bytes: int) -> None:
        """(Re)writes the marker, whole (a rename is atomic), with what the
        store covers (`Coverage`): the first `events_bytes` bytes of the event
        file hold the events of the rows counted in it, and no other."""
        temporary = os.path.join(self.path, f".{MARKER}.tmp")
        with open(temporary, "w") as stream:
            json.dump({"format": FORMAT, "events_bytes": int(events_bytes),
                       "rows": self._written, "texts": self._lines}, stream)
        os.replace(temporary, os.path.join(self.path, MARKER))

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

    def _append(self, data: str, row: bytes, count: int = 1) -> None:
        """Appends `row` (`count` rows of `data`'s set) to what is kept."""
        self._pending.setdefault(data, []).append(row)
        self._sizes[data] = self._sizes.get(data, 0) + len(row)
        self._counts[data] = self._counts.get(data, 0) + count
        if self._sizes[data] >= self.BUFFER_BYTES:
            self._write(data)

    def _write(self, data: str) -> None:
        rows = self._pending.pop(data, None)
        self._sizes.pop(data, None)
        count = self._counts.pop(data, 0)
        if rows:
            with open(data, "ab") as stream:
                stream.write(b"".join(rows))
            name = os.path.basename(data)[:-4]
            self._written[name] = self._written.get(name, 0) + count

    def scalars(self, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        """Appends one row of the tag set `values` holds."""
        self.scalar_row(step, wall_time, tuple(values),
                        np.fromiter(values.values(), np.float64, count=len(values)))

    def scalar_row(self, step: int, wall_time: float, tags: Tuple[str, ...],
                   values: np.ndarray) -> None:
        """Appends one row of the tag set `tags`, `values` in their order."""
        data = self._data(("s", tags), "s", {"kind": "scalars", "columns": list(tags)})
        row = np.empty(_ROW_HEAD + len(tags), np.float64)
        row[0], row[1] = step, wall_time
        row[_ROW_HEAD:] = values
        self._append(data, row.tobytes())

    def scalar_rows(self, steps, walls, tags: Tuple[str, ...], values: np.ndarray) -> None:
        """Appends one row per step of the tag set `tags` (`walls[k]`,
        `values[k]`: step k's wall time, and its values in their order), as
        one block."""
        data = self._data(("s", tags), "s", {"kind": "scalars", "columns": list(tags)})
        rows = np.empty((len(steps), _ROW_HEAD + len(tags)), np.float64)
        rows[:, 0], rows[:, 1] = steps, walls
        rows[:, _ROW_HEAD:] = values
        self._append(data, rows.tobytes(), len(steps))

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
        """Appends the rows kept in memory, then says in the marker how much
        of the event file they cover: call it right after flushing the event
        file, whose size then counts the events of every row."""
        for data in list(self._pending):
            self._write(data)
        if self._texts:
            lines, self._texts = self._texts, []
            with open(os.path.join(self.path, "texts.jsonl"), "a", encoding="utf-8") as stream:
                stream.write("".join(lines))
            self._lines += len(lines)
        self._mark(os.path.getsize(self._events_path))

    def close(self) -> None:
        self.flush()

    def abandon(self) -> None:
        """Forgets the rows not written yet (its event file failed); what was
        flushed stays, whole rows that the reader reads."""
        self._pending, self._sizes, self._counts, self._texts = {}, {}, {}, []

    def drop(self) -> None:
        """Removes the store, its marker first (then no reader uses what is left)."""
        self._pending, self._sizes, self._counts, self._texts = {}, {}, {}, []
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


class Coverage(NamedTuple):
    """What part of its event file a store stands for, as its marker says
    (written at each flush, after the rows)."""

    events_bytes: int
    """The first bytes of the event file: they hold the events of the rows
    counted here, and no event of another row (0 for a store of kerasdbg
    0.1.0, whose marker says nothing: its rows may stand for any event)."""
    rows: Dict[str, int]
    """Set name (`s0`, `h1`) -> its rows at that flush."""
    texts: int
    """Text lines at that flush."""


def coverage(path: str) -> Optional[Coverage]:
    """The `Coverage` of a store, or None when its marker cannot be read.

    Examples:
        >>> import json, os, tempfile
        >>> from kerasdbg.sinks.store import MARKER, coverage
        >>> store = tempfile.mkdtemp()
        >>> with open(os.path.join(store, MARKER), "w") as stream:
        ...     json.dump({"format": 1, "events_bytes": 512, "rows": {"s0": 4}, "texts": 1},
        ...               stream)
        >>> coverage(store)
        Coverage(events_bytes=512, rows={'s0': 4}, texts=1)
    """
    try:
        with open(os.path.join(path, MARKER)) as stream:
            marker = json.load(stream)
        return Coverage(int(marker.get("events_bytes", 0)),
                        {str(k): int(v) for k, v in marker.get("rows", {}).items()},
                        int(marker.get("texts", 0)))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class Table(NamedTuple):
    """One tag set: its header (`kind`, `columns`, `bins` of histograms) and
    its complete rows, in blocks in the order written. A row holds the step,
    the wall time, then per column its value (scalars) or its range and bin
    counts (histograms)."""

    name: str
    """The set's name in its store (`s0`); "" for rows that no header of
    the store describes."""
    kind: str
    columns: List[str]
    bins: List[int]
    blocks: List[np.ndarray]

    @property
    def width(self) -> int:
        return row_width(self.kind, self.columns, self.bins)

    @property
    def rows(self) -> int:
        return sum(len(block) for block in self.blocks)

    def column(self, index: int) -> np.ndarray:
        """Column `index` of every row (0: the steps, 1: the wall times)."""
        if not self.blocks:
            return np.zeros(0)
        return np.concatenate([np.asarray(block[:, index]) for block in self.blocks])


def row_width(kind: str, columns: Sequence[str], bins: Sequence[int]) -> int:
    """The float64 values of one row of a set."""
    return _ROW_HEAD + (len(columns) if kind == "scalars" else sum(2 + b for b in bins))


def tables(path: str) -> List[Table]:
    """The tag sets of one store, each with its complete rows as one read-only
    memory map (no block when none was written). A set whose header is
    missing or unreadable is left out: its writer stopped before its first
    row."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    out = []
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
        kind, columns, bins = header["kind"], list(header["columns"]), list(header.get("bins", []))
        rows = _rows(os.path.join(path, name[:-5] + ".f64"), row_width(kind, columns, bins))
        out.append(Table(name[:-5], kind, columns, bins, [] if rows is None else [rows]))
    return out


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


def text_lines(path: str) -> List[dict]:
    """The complete lines of a store's texts (`step`, `wall_time`, `tag`,
    `text`), in the order written: a line cut by a crash ends them."""
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


def sequences(sets: Sequence[Table], lines: Sequence[dict]
              ) -> Iterator[Tuple[str, List[str], np.ndarray, np.ndarray]]:
    """`(kind, tags, steps, wall_times)` of each set (the tags of a set share
    its rows), the texts' per tag."""
    for table in sets:
        if table.rows:
            yield table.kind, table.columns, table.column(0), table.column(1)
    by_tag: Dict[str, List[Tuple[int, float]]] = {}
    for line in lines:
        by_tag.setdefault(line["tag"], []).append((int(line["step"]), float(line["wall_time"])))
    for tag, written in by_tag.items():
        yield "text", [tag], np.array([s for s, _ in written], np.float64), np.array(
            [w for _, w in written])


def tags(sets: Sequence[Table], lines: Sequence[dict], kind: str) -> List[str]:
    """The tags of `kind` ("scalars", "histograms" or "text") with a value."""
    if kind == "text":
        return sorted({line["tag"] for line in lines})
    # A set whose rows were not written yet (or never: a crash) has no tag yet.
    return sorted({tag for table in sets if table.kind == kind and table.rows
                   for tag in table.columns})


def scalars(sets: Sequence[Table], wanted) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(tag, step, wall_time, value)` arrays of the scalars whose tag
    `wanted(tag)` accepts, in the order they were written within each set;
    only the matching columns are copied."""
    tags_out, steps, walls, values = [], [], [], []
    for table in sets:
        if table.kind != "scalars" or not table.rows:
            continue
        columns = [i for i, tag in enumerate(table.columns) if wanted(tag)]
        if not columns:
            continue
        block = np.concatenate([np.asarray(b[:, [_ROW_HEAD + i for i in columns]])
                                for b in table.blocks])  # rows x columns
        count = len(block)
        tags_out.append(np.repeat(np.array([table.columns[i] for i in columns], object), count))
        steps.append(np.tile(table.column(0), len(columns)))
        walls.append(np.tile(table.column(1), len(columns)))
        values.append(block.T.ravel())
    if not tags_out:
        empty = np.zeros(0)
        return np.zeros(0, object), empty, empty, empty
    return (np.concatenate(tags_out), np.concatenate(steps), np.concatenate(walls),
            np.concatenate(values))


def histograms(sets: Sequence[Table], wanted) -> List[Tuple[str, int, float, np.ndarray, np.ndarray]]:
    """`(tag, step, wall_time, edges, counts)` of the histograms `wanted` accepts."""
    out = []
    for table in sets:
        if table.kind != "histograms" or not any(wanted(t) for t in table.columns):
            continue
        offset = _ROW_HEAD
        for tag, bins in zip(table.columns, table.bins):
            if wanted(tag):
                for block in table.blocks:
                    for row in block:
                        low, high = row[offset], row[offset + 1]
                        out.append((tag, int(row[0]), float(row[1]),
                                    np.linspace(low, high, bins + 1),
                                    np.array(row[offset + 2: offset + 2 + bins])))
            offset += 2 + bins
    return out


def texts(lines: Sequence[dict], wanted) -> List[Tuple[str, int, float, str]]:
    """`(tag, step, wall_time, text)` of the texts `wanted` accepts."""
    return [(t["tag"], int(t["step"]), float(t["wall_time"]), t["text"])
            for t in lines if wanted(t["tag"])]


def matcher(tag_or_regex: str):
    """`tag -> bool`: the tag itself, or a regular expression the whole tag matches."""
    pattern = re.compile(tag_or_regex)
    return lambda tag: tag == tag_or_regex or pattern.fullmatch(tag) is not None
