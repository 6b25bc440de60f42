"""The parts of Keras that every backend's capture and kerasdbg's callbacks
and layers share: finding a model's optimizers and their step counters,
their clipping and accumulation settings, the loop running a model (from the
Python stack), and the wrapper around every `Model.fit`. No framework import:
what differs per backend is looked up from `keras.config.backend()`.

`tests/test_keras_internals.py` fails loudly if a Keras upgrade moves any of
this.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import keras
import numpy as np

TRAINERS = {
    "tensorflow": ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
    "jax": ("keras.src.backend.jax.trainer", "JAXTrainer"),
    "torch": ("keras.src.backend.torch.trainer", "TorchTrainer"),
    "numpy": ("keras.src.backend.numpy.trainer", "NumpyTrainer"),
}
"""The trainer class of each Keras backend (the class `Model.fit` is defined on)."""


def replicas(model) -> int:
    """How many replicas run each step of `model`: a `tf.distribute`
    strategy's number (1 without one); under JAX's `keras.distribution` the
    step is one program over the global batch, so 1."""
    strategy = getattr(model, "distribute_strategy", None)
    return int(getattr(strategy, "num_replicas_in_sync", 1) or 1)


def host_value(variable) -> np.ndarray:
    """The value of a Keras variable (or of a framework variable kerasdbg
    made) on the host, as NumPy (on JAX, what the
    model holds: during a `fit` its variables are written back at each
    epoch's end)."""
    value = variable.value
    # A framework variable of kerasdbg's has `value()` (replica 0's copy).
    value = value() if callable(value) else value
    # A tf.distribute variable reads its primary copy with `numpy()`; a JAX
    # array converts as it is.
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def current_value(model, variable) -> np.ndarray:
    """The value of `variable` now, as NumPy: during a `fit` on JAX, Keras's
    loop holds the state (`model._jax_state`) and the model's variables hold
    their initial values until the epoch ends; elsewhere, the variable's."""
    state = getattr(model, "_jax_state", None)
    if state:
        optimizer = getattr(model, "optimizer", None)
        groups = (("trainable_variables", model.trainable_variables),
                  ("non_trainable_variables", model.non_trainable_variables),
                  ("optimizer_variables", optimizer.variables if optimizer is not None else []),
                  ("metrics_variables", model.metrics_variables))
        for key, variables in groups:
            values = state.get(key)
            if values is None:
                continue
            for candidate, value in zip(variables, values):
                if candidate is variable:
                    return np.asarray(value)
    return host_value(variable)


def trainer_class():
    """The Keras trainer class of the current backend."""
    import importlib

    module, name = TRAINERS[keras.config.backend()]
    return getattr(importlib.import_module(module), name)

ITERATIONS_ATTRIBUTE = "_iterations"

VAR_KEY_METHOD = "_var_key"

class KerasInternalsError(RuntimeError):
    """The installed Keras no longer has what kerasdbg hooks into."""

def inner_optimizer(optimizer):
    """The optimizer that applies the unscaled gradients (mixed precision)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer

def variable_key(optimizer, variable) -> int:
    """A key equal for a Keras variable and the tf.Variable the optimizer sees."""
    return inner_optimizer(optimizer)._var_key(variable)

def patch(obj, name: str, function) -> None:
    """Shadows the method `name` of the instance `obj` with `function`."""
    if name in vars(obj):
        raise KerasInternalsError(
            f"kerasdbg: {type(obj).__name__}.{name} is already patched on this "
            "instance; another tool may be instrumenting the same optimizer."
        )
    object.__setattr__(obj, name, function)

def watch_loss_metrics(model, method: str, take) -> list:
    """Shadows `method` ("update_state", or "stateless_update_state" whose
    first argument is the metric's variables) of each metric of `model`
    named "loss" that no one patched: a call given one value (the loss a
    custom train step gives it) hands that value to `take` first. Returns
    the metrics patched, for `unwatch_loss_metrics`.

    Examples:
        >>> import keras
        >>> from kerasdbg.capture import keras_objects
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> seen = []
        >>> patched = keras_objects.watch_loss_metrics(model, "update_state", seen.append)
        >>> [m.name for m in patched]
        ['loss']
        >>> patched[0].update_state(2.0); seen
        [2.0]
        >>> keras_objects.unwatch_loss_metrics(patched, "update_state")
    """
    stateless = method.startswith("stateless")
    patched = []
    for metric in list(getattr(model, "metrics", None) or []):
        if getattr(metric, "name", None) != "loss" or method in vars(metric):
            continue

        def watched(*args, _original=getattr(metric, method), **kwargs):
            values = args[1:] if stateless else args
            if len(values) == 1:
                take(values[0])
            return _original(*args, **kwargs)

        patch(metric, method, watched)
        patched.append(metric)
    return patched


def unwatch_loss_metrics(metrics, method: str) -> None:
    """Puts back what `watch_loss_metrics` shadowed."""
    for metric in metrics:
        unpatch(metric, method)


def name_scope_depth() -> int:
    """How many scopes Keras's own name-scope stack holds now (this thread)."""
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack")
    return len(stack) if stack else 0

def drop_name_scopes(depth: int) -> None:
    """Drops the scopes above `depth` from Keras's name-scope stack.

    A Keras `name_scope` whose TensorFlow scope refuses its name stays on
    Keras's stack (it is pushed before TensorFlow checks the name), and every
    variable Keras creates afterwards in this thread is named under it; after
    a failure inside a scope, this puts the stack back.
    """
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack")
    if stack and len(stack) > depth:
        del stack[depth:]

def unpatch(obj, name: str) -> None:
    """Removes the instance attribute set by `patch`, if any."""
    if name in vars(obj):
        object.__delattr__(obj, name)

def ensure_built(optimizer, variables) -> None:
    """Builds the optimizer for `variables` as its `apply` would, if not built."""
    if not optimizer.built and variables is not None:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(variables))
        optimizer.built = True

def uses_standard_train_step(model) -> bool:
    """Whether the model trains with Keras's own `train_step` (which applies
    `model.optimizer` to `model.trainable_variables`)."""
    return type(model).train_step is trainer_class().train_step

def optimizer_variables(optimizer) -> list:
    """The variables an optimizer was built for (what `apply(grads)` updates)."""
    return list(optimizer._trainable_variables)

def raw_iterations(optimizer):
    """The variable counting the optimizer's `apply` calls that updated (or, with
    gradient accumulation, accumulated): `optimizer.iterations` is this count
    divided by `gradient_accumulation_steps` there, and a tensor, not a variable."""
    return getattr(inner_optimizer(optimizer), ITERATIONS_ATTRIBUTE)

_UNCOUNTED = None  # weakref.WeakKeyDictionary: inner optimizer -> its uncounted-steps variable


def uncounted_steps(optimizer):
    """The variable counting the optimizer steps that kerasdbg kept Keras's
    step count (`iterations`) from counting: those it skipped
    (`StopOnRule(action="skip")`) and those a fault froze, whose update is
    thrown away whole, the count included, so that the learning-rate
    schedule and Adam's bias correction go on from the last step that
    trained (as `LossScaleOptimizer` does not count a step it skips). None
    when no fault was armed for it. kerasdbg numbers steps by `iterations` +
    this, so that every batch that reached the optimizer has its own step."""
    return None if _UNCOUNTED is None else _UNCOUNTED.get(inner_optimizer(optimizer))


def keep_uncounted_steps(optimizer, variable) -> None:
    """Sets `uncounted_steps(optimizer)` (kept as long as the optimizer lives)."""
    global _UNCOUNTED
    if _UNCOUNTED is None:
        import weakref

        _UNCOUNTED = weakref.WeakKeyDictionary()
    _UNCOUNTED[inner_optimizer(optimizer)] = variable


def step_number(optimizer) -> int:
    """The optimizer's last step as kerasdbg numbers steps (host read):
    `iterations` + the steps it kept from counting (`uncounted_steps`)."""
    count = int(host_value(raw_iterations(optimizer)))
    uncounted = uncounted_steps(optimizer)
    return count if uncounted is None else count + int(host_value(uncounted))


def step_counters(model) -> list:
    """The variables whose largest value + 1 numbers the train step a
    forward pass belongs to (taps): `model.optimizer`'s with Keras's own
    `train_step`; with a custom one, every optimizer's the model holds (a
    GAN applies `d_optimizer` and `g_optimizer`, never `model.optimizer`)."""
    optimizer = getattr(model, "optimizer", None)
    if uses_standard_train_step(model):
        return [raw_iterations(optimizer)] if optimizer is not None else []
    return [raw_iterations(o) for _, o in find_optimizers(model)]

def learning_rate_as_set(optimizer):
    """The learning rate the optimizer was given: a `LearningRateSchedule`, a
    variable, a callable or a number (`optimizer.learning_rate` is a schedule's
    value at the current iterations, not the schedule)."""
    return inner_optimizer(optimizer)._learning_rate

def accumulation_steps(optimizer) -> Optional[int]:
    """The optimizer's `gradient_accumulation_steps`, or None."""
    return getattr(inner_optimizer(optimizer), "gradient_accumulation_steps", None) or None

def clipping(optimizer) -> Optional[Tuple[str, float]]:
    """`(kind, value)` of the optimizer's gradient clipping, or None: kind is
    "clipnorm", "global_clipnorm" or "clipvalue" (Keras allows one of them)."""
    inner = inner_optimizer(optimizer)
    for kind in ("clipnorm", "global_clipnorm", "clipvalue"):
        value = getattr(inner, kind, None)
        if value:
            return kind, float(value)
    return None

def clip_gradients(optimizer, grads) -> list:
    """`grads` clipped as the optimizer clips them before its update (its
    `clipnorm`, `global_clipnorm` or `clipvalue`; None entries kept)."""
    return list(inner_optimizer(optimizer)._clip_gradients(list(grads)))

def accumulators(optimizer, variables) -> list:
    """The gradient accumulators of `variables` (gradient accumulation)."""
    inner = inner_optimizer(optimizer)
    return [inner._accumulated_gradients[inner._get_variable_index(v)] for v in variables]

def find_optimizers(model) -> List[Tuple[str, object]]:
    """`(name, optimizer)` of every optimizer the model or its layers hold.

    `model.optimizer` first (named "optimizer"), then the attributes of the
    model and of each of its layers, also inside lists, tuples and dicts
    (a GAN's `d_optimizer`, `optimizers[0]`), each once. Keras's layer
    tracker does not list optimizers, so this looks at the attributes.
    Names are the attribute paths: `d_optimizer`, `discriminator.optimizer`.
    """
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    found: List[Tuple[str, object]] = []
    seen = set()

    def add(name, value):
        if isinstance(value, BaseOptimizer) and id(value) not in seen:
            seen.add(id(value))
            found.append((name, value))
            # A MultiOptimizer applies its sub-optimizers, each for its variables.
            for i, inner in enumerate(getattr(value, "_inner_optimizers", None) or ()):
                add(f"{name}.optimizers[{i}]", inner)

    add("optimizer", getattr(model, "optimizer", None))
    try:
        layers = list(model._flatten_layers(include_self=False))
    except Exception:  # noqa: BLE001 - a model Keras cannot list: its own attributes only
        layers = []
    modules = [("", model)] + [(f"{layer.name}.", layer) for layer in layers]
    # Attributes first, then what lists and dicts hold; TensorFlow's own
    # tracking attributes (`_self_...`) and Python's (`__...__`) are not the
    # model's (`__d`, set with `setattr`, is).
    attributes = [(prefix + name, value) for prefix, module in modules
                  for name, value in list(vars(module).items())
                  if not (name.startswith("__") and name.endswith("__"))
                  and not name.startswith("_self_")]
    for name, value in attributes:
        add(name, value)
    for name, value in attributes:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{name}[{i}]", item)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                add(f"{name}[{key}]", item)
    return found

_FIT_WRAPPED = "_kerasdbg_after_fit"

def wrap_fit(after_fit: Callable[[object], None]) -> None:
    """Makes every `Model.fit` call `after_fit(model)` when it ends, by a
    return or an exception (KeyboardInterrupt included); idempotent.

    Keras calls no callback when `fit` raises (no `on_train_end`), so this
    is the one place where kerasdbg can restore what it changed in the
    model then. `after_fit` must be cheap for models kerasdbg never touched.
    """
    trainer = trainer_class()
    fit = trainer.__dict__["fit"]
    if getattr(fit, _FIT_WRAPPED, None) is not None:
        return

    @functools.wraps(fit)
    def wrapped(self, *args, **kwargs):
        try:
            return fit(self, *args, **kwargs)
        finally:
            after_fit(self)

    setattr(wrapped, _FIT_WRAPPED, after_fit)
    type.__setattr__(trainer, "fit", wrapped)

def is_float(variable) -> bool:
    """Whether a Keras or tf variable holds floating-point values."""
    return keras.backend.standardize_dtype(variable.dtype).startswith(("float", "bfloat"))

# ----------------------------------------------------------------- layers
# Debug layers find out, at trace time, which Keras loop is calling them by
# walking the Python stack: `Trainer.fit`/`evaluate`/`predict` call the
# model's `train_step`/`test_step`/`predict_step`, which calls the layers.
# Those method names and the `callbacks` local of the loop are Keras
# internals too (checked by tests/test_keras_internals.py).
STEP_METHODS = {"train_step": "fit", "test_step": "evaluate", "predict_step": "predict"}

LOOP_METHODS = ("fit", "evaluate", "predict")

FUNCTION_ATTRIBUTES = {
    "fit": "train_function",
    "evaluate": "test_function",
    "predict": "predict_function",
}

class StepContext:
    """Where a layer is being called from.

    Attributes:
        mode: "fit", "evaluate", "predict", or "call" (any other call: eager,
            a custom training loop, a `tf.function` of the user's).
        model: the Keras model whose step is running, or None.
        callbacks: the running loop's `CallbackList`, or None (e.g. in
            `train_on_batch`).
    """

    def __init__(self, mode: str, model=None, callbacks=None):
        self.mode = mode
        self.model = model
        self.callbacks = callbacks

def _loop_frame(frame, model, loops=LOOP_METHODS):
    """The frame of the Keras loop (`fit`, ...) running `model` above `frame`, or None."""
    while frame is not None:
        if frame.f_code.co_name in loops and frame.f_locals.get("self") is model:
            return frame
        frame = frame.f_back
    return None

def fit_running(model) -> bool:
    """Whether a `fit` of `model` is on the calling thread's stack.

    Examples:
        >>> import keras
        >>> fit_running(keras.Sequential([keras.layers.Dense(1)]))
        False
    """
    import sys

    return _loop_frame(sys._getframe(1), model, ("fit",)) is not None

def _loop_callbacks(frame, model):
    """The `callbacks` local of the Keras loop running `model` above `frame`."""
    from keras.src.callbacks.callback_list import CallbackList

    frame = _loop_frame(frame, model)
    found = frame.f_locals.get("callbacks") if frame is not None else None
    return found if isinstance(found, CallbackList) else None

def fit_batch_size(model):
    """The global batch size of the `fit` running `model` (from a callback),
    as its data adapter reports it, or None when unknown."""
    import sys

    frame = _loop_frame(sys._getframe(1), model, ("fit",))
    if frame is None:
        return None
    adapter = getattr(frame.f_locals.get("epoch_iterator"), "data_adapter", None)
    size = getattr(adapter, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None

def running_callbacks(model):
    """The `CallbackList` of the Keras loop running `model` (from a callback), or None."""
    import sys

    return _loop_callbacks(sys._getframe(1), model)

def step_context() -> StepContext:
    """The `StepContext` of the current call (cheap: a walk of frames).

    Under `MirroredStrategy` the step runs in a replica thread while the
    thread running `fit` waits; the loop's frame is then found in that thread.
    """
    import sys
    import threading

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code.co_name
        owner = frame.f_locals.get("self")
        if code in STEP_METHODS and isinstance(owner, keras.Model):
            break
        frame = frame.f_back
    if frame is None:
        return StepContext("call")
    mode, model = STEP_METHODS[frame.f_code.co_name], frame.f_locals["self"]
    callbacks = _loop_callbacks(frame, model)
    if callbacks is None:
        current = threading.get_ident()
        for ident, other in sys._current_frames().items():
            if ident != current:
                callbacks = _loop_callbacks(other, model)
                if callbacks is not None:
                    break
    return StepContext(mode, model, callbacks)
