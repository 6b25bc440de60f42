"""`PrintLayer`: prints what flows through a point of the model, per step."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from typing import Any, List, Optional, Sequence, TextIO, Union

import keras
import numpy as np

from kerasdbg import _validation as check
from kerasdbg import stats as stats_lib
from kerasdbg.layers import _lazy
from kerasdbg.errors import UnsupportedBackendError
from kerasdbg.layers._debug_layer import DebugLayer, LayerRecord, on_jax
from kerasdbg.sinks import workers as _workers

# On first use (see `kerasdbg.layers._debug_layer`).
tf = _lazy.module("tensorflow")
_buffers = _lazy.module("kerasdbg.backends.tensorflow.buffers")
graph_functions = _lazy.module("kerasdbg.backends.tensorflow.graph_functions")

PRINTING = ("deferred", "immediate")
DEFAULT_PRINT_STATISTICS = ("mean", "std", "min", "max", "nan_count", "inf_count")
STREAMS = ("stderr", "stdout", "logging")


# Set while a saved layer is rebuilt (`PrintLayer.from_config`): a file path
# whose directory is missing on this machine does not stop the model loading.
_LOADING = threading.local()


def _check_stream(owner: str, value):
    if value is None:
        return "stderr"
    if isinstance(value, logging.Logger) or hasattr(value, "write"):
        return value
    if isinstance(value, (str, os.PathLike)):
        value = os.fspath(value)
        if value in STREAMS or value.startswith("logging:") or "://" in value:
            return value
        if value:
            # A file path: found wrong now, not at the first print of a fit.
            directory = os.path.dirname(os.path.abspath(value))
            wrong = (f"{value!r} is a directory" if os.path.isdir(value) else
                     None if os.path.isdir(directory) else f"{directory!r} does not exist")
            if wrong and not getattr(_LOADING, "active", False):
                raise ValueError(
                    f"{owner}: `output_stream` must be a stream name or a file path in an "
                    f"existing directory; {wrong}. Received: output_stream={value!r}")
            return value
    raise TypeError(
        f"{owner}: `output_stream` must be one of {', '.join(STREAMS)}, "
        "'logging:<logger name>', a file path, a logging.Logger or an object "
        f"with a `write` method. Received: output_stream={value!r}"
    )


def _format_number(value: float) -> str:
    return f"{value:.6g}"


def format_elements(head: np.ndarray, tail: np.ndarray, size: int, summarize: int) -> str:
    """The first and last `summarize` elements, as `tf.print` shows them."""
    if summarize == 0 or size == 0:
        return "[]" if size == 0 else "[...]"
    if size <= summarize:
        shown = [_format_number(v) for v in head[:size]]
    elif size <= 2 * summarize:
        rest = size - summarize
        shown = [_format_number(v) for v in head] + [
            _format_number(v) for v in tail[summarize - rest:]
        ]
    else:
        shown = [_format_number(v) for v in head] + ["..."] + [_format_number(v) for v in tail]
    return "[" + " ".join(shown) + "]"


@keras.saving.register_keras_serializable(package="kerasdbg")
class PrintLayer(DebugLayer):
    """Prints its input at the steps it selects, and returns it unchanged.

    Each printed line holds the mode (the Keras call: `fit`, `evaluate`,
    `predict`, or `call` for any other call), the step, the replica, the message, the shape, the
    chosen statistics and the first and last `summarize` elements:

        kerasdbg fit step 3 replica 0 | after dense | shape (4, 2) | mean=0.25 ... | [0.1 0.2 ...]

    With `printing="deferred"` (default) the values are recorded in-graph and
    printed on the host at the end of each execution of the train, test or
    predict function, in step order: this works with XLA (`jit_compile`),
    `steps_per_execution > 1` and `tf.distribute` strategies. Eager calls
    print at once; in a `tf.function` of your own, call `flush()` to print.

    With `printing="immediate"` the layer calls `tf.print` in the graph, which XLA
    cannot compile: the layer sets `supports_jit = False`, so Keras's
    `jit_compile="auto"` turns XLA off (and an explicit `jit_compile=True`
    falls back with Keras's warning).

    Args:
        message: text printed on each line. Defaults to the layer name.
        every_n_steps: print steps divisible by this. Defaults to `1`.
        summarize: how many leading and trailing elements to print (as
            `tf.print`'s `summarize`); 0 prints none. Defaults to `3`.
        stats: statistics from `kerasdbg.stats.ALL_STATISTICS` to print.
            Defaults to mean, std, min, max, nan_count and inf_count.
        replicas: "first" prints replica 0 only; "all" prints every
            replica. Defaults to `"first"`.
        printing: "deferred" or "immediate", see above. Defaults to
            `"deferred"`. (`mode` is its deprecated name: `mode` is the
            Keras call a record comes from everywhere else.)
        output_stream: "stderr", "stdout", "logging" (the `kerasdbg`
            logger, level INFO), "logging:<name>", a file path (appended
            to), a `logging.Logger` or an object with `write`. Streams are
            looked up when printing, so pytest's `capsys` captures them.
            Defaults to `"stderr"`.
        buffer_steps: records kept between two host reads (deferred printing);
            at least `steps_per_execution`. Defaults to `64`.
        strict: raise on a failure of the layer instead of warning once.
            Defaults to `False`.
        **kwargs: `keras.layers.Layer` arguments (`name`, ...).

    Call arguments:
        inputs: any tensor; returned unchanged. A structure of tensors (a
            dict, list or tuple) is printed tensor by tensor, each line with
            the message followed by the tensor's path (`<message>/a`); the
            `PrintLayer` of each tensor is in `parts`.

    On the JAX backend the values are recorded in float32 (JAX's default
    precision) and only `printing="deferred"` exists.

    Raises:
        kerasdbg.errors.UnsupportedBackendError: when made while Keras runs on
            another backend than TensorFlow or JAX; the message names the
            backend and what works there.
            Also `printing="immediate"` on JAX.

    Examples:
        >>> import keras, numpy as np, sys
        >>> from kerasdbg.layers import PrintLayer
        >>> layer = PrintLayer("x", stats=["mean"], output_stream=sys.stdout, name="p")
        >>> _ = layer(np.array([[1.0, 2.0], [3.0, 4.0]]))
        kerasdbg call step 1 replica 0 | x | shape (2, 2) | mean=2.5 | [1 2 3 4]
    """

    def __init__(
        self,
        message: Optional[str] = None,
        every_n_steps: int = 1,
        summarize: int = 3,
        stats: Sequence[str] = DEFAULT_PRINT_STATISTICS,
        replicas: str = "first",
        printing: str = "deferred",
        output_stream: Union[str, logging.Logger, TextIO, None] = None,
        buffer_steps: int = 64,
        strict: bool = False,
        **kwargs: Any,
    ):
        owner = type(self).__name__
        renamed = check.deprecated(owner, kwargs, {
            "mode": ("printing", None, "`mode` is the Keras call a record comes from "
                     "everywhere else"),
        }, {"printing": (printing, "deferred")})
        printing = renamed.get("printing", printing)
        super().__init__(
            every_n_steps=every_n_steps, replicas=replicas, buffer_steps=buffer_steps,
            strict=strict, **kwargs,
        )
        if message is not None and not isinstance(message, str):
            raise TypeError(
                f"{owner}: `message` must be None or a str. Received: message={message!r}"
            )
        self.message = message
        self.summarize = check.non_negative_int(owner, "summarize", summarize)
        self.stats = check.choices(owner, "stats", stats, stats_lib.ALL_STATISTICS, allow_empty=True)
        self.printing = check.one_of(owner, "printing", printing, PRINTING)
        self.output_stream = _check_stream(owner, output_stream)
        if self.printing == "immediate" and on_jax():
            raise UnsupportedBackendError(
                f"{owner}: printing='immediate' prints with tf.print in TensorFlow's graph, "
                "on the Keras backend tensorflow only; Keras runs on 'jax' here. Use "
                "printing='deferred' (the default), which prints after each execution of "
                "the step, in step order.")
        if self.printing == "immediate":
            if isinstance(self.output_stream, logging.Logger) or (
                isinstance(self.output_stream, str) and self.output_stream.startswith("logging:")
            ):
                raise ValueError(
                    f"{owner}: printing='immediate' prints with tf.print, which cannot "
                    "write to a named logger; use output_stream='logging' (TensorFlow's "
                    "logger), a stream or a file path, or printing='deferred'. "
                    f"Received: output_stream={output_stream!r}"
                )
            # tf.print does not compile under XLA.
            self.supports_jit = False

    @classmethod
    def from_config(cls, config: dict):
        # A model saved here loads on another machine whose directories differ;
        # printing there warns once that it cannot write the file.
        _LOADING.active = True
        try:
            return super().from_config(config)
        finally:
            _LOADING.active = False

    def get_config(self) -> dict:
        config = super().get_config()
        stream = self.output_stream
        if not isinstance(stream, str):
            if isinstance(stream, logging.Logger):
                stream = f"logging:{stream.name}"
            elif stream is sys.stdout:
                stream = "stdout"
            else:
                warnings.warn(
                    f"PrintLayer {self.name!r}: output_stream={stream!r} cannot be "
                    "saved; the saved layer prints to stderr.",
                    UserWarning,
                    stacklevel=2,
                )
                stream = "stderr"
        config.update(
            message=self.message,
            summarize=self.summarize,
            stats=list(self.stats),
            printing=self.printing,
            output_stream=stream,
        )
        return config

    def _adopt(self, part, key: str) -> None:
        # A part prints to this layer's stream (an object too), as `<message>/<path>`.
        part.output_stream = self.output_stream
        part.message = f"{self.message if self.message is not None else self.name}/{key}"

    # ------------------------------------------------------------ records
    KIND = "print"

    def _fields(self, input_shape):
        rank = len(input_shape)
        k = max(self.summarize, 1)
        return {
            "shape": ((rank,), "int64"),
            "stats": ((len(self.stats),), "float64"),
            "head": ((k,), "float64"),
            "tail": ((k,), "float64"),
        }

    def _values_key(self) -> tuple:
        return (max(self.summarize, 1), tuple(self.stats))

    @staticmethod
    def _compute_values(key, inputs, state, mode):
        k, stats = key
        x = tf.convert_to_tensor(inputs)
        flat = tf.reshape(x, [-1])
        # Slice before casting and padding: only 2k elements are copied per step.
        head = tf.cast(flat[:k], tf.float64)
        tail = tf.cast(flat[-k:], tf.float64)  # the whole tensor when it has < k elements
        return {
            "shape": tf.shape(x, out_type=tf.int64),
            "stats": stats_lib.tensor_statistics([x], stats)[0],
            "head": tf.pad(head, [[0, k - tf.shape(head)[0]]]),
            "tail": tf.pad(tail, [[k - tf.shape(tail)[0], 0]]),
        }, None

    def _record(self, inputs, context):
        if self.printing == "deferred":
            return super()._record(inputs, context)
        return self._print_in_graph(inputs, context)

    def _line(self, record: LayerRecord) -> str:
        values = record.values
        shape = tuple(int(d) for d in values["shape"])
        size = int(np.prod(shape)) if shape else 1
        shape_text = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
        stats = " ".join(
            f"{name}={_format_number(v)}" for name, v in zip(self.stats, values["stats"])
        )
        parts = [
            f"kerasdbg {record.mode} step {record.step} replica {record.replica}",
            self.message if self.message is not None else self.name,
            f"shape {shape_text}",
        ]
        if stats:
            parts.append(stats)
        if self.summarize:
            parts.append(format_elements(values["head"], values["tail"], size, self.summarize))
        return " | ".join(parts)

    def _consume(self, records: List[LayerRecord]) -> None:
        # Under several workers only the chief prints (unless every worker
        # was asked to write): the strategy of the buffers the records are in.
        strategy = getattr(getattr(self._ring, "rows", None), "distribute_strategy", None)
        if _workers.writes(strategy, f"PrintLayer {self.name!r}"):
            self._emit([self._line(r) for r in records])

    def _emit(self, lines: List[str]) -> None:
        stream = self.output_stream
        if isinstance(stream, str) and (stream == "logging" or stream.startswith("logging:")):
            stream = logging.getLogger(stream.split(":", 1)[1] if ":" in stream else "kerasdbg")
        if isinstance(stream, logging.Logger):
            for line in lines:
                stream.info(line)
            return
        if stream == "stderr":
            stream = sys.stderr
        elif stream == "stdout":
            stream = sys.stdout
        if isinstance(stream, str):
            with open(stream, "a", encoding="utf-8") as handle:
                handle.write("".join(line + "\n" for line in lines))
            return
        stream.write("".join(line + "\n" for line in lines))
        if hasattr(stream, "flush"):
            stream.flush()

    # ------------------------------------------------------- immediate mode
    def _print_in_graph(self, inputs, context) -> None:
        counted = self._step(inputs, context, records=False)
        step = counted["number"]
        replica, static_replica = self._replica()
        if static_replica is not None and not self._record_replica(static_replica):
            return
        x = tf.convert_to_tensor(inputs)
        stats = graph_functions.tensor_statistics(x, self.stats)
        stream = self.output_stream
        target = {
            "stderr": sys.stderr,
            "stdout": sys.stdout,
            "logging": tf.compat.v1.logging.info,
        }.get(stream, None) if isinstance(stream, str) else stream
        if target is None:
            target = "file://" + os.path.abspath(stream)
        elif not isinstance(target, str) and target not in (sys.stderr, sys.stdout, tf.compat.v1.logging.info):
            raise ValueError(
                f"PrintLayer {self.name!r}: printing='immediate' prints with tf.print, which "
                "writes only to sys.stderr, sys.stdout, TensorFlow's logger or a file "
                f"path. Received: output_stream={stream!r}"
            )
        pieces = [f"kerasdbg {context.mode} step", step, "replica", replica, "|",
                  self.message if self.message is not None else self.name,
                  "| shape", tf.shape(x), "|"]
        for i, name in enumerate(self.stats):
            pieces += [f"{name}=", stats[i]]
        if self.summarize:
            pieces += ["|", tf.reshape(x, [-1])]  # one line, as in deferred mode
        # Known while the step is traced under its strategy.
        if not _workers.writes(tf.distribute.get_strategy(), f"PrintLayer {self.name!r}"):
            return

        def show():
            tf.print(*pieces, summarize=self.summarize, output_stream=target)

        _buffers.run_if(True if self.every_n_steps == 1 else counted["selected"], show)
