"""Graph functions shared by every call site that computes the same thing.

A debug layer on every layer of a model computes the same statistics at each
of its hundreds of call sites, and the capture engine computes the statistics
of a model's gradients and weights (the same shapes) at every trace of the
train step. Built inline, each site adds the whole graph of `kerasdbg.stats`
(its `tf.cond`s included) to the train function: Python graph building then
costs about 0.3 ms per op and trace, and the first execution's graph
optimization grows with the graph. Here such work is a `tf.function` traced
once per settings and input signature (an LRU of `MAX_FUNCTIONS`), and each
site adds one call op.

Two kinds of call (measured on ResNet50's 214 weights, 2 CPU cores):

- inlined (`inline=True`): TensorFlow inlines the body into each graph that
  calls it, in C++, at its first execution; the Python trace is paid once.
  The statistics tables are called so (all statistics: 0.4 s trace and 2.5 s
  first execution per new graph, against 3.8 s and 12.0 s built inline);
- kept (`inline=False`): the call stays a call. TensorFlow instantiates and
  optimizes the body at the call's first execution, in every new graph that
  calls it (no cache across graphs), and never when the call sits in a
  branch no step takes. The debug layers' step functions (the graph
  optimizer works on each body once; a model with 122 taps steps as fast
  either way), the engine's schedule chains and the masked statistics path,
  which runs only when a value is not finite, are called so.

Under XLA the cluster compiles the calls with the rest of the step. Eager
calls compute inline (a function per batch size would retrace).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable, Sequence

import tensorflow as tf

from kerasdbg import stats as stats_lib
from kerasdbg.backends.tensorflow import ops as _ops

MAX_FUNCTIONS = 512
"""Functions kept (the least recently used go first); one per settings and
input signature, so a model rarely needs more than a few dozen."""

_FUNCTIONS: "collections.OrderedDict[Hashable, Callable]" = collections.OrderedDict()
_LOCK = threading.Lock()


def _shared(key: Hashable, python_function: Callable, signature, inline: bool = False) -> Callable:
    # The ops of `kerasdbg.stats` take other forms where XLA compiles them
    # (`ops.reduce_sums`, `ops.all_finite`, `ops.stack_small`): a body traced
    # for a graph XLA does not compile (a fit with jit_compile=False) is not
    # the one to call from a graph it compiles, and the other way round.
    key = (key, _ops.xla_form())
    with _LOCK:
        function = _FUNCTIONS.get((key, inline))
        if function is None:
            function = _FUNCTIONS[(key, inline)] = tf.function(
                python_function, input_signature=signature, autograph=False,
                experimental_attributes=None if inline else {"_noinline": True})
            while len(_FUNCTIONS) > MAX_FUNCTIONS:
                _FUNCTIONS.popitem(last=False)
        else:
            _FUNCTIONS.move_to_end((key, inline))
        return function


def clear() -> None:
    """Forgets every shared function: the next trace traces them again
    (the benchmark measures each fit's trace as a fresh process has it)."""
    with _LOCK:
        _FUNCTIONS.clear()


def tensor_statistics(tensor, stats: Sequence[str]) -> tf.Tensor:
    """`stats_lib.tensor_statistics([tensor], stats)[0]`, one call op in a
    graph, shared by every tensor of the same size and dtype."""
    return statistics_table([tf.reshape(tensor, [-1])], stats)[0]


def statistics_table(tensors: Sequence, stats: Sequence[str]) -> tf.Tensor:
    """`stats_lib.tensor_statistics(tensors, stats)`; in a graph one call op
    of a function shared by every call with the same statistics and the same
    shapes and dtypes (a model's gradients and weights share theirs).

    `tensors` may be a `stats_lib.Packed` of them, else they are packed here,
    outside the function: its call takes one vector per dtype of the small
    tensors and one per large tensor, not one per tensor (a call's inputs
    cost trace time, and each condition inside it takes them again).

    Its body holds the fast path; the masked path, which runs only when a
    value is not finite, is a second function called from the body's
    `tf.cond`: the graph optimizer never works on it (its constant folding
    materialises a segment id per element of every large tensor: seconds for
    a large model) unless a step takes it.
    """
    stats = tuple(stats)
    if tf.executing_eagerly() or not len(tensors) or not stats:
        return stats_lib.tensor_statistics(tensors, stats)
    packed = stats_lib.Packed.of(tensors)
    if not packed.vectors:  # only empty tensors: constants
        return stats_lib.tensor_statistics(packed, stats)
    layout = packed.layout

    def masked(vectors):
        return stats_lib.masked_statistics(stats_lib.Packed(vectors, *layout), stats)

    def table(vectors):
        packed = stats_lib.Packed(vectors, *layout)
        fast, finite = stats_lib.fast_statistics(packed, stats)
        if finite is True:
            return fast
        return tf.cond(finite, lambda: fast, lambda: shared_call(
            ("masked", stats, layout), masked, [vectors], inline=False))

    return shared_call(("table", stats, layout), table, [packed.vectors])


def shared_call(key: Hashable, python_function: Callable, args: Sequence, inline: bool = True):
    """`python_function(*args)`; in a graph one call of a function shared by
    every call with the same `key` (everything the function reads besides
    its arguments) and the same shapes and dtypes of `args` (tensors, or
    lists of tensors; `tf.IndexedSlices` are made dense).

    An `inline` function is traced once in Python and inlined into each
    graph that calls it by TensorFlow's graph optimization (fast, in C++);
    one that is not keeps its call: TensorFlow instantiates and optimizes
    its body at the first execution of the call, in every new graph, and
    never when the call sits in a branch no step takes.
    """

    def dense(arg):
        # Cut from the gradient: a watching tape would otherwise have the
        # call's backward function built (the conds and the masked call too).
        if isinstance(arg, (list, tuple)):
            return [tf.stop_gradient(tf.convert_to_tensor(t)) for t in arg]
        return tf.stop_gradient(tf.convert_to_tensor(arg))

    args = [dense(a) for a in args]
    if tf.executing_eagerly():
        return python_function(*args)

    def spec(arg):
        return [_spec(t) for t in arg] if isinstance(arg, list) else _spec(arg)

    def spec_key(arg):
        return tuple(signature_key(t) for t in arg) if isinstance(arg, list) else signature_key(arg)

    signature = [spec(a) for a in args]
    function = _shared((key, tuple(spec_key(a) for a in args)), python_function, signature,
                       inline)
    return function(*args)


def _spec(tensor) -> tf.TensorSpec:
    return tf.TensorSpec(tensor.shape, tensor.dtype)


def signature_key(tensor) -> tuple:
    """`(shape, dtype name)` of a tensor, hashable (shape None when its rank
    is unknown): what a cache of traced functions keys on."""
    shape = tensor.shape
    return (None if shape.rank is None else tuple(shape.as_list()), tensor.dtype.name)


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
