"""Reads of Keras and `tf.Variable`s in a TensorFlow graph."""

from __future__ import annotations

import keras
import tensorflow as tf


def read_handle(variable):
    """The tf.Variable behind a Keras variable (what the optimizer's reduction sees)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def on_read(variable) -> bool:
    """Whether a variable is synchronized on read (a per-replica buffer, e.g.
    those of kerasdbg's own layers), rather than state the model updates."""
    return read_handle(variable).synchronization == tf.VariableSynchronization.ON_READ


def read(variable) -> tf.Tensor:
    """The current value of a Keras or tf variable as a tensor (in-graph)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return tf.convert_to_tensor(variable)
