"""The class counts of a JAX train step, for a "classes" request.

What `ClassImbalance` reads: per class, the labels seen and how many of them
the model's prediction got wrong (argmax; above 0.5 for one sigmoid unit),
counted in the train step on its first output and summed over the fit. The
labels and predictions are those Keras's JAX `train_step` hands to
`_update_metrics_variables` (the engine's patch puts them in the step's
context); under a `keras.distribution` the step is one program over the
global batch, so the counts are the global ones.

The totals travel in the engine's carry as one fixed `[MAX_CLASSES, 2]`
int32 array (counts exact up to 2**31 labels), only in a fit that asks for
them: the carry's structure is fixed before the step is traced, when the
number of classes is not known yet.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import keras

from kerasdbg.capture.requests import CLASS_COLUMNS, MAX_CLASSES

CARRY = "classes"
"""The carry's key of the running totals."""


def zeros():
    """The totals at the fit's start."""
    return jnp.zeros([MAX_CLASSES, len(CLASS_COLUMNS)], jnp.int32)


def counts(y, y_pred) -> Optional[Tuple[object, int]]:
    """`([MAX_CLASSES, 2]` labels seen and mispredicted in this step, the
    number of classes`), from the first output; None when the step gave no
    labels or no class predictions (more than `MAX_CLASSES` classes, or a
    scalar output)."""
    if y is None or y_pred is None:
        return None
    y, y_pred = keras.tree.flatten(y)[0], keras.tree.flatten(y_pred)[0]
    if y is None or y_pred is None or jnp.ndim(y_pred) == 0:
        return None
    y, y_pred = jnp.asarray(y), jnp.asarray(y_pred)
    classes = y_pred.shape[-1]
    if not isinstance(classes, int) or classes > MAX_CLASSES:
        return None
    if classes == 1:  # one sigmoid unit: class 1 above 0.5
        predicted = (jnp.reshape(y_pred, [-1]) > 0.5).astype(jnp.int32)
        labels = (jnp.reshape(y, [-1]) > 0.5).astype(jnp.int32)
        classes = 2
    else:
        predicted = jnp.reshape(jnp.argmax(y_pred, axis=-1), [-1]).astype(jnp.int32)
        if y.ndim == y_pred.ndim and y.shape[-1] == y_pred.shape[-1]:
            labels = jnp.reshape(jnp.argmax(y, axis=-1), [-1]).astype(jnp.int32)  # one-hot
        else:
            labels = jnp.reshape(y, [-1]).astype(jnp.int32)
    if labels.shape != predicted.shape:
        return None  # labels that are not one per prediction: nothing to count
    valid = jnp.logical_and(labels >= 0, labels < classes)
    ids = jnp.where(valid, labels, classes)  # out-of-range labels are dropped
    wrong = (predicted != labels).astype(jnp.int32)
    table = jnp.stack([
        jax.ops.segment_sum(jnp.ones_like(wrong), ids, classes + 1)[:classes],
        jax.ops.segment_sum(wrong, ids, classes + 1)[:classes],
    ], axis=1)
    return jnp.pad(table, [[0, MAX_CLASSES - classes], [0, 0]]), classes


__all__ = ["CARRY", "counts", "zeros"]
