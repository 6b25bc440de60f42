"""`load_run`: reads a kerasdbg / TensorBoard log directory into pandas.

Built on TensorBoard's own event reading (`plugin_event_multiplexer`), which
migrates legacy summaries, understands the plugins' metadata and stops
cleanly at a truncated last record.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional

import numpy as np
import pandas as pd
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.util import tensor_util

_KINDS = {"scalars": "scalars", "histograms": "histograms", "text": "text"}


class Run:
    """The scalars, histograms and text of a log directory, as pandas.

    A log directory holds one or more runs (`train`, `validation`, ...) as
    TensorBoard sees them. Each call re-reads the files, so steps written since
    the last call appear.

    Args:
        log_dir: the directory given to the callbacks (or any TensorBoard log
            directory).

    Example:

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
        self._multiplexer = plugin_event_multiplexer.EventMultiplexer(
            size_guidance={"tensors": 0},
            tensor_size_guidance={"scalars": 0, "histograms": 0, "text": 0},
            purge_orphaned_data=False,
        )
        self._multiplexer.AddRunsFromDirectory(log_dir)

    def _reload(self) -> None:
        self._multiplexer.AddRunsFromDirectory(self.log_dir)
        self._multiplexer.Reload()

    @property
    def runs(self) -> List[str]:
        """Names of the runs (sub-directories with event files), sorted."""
        self._reload()
        return sorted(self._multiplexer.Runs())

    def _tags(self, kind: str, run: Optional[str]):
        self._reload()
        content = self._multiplexer.PluginRunToTagToContent(_KINDS[kind])
        for name, tags in sorted(content.items()):
            if run is None or name == run:
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

    def _frame(self, kind: str, tag_or_regex: str, run: Optional[str], convert):
        rows = []
        matched = [
            (name, tag)
            for name, tag in self._tags(kind, run)
            if tag == tag_or_regex or re.fullmatch(tag_or_regex, tag)
        ]
        if not matched:
            raise KeyError(
                f"load_run: no {kind} tag matches {tag_or_regex!r} in {self.log_dir!r}. "
                f"Tags: {', '.join(self.tags(kind=kind, run=run)) or '(none)'}"
            )
        for name, tag in matched:
            for event in self._multiplexer.Tensors(name, tag):
                rows.append(
                    dict(run=name, tag=tag, step=event.step, wall_time=event.wall_time,
                         **convert(tensor_util.make_ndarray(event.tensor_proto)))
                )
        return pd.DataFrame(rows).sort_values(["run", "tag", "step"], kind="stable").reset_index(drop=True)

    def scalars(self, tag_or_regex: str, run: Optional[str] = None) -> pd.DataFrame:
        """Scalar values: columns `run`, `tag`, `step`, `wall_time`, `value`.

        Args:
            tag_or_regex: a tag, or a regular expression the whole tag matches.
            run: only this run. Defaults to `None` (all runs).

        Raises:
            KeyError: when no scalar tag matches; the message lists the tags.
        """
        return self._frame("scalars", tag_or_regex, run, lambda a: {"value": float(a)})

    def histograms(self, tag_or_regex: str, run: Optional[str] = None) -> pd.DataFrame:
        """Histograms: columns `run`, `tag`, `step`, `wall_time`, `edges`, `counts`.

        `edges` has one more element than `counts` (equal-width bins).

        Raises:
            KeyError: when no histogram tag matches; the message lists the tags.
        """

        def convert(array):
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


def load_run(log_dir: str) -> Run:
    """Opens a log directory written by kerasdbg (or any TensorBoard run).

    Args:
        log_dir: the directory given to the callbacks.

    Returns:
        A `Run`.

    Raises:
        FileNotFoundError: when `log_dir` is not a directory.

    Example:

    >>> import tempfile
    >>> from kerasdbg import load_run
    >>> load_run(tempfile.mkdtemp()).runs
    []
    """
    return Run(log_dir)
