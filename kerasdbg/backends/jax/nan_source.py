"""Where the first non-finite value of a faulty JAX step came from.

At the first step whose loss or gradients held NaN/Inf, kerasdbg's step
replays the model's forward pass on that step's batch, layer call by layer
call, with the weights the step started from, and records the position of
the first layer output (inputs first, in graph order) that held NaN/Inf. The
replay sits in a condition taken only then: a healthy step runs the fault
test and nothing more (`jax.lax.cond` in a jitted step; without `jit_compile`
a Python branch on the concrete test).

The replay runs under a `StatelessScope` mapped to the step's own state, as
Keras's train step calls the model: its writes (a BatchNormalization's moving
statistics, a seed generator's state) are thrown away, and the batch and
weights are those of the faulty step.
"""

from __future__ import annotations

from typing import List, Optional

import jax
import jax.numpy as jnp

from kerasdbg import _replay
from kerasdbg.quantities import reductions

NONE_FOUND = -1
"""The recorded position when no layer output held NaN/Inf."""


def replayable(model, data) -> bool:
    """Whether the layers of `model` can be replayed on the batch `data`
    (a Functional or Sequential model, and inputs to give it)."""
    return _replay.is_graph_model(model) and _inputs(data) is not None


def first_nonfinite_layer(model, state, data, names: List[str]):
    """In the step: the position in `names` of the first layer output of
    `model` on `data`'s inputs that held NaN/Inf, with the weights in `state`
    (Keras's `(trainable, non_trainable, ...)` state), as an int32 scalar
    (`NONE_FOUND` when none did). `names` is filled with the qualified names
    of the layers, in the order of the positions."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    x = _inputs(data)
    flags = []
    del names[:]

    def on_output(name, outputs):
        for tensor in jax.tree_util.tree_leaves(outputs):
            if hasattr(tensor, "dtype") and jnp.issubdtype(tensor.dtype, jnp.floating):
                names.append(name)
                flags.append(jnp.logical_not(reductions.all_finite(tensor)))

    mapping = list(zip(model.trainable_variables, state[0])) + \
        list(zip(model.non_trainable_variables, state[1]))
    with StatelessScope(state_mapping=mapping):
        _replay.call_layer_by_layer(model, x, True, on_output)
    if not flags:
        return jnp.asarray(NONE_FOUND, jnp.int32)
    bad = jnp.stack(flags)
    return jnp.where(jnp.any(bad), jnp.argmax(bad).astype(jnp.int32),
                     jnp.asarray(NONE_FOUND, jnp.int32))


def _inputs(data) -> Optional[object]:
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
    return x


__all__ = ["NONE_FOUND", "first_nonfinite_layer", "replayable"]
