"""`load_run`: reads a kerasdbg / TensorBoard log directory into pandas.

An event file that kerasdbg wrote has an analysis store beside it
(`kerasdbg.sinks.store`): fixed-width rows per set of tags, read through a memory
map, column by column, so a query reads only what it asks for. The store is
an index, written at each flush of the event writer: the steps the event
file holds beyond it (a process killed between two flushes, a fit still
running) are read from the event file's tail (`kerasdbg.sinks.event_tail`), so
every step the event file holds is read, wherever the process died. Every
other event file (TensorBoard's own callback, runs written before the store
existed) is read with TensorBoard's own event reading
(`plugin_event_accumulator`), which migrates legacy summaries, understands the
plugins' metadata and stops cleanly at a truncated last record.
"""

from __future__ import annotations

import bisect
import difflib
import heapq
import os
import re
from typing import Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import pandas as pd
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.util import tensor_util

from kerasdbg.records.tags import statistic_of, tensor_name
from kerasdbg.sinks import store as _store
from kerasdbg.sinks.event_tail import EventSource

_KINDS = {"scalars": "scalars", "histograms": "histograms", "text": "text"}
REDUCTIONS = ("mean", "std", "min", "max", "l2_norm", "norm")
"""What `Tensor.reduction` can return, from the recorded statistics."""


