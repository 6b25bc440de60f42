"""Host side of the debug layers: reads their buffers after each execution.

A debug layer records in-graph; something on the host must read its ring
buffer when an execution of the train/test/predict function ends. The layer
finds, at trace time, the model whose step calls it (`step_context`) and
registers here. The model's sink then

- wraps the model's `train_function` / `test_function` / `predict_function`
  (an instance attribute Keras looks up at every execution) so that it
  flushes the layers after each call, for this and every later run until the
  function is rebuilt (which retraces, and so registers again);
- for the run that is tracing right now, whose first execution is already
  under way, adds a flushing callback to the loop's `CallbackList` (it flushes
  at batch ends only until the function is wrapped, and at the loop's end).

Flushing is idempotent: each layer hands out only rows it has not handed out.
After a train execution the sink reads `optimizer.iterations` once, and a
layer whose `every_n_steps` selects none of the steps just run skips reading
its buffers (they keep the rows until the next full read).
"""

from __future__ import annotations

import functools
import weakref
from typing import List

import keras
import tensorflow as tf

from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg.capture import keras_objects

_SINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _FlushCallback(keras.callbacks.Callback):
    """Flushes the sink at the end of each execution of the current run."""

    def __init__(self, sink: "LayerSink", model):
        super().__init__()
        self._sink = sink
        self._target = weakref.ref(model)
        self._seen = set()

    def _flush_unless_wrapped(self, mode: str) -> None:
        # The execution that traced ran unwrapped: always flush after it.
        model = self._target()
        function = getattr(model, keras_objects.FUNCTION_ATTRIBUTES[mode], None)
        if mode not in self._seen or not getattr(function, "_kerasdbg_flushes", False):
            self._seen.add(mode)
            self._sink.flush()

    def on_train_batch_end(self, batch, logs=None):
        self._flush_unless_wrapped("fit")

    def on_test_batch_end(self, batch, logs=None):
        self._flush_unless_wrapped("evaluate")

    def on_predict_batch_end(self, batch, logs=None):
        self._flush_unless_wrapped("predict")

    def on_train_end(self, logs=None):
        self._sink.flush()

    def on_test_end(self, logs=None):
        self._sink.flush()

    def on_predict_end(self, logs=None):
        self._sink.flush()


class LayerSink:
    """The debug layers of one model and the hooks that flush them."""

    def __init__(self):
        self._layers: List[weakref.ref] = []

    def add(self, layer) -> None:
        if not any(ref() is layer for ref in self._layers):
            self._layers.append(weakref.ref(layer))

    def flush(self, fit_step=None, alone: bool = False) -> None:
        """Flushes every layer; `fit_step` is `(iterations variable, value)`
        after a train call; `alone`: see `flush_layers`."""
        layers = []
        for ref in list(self._layers):
            layer = ref()
            if layer is None:
                self._layers.remove(ref)
            else:
                layers.append(layer)
        flush_layers(layers, fit_step, alone)

    def hook(self, context: keras_objects.StepContext) -> None:
        model = context.model
        attribute = keras_objects.FUNCTION_ATTRIBUTES[context.mode]
        function = getattr(model, attribute, None)
        if function is not None and not getattr(function, "_kerasdbg_flushes", False):
            setattr(model, attribute, self._flushing(function, model, context.mode))
        callbacks = context.callbacks
        if callbacks is not None and not any(
            isinstance(c, _FlushCallback) and c._sink is self for c in callbacks.callbacks
        ):
            callbacks.callbacks.append(_FlushCallback(self, model))

    def _flushing(self, function, model, mode: str):
        target = weakref.ref(model)

        @functools.wraps(function)
        def flushing(*args, **kwargs):
            ended = True  # returned, or the data ended (on every worker alike)
            try:
                return function(*args, **kwargs)
            except BaseException as error:
                ended = isinstance(error, (StopIteration, tf.errors.OutOfRangeError))
                raise
            finally:
                self.flush(current_fit_step(target()) if mode == "fit" else None, alone=not ended)

        flushing._kerasdbg_flushes = True
        return flushing


