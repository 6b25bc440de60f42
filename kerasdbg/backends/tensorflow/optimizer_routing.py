"""The optimizer methods that kerasdbg routes through itself while a train
step is traced.

Keras 3 has no public hook for the gradients that `fit` applies. While a
kerasdbg train step is being traced (only then: tracing is the only time
Python runs inside `fit`'s compiled step), kerasdbg routes these optimizer
methods through itself (`optimizer_routes`):

- `apply` (public) of every optimizer class that defines one (Keras's
  `BaseOptimizer` and `LossScaleOptimizer`, and a wrapper another tool put
  on a class), for every optimizer the train step applies, wherever the
  model keeps it: the step being applied, whether the loss scaler skipped
  it, the gradients the model produced and the weights before and after the
  update;
- `_all_reduce_sum_gradients` (private, TensorFlow backend), whose result is
  the gradient the optimizer applies: after clipping and, under a
  `tf.distribute` strategy, after the cross-replica sum;
- `_distributed_tf_update_step` and `_apply_weight_decay` (private,
  TensorFlow backend), which a frozen step skips inside Keras's own `apply`
  (`update_gateable`).

A class method is replaced only during traces and put back after each, so
nothing is left on any optimizer instance. `fit` itself is wrapped once
(`kerasdbg.capture.keras_objects.wrap_fit`) so that whatever way a `fit`
ends, an exception included, kerasdbg restores the model it instrumented.

`check_supported` is called before anything is patched, and
`tests/test_keras_internals.py` fails loudly if an upgrade moves any of this.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import types
from typing import List, Tuple

import keras

from kerasdbg.capture.keras_objects import (
    VAR_KEY_METHOD,
    KerasInternalsError,
    ensure_built,
    inner_optimizer,
)

REDUCE_METHOD = "_all_reduce_sum_gradients"
UPDATE_METHOD = "_distributed_tf_update_step"
WEIGHT_DECAY_METHOD = "_apply_weight_decay"
AVERAGE_METHODS = ("_update_model_variables_moving_average",
                   "_overwrite_model_variables_with_average_value")
"""EMA's update of its averages and its overwrite of the variables with them
(`use_ema=True`): both take `(self, trainable_variables)`."""


def check_supported(optimizer) -> None:
    """Raises `KerasInternalsError` if `optimizer` cannot be instrumented."""
    if keras.backend.backend() != "tensorflow":
        raise KerasInternalsError(
            "kerasdbg needs the TensorFlow backend of Keras. "
            f"Received: keras.backend.backend()={keras.backend.backend()!r}"
        )
    inner = inner_optimizer(optimizer)
    owners = ((optimizer, "apply"), (inner, REDUCE_METHOD), (inner, VAR_KEY_METHOD),
              (inner, "_iterations"))
    owners += tuple((cls, name) for cls, name in _routed_methods())
    for owner, name in owners:
        if getattr(owner, name, None) is None:
            kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
            raise KerasInternalsError(
                f"kerasdbg: {kind} has no `{name}` "
                f"(Keras {keras.__version__}). kerasdbg supports Keras >= 3.0 "
                "with the TensorFlow backend; please report this Keras version."
            )


def build_optimizer_before_trace(model) -> bool:
    """Builds the model's optimizer now, outside `fit`'s first trace; returns
    whether it did.

    Without an explicit strategy Keras builds the optimizer inside the first
    trace of the train function; that trace then creates variables, and
    `tf.function` throws it away and traces again, so everything in the
    graph (taps, statistics) is traced twice. Keras itself builds first under
    an explicit strategy (`Trainer._symbolic_build`); this is that build. A
    model whose layers are not all built yet (a subclassed model before its
    first call) is left to Keras: its variables do not exist yet.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return False
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    with model.distribute_strategy.scope():
        ensure_built(optimizer, model.trainable_variables)
    return True