class Run:
    """The scalars, histograms and text of a log directory, as pandas.

    A log directory holds one or more runs (`train`, `validation`, ...) as
    TensorBoard sees them. Each call re-reads the files, so steps written since
    the last call appear: every step the event files hold, also those of a
    fit still running or of a process killed before its last flush.

    Args:
        log_dir: the directory given to the callbacks (or any TensorBoard log
            directory).

    Examples:
        >>> import keras, numpy as np, tempfile
        >>> from kerasdbg import load_run
        >>> from kerasdbg.callbacks import GradientStatistics
        >>> log_dir = tempfile.mkdtemp()
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")],
        ...                          name="model")
        >>> model.compile("sgd", "mse")
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, epochs=1,
        ...               verbose=0, callbacks=[GradientStatistics(log_dir)])
        >>> run = load_run(log_dir)
        >>> run.scalars("gradients/global_norm")["step"].tolist()
        [1, 2]
    """

    def __init__(self, log_dir: str):
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "load_run: `log_dir` must be a str or os.PathLike. "
                f"Received: log_dir={log_dir!r} of type {type(log_dir).__name__}"
            )
        log_dir = os.fspath(log_dir)
        if not os.path.isdir(log_dir):
            raise FileNotFoundError(
                f"load_run: `log_dir` is not a directory. Received: log_dir={log_dir!r}"
            )
        self.log_dir = log_dir
        self._dropped: Dict[tuple, set] = {}
        self._accumulators: Dict[str, plugin_event_accumulator.EventAccumulator] = {}
        self._event_sources: Dict[str, EventSource] = {}

    def _sources(self) -> Dict[str, Tuple[List[EventSource], List[str]]]:
        """run name -> (event files with a store, other event files), as
        TensorBoard names runs (a directory holding event files, by its path
        relative to `log_dir`); the former refreshed (their tails read)."""
        runs: Dict[str, Tuple[List[EventSource], List[str]]] = {}
        seen = set()
        # Symbolic links followed, as TensorBoard does (once each: no cycle).
        for directory, subdirectories, files in os.walk(self.log_dir, followlinks=True):
            real = os.path.realpath(directory)
            if real in seen:
                subdirectories[:] = []
                continue
            seen.add(real)
            subdirectories[:] = sorted(d for d in subdirectories if d != _store.DIRECTORY)
            events = sorted(f for f in files if _is_events_file(f))
            if not events:
                continue
            stores, others = [], []
            for name in events:
                path = os.path.join(directory, name)
                store = _store.store_path(path)
                if _store.usable(store):
                    stores.append(self._event_source(path, store))
                else:  # no store, or one of a later version or half removed
                    others.append(path)
            runs[os.path.relpath(directory, self.log_dir)] = (stores, others)
        return runs

    def _event_source(self, path: str, store: str) -> EventSource:
        """An event file and its store, with what the event file gained since
        the last call read."""
        source = self._event_sources.get(path)
        if source is None or source.store != store:
            source = self._event_sources[path] = EventSource(path, store)
        source.refresh()
        return source

    def _accumulator(self, path: str) -> plugin_event_accumulator.EventAccumulator:
        """TensorBoard's reader of one event file, reloaded (it reads what was
        appended since the last call)."""
        accumulator = self._accumulators.get(path)
        if accumulator is None:
            accumulator = self._accumulators[path] = plugin_event_accumulator.EventAccumulator(
                path, size_guidance={"tensors": 0},
                tensor_size_guidance={"scalars": 0, "histograms": 0, "text": 0},
                purge_orphaned_data=False)
        accumulator.Reload()
        return accumulator

    @property
    def runs(self) -> List[str]:
        """Names of the runs (sub-directories with event files), sorted."""
        return sorted(self._sources())

    def _selected(self, run: Optional[str]):
        for name, (stores, others) in sorted(self._sources().items()):
            if run is None or name == run:
                yield name, stores, others

    def _tags(self, kind: str, run: Optional[str]):
        for name, stores, others in self._selected(run):
            tags = set()
            for source in stores:
                tags.update(_store.tags(source.tables() if kind != "text" else [],
                                        source.text_lines() if kind == "text" else [], kind))
            for path in others:
                tags.update(_plugin_tags(self._accumulator(path), kind))
            for tag in sorted(tags):
                yield name, tag

    def tags(self, pattern: Optional[str] = None, kind: str = "scalars",
             run: Optional[str] = None) -> List[str]:
        """Tags of `kind` ("scalars", "histograms" or "text"), sorted.

        Args:
            pattern: keep the tags this regular expression matches (by
                `re.search`). Defaults to `None` (all).
            kind: which plugin's tags. Defaults to `"scalars"`.
            run: only this run. Defaults to `None` (all runs).
        """
        if kind not in _KINDS:
            raise ValueError(
                f"Run.tags: `kind` must be one of {', '.join(_KINDS)}. "
                f"Received: kind={kind!r}"
            )
        tags = {t for _, t in self._tags(kind, run)}
        if pattern is not None:
            tags = {t for t in tags if re.search(pattern, t)}
        return sorted(tags)

    def _events(self, name: str, tag: str) -> List[Tuple[int, float]]:
        """`(step, wall_time)` of one tag's writes, in the order they were
        written, without those a rollback abandoned (see `_keep_latest`); the
        drops are kept for `rollbacks`."""
        written = []
        for run, stores, others in self._selected(name):
            for kind in ("scalars", "histograms", "text"):
                for row in self._read(kind, stores, others, lambda t: t == tag):
                    written.append((int(row[1]), float(row[2])))
        written.sort(key=_written_order)
        return self._abandon(name, written)

    def _abandon(self, name: str, written: List[Tuple[int, float]]) -> List[Tuple[int, float]]:
        """The `(step, wall_time)` writes (in wall-time order) that no later
        write abandoned; a write at a step below an earlier one records the
        abandoned steps for `rollbacks`."""
        kept: List[Tuple[int, float]] = []
        steps: List[int] = []  # of `kept`, increasing
        for event in written:
            if steps and event[0] <= steps[-1]:
                cut = bisect.bisect_left(steps, event[0])
                if steps[-1] > event[0]:
                    self._dropped.setdefault((name, event[0]), set()).update(steps[cut:])
                del kept[cut:], steps[cut:]
            kept.append(event)
            steps.append(event[0])
        return kept

    def _read(self, kind: str, stores: List[EventSource], others: List[str], wanted) -> list:
        """`(tag, step, wall_time, value)` rows of `kind` from stores and
        event files: value a float, `(edges, counts)` or a text."""
        rows: list = []
        for source in stores:
            if kind == "scalars":
                tags, steps, walls, values = _store.scalars(source.tables(), wanted)
                rows += zip(tags, steps.astype(np.int64), walls, values)
            elif kind == "histograms":
                rows += [(t, s, w, (e, c))
                         for t, s, w, e, c in _store.histograms(source.tables(), wanted)]
            else:
                rows += _store.texts(source.text_lines(), wanted)
        for path in others:
            accumulator = self._accumulator(path)
            for tag in _plugin_tags(accumulator, kind):
                if wanted(tag):
                    rows += [(tag, int(e.step), float(e.wall_time),
                              tensor_util.make_ndarray(e.tensor_proto))
                             for e in accumulator.Tensors(tag)]
        return rows

    def rollbacks(self, run: Optional[str] = "train") -> pd.DataFrame:
        """Where training was rolled back and resumed (e.g. by
        `keras.callbacks.BackupAndRestore` after a crash): one row per restart,
        columns `run`, `step` (the first step written again) and `dropped`
        (the abandoned steps, from `step` on, that the reader leaves out).

        Examples:
            >>> import os, tempfile
            >>> from kerasdbg import load_run
            >>> from kerasdbg.sinks import events as _events
            >>> log_dir = tempfile.mkdtemp()
            >>> writer = _events.EventWriter(os.path.join(log_dir, "train"))
            >>> for step, value in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0)]:
            ...     writer.write(step, {"step/loss": value})
            >>> writer.flush()
            >>> run = load_run(log_dir)
            >>> run.scalars("step/loss")[["step", "value"]].values.tolist()
            [[1.0, 1.0], [2.0, 20.0], [3.0, 30.0]]
            >>> run.rollbacks().to_dict("records")
            [{'run': 'train', 'step': 2, 'dropped': [2, 3]}]
        """
        self._dropped = {}
        for name, stores, others in self._selected(run):
            # The tags of a store that were written in the same sets share their steps.
            shared: Dict[str, list] = {}
            for source in stores:
                for kind, tags, steps, walls in _store.sequences(source.tables(),
                                                                 source.text_lines()):
                    for tag in tags:
                        shared.setdefault((kind, tag), []).append((steps, walls))
            groups: Dict[tuple, list] = {}
            for key, parts in shared.items():
                groups.setdefault(tuple(id(p[0]) for p in parts), parts)
            for parts in groups.values():
                written = sorted(((int(s), float(w)) for steps, walls in parts
                                  for s, w in zip(steps, walls)), key=_written_order)
                self._abandon(name, written)
            for kind in _KINDS:
                for path in others:
                    accumulator = self._accumulator(path)
                    for tag in _plugin_tags(accumulator, kind):
                        written = sorted(((int(e.step), float(e.wall_time))
                                          for e in accumulator.Tensors(tag)), key=_written_order)
                        self._abandon(name, written)
        rows = [{"run": name, "step": step, "dropped": sorted(steps)}
                for (name, step), steps in sorted(self._dropped.items())]
        return pd.DataFrame(rows, columns=["run", "step", "dropped"])

    def _frame(self, kind: str, tag_or_regex: str, run: Optional[str], convert):
        wanted = _store.matcher(tag_or_regex)
        frames = []
        for name, stores, others in self._selected(run):
            if kind == "scalars":
                frames.append(self._scalar_frame(name, stores, others, wanted))
                continue
            rows = [dict(run=name, tag=tag, step=step, wall_time=wall, **convert(value))
                    for tag, step, wall, value in self._read(kind, stores, others, wanted)]
            if rows:
                frames.append(_keep_latest(pd.DataFrame(rows)))
        frames = [f for f in frames if len(f)]
        if not frames:
            raise KeyError(
                f"load_run: no {kind} tag matches {tag_or_regex!r} in {self.log_dir!r}. "
                + _tags_said(tag_or_regex, self.tags(kind=kind, run=run), kind)
            )
        frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        return frame.sort_values(["run", "tag", "step"], kind="stable").reset_index(drop=True)

    def _scalar_frame(self, name: str, stores: List[EventSource], others: List[str],
                      wanted) -> pd.DataFrame:
        """The scalars of one run, column arrays from the stores (no row objects)."""
        parts = []
        for source in stores:
            tags, steps, walls, values = _store.scalars(source.tables(), wanted)
            if len(tags):
                parts.append(pd.DataFrame({"tag": tags, "step": steps.astype(np.int64),
                                           "wall_time": walls, "value": values}))
        rows = self._read("scalars", [], others, wanted)
        if rows:
            tags, steps, walls, values = zip(*rows)
            parts.append(pd.DataFrame({"tag": list(tags), "step": np.array(steps, np.int64),
                                       "wall_time": np.array(walls, np.float64),
                                       "value": np.array([float(v) for v in values])}))
        if not parts:
            return pd.DataFrame()
        frame = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
        frame.insert(0, "run", name)
        return _keep_latest(frame)

    def scalars(self, tag_or_regex: str, run: Optional[str] = None) -> pd.DataFrame:
        """Scalar values: columns `run`, `tag`, `step`, `wall_time`, `value`.

        Args:
            tag_or_regex: a tag, or a regular expression the whole tag matches.
            run: only this run. Defaults to `None` (all runs).

        Raises:
            KeyError: when no scalar tag matches; the message lists the tags.
        """
        return self._frame("scalars", tag_or_regex, run, lambda a: {"value": float(a)})

    def _records(self, run: Optional[str]) -> Iterator[Tuple[int, Dict[str, float]]]:
        """`(step, {tag: value})` for every step of the scalars, in step order
        and tag order, one step in memory at a time for the stores: what
        `check_run` feeds the rules. The same values as `scalars(".*")`: a
        rollback keeps the later writes (per set of tags written together)."""
        streams = []
        for name, stores, others in self._selected(run):
            for source in stores:
                for table in source.tables():
                    if table.kind == "scalars" and table.rows:
                        keep = _kept(table.column(0))
                        streams.append(_set_records(table, np.flatnonzero(keep)))
            rows = self._read("scalars", [], others, lambda t: True)
            if rows:
                frame = _keep_latest(pd.DataFrame({
                    "tag": [r[0] for r in rows], "step": [int(r[1]) for r in rows],
                    "wall_time": [r[2] for r in rows], "value": [float(r[3]) for r in rows]}))
                streams.append(((int(step), dict(zip(group.tag, group.value)))
                                for step, group in frame.groupby("step", sort=True)))
        step, record = None, {}
        for at, values in heapq.merge(*streams, key=lambda item: item[0]):
            if at != step and step is not None:
                yield step, dict(sorted(record.items()))
                record = {}
            step = at
            record.update(values)
        if step is not None:
            yield step, dict(sorted(record.items()))

    def scalar_table(self, tag_or_regex: str, run: Optional[str] = None) -> pd.DataFrame:
        """The scalars as a table: one row per step, one column per tag (the
        last value where a step was written twice; NaN where a tag was not
        written at a step, and where NaN was written).

        Raises:
            KeyError: when no scalar tag matches; the message lists the tags.

        Examples:
            >>> import os, tempfile
            >>> from kerasdbg import load_run
            >>> from kerasdbg.sinks import events as _events
            >>> log_dir = tempfile.mkdtemp()
            >>> writer = _events.EventWriter(os.path.join(log_dir, "train"))
            >>> for step in (1, 2):
            ...     writer.write(step, {"a/x": step * 1.0, "a/y": -step * 1.0})
            >>> writer.flush()
            >>> load_run(log_dir).scalar_table("a/.*").to_dict("list")
            {'a/x': [1.0, 2.0], 'a/y': [-1.0, -2.0]}
        """
        # `pivot`, not `pivot_table`: the latter drops NaN values, and a NaN loss
        # is exactly what a debugging table must keep.
        table = self._last_scalars(tag_or_regex, run).pivot(
            index="step", columns="tag", values="value")
        table.columns.name = None
        return table

    def _last_scalars(self, tag_or_regex: str, run: Optional[str]) -> pd.DataFrame:
        """`scalars`, which keeps the last value where a step of a tag was
        written twice (`_keep_latest`)."""
        return self.scalars(tag_or_regex, run=run)

    def steps(self, tag: str, run: Optional[str] = "train") -> List[int]:
        """The steps at which a scalar (or else histogram) tag was recorded.

        Args:
            tag: the exact tag, e.g. `"gradients/global_norm"`.
            run: the run to read. Defaults to `"train"`; None for all runs.

        Raises:
            KeyError: when the tag is in neither; the message lists the tags.
        """
        for kind in ("scalars", "histograms"):
            if any(t == tag for _, t in self._tags(kind, run)):
                return sorted({e[0] for name, t in self._tags(kind, run) if t == tag
                               for e in self._events(name, t)})
        raise KeyError(
            f"Run.steps: no scalar or histogram tag {tag!r} in run {run!r} of "
            f"{self.log_dir!r}. " + _tags_said(tag, self.tags(run=run), "scalars")
        )

    def tensor(self, name: str, run: Optional[str] = "train") -> "Tensor":
        """One recorded tensor (or scalar), smdebug-style: `.steps()`,
        `.value(step)`, `.values()`, `.reduction(step, "mean", abs=False)`.

        Args:
            name: `<collection>/<tensor>` (e.g. `"gradients/model/dense/kernel"`,
                `"activations/dense_tap"`), whose statistics are the tags
                `<name>/<statistic>`; or a scalar tag (`"step/loss"`,
                `"gradients/global_norm"`).
            run: the run to read. Defaults to `"train"`.

        Raises:
            KeyError: when nothing was recorded under `name`; the message
                lists the tensors that were.
        """
        return Tensor(self, name, run)

    def tensor_names(self, pattern: Optional[str] = None, run: Optional[str] = "train") -> List[str]:
        """Names `tensor()` takes: `<collection>/<tensor>` of the per-tensor
        statistics, and the plain scalar tags, sorted.

        Args:
            pattern: keep the names this regular expression matches (by
                `re.search`). Defaults to `None` (all).
            run: the run to read. Defaults to `"train"`.

        Examples:
            >>> import os, tempfile
            >>> from kerasdbg import load_run
            >>> from kerasdbg.sinks import events as _events
            >>> log_dir = tempfile.mkdtemp()
            >>> writer = _events.EventWriter(os.path.join(log_dir, "train"))
            >>> writer.write(1, {"gradients/m/d/kernel/mean": 0.5, "gradients/m/d/kernel/max": 2.0,
            ...                  "gradients/global_norm": 3.0, "step/loss": 0.25})
            >>> writer.flush()
            >>> run = load_run(log_dir)
            >>> run.tensor_names()
            ['gradients/global_norm', 'gradients/m/d/kernel', 'step/loss']
            >>> run.steps("step/loss")
            [1]
        """
        names = {tensor_name(tag) for tag in self.tags(run=run)}
        names.update(self.tags(kind="histograms", run=run))
        if pattern is not None:
            names = {n for n in names if re.search(pattern, n)}
        return sorted(names)

    def histograms(self, tag_or_regex: str, run: Optional[str] = None) -> pd.DataFrame:
        """Histograms: columns `run`, `tag`, `step`, `wall_time`, `edges`, `counts`.

        `edges` has one more element than `counts` (equal-width bins).

        Raises:
            KeyError: when no histogram tag matches; the message lists the tags.
        """

        def convert(array):
            if isinstance(array, tuple):  # from a store: (edges, counts)
                return {"edges": np.asarray(array[0]), "counts": np.asarray(array[1])}
            array = np.asarray(array, dtype=np.float64).reshape(-1, 3)
            edges = np.append(array[:, 0], array[-1, 1]) if len(array) else np.zeros(0)
            return {"edges": edges, "counts": array[:, 2]}

        return self._frame("histograms", tag_or_regex, run, convert)

    def texts(self, tag_or_regex: str, run: Optional[str] = None) -> pd.DataFrame:
        """Text summaries (e.g. `StopOnRule`'s `rules/verdicts`): columns `run`,
        `tag`, `step`, `wall_time`, `text` (markdown).

        Raises:
            KeyError: when no text tag matches; the message lists the tags.
        """

        def convert(array):
            value = np.asarray(array).reshape(-1)[0] if np.size(array) else b""
            return {"text": value.decode("utf-8") if isinstance(value, bytes) else str(value)}

        return self._frame("text", tag_or_regex, run, convert)


