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
  under way, adds a flushing callback to the loop's `CallbackList`.

Flushing is idempotent: each layer hands out only rows it has not handed out.
"""

from __future__ import annotations

import functools
import weakref
from typing import List

import keras

from kerasdbg import _keras_internals as internals

_SINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _FlushCallback(keras.callbacks.Callback):
    """Flushes the sink at the end of each execution of the current run."""

    def __init__(self, sink: "LayerSink"):
        super().__init__()
        self._sink = sink

    def on_train_batch_end(self, batch, logs=None):
        self._sink.flush()

    def on_test_batch_end(self, batch, logs=None):
        self._sink.flush()

    def on_predict_batch_end(self, batch, logs=None):
        self._sink.flush()

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

    def flush(self) -> None:
        for ref in list(self._layers):
            layer = ref()
            if layer is None:
                self._layers.remove(ref)
            else:
                layer.flush()

    def hook(self, context: internals.StepContext) -> None:
        model = context.model
        attribute = internals.FUNCTION_ATTRIBUTES[context.mode]
        function = getattr(model, attribute, None)
        if function is not None and not getattr(function, "_kerasdbg_flushes", False):
            setattr(model, attribute, self._flushing(function))
        callbacks = context.callbacks
        if callbacks is not None and not any(
            isinstance(c, _FlushCallback) and c._sink is self for c in callbacks.callbacks
        ):
            callbacks.callbacks.append(_FlushCallback(self))

    def _flushing(self, function):
        @functools.wraps(function)
        def flushing(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            finally:
                self.flush()

        flushing._kerasdbg_flushes = True
        return flushing


def sink_for(model) -> LayerSink:
    sink = _SINKS.get(model)
    if sink is None:
        sink = _SINKS[model] = LayerSink()
    return sink


def register(layer, context: internals.StepContext) -> None:
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