def _routed_methods() -> List[Tuple[type, str]]:
    """The class methods `optimizer_routes` replaces: `BaseOptimizer.apply`,
    `LossScaleOptimizer.apply`, the `apply` that another tool or a test put on
    any optimizer class (such as a wrapper of the function it saved from
    `AdamW.apply` first, which no route further up would see), and the
    TensorFlow optimizer's reduction, update and weight decay."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    classes, pending = [], [BaseOptimizer]
    while pending:
        cls = pending.pop(0)
        if cls in classes:
            continue
        classes.append(cls)
        pending.extend(type.__subclasses__(cls))
    # Keras's own `apply`s route through these two (a MultiOptimizer's
    # dispatches to its optimizers' own); one from elsewhere is routed too.
    keras_applies = (BaseOptimizer, keras.optimizers.LossScaleOptimizer)
    applies = [(cls, "apply") for cls in classes
               if cls in keras_applies or (_takes_apply_arguments(cls.__dict__.get("apply"))
                                           and not _from_keras(cls.__dict__["apply"]))]
    return applies + [(TFOptimizer, REDUCE_METHOD), (TFOptimizer, UPDATE_METHOD),
                      (TFOptimizer, WEIGHT_DECAY_METHOD)] + _average_owners()


def _takes_apply_arguments(function) -> bool:
    """Whether `function` is a function callable as `apply(self, grads,
    trainable_variables)`, as Keras calls it (a class's own `apply` of
    another signature is left alone)."""
    if not isinstance(function, types.FunctionType):
        return False
    try:
        inspect.signature(function).bind(None, [], None)
    except (TypeError, ValueError):
        return False
    return True


_KERAS_SOURCES = os.path.dirname(os.path.abspath(keras.__file__)) + os.sep


def _from_keras(function) -> bool:
    """Whether `function`'s code is Keras's own (by its file: a wrapper made
    with `functools.wraps(AdamW.apply)` carries Keras's `__module__`)."""
    code = getattr(function, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_KERAS_SOURCES)


_ROUTES_LOCK = threading.Lock()
_ROUTES_DEPTH = 0
_ROUTES_ORIGINALS: dict = {}


@contextlib.contextmanager
def optimizer_routes(apply_route, reduce_route, update_route, weight_decay_route,
                     average_route):
    """While active, every optimizer's `apply` runs as
    `apply_route(optimizer, original_apply, grads, trainable_variables)`,
    its `_all_reduce_sum_gradients` as `reduce_route(optimizer,
    original_reduce, grads_and_vars)`, its `_distributed_tf_update_step`
    as `update_route(optimizer, original_update, distribution,
    grads_and_vars, learning_rate)`, its `_apply_weight_decay` as
    `weight_decay_route(optimizer, original, variables)` and EMA's two
    methods (`AVERAGE_METHODS`) as `average_route(optimizer, original,
    variables)`, where the originals are bound methods.

    Class-level and reference-counted: the replicas of a `MirroredStrategy`
    trace their steps at the same time in several threads, and routes that
    do not recognise the optimizer call the original. Only kerasdbg's own
    four routes are ever passed. Where several classes of an optimizer's
    hierarchy define `apply`, each is routed, and the route passes the
    calls that the first one made on to the original.
    """
    global _ROUTES_DEPTH
    routes = {REDUCE_METHOD: reduce_route, UPDATE_METHOD: update_route,
              WEIGHT_DECAY_METHOD: weight_decay_route,
              **{name: average_route for name in AVERAGE_METHODS}}
    with _ROUTES_LOCK:
        if _ROUTES_DEPTH == 0:
            for cls, name in _routed_methods():
                original = cls.__dict__[name]
                _ROUTES_ORIGINALS[(cls, name)] = original
                type.__setattr__(cls, name, _routed(original, routes.get(name, apply_route), name))
        _ROUTES_DEPTH += 1
    try:
        yield
    finally:
        with _ROUTES_LOCK:
            _ROUTES_DEPTH -= 1
            if _ROUTES_DEPTH == 0:
                _restore_optimizer_methods()


def _restore_optimizer_methods() -> None:
    """Puts back every class method `optimizer_routes` replaced (under the lock)."""
    for (cls, name), original in list(_ROUTES_ORIGINALS.items()):
        type.__setattr__(cls, name, original)
    _ROUTES_ORIGINALS.clear()


def routes_active() -> bool:
    """Whether an optimizer class method is routed now (for tests)."""
    return any(getattr(cls.__dict__[name], "_kerasdbg_route", False)
               for cls, name in _routed_methods())


def _routed(original, route, name):
    if name == REDUCE_METHOD:
        @functools.wraps(original)
        def routed(self, grads_and_vars):
            return route(self, functools.partial(original, self), grads_and_vars)
    elif name == WEIGHT_DECAY_METHOD or name in AVERAGE_METHODS:
        @functools.wraps(original)
        def routed(self, variables):
            return route(self, functools.partial(original, self), variables)
    elif name == UPDATE_METHOD:
        @functools.wraps(original)
        def routed(self, distribution, grads_and_vars, learning_rate):
            return route(self, functools.partial(original, self), distribution, grads_and_vars,
                         learning_rate)
    else:
        @functools.wraps(original)
        def routed(self, grads, trainable_variables=None, *args, **kwargs):
            if args or kwargs:  # an `apply` of another signature: not one kerasdbg knows
                return original(self, grads, trainable_variables, *args, **kwargs)
            return route(self, functools.partial(original, self), grads, trainable_variables)
    routed._kerasdbg_route = True
    return routed


def _unrouted(cls, name: str):
    """`cls.<name>` as it is outside a trace (the function a route wraps)."""
    function = getattr(cls, name, None)
    return function.__wrapped__ if getattr(function, "_kerasdbg_route", False) else function


def _average_owners() -> list:
    """`[(class, name)]` of Keras's own EMA methods (`AVERAGE_METHODS`) that
    this Keras has (an EMA optimizer is gateable only where it has both)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    owners = [next(((cls, name) for cls in (TFOptimizer, BaseOptimizer)
                    if name in cls.__dict__), None) for name in AVERAGE_METHODS]
    return [owner for owner in owners if owner is not None]


def update_gateable(optimizer, variables) -> bool:
    """Whether every write that `optimizer.apply` derives from the gradients
    happens in `_distributed_tf_update_step`, so that a condition there can
    skip the update and leave the rest of `apply` as Keras traces it.

    True for Keras's own `apply` (not a mixed-precision `LossScaleOptimizer`,
    not one another tool replaced) and `update_step` of an optimizer without
    clipping, loss scaling, gradient accumulation, variable constraints or
    variables overwritten with their gradient, whose `_backend_apply_gradients`, `_backend_update_step` and
    `_distributed_tf_update_step` are the TensorFlow backend's.
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    if optimizer is not inner_optimizer(optimizer) or not isinstance(optimizer, TFOptimizer):
        return False
    cls = type(optimizer)
    for owner, name in ((BaseOptimizer, "apply"), (BaseOptimizer, "_backend_apply_gradients"),
                        (BaseOptimizer, "_overwrite_variables_directly_with_gradients"),
                        (TFOptimizer, "_backend_update_step"), (TFOptimizer, UPDATE_METHOD),
                        (TFOptimizer, WEIGHT_DECAY_METHOD)):
        if _unrouted(cls, name) is not _unrouted(owner, name):
            return False
    # Keras's own update steps read the step count and write only the
    # variables and the optimizer's slots (`_route_update` relies on both).
    if not getattr(_unrouted(cls, "update_step"), "__module__", "").startswith("keras."):
        return False
    # Clipping and loss scaling compute on the gradients before the update:
    # with the update in a condition of its own, TensorFlow's graph optimizer
    # may fuse them otherwise than in plain Keras (a last-bit difference).
    if any(getattr(optimizer, name, None) is not None
           for name in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")):
        return False
    # EMA's writes after the update (its averages, and its overwrite of the
    # variables with them) have a route of their own (`AVERAGE_METHODS`).
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return False
    owners = _average_owners()
    if getattr(optimizer, "use_ema", False) and (len(owners) < len(AVERAGE_METHODS) or any(
            _unrouted(cls, name) is not _unrouted(owner, name) for owner, name in owners)):
        return False
    return not any(getattr(v, "overwrite_with_gradient", False)
                   or getattr(v, "constraint", None) is not None for v in variables)