def _is_events_file(name: str) -> bool:
    """TensorBoard's test of an event file name (`io_wrapper.IsSummaryEventsFile`),
    without the TensorFlow import (seconds) that its `tf.compat.as_str_any` costs."""
    return "tfevents" in name and not name.endswith(".profile-empty")


def _set_records(table: _store.Table, kept: np.ndarray):
    """`(step, {tag: value})` of the kept rows (indices, increasing) of one
    store set, in order."""
    start = 0
    for block in table.blocks:
        for index in kept[(kept >= start) & (kept < start + len(block))]:
            row = block[index - start].tolist()
            yield int(row[0]), dict(zip(table.columns, row[2:]))
        start += len(block)


def _plugin_tags(accumulator, kind: str) -> List[str]:
    """The tags of one plugin in an event file (none when it has no such data)."""
    try:
        return list(accumulator.PluginTagToContent(_KINDS[kind]))
    except KeyError:
        return []


def _keep_latest(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of each (run, tag) that no later write abandoned, in the order
    they were written (by wall time): a write at a step at or below an
    earlier one (a run resumed from a backup, e.g. `BackupAndRestore`, or a
    step written twice) drops the earlier writes from that step on, as
    TensorBoard purges orphaned data."""
    if not len(frame):
        return frame
    frame = frame.sort_values(["tag", "wall_time", "step"], kind="stable")
    tags = frame["tag"].to_numpy()
    bounds = np.flatnonzero(tags[1:] != tags[:-1]) + 1
    keep = np.concatenate([_kept(part) for part in np.split(frame["step"].to_numpy(), bounds)])
    return frame[keep]


def _written_order(write: Tuple[int, float]) -> Tuple[float, int]:
    """The order of a tag's `(step, wall_time)` writes: by wall time, and
    where two share one, by step. kerasdbg's writer gives every row its own
    wall time; files of earlier versions gave a read's rows one, and spread
    a tag over several tag sets (e.g. the full statistics at a scheduled
    step beside the every-step set): their steps, in one read, are in step
    order."""
    return write[1], write[0]


def _kept(steps: np.ndarray) -> np.ndarray:
    """Which of one tag's writes (steps in the order written) no later write
    abandoned: those whose step is below every later one's."""
    later = np.minimum.accumulate(steps[::-1])[::-1]
    return np.append(steps[:-1] < later[1:], True)


class Tensor:
    """The recorded statistics of one tensor across steps (see `Run.tensor`).

    kerasdbg records statistics (and histograms) of a tensor, not the tensor
    itself: `value(step)` is a dict of those statistics, or a float for a
    scalar tag.

    Examples:
        >>> import keras, numpy as np, tempfile
        >>> from kerasdbg import load_run
        >>> from kerasdbg.callbacks import GradientStatistics
        >>> log_dir = tempfile.mkdtemp()
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")], name="m")
        >>> model.compile("sgd", "mse")
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, epochs=1, verbose=0,
        ...               callbacks=[GradientStatistics(log_dir, stats=["min", "max"])])
        >>> kernel = load_run(log_dir).tensor("gradients/m/d/kernel")
        >>> kernel.steps()
        [1, 2]
        >>> sorted(kernel.value(1))
        ['max', 'min']
        >>> kernel.reduction(1, "max", abs=True) == max(abs(kernel.value(1)["min"]),
        ...                                             abs(kernel.value(1)["max"]))
        True
    """

    def __init__(self, run: Run, name: str, run_name: Optional[str]):
        self.name = name
        self._run = run
        self._run_name = run_name
        tags = run.tags(run=run_name)
        self._scalar = name in tags
        self.statistics = [s for s in (statistic_of(name, t) for t in tags)
                           if s is not None]
        self._histogram = name in run.tags(kind="histograms", run=run_name)
        if not (self._scalar or self.statistics or self._histogram):
            raise KeyError(
                f"Run.tensor: nothing recorded under {name!r} in run {run_name!r} of "
                f"{run.log_dir!r}. Tensors: {', '.join(run.tensor_names(run=run_name)) or '(none)'}"
            )

    def _rows(self) -> pd.DataFrame:
        """The written scalars (the last per step and tag): run.scalars's long
        form, so that a NaN that was written is told from a value never written."""
        if self._scalar:
            pattern = re.escape(self.name)
        elif self.statistics:
            pattern = re.escape(self.name) + "/(" + "|".join(map(re.escape, self.statistics)) + ")"
        else:
            return pd.DataFrame(columns=["step", "tag", "value"])
        return self._run._last_scalars(pattern, self._run_name).sort_values("step", kind="stable")

    def steps(self) -> List[int]:
        """The steps with a recorded value (or, without statistics, histogram)."""
        rows = self._rows()
        if len(rows):
            return sorted(int(s) for s in rows.step.unique())
        return self._run.steps(self.name, run=self._run_name)

    def value(self, step: int) -> Union[float, Dict[str, float]]:
        """The scalar at `step`, or the dict statistic -> value of a tensor
        (NaN where NaN was recorded, e.g. the mean of a gradient that is all NaN).

        Raises:
            KeyError: when `step` was not recorded; the message lists the steps.
        """
        rows = self._rows()
        at = rows[rows.step == step]
        if not len(at):
            steps = sorted(int(s) for s in rows.step.unique())
            raise KeyError(
                f"Tensor {self.name!r}: step {step!r} was not recorded. Steps: "
                f"{', '.join(map(str, steps[:20]))}" + (" ..." if len(steps) > 20 else "")
            )
        return self._value(at)

    def _value(self, rows: pd.DataFrame):
        if self._scalar:
            return float(rows.value.iloc[-1])
        return {tag[len(self.name) + 1:]: float(value) for tag, value in zip(rows.tag, rows.value)}

    def values(self) -> Dict[int, Union[float, Dict[str, float]]]:
        """`{step: value(step)}` for every recorded step (one read)."""
        return {int(step): self._value(rows) for step, rows in self._rows().groupby("step")}

    def reduction(self, step: int, name: str = "mean", abs: bool = False) -> float:
        """A reduction of the tensor at `step`, from its recorded statistics.

        Args:
            step: the step.
            name: one of `REDUCTIONS` ("norm" is "l2_norm").
            abs: of the absolute values: "mean" reads `mean_abs`, "max" the
                larger of |min| and |max|, "l2_norm" is unchanged; "min" and
                "std" of |x| cannot be derived and are refused.

        Raises:
            ValueError: for an unknown or underivable reduction.
            KeyError: when the statistics it needs were not recorded.
        """
        if name not in REDUCTIONS:
            raise ValueError(
                f"Tensor.reduction: `name` must be one of {', '.join(REDUCTIONS)}. "
                f"Received: name={name!r}"
            )
        name = "l2_norm" if name == "norm" else name
        if abs and name in ("min", "std"):
            raise ValueError(
                f"Tensor.reduction: the {name} of |x| is not derivable from the recorded "
                f"statistics. Received: name={name!r}, abs=True"
            )
        value = self.value(step)
        if self._scalar:
            return float(np.abs(value)) if abs else float(value)
        needed = {"mean": ["mean_abs"], "max": ["min", "max"]}.get(name, [name]) if abs else [name]
        missing = [s for s in needed if s not in value]
        if missing:
            raise KeyError(
                f"Tensor {self.name!r}: reduction {name!r} (abs={abs}) needs the statistics "
                f"{', '.join(missing)}, not recorded at step {step}. Recorded: "
                f"{', '.join(sorted(value)) or '(none)'}"
            )
        if abs and name == "max":
            return float(max(np.abs(value["min"]), np.abs(value["max"])))
        return float(value[needed[0]])

    def histogram(self, step: int):
        """`(edges, counts)` of the histogram recorded at `step`.

        Raises:
            KeyError: when no histogram was recorded at `step`.
        """
        frame = self._run.histograms(re.escape(self.name), run=self._run_name) \
            if self._histogram else pd.DataFrame(columns=["step"])
        rows = frame[frame["step"] == step]
        if not len(rows):
            raise KeyError(f"Tensor {self.name!r}: no histogram recorded at step {step!r}")
        return rows.iloc[-1]["edges"], rows.iloc[-1]["counts"]

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, statistics={self.statistics})"


