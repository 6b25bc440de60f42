"""Where the first non-finite value of a faulty JAX step came from.

At the first step of a fit whose loss or gradients held NaN/Inf, the host
replays the model's forward pass on that step's batch, layer call by layer
call, with the weights the step started from, and finds the first layer
output (inputs first, in graph order) that held NaN/Inf. Nothing of it is in
kerasdbg's step: a healthy fit traces, compiles and runs no replay.

The engine keeps a reference to each step's batch until the step's records
are read (the batches of one execution), and the NaN guard keeps the weights
of the faulty step's start in the loop's state. The replay runs op by op
under a `StatelessScope` mapped to those weights, as Keras's train step calls
the model (`training=True`): its writes (a BatchNormalization's moving
statistics, a seed generator's state) are thrown away.
"""

from __future__ import annotations

from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kerasdbg import _replay


def replayable(model, data) -> bool:
    """Whether the layers of `model` can be replayed on the batch `data`
    (a Functional or Sequential model, and inputs to give it)."""
    return _replay.is_graph_model(model) and _inputs(data) is not None


def replay(model, weights, data, names: List[str]) -> Optional[int]:
    """The position in `names` of the first layer output of `model` on
    `data`'s inputs that held NaN/Inf, with the weights `(trainable,
    non_trainable)` (values in the order of the model's variables), or None
    when none did. `names` receives the qualified names of the layers
    examined, in order (a layer once per floating-point output)."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    trainable, non_trainable = weights
    flags = []

    def on_output(name, outputs):
        for tensor in jax.tree_util.tree_leaves(outputs):
            if hasattr(tensor, "dtype") and jnp.issubdtype(tensor.dtype, jnp.floating):
                names.append(name)
                flags.append(jnp.logical_not(jnp.all(jnp.isfinite(tensor))))

    mapping = list(zip(model.trainable_variables, trainable)) + \
        list(zip(model.non_trainable_variables, non_trainable))
    with StatelessScope(state_mapping=mapping):
        _replay.call_layer_by_layer(model, _inputs(data), True, on_output)
    bad = np.asarray(jax.device_get(flags), bool) if flags else np.zeros(0, bool)
    return int(np.argmax(bad)) if bad.any() else None


def _inputs(data) -> Optional[object]:
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
    return x


__all__ = ["replay", "replayable"]
