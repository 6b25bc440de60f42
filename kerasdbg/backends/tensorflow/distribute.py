"""The `tf.distribute` helpers of the TensorFlow capture: the replica a step
is traced for, a call in the cross-replica context, and how a strategy
all-reduces the gradients.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf


def replica_id() -> Optional[int]:
    """The replica this code is traced for (0 without a strategy), or None
    in a cross-replica context."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return None
    value = getattr(context, "_replica_id_in_sync_group", None)
    if not isinstance(value, int):
        value = tf.get_static_value(context.replica_id_in_sync_group)
    return int(value) if value is not None else 0


def merge_call(function: Callable[[], object]):
    """Runs `function` once, in a cross-replica context, from a replica
    context of a `tf.distribute` strategy (each replica must call this), or
    directly without one. Variables can only be created there."""
    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None and not tf.distribute.in_cross_replica_context():
        return context.merge_call(lambda _: function())
    return function()


def cross_device_ops(strategy):
    """The `cross_device_ops` a MirroredStrategy was made with (None: the default)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def is_multi_worker(strategy) -> bool:
    """Whether `strategy` runs collectives across several workers (as Keras's
    TensorFlow trainer tells)."""
    from keras.src.backend.tensorflow import trainer

    return bool(strategy is not None and trainer._collective_all_reduce_multi_worker(strategy))


def all_reduces_collectively(strategy) -> bool:
    """Whether the strategy's gradient all-reduce is a collective op: every
    MultiWorkerMirroredStrategy with several replicas, and a MirroredStrategy
    over several devices made without `cross_device_ops` or with
    `CollectiveAllReduce`."""
    if is_multi_worker(strategy):
        return True
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return False
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return True  # one worker with several local devices: collective too
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return False
    chosen = cross_device_ops(strategy)
    return chosen is None or "Collective" in type(chosen).__name__
