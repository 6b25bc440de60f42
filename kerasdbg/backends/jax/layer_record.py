"""JAX side of the debug layers, in the trace: one call's record in Keras's state.

Keras's JAX trainer runs stateless steps: a layer's variables are arrays of
the step's state, read and assigned through Keras's `StatelessScope`, and
only what the step returns survives it. So a debug layer keeps everything it
writes in Keras variables that the state carries (non-trainable, tracked by
the layer): the call counters (int32: JAX truncates int64 unless x64 is on),
the ring buffer of rows (float32) and, for a `TapLayer` after an activation,
its runs of flagged examples. `train_step`, `test_step` and `predict_step`
all return the updated non-trainable variables; the host reads the buffer
from the state the loop holds (`kerasdbg.backends.jax.layer_sink`).

A row is `HEAD` (the call id, the mode's index and the step, as the bit
patterns of int32 in float32 columns: exact at any size) then each field
flattened, cast to float32.

The step number in `fit` is the optimizer step this forward pass belongs to:
the largest step counter of the optimizers (`keras_objects.step_counters`),
each plus the steps kerasdbg kept its optimizer from counting (skipped by
`action="skip"` or frozen by a fault), + 1, read from the state the
model's `train_step(self, state, data)` was given (its frame, found on the
stack at trace time): the counters live in the optimizer variables
(`state[2]`) or, for a second optimizer of a train step written for JAX,
in the non-trainable ones (`state[1]`), which the forward pass inside
`jax.value_and_grad` does not receive. Closing over those
arrays (tracers of the enclosing jit) is legal there. In `evaluate`,
`predict` and other calls the number is the layer's own count of calls in
that mode, as on TensorFlow.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from kerasdbg import stats as stats_lib
from kerasdbg.backends.jax import ops as _ops
from kerasdbg.capture import keras_objects

HEAD = ("id", "mode", "step")
"""The first columns of a row (int32 bit patterns)."""

STEP_METHODS = {"train_step": "fit", "test_step": "evaluate", "predict_step": "predict"}
"""The model methods whose frame tells the mode of a call (as on TensorFlow)."""

class Context:
    """Where a debug layer is called from.

    Attributes:
        mode: "fit", "evaluate", "predict" or "call".
        model: the model whose step runs, or None.
        callbacks: the running loop's `CallbackList`, or None.
        state: the state the model's step was given (in `fit`), or None.
    """

    def __init__(self, mode: str, model=None, callbacks=None, state=None):
        self.mode = mode
        self.model = model
        self.callbacks = callbacks
        self.state = state


def context() -> Context:
    """The `Context` of the current call (a walk of the Python stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in STEP_METHODS and isinstance(owner, keras.Model):
            break
        frame = frame.f_back
    if frame is None:
        return Context("call")
    mode, model = STEP_METHODS[frame.f_code.co_name], frame.f_locals["self"]
    return Context(mode, model, keras_objects.running_callbacks(model),
                   frame.f_locals.get("state"))


class Ring:
    """The ring buffer of one layer: `slots + 1` float32 rows (the last one
    takes the calls that record nothing), as a non-trainable variable the
    layer tracks (so that Keras's state carries it)."""

    def __init__(self, slots: int, fields: Dict[str, Tuple[tuple, str]]):
        self.slots = slots
        layout, width = [], len(HEAD)
        for key, (shape, dtype) in fields.items():
            size = int(np.prod(shape, dtype=np.int64))
            layout.append((key, tuple(shape), np.dtype(dtype), width, width + size))
            width += size
        self.layout = tuple(layout)
        self.width = width
        # Not autocast: under a mixed precision policy a layer's float reads
        # become float16, which would garble the rows' int32 head.
        self.rows = keras.Variable(np.zeros((slots + 1, width), np.float32), dtype="float32",
                                   trainable=False, autocast=False, name="rows")
        _mark(self.rows)


def int_variable(value, name: str) -> keras.Variable:
    """A non-trainable int32 variable (a counter, a state of the layer)."""
    return _mark(keras.Variable(np.asarray(value, np.int32), dtype="int32", trainable=False,
                                name=name))


_DEBUG = "_kerasdbg_debug_layer_state"


def _mark(variable):
    setattr(variable, _DEBUG, True)
    return variable


def is_debug_variable(variable) -> bool:
    """Whether `variable` is a debug layer's (a counter, a buffer, a tap's
    runs): what a step writes there records the step and must survive a
    freeze of the model's state (as on TensorFlow, where it is no weight)."""
    return bool(getattr(variable, _DEBUG, False))


def decode(table: np.ndarray) -> np.ndarray:
    """A buffer read back as TensorFlow's layout: float64, the head as numbers."""
    table = np.asarray(table)
    out = table.astype(np.float64)
    out[:, :len(HEAD)] = np.ascontiguousarray(table[:, :len(HEAD)]).view(np.int32)
    return out


def _counter_values(model, state) -> list:
    """The step counters of `model`'s optimizers in `state` (the state its
    `train_step` was given), each plus the steps kerasdbg kept it from
    counting (`engine.skipped_offset`)."""
    from kerasdbg.backends.jax import engine as _engine  # which imports this module

    counters = keras_objects.step_counters(model)
    if not counters:
        return []
    groups = [list(model.trainable_variables), list(model.non_trainable_variables)]
    if getattr(model, "optimizer", None) is not None:
        groups.append(list(model.optimizer.variables))
    try:
        parts = [list(state[i]) for i in range(len(groups))]
    except (TypeError, IndexError, KeyError):
        parts = None
    if parts is None or [len(p) for p in parts] != [len(g) for g in groups]:
        raise RuntimeError(
            f"the train step of model {model.name!r} was not given Keras's state "
            "(trainable, non-trainable, optimizer and metrics variables) as `state`, so "
            "the optimizers' step counters, which number the records of `fit`, cannot be "
            "found; name the train step's state argument `state`, as Keras does")
    where = {}
    for group, part in zip(groups, parts):
        for variable, value in zip(group, part):
            where.setdefault(id(variable), value)
    values = []
    for counter in counters:
        if id(counter) not in where:
            raise RuntimeError(
                f"the step counter {counter.path!r} of an optimizer of model "
                f"{model.name!r} is not in the train step's state (Keras's JAX trainer "
                "carries `model.optimizer`'s variables and the model's non-trainable "
                "ones): track the optimizer's variables in the model")
        # kerasdbg numbers the steps it skipped too (`iterations` does not count them).
        values.append(jnp.asarray(where[id(counter)], jnp.int32)
                      + _engine.skipped_offset(model, counter))
    return values


# Where JAX runs a function in a trace of its own, nested in the step's: by
# the file (and function) of its frame.
_TRANSFORMS = (
    ("/jax/_src/lax/control_flow/loops.py", None, "lax.scan / lax.while_loop / lax.fori_loop"),
    ("/jax/_src/lax/control_flow/conditionals.py", None, "lax.cond / lax.switch"),
    ("/jax/_src/ad_checkpoint.py", None, "jax.checkpoint (remat)"),
    ("/jax/_src/api.py", "vmap_f", "jax.vmap"),
    ("/jax/_src/api.py", "pmap_f", "jax.pmap"),
)


def _nested_transform() -> Optional[str]:
    """The JAX transform the current call runs inside, within the step (a
    frame of lax.scan, lax.cond, jax.checkpoint, vmap), or None."""
    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < 400:
        path = frame.f_code.co_filename.replace("\\", "/")
        for where, function, name in _TRANSFORMS:
            if path.endswith(where) and (function is None or frame.f_code.co_name == function):
                return name
        frame, depth = frame.f_back, depth + 1
    return None


def record(layer, inputs, where: Context, values) -> None:
    """One call of `layer` (a `DebugLayer` built on JAX): counts it and, at
    the steps it selects, writes its row; every write is an `assign` (to
    Keras's stateless scope inside a step). `values(key, x, state, mode)`
    returns the fields and the new state (`DebugLayer._compute_values` on
    JAX)."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    if not in_stateless_scope() and isinstance(inputs, jax.core.Tracer):
        raise RuntimeError(
            "called inside a JAX trace (jax.jit, jax.grad, ...) outside Keras's stateless "
            "scope, where the layer's counters and buffer cannot leave the trace; call the "
            "model there with `model.stateless_call(trainable, non_trainable, x)`, assign "
            "the non-trainable values it returns to `model.non_trainable_variables`, then "
            "call `flush()`")
    transform = _nested_transform()
    if transform is not None:
        raise RuntimeError(
            f"called inside {transform} within the step, whose values cannot leave it: a "
            "debug layer records on JAX only where the step itself runs it (not in an RNN "
            "cell under lax.scan, a rematerialized block, vmap, or a lax.cond branch); tap "
            "the output of the enclosing layer instead")
    mode = where.mode
    modes = layer.MODES
    mode_index = modes.index(mode)
    one_hot = jnp.asarray(np.eye(len(modes), dtype=np.int32)[mode_index])
    calls = jnp.asarray(layer.calls.value, jnp.int32) + 1
    mode_calls = jnp.asarray(layer.mode_calls.value, jnp.int32) + one_hot
    counters = _counter_values(where.model, where.state) \
        if where.model is not None and mode == "fit" else []
    if counters:
        number = jnp.max(jnp.stack(counters)) + 1
    else:
        number = mode_calls[mode_index]
    every = layer.every_n_steps
    selected = jnp.asarray(True) if every == 1 else (number % every == 0)
    ring = layer._ring
    state_variable = layer._state_variable()
    state = None if state_variable is None else state_variable.value
    x = jax.lax.stop_gradient(jnp.asarray(inputs))
    key = layer._values_key()

    def row_and_state():
        fields, new_state = values(key, x, state, mode)
        head = jax.lax.bitcast_convert_type(
            jnp.stack([calls, jnp.asarray(mode_index, jnp.int32), number]).astype(jnp.int32),
            jnp.float32)
        parts = [head] + [jnp.reshape(jnp.asarray(fields[name]).astype(jnp.float32), [-1])
                          for name, _, _, start, end in ring.layout if end > start]
        return jnp.concatenate(parts), state if new_state is None else new_state

    slot = (calls - 1) % ring.slots
    if every == 1:
        row, new_state = row_and_state()
    else:
        def skipped():
            return jnp.zeros([ring.width], jnp.float32), state

        if state is None:
            row = _ops.cond(selected, lambda: row_and_state()[0], lambda: skipped()[0])
            new_state = None
        else:
            row, new_state = _ops.cond(selected, row_and_state, skipped)
        slot = jnp.where(selected, slot, ring.slots)
    ring.rows.assign(ring.rows.value.at[slot].set(row))
    layer.calls.assign(calls)
    layer.mode_calls.assign(mode_calls)
    if state_variable is not None and new_state is not None \
            and mode not in ("evaluate", "predict"):
        state_variable.assign(new_state)


def eager(inputs) -> bool:
    """Whether a call runs eagerly (outside any trace and stateless scope):
    its records are read at once."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    leaves = keras.tree.flatten(inputs)
    return not in_stateless_scope() and not any(isinstance(x, jax.core.Tracer)
                                                for x in leaves)


# ------------------------------------------------------------- fields
def tap_values(key, x, state, mode):
    """`TapLayer`'s fields (`TapLayer._fields`) of one call, and its new runs."""
    stats, histogram, bins, sample_rows, health = key
    values = {
        "stats": stats_lib.tensor_statistics([x], stats)[0],
        "size": jnp.asarray(x.size, jnp.float32),
    }
    new_state = None
    if health is not None:
        values["health"], new_state = _health(health, x, state, mode)
    if histogram:
        counts, ranges = stats_lib.histograms([x], bins)
        values["hist_counts"], values["hist_range"] = counts[0], ranges[0]
    if sample_rows:
        rows = x[:sample_rows].astype(jnp.float32)
        missing = sample_rows - rows.shape[0]
        values["rows"] = jnp.pad(rows, [(0, missing)] + [(0, 0)] * (rows.ndim - 1))
        values["valid_rows"] = jnp.asarray(x.shape[0], jnp.float32)
    return values, new_state


TANH_INPUT_BOUND = 9.4999
SIGMOID_INPUT_BOUNDS = (-23.0, 16.99999)


def _saturated(activation: str, x):
    if activation == "tanh":
        return jnp.abs(x) >= jnp.asarray(np.tanh(TANH_INPUT_BOUND), x.dtype)
    low = jnp.asarray(1.0 / (1.0 + np.exp(-SIGMOID_INPUT_BOUNDS[0])), x.dtype)
    high = jnp.asarray(1.0 / (1.0 + np.exp(-SIGMOID_INPUT_BOUNDS[1])), x.dtype)
    return (x <= low) | (x >= high)


def _health(key, x, flagged_examples, mode):
    """As `TapLayer._health` on TensorFlow (see there), in float32."""
    activation, active_fraction, min_examples, axes = key
    y = x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)
    flagged = (y == 0) if activation == "relu" else _saturated(activation, y)
    if y.ndim < 2:  # rank 1: the units are the batch
        bad = flagged.astype(jnp.float32) >= 1.0 - active_fraction
        return jnp.mean(bad.astype(jnp.float32))[None], None
    share = jnp.mean(flagged.astype(jnp.float32), axis=tuple(axes))
    bad = share >= 1.0 - active_fraction
    rows = y.shape[0]
    runs = jnp.minimum(flagged_examples + rows, min_examples)
    runs = jnp.where(bad, runs, jnp.zeros_like(runs))
    if rows == 0:  # an empty batch changes nothing
        runs = flagged_examples
    health = jnp.mean((runs >= min_examples).astype(jnp.float32))[None]
    return health, (None if mode in ("evaluate", "predict") else runs.astype(jnp.int32))


def print_values(key, x, state, mode):
    """`PrintLayer`'s fields (`PrintLayer._fields`) of one call."""
    k, stats = key
    flat = jnp.reshape(x, [-1])
    head = flat[:k].astype(jnp.float32)
    tail = flat[-k:].astype(jnp.float32)  # the whole tensor when it has < k elements
    return {
        "shape": jnp.asarray(x.shape, jnp.float32).reshape([x.ndim]),
        "stats": stats_lib.tensor_statistics([x], stats)[0],
        "head": jnp.pad(head, [(0, k - head.shape[0])]),
        "tail": jnp.pad(tail, [(k - tail.shape[0], 0)]),
    }, None


VALUES = {"tap": tap_values, "print": print_values}
"""The fields of each kind of debug layer (`DebugLayer.KIND`)."""
