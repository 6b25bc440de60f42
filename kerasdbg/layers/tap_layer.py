"""`TapLayer`: records statistics of what flows through a point of the model."""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Sequence

import keras
import numpy as np
import pandas as pd

from kerasdbg import _validation as check
from kerasdbg import stats as stats_lib
from kerasdbg.layers import _lazy
from kerasdbg.layers._debug_layer import DebugLayer, LayerRecord, on_jax

# On first use (see `kerasdbg.layers._debug_layer`).
tf = _lazy.module("tensorflow")
_buffers = _lazy.module("kerasdbg.backends.tensorflow.buffers")
_jax_record = _lazy.module("kerasdbg.backends.jax.layer_record")

DEFAULT_TAP_STATISTICS = (
    "mean", "std", "min", "max", "zero_fraction", "nan_count", "inf_count",
)
ACTIVATIONS = ("relu", "tanh", "sigmoid")
HEALTH = stats_lib.HEALTH_STATISTICS

# SageMaker Debugger's documented bounds on the *input* of the activation;
# a tap sees the activation's output, so it compares with their images.
TANH_INPUT_BOUND = 9.4999
SIGMOID_INPUT_BOUNDS = (-23.0, 16.99999)


@keras.saving.register_keras_serializable(package="kerasdbg")
class TapLayer(DebugLayer):
    """Records per-step statistics of its input, and returns it unchanged.

    At each selected step the layer records, in-graph (XLA, steps_per_execution
    and strategies included), the chosen statistics of its input, optionally a
    histogram and the first `sample_rows` rows, and, when it follows an
    activation, the activation's health:

    - after a ReLU-family activation: `dead_fraction`, the fraction of units
      (every non-batch position) that are dead: active (non-zero) for at
      most `active_fraction` of each batch, in the consecutive recorded
      batches (`every_n_steps`) of the last `min_examples` examples or more.
      With the defaults (0.01, 100 examples, every step) a batch of
      100 or more decides alone; with batches of 8, a unit is dead when no
      example of 13 batches in a row activated it: one small batch that
      happens not to activate a healthy unit is no evidence that it died;
    - after tanh or sigmoid: `saturated_fraction`, the fraction of units
      saturated in the same sense. Saturation is measured on the
      activation's output, against the images of SageMaker Debugger's input
      bounds: |tanh(x)| >= tanh(9.4999), sigmoid(x) <= sigmoid(-23) or
      >= sigmoid(16.99999), compared in the tensor's precision (in float32
      both upper bounds round to 1.0, so a unit counts when its output is
      exactly ±1).

    Under a `tf.distribute` strategy the statistics describe replica 0's
    slice of the batch by default; `replicas="all"` records every replica and
    `latest`/`history` then aggregate them (means and fractions weighted by
    size, std pooled, min/max/counts over all; histograms and sample rows stay
    replica 0's). Under several workers (`MultiWorkerMirroredStrategy`) every
    worker reads the records of the cluster's replicas (replica 0 is the
    chief's first), gathered after each execution in one host collective for
    all taps of the model, so every worker holds the same records and the
    rules on them decide alike; `flush()` then does nothing, since a read on
    one worker alone would leave the others behind.

    On the JAX backend a step is one program over the global batch (also
    under `keras.distribution`): each call gives one record, replica 0's,
    of the whole batch, computed in float32 (JAX's default precision).

    Records of `fit` go to `history` and `latest` and to every
    `ActivationStatistics` callback on the model; those of `evaluate`,
    `predict` and other calls go to `latest_by_mode`.

    Args:
        stats: statistics from `kerasdbg.stats.ALL_STATISTICS`. Defaults to mean,
            std, min, max, zero_fraction, nan_count and inf_count. With
            `replicas="all"` the quantiles (`p05`, ...) are the means of the
            replicas' quantiles, weighted by their sizes: quantiles of parts
            do not give the quantile of the whole.
        histogram: also record a histogram. Defaults to `False`.
        histogram_bins: bins of the histogram. Defaults to `30`.
        sample_rows: record the first rows of the batch. Defaults to `0`.
        every_n_steps: record steps divisible by this. Defaults to `1`.
        activation: "relu", "tanh", "sigmoid" or None: the activation the
            tap follows, for the health fractions. `insert_taps` sets it.
            Defaults to `None`.
        active_fraction: the largest fraction (0-1) of a batch a unit can
            be active in (non-zero; for tanh and sigmoid, unsaturated) and
            still count as dead (saturated), see above. Defaults to `0.01`.
            (`inactivity_threshold`, a percent, is its deprecated name.)
        min_examples: the examples a unit must have been inactive (or
            saturated) for, in consecutive recorded batches, to count (under a
            strategy, the examples of the replica's share). `fit` and other
            calls (a custom training loop) extend or end the runs;
            `evaluate` and `predict` read them with their own batch added.
            Dimensions of unknown size after the batch (a sequence of any
            length) count as more of the batch, not as units. Defaults to
            `100`.
        replicas: "first" or "all". Defaults to `"first"`.
        history_size: records of `fit` kept in `history`. Defaults to `1000`.
        buffer_steps: records kept between two host reads; at least
            `steps_per_execution`. Defaults to `64`.
        strict: raise on a failure of the layer instead of warning once.
            Defaults to `False`.
        **kwargs: `keras.layers.Layer` arguments (`name`, ...).

    Call arguments:
        inputs: a tensor with a batch dimension first; returned unchanged.
            A structure of tensors (a dict, list or tuple: the outputs of a
            layer with several outputs) is tapped tensor by tensor: `parts`
            holds a `TapLayer` of the same settings per tensor, by its path
            (`"a"`, `"0"`, `"a/0"`), named `<name>_<path>`, and
            `ActivationStatistics` records each; read `history` and `latest`
            on the parts.

    Raises:
        kerasdbg.errors.UnsupportedBackendError: when made while Keras runs on
            another backend than TensorFlow or JAX; the message names the
            backend and what works there.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.layers import TapLayer
        >>> tap = TapLayer(stats=["mean", "max"], activation="relu", min_examples=2,
        ...                name="tap")
        >>> _ = tap(np.array([[0.0, 2.0], [0.0, 4.0]]))
        >>> tap.latest
        {'step': 1, 'mode': 'call', 'mean': 1.5, 'max': 4.0, 'dead_fraction': 0.5}
    """

    follows_chief = True

    KIND = "tap"

    def __init__(
        self,
        stats: Sequence[str] = DEFAULT_TAP_STATISTICS,
        histogram: bool = False,
        histogram_bins: int = stats_lib.DEFAULT_HISTOGRAM_BINS,
        sample_rows: int = 0,
        every_n_steps: int = 1,
        activation: Optional[str] = None,
        active_fraction: float = 0.01,
        min_examples: int = 100,
        replicas: str = "first",
        history_size: int = 1000,
        buffer_steps: int = 64,
        strict: bool = False,
        **kwargs: Any,
    ):
        owner = type(self).__name__
        renamed = check.deprecated(owner, kwargs, {
            "inactivity_threshold": ("active_fraction", check.from_percent,
                                     "a fraction 0-1, not a percent"),
        }, {"active_fraction": (active_fraction, 0.01)})
        active_fraction = renamed.get("active_fraction", active_fraction)
        super().__init__(
            every_n_steps=every_n_steps, replicas=replicas, buffer_steps=buffer_steps,
            strict=strict, **kwargs,
        )
        self.stats = check.choices(owner, "stats", stats, stats_lib.ALL_STATISTICS)
        self.histogram = check.boolean(owner, "histogram", histogram)
        self.histogram_bins = check.positive_int(owner, "histogram_bins", histogram_bins)
        self.sample_rows = check.non_negative_int(owner, "sample_rows", sample_rows)
        if activation is not None:
            check.one_of(owner, "activation", activation, ACTIVATIONS)
        self.activation = activation
        self.active_fraction = check.number(owner, "active_fraction", active_fraction,
                                            minimum=0.0)
        if self.active_fraction >= 1.0:
            raise ValueError(f"{owner}: `active_fraction` must be a fraction in [0, 1). "
                             f"Received: active_fraction={active_fraction!r}")
        self.min_examples = check.positive_int(owner, "min_examples", min_examples)
        self.history_size = check.non_negative_int(owner, "history_size", history_size)
        self._host.history = collections.deque(maxlen=history_size)
        self._host.latest = {}  # mode -> row
        self._host.latest_raw = None  # LayerRecord of the last call
        self._host.last = {}
        # Called as listener(tap, [(row, record), ...]) with new records of fit.
        self._host.listeners = []

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            stats=list(self.stats),
            histogram=self.histogram,
            histogram_bins=self.histogram_bins,
            sample_rows=self.sample_rows,
            activation=self.activation,
            active_fraction=self.active_fraction,
            min_examples=self.min_examples,
            history_size=self.history_size,
        )
        return config

    @property
    def health(self) -> tuple:
        """Names of the health columns this tap records."""
        if self.activation == "relu":
            return ("dead_fraction",)
        if self.activation in ("tanh", "sigmoid"):
            return ("saturated_fraction",)
        return ()

    def build(self, input_shape):
        super().build(input_shape)
        if self._parts is not None:
            return  # a structure: each part tracks its own units
        # Per unit (each position after the batch dimension whose size is static):
        # the examples of the run of batches, up to the latest, that flagged it, up to
        # `min_examples`; per replica, not saved with the model (like the buffers).
        self._host.flagged = None
        units = [d for d in tuple(input_shape)[1:] if d is not None]
        if self.health and len(input_shape) > 1:
            if on_jax():
                # Tracked, so that Keras's stateless steps carry it (not saved).
                self._flagged_examples = _jax_record.int_variable(
                    np.zeros(units), "flagged_examples")
                self._host.flagged = self._flagged_examples
            else:
                self._host.flagged = _buffers.on_read_variable(
                    tf.zeros(units, tf.int32), f"{self.name}_flagged_examples")

    # ------------------------------------------------------------ records
    def _state_variable(self):
        return self._host.flagged

    @staticmethod
    def _health(key, x, flagged_examples, mode):
        """The health fraction of this call and the new runs: units flagged in
        a run of recorded batches of at least `min_examples` examples. Training
        calls (`fit`, and calls outside Keras's loops: a custom training loop)
        extend or end the runs; `evaluate` and `predict` read them, with their
        own batch added."""
        activation, active_fraction, min_examples, axes = key
        y = x if x.dtype.is_floating else tf.cast(x, tf.float32)
        if activation == "relu":
            flagged = tf.equal(y, 0)
        else:
            flagged = TapLayer._saturated(activation, y)
        if not y.shape.rank or y.shape.rank < 2:  # rank 1: the units are the batch
            bad = tf.cast(flagged, tf.float64) >= 1.0 - active_fraction
            return tf.reduce_mean(tf.cast(bad, tf.float64))[None], None
        # Share of the batch each unit is flagged for; dimensions of unknown size (a
        # sequence of any length) count as more examples of the batch.
        share = tf.reduce_mean(tf.cast(flagged, tf.float64), axis=list(axes))
        bad = share >= 1.0 - active_fraction
        rows = tf.shape(y)[0]
        runs = tf.minimum(flagged_examples + rows, min_examples)
        runs = tf.where(bad, runs, tf.zeros_like(runs))
        # An empty batch (a replica's share of the last one) changes nothing.
        runs = tf.where(rows > 0, runs, flagged_examples)
        health = tf.reduce_mean(tf.cast(runs >= min_examples, tf.float64))[None]
        return health, (None if mode in ("evaluate", "predict") else runs)

    def _fields(self, input_shape):
        fields = {
            "stats": ((len(self.stats),), "float64"),
            "size": ((), "float64"),
        }
        if self.health:
            fields["health"] = ((1,), "float64")
        if self.histogram:
            fields["hist_counts"] = ((self.histogram_bins,), "float64")
            fields["hist_range"] = ((2,), "float64")
        if self.sample_rows:
            features = tuple(input_shape[1:])
            if any(d is None for d in features):
                raise ValueError(
                    f"TapLayer {self.name!r}: `sample_rows` needs a static shape "
                    f"after the batch dimension. Received input shape: {tuple(input_shape)}"
                )
            fields["rows"] = ((self.sample_rows, *features), "float64")
            fields["valid_rows"] = ((), "int64")
        return fields

    @staticmethod
    def _saturated(activation: str, x):
        if activation == "tanh":
            bound = tf.cast(np.tanh(TANH_INPUT_BOUND), x.dtype)
            return tf.abs(x) >= bound
        low = tf.cast(1.0 / (1.0 + np.exp(-SIGMOID_INPUT_BOUNDS[0])), x.dtype)
        high = tf.cast(1.0 / (1.0 + np.exp(-SIGMOID_INPUT_BOUNDS[1])), x.dtype)
        return (x <= low) | (x >= high)

    def _values_key(self) -> tuple:
        health = None
        if self.health:
            # (As built: an eager call knows every size.)
            axes = (0,) + tuple(i for i, d in enumerate(self._input_shape) if i and d is None)
            health = (self.activation, self.active_fraction, self.min_examples, axes)
        return (tuple(self.stats), self.histogram, self.histogram_bins, self.sample_rows, health)

    @staticmethod
    def _compute_values(key, inputs, state, mode):
        stats, histogram, bins, sample_rows, health = key
        x = tf.convert_to_tensor(inputs)
        values = {
            "stats": stats_lib.tensor_statistics([x], stats)[0],
            "size": tf.cast(tf.size(x), tf.float64),
        }
        new_state = None
        if health is not None:
            values["health"], new_state = TapLayer._health(health, x, state, mode)
        if histogram:
            counts, ranges = stats_lib.histograms([x], bins)
            values["hist_counts"], values["hist_range"] = counts[0], ranges[0]
        if sample_rows:
            rows = tf.cast(x[:sample_rows], tf.float64)
            missing = sample_rows - tf.shape(rows)[0]
            pad = tf.zeros(tf.concat([[missing], tf.shape(rows)[1:]], 0), tf.float64)
            values["rows"] = tf.concat([rows, pad], 0)
            values["valid_rows"] = tf.cast(tf.shape(x)[0], tf.int64)
        return values, new_state

    # -------------------------------------------------------------- host
    def _row(self, records: List[LayerRecord]) -> dict:
        """One step's row: statistics (aggregated over replicas) and health."""
        first = records[0]
        row = {"step": first.step, "mode": first.mode}
        stats = np.array([r.values["stats"] for r in records])
        sizes = np.array([float(r.values["size"]) for r in records])
        if not sizes.sum():  # only empty batches: every record counts alike
            sizes = None
        for i, name in enumerate(self.stats):
            column = stats[:, i]
            if len(records) == 1:
                value = column[0]
            elif name in ("min",):
                value = np.nanmin(column)
            elif name in ("max",):
                value = np.nanmax(column)
            elif name in ("nan_count", "inf_count"):
                value = column.sum()
            elif name == "l2_norm":
                value = np.sqrt(np.sum(column ** 2))
            elif name == "std" and "mean" in self.stats:
                means = stats[:, self.stats.index("mean")]
                pooled = np.average(means, weights=sizes)
                value = np.sqrt(np.average(column ** 2 + (means - pooled) ** 2, weights=sizes))
            else:  # mean, mean_abs, zero_fraction; std without mean; quantiles
                value = np.average(column, weights=sizes)
            row[name] = float(value)
        if self.health:
            health = np.array([r.values["health"][0] for r in records])
            row[self.health[0]] = float(np.average(health, weights=sizes))
        return row

    def add_listener(self, listener) -> None:
        """Calls `listener(layer, rows)` with the rows of each later flush
        (the host side of a callback that reads this layer)."""
        if listener not in self._host.listeners:
            self._host.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        """Undoes `add_listener` (nothing when `listener` was not added)."""
        if listener in self._host.listeners:
            self._host.listeners.remove(listener)

    def _consume(self, records: List[LayerRecord]) -> None:
        rows, by_call = [], []
        for record in records:
            if record.replica == 0 or not by_call:
                by_call.append([record])
            else:
                by_call[-1].append(record)
        for group in by_call:
            row = self._row(group)
            self._host.latest[row["mode"]] = row
            self._host.last = row
            self._host.latest_raw = group[0]
            if row["mode"] == "fit":
                if self.history_size:
                    self._host.history.append(row)
                rows.append((row, group[0]))
        for listener in list(self._host.listeners):
            listener(self, rows)

    # ----------------------------------------------------------- results
    @property
    def latest(self) -> dict:
        """The last record (of any mode) as `{"step", "mode", <stat>: ...}`."""
        self._check_single("latest")
        self.flush()
        return dict(self._host.last)

    @property
    def latest_by_mode(self) -> Dict[str, dict]:
        """The last record of each mode seen: `{"fit": {...}, "predict": {...}}`."""
        self._check_single("latest_by_mode")
        self.flush()
        return {mode: dict(row) for mode, row in self._host.latest.items()}

    @property
    def history(self) -> pd.DataFrame:
        """The latest `fit` records (at most `history_size`), one row per step."""
        self._check_single("history")
        self.flush()
        columns = ["step", "mode", *self.stats, *self.health]
        return pd.DataFrame(list(self._host.history), columns=columns)

    @property
    def latest_histogram(self):
        """`(counts, (low, high))` of the last record, or None."""
        self._check_single("latest_histogram")
        self.flush()
        record = self._host.latest_raw
        if record is None or "hist_counts" not in record.values:
            return None
        return record.values["hist_counts"], tuple(record.values["hist_range"])

    @property
    def latest_rows(self) -> Optional[np.ndarray]:
        """The sample rows of the last record (replica 0), or None."""
        self._check_single("latest_rows")
        self.flush()
        record = self._host.latest_raw
        if record is None or "rows" not in record.values:
            return None
        return record.values["rows"][: int(record.values["valid_rows"])]
