"""Every private part of Keras that kerasdbg relies on, in one place.

Keras 3 has no public hook for the gradients that `fit` applies. kerasdbg
wraps two methods of the optimizer instance for the duration of a `fit`:

- `apply` (public), for the step being applied, whether the loss scaler
  skipped it, and the weights before and after the update;
- `_all_reduce_sum_gradients` (private, TensorFlow backend), whose result is
  the gradient the optimizer applies: after clipping and, under a
  `tf.distribute` strategy, after the cross-replica sum.

`check_supported` is called before anything is patched, and
`tests/test_keras_internals.py` fails loudly if an upgrade moves any of this.
"""

from __future__ import annotations

import keras
import tensorflow as tf

REDUCE_METHOD = "_all_reduce_sum_gradients"
VAR_KEY_METHOD = "_var_key"


class KerasInternalsError(RuntimeError):
    """The installed Keras no longer has what kerasdbg hooks into."""


def check_supported(optimizer) -> None:
    """Raises `KerasInternalsError` if `optimizer` cannot be instrumented."""
    if keras.backend.backend() != "tensorflow":
        raise KerasInternalsError(
            "kerasdbg needs the TensorFlow backend of Keras. "
            f"Received: keras.backend.backend()={keras.backend.backend()!r}"
        )
    inner = inner_optimizer(optimizer)
    for owner, name in ((optimizer, "apply"), (inner, REDUCE_METHOD), (inner, VAR_KEY_METHOD)):
        if not callable(getattr(owner, name, None)):
            raise KerasInternalsError(
                f"kerasdbg: {type(owner).__name__} has no method `{name}` "
                f"(Keras {keras.__version__}). kerasdbg supports Keras >= 3.0 "
                "with the TensorFlow backend; please report this Keras version."
            )


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


def unpatch(obj, name: str) -> None:
    """Removes the instance attribute set by `patch`, if any."""
    if name in vars(obj):
        object.__delattr__(obj, name)


def read(variable) -> tf.Tensor:
    """The current value of a Keras or tf variable as a tensor (in-graph)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return tf.convert_to_tensor(variable)
