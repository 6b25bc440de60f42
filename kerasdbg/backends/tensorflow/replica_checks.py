"""How far the replicas' copies of each trainable weight are apart, for
`ReplicaConsistency` (read by `StopOnRule` every few steps).

Each copy's checksums (sum and sum of squares, in float64) are computed on
the device that holds it, by one function traced once per fit, so two
numbers per variable and replica reach the host; under several workers one
gather brings every worker's to each. Nothing runs inside the train step.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg.capture import keras_objects
from kerasdbg.capture.requests import unique_paths

TINY = 1e-30


class ReplicaChecksums:
    """The checksums of `model`'s trainable float variables on every replica.

    Args:
        model: a model built under a strategy with more than one replica.
    """

    def __init__(self, model):
        self.strategy = model.distribute_strategy
        variables = [v for v in model.trainable_variables if keras_objects.is_float(v)]
        paths = unique_paths(variables)
        handles = [reads.read_handle(v) for v in variables]
        copies = [self.strategy.experimental_local_results(h) for h in handles]
        local = max((len(c) for c in copies), default=0)
        # Only mirrored variables (a worker may hold one copy of each): one
        # made outside the strategy's scope has one copy in the cluster.
        kept = [i for i, (h, c) in enumerate(zip(handles, copies))
                if isinstance(h, tf.distribute.DistributedValues) and len(c) == local]
        self.paths: List[str] = [paths[i] for i in kept]
        copies = [copies[i] for i in kept]

        def checksums():
            rows = []
            for replica in range(local):
                sums = []
                for parts in copies:
                    copy = parts[replica]
                    with tf.device(copy.device):
                        x = tf.cast(tf.convert_to_tensor(copy), tf.float64)
                        sums.append(tf.stack([tf.reduce_sum(x), tf.reduce_sum(tf.square(x))]))
                rows.append(tf.stack(sums))
            return tf.stack(rows)

        self._local = local
        self._checksums = tf.function(checksums, autograph=False) if copies else None

    def spreads(self) -> Dict[str, float]:
        """`{variable path: spread}`: the largest relative difference of a
        replica's checksums from replica 0's (0 where they are equal, NaN
        included; inf where only some copies are not finite).

        Under several workers every worker takes part in the gather even
        when its own checksums failed (it sends a failure flag), so that all
        of them raise together instead of one leaving the others waiting.

        Raises:
            RuntimeError: this worker's or another's checksums failed.
        """
        if self._checksums is None:
            return {}
        count = len(self.paths)
        try:
            local, failure = self._checksums().numpy(), None
            flags = np.zeros((self._local, 1))
        except Exception as error:  # noqa: BLE001 - said to every worker below
            local, failure = np.full((self._local, count, 2), np.nan), error
            flags = np.ones((self._local, 1))
        payload = np.concatenate([local.reshape(self._local, -1), flags], axis=1)
        gathered = _buffers.gather_workers(payload, self.strategy)
        if failure is not None:
            raise RuntimeError(f"{type(failure).__name__}: {failure}") from failure
        if gathered[:, -1].any():
            raise RuntimeError("another worker could not compute its replicas' checksums")
        sums = gathered[:, :-1].reshape(len(gathered), count, 2)
        return dict(zip(self.paths, spreads(sums).tolist()))


def spreads(sums: np.ndarray) -> np.ndarray:
    """Per variable, from `sums[replica, variable, (sum, sum of squares)]`:
    `max |c_r - c_0| / scale` over replicas r and both checksums, where the
    scale of the sum is `max(|sum_0|, sqrt(sumsq_0))` (a sum near zero of
    large values is not compared to its own rounding) and that of the sum of
    squares is `sumsq_0`."""
    reference = sums[0]
    equal = (sums == reference) | (np.isnan(sums) & np.isnan(reference))
    scale = np.stack([np.maximum(np.abs(reference[:, 0]), np.sqrt(np.abs(reference[:, 1]))),
                      np.abs(reference[:, 1])], axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        relative = np.abs(sums - reference) / np.maximum(scale, TINY)
    relative = np.where(equal, 0.0, np.where(np.isfinite(relative), relative, np.inf))
    return relative.max(axis=(0, 2)) if len(sums) else np.zeros(sums.shape[1])


def checker(model) -> Optional[ReplicaChecksums]:
    """A `ReplicaChecksums` of `model`, or None with one replica."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return None
    return ReplicaChecksums(model)
