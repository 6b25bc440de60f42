"""Graph functions shared by every call site that computes the same thing.

A debug layer on every layer of a model computes the same statistics at each
of its hundreds of call sites. Built inline, each site adds the whole graph of
`kerasdbg.stats` (its `tf.cond`s included) to the train function, and Python
graph building then costs tens of milliseconds per site and trace. Here the
statistics of one flattened tensor are a `tf.function` traced once per
(statistics, dtype, number of elements), and each site adds one call op. In
graph mode Grappler inlines the call, and under XLA the cluster compiles it, so
the step runs the same operations as with the inline graph.

Eager calls compute inline (a function per batch size would retrace).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Hashable, Sequence, Tuple

import tensorflow as tf

from kerasdbg import stats as stats_lib

_FUNCTIONS: Dict[Hashable, Callable] = {}
_LOCK = threading.Lock()


def _shared(key: Hashable, python_function: Callable, signature) -> Callable:
    with _LOCK:
        function = _FUNCTIONS.get(key)
        if function is None:
            function = _FUNCTIONS[key] = tf.function(
                python_function, input_signature=signature, autograph=False,
                experimental_attributes={"_noinline": True})
        return function


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


def histogram(tensor, bins: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """`stats_lib.histograms([tensor], bins)` of one tensor: its `[bins]`
    counts and `[2]` range, one call op in a graph."""
    if tf.executing_eagerly():
        counts, ranges = stats_lib.histograms([tensor], bins)
        return counts[0], ranges[0]
    x, size = _flat(tensor)

    def compute(flat):
        counts, ranges = stats_lib.histograms([flat], bins)
        return counts[0], ranges[0]

    function = _shared(("histogram", bins, x.dtype, size), compute,
                       [tf.TensorSpec([size], x.dtype)])
    return function(x)


def _spec(tensor) -> tf.TensorSpec:
    return tf.TensorSpec(tensor.shape, tensor.dtype)


def layer_row(compute: Callable, settings: Hashable, layout: tuple, inputs, state,
              head) -> tf.Tensor:
    """One buffer row of a debug layer: `head` (int64 `[3]`), then each field
    of `compute(settings, inputs, state)` in `layout` order, as float64.

    `settings` holds everything `compute` reads besides its arguments; the
    layers with the same `compute`, settings, layout and input signature
    share one traced function.
    """
    x = tf.stop_gradient(tf.convert_to_tensor(inputs))
    if state is not None:
        state = tf.stop_gradient(state)

    def row(x, state, head):
        values = compute(settings, x, state)
        parts = [tf.cast(head, tf.float64)]
        parts += [tf.reshape(tf.cast(values[name], tf.float64), [-1])
                  for name, _, _, start, end in layout if end > start]
        return tf.concat(parts, 0)

    if tf.executing_eagerly():
        return row(x, state, head)
    signature = [_spec(x), None if state is None else _spec(state), tf.TensorSpec([3], tf.int64)]
    if state is None:
        function = _shared(("layer row", compute, settings, layout, signature[0]),
                           lambda x, head: row(x, None, head), [signature[0], signature[2]])
        return function(x, head)
    function = _shared(("layer row", compute, settings, layout, signature[0], signature[1]), row, signature)
    return function(x, state, head)
