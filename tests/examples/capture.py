"""An independent capture of what every optimizer's `apply` receives, for the tests.

`capture_applies()` wraps the optimizer classes' `apply` for the duration of a `with`
block: each call stores the gradients it was given, unreduced, in per-replica buffers of
the test's own (no kerasdbg code involved). After `fit`, `Capture.gradients(optimizer)`
sums the replicas on the host, so under `MirroredStrategy` the result is the global
gradient of each call, as one device would compute it.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import numpy as np
import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer

MAX_CALLS = 128


class _Buffers:
    def __init__(self, variables):
        self.paths = [v.path for v in variables]
        self.calls = _on_read(tf.zeros([], tf.int64))
        self.grads = [_on_read(tf.zeros([MAX_CALLS] + list(v.shape), tf.float32))
                      for v in variables]


def _on_read(value):
    return tf.Variable(value, trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


class Capture:
    """The gradients of every `apply` call, per optimizer."""

    def __init__(self):
        self._buffers: Dict[int, _Buffers] = {}

    def _record(self, optimizer, grads, variables) -> None:
        key = id(optimizer)
        if key not in self._buffers:
            def create(*_):
                with tf.init_scope():
                    self._buffers[key] = _Buffers(variables)

            context = tf.distribute.get_replica_context()
            if tf.distribute.has_strategy() and context is not None:
                context.merge_call(create)
            else:
                create()
        buffers = self._buffers[key]
        row = buffers.calls.read_value()
        for buffer, grad in zip(buffers.grads, grads):
            if grad is not None:
                grad = tf.convert_to_tensor(grad)
                buffer.assign(tf.tensor_scatter_nd_update(
                    buffer.read_value(), tf.reshape(row, [1, 1]),
                    tf.expand_dims(tf.cast(grad, tf.float32), 0)))
        buffers.calls.assign_add(1)

    def gradients(self, optimizer) -> List[Dict[str, np.ndarray]]:
        """One `{variable path: gradient}` per call, summed over replicas."""
        buffers = self._buffers[id(optimizer)]
        calls = int(_replicas(buffers.calls)[0])
        out = [{} for _ in range(calls)]
        for path, buffer in zip(buffers.paths, buffers.grads):
            total = np.sum(_replicas(buffer), axis=0)
            for call in range(calls):
                out[call][path] = total[call]
        return out

    def norms(self, optimizer) -> List[Dict[str, float]]:
        """The l2 norm of each variable's gradient, per call (float64 NumPy)."""
        return [{p: float(np.linalg.norm(g.astype(np.float64))) for p, g in call.items()}
                for call in self.gradients(optimizer)]


def _replicas(variable) -> List[np.ndarray]:
    if isinstance(variable, tf.distribute.DistributedValues):
        strategy = variable.distribute_strategy
        return [np.asarray(v.numpy()) for v in strategy.experimental_local_results(variable)]
    return [variable.numpy()]


@contextlib.contextmanager
def capture_applies():
    """Wraps `BaseOptimizer.apply` (what `apply_gradients` and Keras's `train_step`
    call); yields the `Capture`."""
    capture = Capture()
    original = BaseOptimizer.__dict__["apply"]

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables) if trainable_variables is not None \
            else list(self._trainable_variables)
        capture._record(self, list(grads), variables)
        return original(self, grads, trainable_variables)

    BaseOptimizer.apply = apply
    try:
        yield capture
    finally:
        BaseOptimizer.apply = original
