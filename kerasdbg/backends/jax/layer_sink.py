"""JAX side of the debug layers, on the host: reads their buffers after each execution.

A debug layer writes its rows into a variable of Keras's state
(`kerasdbg.backends.jax.layer_record`); during a loop the live values are in
the state Keras's loop holds, not in the model's variables (Keras writes
them back at the loop's end). The layer registers at trace time with the
sink of the model whose step calls it; the sink then

- wraps the model's `train_function` / `test_function` / `predict_function`
  (an instance attribute Keras looks up at every execution): after each
  execution it reads the buffers of all its layers, at once (one
  `jax.device_get`), from the state the function returns;
- adds a flushing callback to the running loop's `CallbackList`, and to
  every later loop of the model (Keras's `make_*_function`, which each loop
  calls after making its `CallbackList`, is wrapped once), which reads the
  live state (`model._jax_state`) at each batch's end unless the wrapper
  already read it: it covers the execution that traced (already running,
  unwrapped) and a train function that kerasdbg's capture put in place of
  the wrapped one (`kerasdbg.backends.jax.engine`).

Flushing is idempotent: each layer hands out only rows it has not handed out.

When the loop ends (a `fit` however it ends, through `capture.fit_end`; an
`evaluate` or `predict` outside a fit at its `on_*_end`), the model's
functions are given back unwrapped, and the callback leaves a `CallbackList`
the user made; the next loop wraps them again (`_wrap_makers`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional

import jax
import keras
import numpy as np

from kerasdbg.backends.jax import layer_record
from kerasdbg.capture import fit_end, keras_objects

FUNCTION_ATTRIBUTES = {"fit": "train_function", "evaluate": "test_function",
                       "predict": "predict_function"}
MAKERS = {"make_train_function": "fit", "make_test_function": "evaluate",
          "make_predict_function": "predict"}

_SINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _FlushCallback(keras.callbacks.Callback):
    """Flushes the sink at the end of each execution of one loop, from the
    live state, and at the loop's end.

    Under Keras's asynchronous dispatch of batch ends (a `CallbackList` whose
    callbacks are all `async_safe`, made before this one joined it) a batch's
    end runs in a thread while the next execution consumes (donates) the
    state: this callback then reads the state of the execution before at the
    next batch's begin (always dispatched in the loop's thread, before the
    state is passed on), at an epoch's end and at the loop's end.
    """

    def __init__(self, sink: "LayerSink", callbacks):
        super().__init__()
        self._sink = sink
        # Keras's CallbackList flags (keras/src/callbacks/callback_list.py).
        self._live = {mode: not getattr(callbacks, f"_async_{mode}", False)
                      for mode in ("train", "test", "predict")}

    def on_train_batch_begin(self, batch, logs=None):
        if not self._live["train"]:
            self._sink.flush_live()

    def on_test_batch_begin(self, batch, logs=None):
        if not self._live["test"]:
            self._sink.flush_live()

    def on_predict_batch_begin(self, batch, logs=None):
        if not self._live["predict"]:
            self._sink.flush_live()

    def on_train_batch_end(self, batch, logs=None):
        if self._live["train"]:
            self._sink.flush_live()

    def on_test_batch_end(self, batch, logs=None):
        if self._live["test"]:
            self._sink.flush_live()

    def on_predict_batch_end(self, batch, logs=None):
        if self._live["predict"]:
            self._sink.flush_live()

    def on_epoch_end(self, epoch, logs=None):
        self._sink.flush_live()

    def on_train_end(self, logs=None):
        self._sink.flush_live()

    def _ended(self) -> None:
        """An evaluate or predict ended: outside a fit, the model is given back."""
        model = self._sink._model()
        if model is not None and not keras_objects.fit_running(model):
            self._sink.restore()

    def on_test_end(self, logs=None):
        self._sink.flush_live()
        self._ended()

    def on_predict_end(self, logs=None):
        self._sink.flush_live()
        self._ended()


class LayerSink:
    """The debug layers of one model and the hooks that flush them."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self._layers: List[weakref.ref] = []
        self._positions: Optional[Dict[int, int]] = None
        # The non-trainable values read last (the list Keras's loop holds).
        self._last_read = None
        # The CallbackLists this sink's callback joined (weakly).
        self._lists: "weakref.WeakSet" = weakref.WeakSet()

    def layers(self) -> list:
        alive = []
        for ref in list(self._layers):
            layer = ref()
            if layer is None:
                self._layers.remove(ref)
            else:
                alive.append(layer)
        return alive

    def add(self, layer) -> None:
        if not any(ref() is layer for ref in self._layers):
            self._layers.append(weakref.ref(layer))
            self._positions = None

    def position(self, variable) -> Optional[int]:
        """Where `variable` is among the model's non-trainable variables."""
        if self._positions is None:
            model = self._model()
            self._positions = {id(v): i for i, v in enumerate(model.non_trainable_variables)} \
                if model is not None else {}
        return self._positions.get(id(variable))

    def live(self):
        """The non-trainable values of the running loop, or None."""
        model = self._model()
        state = getattr(model, "_jax_state", None) if model is not None else None
        return state.get("non_trainable_variables") if state else None

    def flush_live(self) -> None:
        values = self.live()
        if values is not None and values is not self._last_read:
            self.flush_state(values)

    def flush_state(self, values) -> None:
        """Hands each layer the new rows of its buffer in `values` (the
        model's non-trainable values after an execution), read in one go."""
        self._last_read = values
        layers = [layer for layer in self.layers() if layer._ring is not None]
        wanted = []
        for layer in layers:
            position = self.position(layer._ring.rows)
            if position is None or position >= len(values):
                self._positions = None  # the model changed: look again
                position = self.position(layer._ring.rows)
            wanted.append(position)
        chosen = [(layer, p) for layer, p in zip(layers, wanted) if p is not None]
        if any(getattr(values[p], "is_deleted", lambda: False)() for _, p in chosen):
            return  # a state already passed on (donated): its successor holds the rows
        try:
            tables = jax.device_get([values[p] for _, p in chosen])
        except Exception as error:  # noqa: BLE001 - the host side must not stop fit
            for layer, _ in chosen:
                layer._fail(error)
            return
        for (layer, _), table in zip(chosen, tables):
            layer._deliver(lambda layer=layer, table=table:
                           layer._records([layer_record.decode(table)]))

    def hook(self, where: layer_record.Context) -> None:
        self.wrap(where.model, where.mode)
        self.add_callback(where.callbacks)

    def wrap(self, model, mode: str) -> None:
        """Wraps the model's function of the loop `mode` ("fit", "evaluate",
        "predict") to flush after each execution, until the loop ends."""
        attribute = FUNCTION_ATTRIBUTES[mode]
        function = getattr(model, attribute, None)
        if function is not None and not getattr(function, "_kerasdbg_flushes", False):
            setattr(model, attribute, self._flushing(function))
        if keras_objects.fit_running(model):
            # However the fit ends (Keras calls no callback when it raises);
            # last: kerasdbg's capture gives back the function it found (this
            # sink's wrapper, in a later fit) in a cleanup of its own.
            fit_end.on_fit_end(model, self, self.restore, last=True)

    def add_callback(self, callbacks) -> None:
        if callbacks is not None and not any(
                isinstance(c, _FlushCallback) and c._sink is self for c in callbacks.callbacks):
            # First: the other callbacks (ActivationStatistics, the user's) then
            # see this execution's records.
            callbacks.callbacks.insert(0, _FlushCallback(self, callbacks))
            self._lists.add(callbacks)

    def restore(self) -> None:
        """Gives the model its functions back unwrapped and takes the
        flushing callback out of the lists it joined."""
        model = self._model()
        if model is not None:
            for attribute in FUNCTION_ATTRIBUTES.values():
                function = vars(model).get(attribute)
                if getattr(function, "_kerasdbg_flushes", False):
                    setattr(model, attribute, function.__wrapped__)
        for callbacks in list(self._lists):
            callbacks.callbacks[:] = [c for c in callbacks.callbacks
                                      if not (isinstance(c, _FlushCallback) and c._sink is self)]
        self._lists = weakref.WeakSet()

    def _flushing(self, function):
        sink = self

        @functools.wraps(function)
        def flushing(state, iterator):
            outputs, new_state = function(state, iterator)
            try:
                values = new_state[1]  # non-trainable: second in every mode's state
            except Exception:  # noqa: BLE001 - then the callback reads the live state
                return outputs, new_state
            sink.flush_state(values)
            return outputs, new_state

        flushing._kerasdbg_flushes = True
        return flushing


