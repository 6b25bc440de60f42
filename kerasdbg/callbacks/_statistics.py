"""Shared machinery of the gradient and weight statistics callbacks."""

from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np
import pandas as pd

from kerasdbg import _engine
from kerasdbg._engine import unique_paths
from kerasdbg import _events
from kerasdbg import _keras_internals as internals
from kerasdbg.callbacks._recording import RecordingCallback, selected
from kerasdbg import _validation as check
from kerasdbg import stats as stats_lib


def trainable_float_variables(model) -> list:
    """The model's trainable floating-point variables, in model order."""
    return [v for v in model.trainable_variables if internals.is_float(v)]


def select_variables(owner: str, model, include: Optional[str], exclude: Optional[str]):
    """`(variables, paths)`: the trainable float variables whose unique path
    passes `include` / `exclude`; raises, listing the paths, if none does."""
    variables = trainable_float_variables(model)
    paths = unique_paths(variables)
    chosen = [(v, p) for v, p in zip(variables, paths) if selected(p, include, exclude)]
    if not chosen:
        raise ValueError(
            f"{owner}: no trainable float variable matches "
            f"include={include!r}, exclude={exclude!r}. "
            f"Variables: {', '.join(paths) or '(none)'}"
        )
    return [v for v, _ in chosen], [p for _, p in chosen]


class StatisticsCallback(RecordingCallback):
    """Records per-variable statistics at each optimizer step (base class).

    Subclasses set `kind` ("gradients" or "weights") and `allowed_stats`.
    """

    kind = ""
    allowed_stats: Sequence[str] = stats_lib.ALL_STATISTICS

    def __init__(
        self,
        log_dir: Optional[str] = None,
        every_n_steps: int = 1,
        histogram_every_n_steps: Optional[int] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        stats: Sequence[str] = stats_lib.STATISTICS,
        histogram_bins: int = stats_lib.DEFAULT_HISTOGRAM_BINS,
        history_size: int = 1000,
        strict: bool = False,
    ):
        super().__init__()
        owner = type(self).__name__
        self.log_dir = check.optional_path(owner, "log_dir", log_dir)
        self.every_n_steps = check.positive_int(owner, "every_n_steps", every_n_steps)
        self.histogram_every_n_steps = check.optional_positive_int(
            owner, "histogram_every_n_steps", histogram_every_n_steps
        )
        self.include = check.optional_regex(owner, "include", include)
        self.exclude = check.optional_regex(owner, "exclude", exclude)
        self.stats = check.choices(owner, "stats", stats, self.allowed_stats)
        self.histogram_bins = check.positive_int(owner, "histogram_bins", histogram_bins)
        self.history_size = check.non_negative_int(owner, "history_size", history_size)
        self.strict = check.boolean(owner, "strict", strict)
        self._request: Optional[_engine.Request] = None
        self._rows: collections.deque = collections.deque(maxlen=history_size)
        self._writer: Optional[_events.EventWriter] = None
        self._failed = False
        self._skipped = 0

    # ------------------------------------------------------------ config
    def get_config(self) -> dict:
        return {
            "log_dir": self.log_dir,
            "every_n_steps": self.every_n_steps,
            "histogram_every_n_steps": self.histogram_every_n_steps,
            "include": self.include,
            "exclude": self.exclude,
            "stats": list(self.stats),
            "histogram_bins": self.histogram_bins,
            "history_size": self.history_size,
            "strict": self.strict,
        }

    # ------------------------------------------------------- selection
    def _select(self, model):
        return select_variables(type(self).__name__, model, self.include, self.exclude)

    # --------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        self._rows.clear()
        self._failed = False
        self._skipped = 0
        variables, paths = self._select(self.model)
        self._request = _engine.Request(
            kind=self.kind,
            variables=variables,
            paths=paths,
            stats=self.stats,
            every_n_steps=self.every_n_steps,
            histogram_every_n_steps=self.histogram_every_n_steps,
            consumer=self._consume,
            bins=self.histogram_bins,
            strict=self.strict,
        )
        self._writer = self._open_writer()
        _engine.engine_for(self.model).attach(self._request)

    def on_train_batch_begin(self, batch, logs=None):
        _engine.engine_for(self.model).prepare()

    def on_train_batch_end(self, batch, logs=None):
        _engine.engine_for(self.model).collect()

    def on_epoch_end(self, epoch, logs=None):
        _engine.engine_for(self.model).collect()
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._request is not None:
            _engine.engine_for(self.model).detach(self._request)
        if self._writer is not None:
            self._writer.flush()

    # -------------------------------------------------------- records
    def _consume(self, records: List[_engine.Record]) -> None:
        self._guarded(self._write, records)

    def _write(self, records: List[_engine.Record]) -> None:
        request = self._request
        tags = request.tags()
        loss_scaled = isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)
        for record in records:
            if record.skipped:
                self._skipped += 1
            if record.values is not None or record.skipped:
                if self.history_size:
                    self._rows.append((record.step, record.skipped, record.values))
            if self._writer is None or record.skipped:
                continue
            scalars = {}
            if record.values is not None:
                scalars = {
                    tag: value for tag, value in zip(tags, record.values) if tag is not None
                }
                if loss_scaled and self.kind == "gradients":
                    scalars[f"{self.kind}/skipped_updates"] = self._skipped
            histograms = {}
            if record.histograms is not None:
                counts, ranges = record.histograms
                for i, path in enumerate(request.paths):
                    if request.present[i] and np.all(np.isfinite(ranges[i])):
                        histograms[f"{self.kind}/{path}"] = (counts[i], *ranges[i])
            self._writer.write(record.step, scalars, histograms)

    # --------------------------------------------------------- results
    @property
    def history(self) -> pd.DataFrame:
        """The latest recorded steps (at most `history_size`), one row each.

        Columns: `step`, `skipped`, then `<variable path>/<stat>` (and
        `global_norm` for gradients). Steps the loss scaler skipped have
        `skipped=True` and NaN gradient statistics.
        """
        columns = self._request.columns if self._request is not None else []
        width = len(columns)
        steps = [r[0] for r in self._rows]
        skipped = [r[1] for r in self._rows]
        values = np.array(
            [r[2] if r[2] is not None else np.full(width, np.nan) for r in self._rows]
        ).reshape(len(self._rows), width)
        frame = pd.DataFrame(values, columns=columns)
        frame.insert(0, "skipped", skipped)
        frame.insert(0, "step", np.array(steps, dtype=np.int64))
        return frame

    @property
    def latest(self) -> Dict[str, float]:
        """The last recorded step as `{"step": ..., "<path>/<stat>": ...}`."""
        for step, _, values in reversed(self._rows):
            if values is not None:
                latest = {"step": step}
                latest.update(zip(self._request.columns, values.tolist()))
                return latest
        return {}
