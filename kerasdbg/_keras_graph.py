"""The parts of Keras's functional graph that the model tools replay, on every
backend (no framework import).

`insert_taps`, `strip_debug_layers` and `MultiOutputModel` replay the graph
of a Functional model node by node (what `keras.models.clone_model` does
with `call_function`, which Keras refuses for Sequential models and which
clones nested models only all or nothing). These are Keras's own,
backend-neutral: `keras.src.models.functional` and `keras.src.ops.function`.
`tests/test_keras_graph.py` fails loudly if a Keras upgrade moves any of this.
"""

from __future__ import annotations

import keras


def is_functional(model) -> bool:
    """Whether `model` is a Functional model (not Sequential, not subclassed)."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional) and not isinstance(model, keras.Sequential)


def run_graph(model, inputs, call_fn):
    """Replays the graph of Functional `model` on `inputs`.

    Each node is computed as `call_fn(layer, *args, **kwargs)`; the result
    has the structure of `model.output`.
    """
    return model._run_through_graph(inputs, operation_fn=lambda op: op, call_fn=call_fn)


def run_graph_on_data(model, inputs, call_fn):
    """`run_graph` on real tensors, with `inputs` as `model(inputs)` takes them."""
    return run_graph(model, standardize_inputs(model, inputs), call_fn)


def standardize_inputs(model, inputs) -> list:
    """The flat list of input tensors, in `model.inputs` order (dicts by name)."""
    return model._standardize_inputs(inputs)


def takes_training(layer) -> bool:
    """Whether Keras passes `training` to this layer's `call`."""
    return "training" in getattr(layer, "_call_context_args", ())


def producing_layer(keras_tensor):
    """The layer whose output `keras_tensor` is (an `InputLayer` for an input)."""
    return keras_tensor._keras_history.operation