def sink_for(model) -> LayerSink:
    sink = _SINKS.get(model)
    if sink is None:
        sink = _SINKS[model] = LayerSink(model)
    return sink


def register(layer, where: layer_record.Context) -> None:
    """Called by a debug layer at trace time inside a Keras loop."""
    if where.model is None:
        return
    _wrap_makers()
    sink = sink_for(where.model)
    sink.add(layer)
    sink.hook(where)
    layer._host.model = weakref.ref(where.model)


def read(layer) -> List[np.ndarray]:
    """The buffer of `layer` now, as TensorFlow's layout (`layer_record.decode`):
    the live value during a loop of its model, else the variable's. Empty when
    the sink read this state already or the value is not there."""
    ref = getattr(layer._host, "model", None)
    model = ref() if ref is not None else None
    sink = _SINKS.get(model) if model is not None else None
    if sink is not None:
        values = sink.live()
        if values is not None:
            if values is sink._last_read:
                return []
            position = sink.position(layer._ring.rows)
            if position is not None and position < len(values):
                if getattr(values[position], "is_deleted", lambda: False)():
                    return []  # passed on (donated): the next read has the rows
                return [layer_record.decode(jax.device_get(values[position]))]
    variable = layer._ring.rows
    if getattr(variable, "_value", None) is None:
        return []  # moved into a loop's state that is gone
    return [layer_record.decode(np.asarray(variable.value))]


def flush_layers(layers, fit_step=None, alone: bool = False) -> None:
    """Flushes each layer (on JAX every layer reads its own replicas: one)."""
    for layer in layers:
        layer.flush()


def current_fit_step(model):
    """Always None on JAX: a layer reads its buffer in full (see `read`,
    which skips a state already read)."""
    return None


def flush_model(model) -> None:
    """Flushes every debug layer of `model` that has registered."""
    sink = _SINKS.get(model)
    if sink is not None:
        for layer in sink.layers():
            layer.flush()


_WRAPPED = "_kerasdbg_layer_sink"


def _wrap_makers() -> None:
    """Makes each loop of a model with registered layers flush them
    (`_FlushCallback`); idempotent. Keras's loops call `make_*_function`
    after making their `CallbackList`, each time."""
    trainer = keras_objects.trainer_class()
    for name in MAKERS:
        original = trainer.__dict__.get(name)
        if original is None or getattr(original, _WRAPPED, False):
            continue

        def wrapped(self, *args, _original=original, _mode=MAKERS[name], **kwargs):
            result = _original(self, *args, **kwargs)
            sink = _SINKS.get(self)
            if sink is not None and sink.layers():
                sink.wrap(self, _mode)
                sink.add_callback(keras_objects.running_callbacks(self))
            return result

        functools.update_wrapper(wrapped, original)
        setattr(wrapped, _WRAPPED, True)
        type.__setattr__(trainer, name, wrapped)