def flush_layers(layers, fit_step=None, alone: bool = False) -> None:
    """`flush_unless_idle(fit_step)` of every layer in `layers`, those whose
    records are the cluster's (`DebugLayer.across_workers`) together, in one
    gather across workers, first. Under several workers every worker must
    call it at the same point with the same layers and `fit_step` (the
    kerasdbg callbacks and the model's sink do, after each execution);
    `alone=True` leaves those layers out (after a step that failed on this
    worker, whose peers may never reach the gather)."""
    together, local = [], []
    for layer in layers:
        (local if layer.across_workers() is None else together).append(layer)
    try:
        if together and not alone:
            # The idle test depends on `fit_step` only: the same on every worker.
            chosen = [layer for layer in together
                      if fit_step is None or not layer._nothing_selected_since(*fit_step)]
            if chosen:
                _flush_across_workers(chosen)
    finally:
        for layer in local:
            layer.flush_unless_idle(fit_step)


def _flush_across_workers(layers) -> None:
    """Hands every layer the new records of all the cluster's replicas, in
    one `gather_workers` for all layers: one row per local replica, holding
    every layer's whole ring buffer (its size is fixed, so every worker
    sends rows of one shape whatever it recorded), then a failure flag (a
    worker that cannot read still joins, and every worker fails alike)."""
    import numpy as np

    from kerasdbg.backends.tensorflow import buffers as _buffers

    strategy = layers[0]._ring.rows.distribute_strategy
    shapes = [tuple(layer._ring.rows.shape) for layer in layers]
    sizes = [int(np.prod(shape)) for shape in shapes]
    local_replicas = len(strategy.extended.worker_devices)
    packed = np.zeros((local_replicas, sum(sizes) + 1))
    failure = None
    try:
        start = 0
        for layer, size in zip(layers, sizes):
            copies = _buffers.read_replicas(layer._ring.rows)
            for replica in range(local_replicas):
                packed[replica, start:start + size] = np.ravel(copies[replica])
            start += size
    except Exception as error:  # noqa: BLE001 - said by every layer below
        failure = error
        packed[:, -1] = 1.0
    try:
        cluster = _buffers.gather_workers(packed, strategy)
    except Exception as error:  # noqa: BLE001 - the host side must not stop fit
        for layer in layers:
            layer._fail(error)
        return
    if cluster[:, -1].any():
        failure = failure or RuntimeError("another worker could not read its buffers")
        for layer in layers:
            layer._fail(failure)
        return
    start = 0
    for layer, shape, size in zip(layers, shapes, sizes):
        tables = [row[start:start + size].reshape(shape) for row in cluster]
        start += size
        layer._deliver(lambda layer=layer, tables=tables: layer._records(tables, 0))


def current_fit_step(model):
    """`(key, step)` of the model's train-step counters after a train call
    (`keras_objects.step_counters`), or None."""
    try:
        counters = keras_objects.step_counters(model)
        if not counters:
            return None
        steps = {id(keras_objects.raw_iterations(o)): keras_objects.step_number(o)
                 for _, o in keras_objects.find_optimizers(model)}
        return tuple(id(v) for v in counters), max(
            steps.get(id(v), int(reads.read(v).numpy())) for v in counters)
    except Exception:  # noqa: BLE001 - then every layer reads in full
        return None


def sink_for(model) -> LayerSink:
    sink = _SINKS.get(model)
    if sink is None:
        sink = _SINKS[model] = LayerSink()
    return sink


def register(layer, context: keras_objects.StepContext) -> None:
    """Called by a debug layer at trace time inside a Keras loop."""
    if context.model is None:
        return
    sink = sink_for(context.model)
    sink.add(layer)
    sink.hook(context)


def flush_model(model) -> None:
    """Flushes every debug layer of `model` that has registered."""
    sink = _SINKS.get(model)
    if sink is not None:
        sink.flush()
