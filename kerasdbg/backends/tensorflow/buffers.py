"""Ring-buffer variables written in the train graph and read on the host.

Buffers are `ON_READ` / `ONLY_FIRST_REPLICA` variables: under a
`tf.distribute` strategy each replica writes its own copy with no
communication, a plain read returns replica 0's copy, and
`strategy.experimental_local_results` returns every replica's. Rows are
written with `assign(tensor_scatter_nd_update(...))` because
`scatter_nd_update` is not implemented for sync-on-read variables.
"""

from __future__ import annotations

import re
import weakref
from typing import Callable, List, Optional

import numpy as np
import tensorflow as tf

from kerasdbg.sinks import workers as _workers


def on_read_variable(initial_value, name: str, shapeless: bool = False) -> tf.Variable:
    """A non-trainable buffer each replica writes for itself; a `shapeless`
    one takes a value of any shape at each assignment (not under XLA).

    `name` may hold a user's layer name: what TensorFlow refuses in an op
    name (a leading `_` or `-`, spaces, other characters) becomes `_`, and
    the name starts with `kerasdbg_` where it would not start validly."""
    return tf.Variable(
        initial_value,
        trainable=False,
        name=variable_name(name),
        shape=tf.TensorShape(None) if shapeless else None,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def variable_name(name: str) -> str:
    """`name` as TensorFlow accepts it for a variable created anywhere (the
    root of a graph included): `[A-Za-z0-9.][A-Za-z0-9_.-]*`."""
    name = _INVALID.sub("_", str(name))
    return name if _VALID_START.match(name) else f"kerasdbg_{name}"


_INVALID = re.compile(r"[^A-Za-z0-9_.\-]")
_VALID_START = re.compile(r"[A-Za-z0-9.]")


def write_row(buffer: tf.Variable, row, value) -> None:
    """Writes `value` into row `row` of `buffer` (in-graph, XLA-safe).

    A plain variable (no strategy, or one that keeps plain variables) is
    updated in place by one `ResourceScatterNdUpdate`; a sync-on-read
    variable of a strategy, which has no scatter, by reading, updating and
    assigning the whole buffer. The in-place write is one op at the end of
    the step instead of three in a row (the next step waits for it).
    """
    value = tf.expand_dims(tf.cast(value, buffer.dtype), 0)
    # reshape/expand_dims: 4 graph ops fewer than [[row]] and value[None]
    # (each tap writes several rows, and trace time grows with graph size).
    index = tf.reshape(row, [1, 1])
    if not isinstance(buffer, tf.distribute.DistributedValues):
        buffer.scatter_nd_update(index, value)
        return
    buffer.assign(tf.tensor_scatter_nd_update(buffer.read_value(), index, value))


def read(buffer: tf.Variable) -> np.ndarray:
    """Replica 0's copy (the cheapest eager read: `value()`, not `numpy()`)."""
    return buffer.value().numpy()


def read_replicas(buffer: tf.Variable, column: Optional[int] = None) -> List[np.ndarray]:
    """Every replica's copy, replica 0 first; one element without a strategy.
    With `column`, only that column of a matrix (sliced before the copy)."""
    strategy = getattr(buffer, "distribute_strategy", None)
    if strategy is None or not isinstance(buffer, tf.distribute.DistributedValues):
        if column is None:
            return [read(buffer)]
        copies = [buffer]
    else:
        copies = strategy.experimental_local_results(buffer)
    if column is not None:
        return [np.asarray(v[:, column].numpy()) for v in copies]
    return [np.asarray(v.numpy()) for v in copies]


_GATHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _gather_function(strategy):
    """`strategy.gather(values, axis=0)` as a `tf.function`, one per strategy:
    run eagerly, each gather across workers took 75-97 ms on two local
    workers, traced 4-9 ms (bench/bench_multi_worker.py's machine)."""
    function = _GATHERS.get(strategy)
    if function is None:
        function = _GATHERS[strategy] = tf.function(
            lambda values: strategy.gather(values, axis=0), reduce_retracing=True)
    return function


def gather_workers(local: np.ndarray, strategy) -> np.ndarray:
    """`local` (one row per replica of this worker, replica 0 first) of every
    worker of a multi-worker strategy, one row per replica of the cluster in
    its order, on every worker; `local` itself otherwise. A collective:
    every worker must call it at the same point, with rows of one shape."""
    worker = _workers.of(strategy)
    if worker is None:
        return np.asarray(local)
    rows = [tf.constant(row) for row in np.asarray(local)]
    first = worker.position * len(rows)
    values = strategy.experimental_distribute_values_from_function(
        lambda context: rows[context.replica_id_in_sync_group - first])
    gathered = _gather_function(strategy)(values)
    return gathered.numpy().reshape((-1,) + tuple(rows[0].shape))


def read_all_workers(buffer: tf.Variable) -> List[np.ndarray]:
    """`read_replicas(buffer)` of every replica of the cluster under a
    multi-worker strategy (`gather_workers`), else `read_replicas(buffer)`."""
    rows = read_replicas(buffer)
    strategy = getattr(buffer, "distribute_strategy", None)
    if _workers.of(strategy) is None:
        return rows
    return list(gather_workers(np.stack(rows), strategy))


def run_if(predicate, function: Callable[[], None]) -> None:
    """Runs `function` when `predicate` holds; a Python bool costs no cond."""
    if predicate is True or predicate is False:
        if predicate:
            function()
        return

    def true_fn():
        function()
        return tf.constant(True)

    tf.cond(predicate, true_fn, lambda: tf.constant(False))