TAGS_LISTED = 10
"""A missing tag's error lists every tag up to this many; beyond, the closest."""


def _tags_said(wanted: str, tags: List[str], kind: str) -> str:
    """What a missing tag's error says of the run's tags: all of them, when
    few; else the closest few to `wanted` (by their text, then by their last
    parts: a statistic under another variable) and how to list the rest.

    Examples:
        >>> from kerasdbg.reader import _tags_said
        >>> _tags_said("step/los", ["epoch/loss", "step/loss"], "scalars")
        'Tags: epoch/loss, step/loss'
        >>> tags = [f"gradients/m/dense_{i}/kernel/{s}" for i in range(9) for s in ("l2_norm", "max")]
        >>> print(_tags_said("gradients/m/dense_3/kernal/l2_norm", tags, "scalars"))
        18 tags; the closest: gradients/m/dense_3/kernel/l2_norm, gradients/m/dense_8/kernel/l2_norm, gradients/m/dense_7/kernel/l2_norm, ... List them with run.tags(kind='scalars'), or those a regular expression finds with run.tags(r'l2_norm')
    """
    if not tags:
        return "Tags: (none)"
    if len(tags) <= TAGS_LISTED:
        return "Tags: " + ", ".join(tags)
    closest = difflib.get_close_matches(wanted, tags, n=3, cutoff=0.6)
    if not closest:  # the tail alike (the statistic), the head not
        tail = "/".join(wanted.split("/")[-2:])
        closest = difflib.get_close_matches(tail, ["/".join(t.split("/")[-2:]) for t in tags],
                                            n=1, cutoff=0.6)
        closest = [t for t in tags if "/".join(t.split("/")[-2:]) in closest][:3]
    parts = [p for p in re.split(r"[/^$.*+?()\[\]\\|]", wanted) if p]
    hint = parts[-1] if parts else "loss"
    return (f"{len(tags)} tags; " + (f"the closest: {', '.join(closest)}, ... " if closest
                                     else "none close to it. ")
            + f"List them with run.tags(kind='{kind}'), or those a regular expression finds "
            f"with run.tags(r'{hint}')")


def load_run(log_dir: str) -> Run:
    """Opens a log directory written by kerasdbg (or any TensorBoard run).

    Args:
        log_dir: the directory given to the callbacks.

    Returns:
        A `Run`.

    Raises:
        FileNotFoundError: when `log_dir` is not a directory.

    Examples:
        >>> import tempfile
        >>> from kerasdbg import load_run
        >>> load_run(tempfile.mkdtemp()).runs
        []
    """
    return Run(log_dir)
