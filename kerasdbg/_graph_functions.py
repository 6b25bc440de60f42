"""Graph functions shared by every call site that computes the same thing.

A debug layer on every layer of a model computes the same statistics at each
of its hundreds of call sites. Built inline, each site adds the whole graph of
`kerasdbg.stats` (its `tf.cond`s included) to the train function, and Python
graph building then costs tens of milliseconds per site and trace, and the
first execution's graph optimization grows with it. Here such work is a
`tf.function` traced once per settings and input signature, and each site
adds one call op. The functions are not inlined: the graph optimizer works on
each body once, and a call costs the executor about as much as the ops it
saves (measured: a model with 122 taps steps as fast either way). Under XLA
the cluster compiles the calls with the rest of the step.

Eager calls compute inline (a function per batch size would retrace).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable, Sequence, Tuple

import tensorflow as tf

from kerasdbg import stats as stats_lib

MAX_FUNCTIONS = 512
"""Functions kept (the least recently used go first); one per settings and
input signature, so a model rarely needs more than a few dozen."""

_FUNCTIONS: "collections.OrderedDict[Hashable, Callable]" = collections.OrderedDict()
_LOCK = threading.Lock()


def _shared(key: Hashable, python_function: Callable, signature) -> Callable:
    with _LOCK:
        function = _FUNCTIONS.get(key)
        if function is None:
            function = _FUNCTIONS[key] = tf.function(
                python_function, input_signature=signature, autograph=False,
                experimental_attributes={"_noinline": True})
            while len(_FUNCTIONS) > MAX_FUNCTIONS:
                _FUNCTIONS.popitem(last=False)
        else:
            _FUNCTIONS.move_to_end(key)
        return function


def clear() -> None:
    """Forgets every shared function: the next trace traces them again
    (the benchmark measures each fit's trace as a fresh process has it)."""
    with _LOCK:
        _FUNCTIONS.clear()


def _flat(tensor) -> Tuple[tf.Tensor, object]:
    x = tf.reshape(tf.stop_gradient(tf.convert_to_tensor(tensor)), [-1])
    return x, x.shape.num_elements()


def tensor_statistics(tensor, stats: Sequence[str]) -> tf.Tensor:
    """`stats_lib.tensor_statistics([tensor], stats)[0]`, one call op in a graph."""
    stats = tuple(stats)
    if tf.executing_eagerly():
        return stats_lib.tensor_statistics([tensor], stats)[0]
    x, size = _flat(tensor)
    function = _shared(
        ("statistics", stats, x.dtype, size),
        lambda flat: stats_lib.tensor_statistics([flat], stats)[0],
        [tf.TensorSpec([size], x.dtype)],
    )
    return function(x)


def _spec(tensor) -> tf.TensorSpec:
    return tf.TensorSpec(tensor.shape, tensor.dtype)


def shared_step(step: Callable, key: Hashable) -> Callable:
    """`call(x, counts, state)` running `step(x, counts, state)`: eagerly as
    is, in a graph as one call of a function shared by every `step` with the
    same `key` (everything `step` reads besides its arguments) and the same
    signature of the arguments. `counts` is a list of tensors, `state` a
    tensor or None; `x` and `state` are cut from the gradient."""

    def call(x, counts, state):
        x = tf.stop_gradient(tf.convert_to_tensor(x))
        if state is not None:
            state = tf.stop_gradient(state)
        if tf.executing_eagerly():
            return step(x, list(counts), state)
        args = [x, list(counts)] + ([] if state is None else [state])
        signature = [_spec(x), [_spec(c) for c in counts]] + (
            [] if state is None else [_spec(state)])
        key_signature = (signature[0], tuple(signature[1]), *signature[2:])
        function = _shared(("step", key, key_signature),
                           lambda x, counts, *state: step(x, counts, *(state or [None])),
                           signature)
        return function(*args)

    return call
