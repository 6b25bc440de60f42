"""`ActivationStatistics`: writes what the model's `TapLayer`s record."""

from __future__ import annotations

import collections
import warnings
from typing import Dict, List, Optional

import keras
import pandas as pd

from kerasdbg.sinks import events as _events
from kerasdbg import capture as _capture
from kerasdbg.sinks import layout as _layout
from kerasdbg.records import tags as _tags
from kerasdbg import _validation as check
from kerasdbg.callbacks._executions import AfterEachExecution
from kerasdbg.callbacks._recording import RecordingCallback, release_writer, selected
from kerasdbg.layers._debug_layer import layer_sink
from kerasdbg.layers.tap_layer import TapLayer


def find_taps(model) -> List[TapLayer]:
    """Every `TapLayer` of `model`, nested models included, in layer order."""
    taps, stack = [], list(reversed(getattr(model, "layers", [])))
    while stack:
        layer = stack.pop()
        if isinstance(layer, TapLayer):
            taps.extend(layer.parts.values() or [layer])  # a tap per tensor of a structure
        elif isinstance(layer, keras.Model):
            stack.extend(reversed(layer.layers))
    return taps


def _layer_sink():
    """The debug layers' host side on Keras's backend, imported on use."""
    return layer_sink()


class ActivationStatistics(AfterEachExecution, RecordingCallback):
    """Writes the statistics of the model's `TapLayer`s to TensorBoard.

    Each tap records in-graph at its own `every_n_steps`; this callback reads
    the records after each execution and writes, at the optimizer step of each
    record, `activations/<tap name>/<stat>` scalars (the tap's statistics and
    its `dead_fraction` / `saturated_fraction`) and, for taps with
    `histogram=True`, `activations/<tap name>` histograms, under
    `<log_dir>/train`.

    Args:
        log_dir: TensorBoard log directory, or None to keep the records in
            Python only. Defaults to `None`.
        include: regular expression on tap names; only the taps it matches.
            Defaults to `None` (all).
        exclude: regular expression on tap names to leave out. Defaults to
            `None`.
        history_size: recorded steps `history` keeps. Defaults to `1000`.
        strict: raise, instead of warning and going on, when writing fails.
            Defaults to `False`.

    A model with no matching tap, or whose train step calls none of them (a
    custom `train_step` that calls sub-models without taps), trains on with a
    warning that says so (`strict=True` raises a `ValueError` instead).

    Examples:
        >>> import keras, numpy as np
        >>> from kerasdbg.callbacks import ActivationStatistics
        >>> from kerasdbg.layers import TapLayer
        >>> inputs = keras.Input((2,))
        >>> hidden = keras.layers.Dense(3, activation="relu", name="dense")(inputs)
        >>> tapped = TapLayer(stats=["mean"], activation="relu", name="dense_tap")(hidden)
        >>> model = keras.Model(inputs, keras.layers.Dense(1, name="out")(tapped))
        >>> model.compile("sgd", "mse")
        >>> callback = ActivationStatistics()
        >>> _ = model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=2, verbose=0,
        ...               callbacks=[callback])
        >>> list(callback.history.columns)
        ['step', 'dense_tap/mean', 'dense_tap/dead_fraction']
        >>> callback.history.step.tolist()
        [1, 2]
    """

    def __init__(
        self,
        log_dir: Optional[str] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        history_size: int = 1000,
        strict: bool = False,
    ):
        super().__init__()
        owner = type(self).__name__
        _capture.supported(owner, "taps")
        self.log_dir = check.log_dir(owner, "log_dir", log_dir)
        self.include = check.optional_regex(owner, "include", include)
        self.exclude = check.optional_regex(owner, "exclude", exclude)
        self.history_size = check.non_negative_int(owner, "history_size", history_size)
        self.strict = check.boolean(owner, "strict", strict)
        self._taps: List[TapLayer] = []
        self._steps: "collections.OrderedDict[int, Dict[str, float]]" = collections.OrderedDict()
        # step -> the taps' health fractions written at it, for the views
        # across taps (written once every tap's rows of the step are in).
        self._pending: Dict[int, Dict[str, float]] = {}
        self._writer: Optional[_events.EventWriter] = None
        self._failed = False
        self._checked = False

    def get_config(self) -> dict:
        return {
            "log_dir": self.log_dir,
            "include": self.include,
            "exclude": self.exclude,
            "history_size": self.history_size,
            "strict": self.strict,
        }

    # --------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        self._steps.clear()
        self._pending.clear()
        self._checked = False
        taps = find_taps(self.model)
        self._taps = [t for t in taps if selected(t.name, self.include, self.exclude)]
        if not self._taps:
            message = (
                f"{type(self).__name__} records nothing this fit: the model has no TapLayer "
                f"matching include={self.include!r}, exclude={self.exclude!r}. Taps: "
                f"{', '.join(t.name for t in taps) or '(none; add TapLayer()s after the layers to watch, or use kerasdbg.insert_taps)'}"
            )
            if self.strict:
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._writer = self._open_writer()
        _layout.add(type(self).__name__, self._writer, _layout.activation_lines(
            (name for tap in self._taps for name in tap.health), len(self._taps)), self.strict)
        for tap in self._taps:
            tap.add_listener(self._consume)
        # One trace of the train function, not two (the taps' graph is large).
        _capture.engine_for(self.model).build_before_trace()
        self._begin_executions()

    def _after_execution(self, batch: int) -> None:
        # The model's layer sink flushed the taps after the execution; this
        # catches what it could not, reading only taps whose every_n_steps
        # selected one of the steps since the last check.
        self._flush(_layer_sink().current_fit_step(self.model))
        self._guarded(self._write_views)
        if not self._checked:
            self._checked = True
            self._check_taps_ran()

    def _check_taps_ran(self) -> None:
        """After the first execution: says once when none of the taps is in
        the train step (a custom `train_step` that never calls the layers they
        sit in), since they then record nothing in `fit`."""
        if not self._taps or any(tap.traced_in("fit") for tap in self._taps):
            return
        message = (
            f"{type(self).__name__} records nothing this fit: none of its taps "
            f"({', '.join(t.name for t in self._taps)}) ran in the train step of model "
            f"{self.model.name!r}; the train step does not call the layers they are in. Put "
            "the taps in the model or sub-model that `train_step` calls.")
        if self.strict:
            raise ValueError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def on_epoch_end(self, epoch, logs=None):
        self._executions_read()
        self._flush(_layer_sink().current_fit_step(self.model))
        self._guarded(self._write_views)
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs=None):
        self._flush(_layer_sink().current_fit_step(self.model))
        self._guarded(self._write_views)
        for tap in self._taps:
            tap.remove_listener(self._consume)
        release_writer(self, self._writer)

    def _flush(self, fit_step=None, alone: bool = False):
        _layer_sink().flush_layers(self._taps, fit_step, alone)

    # ----------------------------------------------------------- records
    def _consume(self, tap: TapLayer, rows) -> None:
        self._guarded(self._write, tap, rows)

    def _write(self, tap: TapLayer, rows) -> None:
        for row, record in rows:
            step = row["step"]
            scalars = {_tags.statistic(_tags.ACTIVATIONS, tap.name, k): v
                       for k, v in row.items() if k not in ("step", "mode")}
            values = {_tags.column(tag, _tags.ACTIVATIONS): v for tag, v in scalars.items()}
            if self.history_size:
                self._steps.setdefault(step, {}).update(values)
                while len(self._steps) > self.history_size:
                    self._steps.popitem(last=False)
            if self._writer is None:
                continue
            histograms = {}
            if "hist_counts" in record.values:
                low, high = record.values["hist_range"]
                if low == low and high == high:  # not NaN: some value was finite
                    histograms[_tags.tensor(_tags.ACTIVATIONS, tap.name)] = (
                        record.values["hist_counts"], low, high)
            self._writer.write(step, scalars, histograms)
            health = {t: v for t, v in scalars.items()
                      if _tags.tag_parts(t)[2] in tap.health}
            if health:
                self._pending.setdefault(step, {}).update(health)

    def _write_views(self) -> None:
        """Writes the views across taps (`_layout.views`) of the steps whose
        rows are in: after the flush that follows each execution, the steps
        of one layout computed as one array (`_layout.views_of_steps`)."""
        pending, self._pending = self._pending, {}
        if self._writer is None:
            return
        steps = sorted(pending)
        layouts: Dict[tuple, List[int]] = {}
        for step in steps:
            layouts.setdefault(tuple(pending[step]), []).append(step)
        views: Dict[int, Dict[str, float]] = {}
        for tags, of_layout in layouts.items():
            found = _layout.views_of_steps(
                _tags.ACTIVATIONS, tags, [list(pending[step].values()) for step in of_layout])
            views.update(zip(of_layout, found))
        for step in steps:
            self._writer.write(step, views=views[step])

    # ----------------------------------------------------------- results
    @property
    def history(self) -> pd.DataFrame:
        """Recorded steps, one row each: `step`, then `<tap name>/<stat>`.
        Under several workers, what the reads after each execution delivered
        (reading it on one worker alone must not wait for the others)."""
        self._flush(alone=True)
        columns = ["step"]
        for tap in self._taps:
            columns += [_tags.column(_tags.statistic(_tags.ACTIVATIONS, tap.name, s),
                                     _tags.ACTIVATIONS) for s in (*tap.stats, *tap.health)]
        rows = [{"step": step, **values} for step, values in sorted(self._steps.items())]
        return pd.DataFrame(rows, columns=columns)

    @property
    def latest(self) -> Dict[str, float]:
        """The last recorded step as `{"step": ..., "<tap>/<stat>": ...}`
        (under several workers, as `history`)."""
        self._flush(alone=True)
        if not self._steps:
            return {}
        step = max(self._steps)
        return {"step": step, **self._steps[step]}
