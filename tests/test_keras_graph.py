"""The parts of Keras's functional graph that `kerasdbg._keras_graph` uses
(insert_taps, strip_debug_layers and MultiOutputModel replay graphs with
them): fails loudly if a Keras upgrade moves any of them. The same on every
backend: `tests/test_backends_other.py` runs the tools on JAX."""

import keras
import numpy as np

from kerasdbg import _keras_graph


def test_functional_graph_replay_helpers():
    from keras.src.models.functional import Functional

    x = keras.Input((2,), name="x")
    dense = keras.layers.Dense(3, name="d")
    model = keras.Model(x, {"y": dense(x)}, name="f")
    sequential = keras.Sequential([keras.Input((2,), name="s_in"), keras.layers.Dense(1)])
    assert isinstance(model, Functional)
    assert _keras_graph.is_functional(model)
    assert not _keras_graph.is_functional(sequential)
    assert _keras_graph.producing_layer(model.inputs[0]).name == "x"
    assert _keras_graph.producing_layer(sequential.inputs[0]).name == "s_in"
    assert _keras_graph.producing_layer(model.outputs[0]) is dense
    assert model.output_names == ["d"]  # a plain attribute the replay sets on rebuilt models

    calls = []

    def call_fn(layer, *args, **kwargs):
        calls.append(layer.name)
        return layer(*args, **kwargs) * 2.0

    data = np.ones((1, 2), "float32")
    out = _keras_graph.run_graph(model, [keras.ops.convert_to_tensor(data)], call_fn)
    assert calls == ["d"] and set(out) == {"y"}
    np.testing.assert_allclose(out["y"], 2.0 * model(data)["y"], rtol=1e-6)
    out = _keras_graph.run_graph_on_data(model, data, call_fn)
    np.testing.assert_allclose(out["y"], 2.0 * model(data)["y"], rtol=1e-6)
    (flat,) = _keras_graph.standardize_inputs(model, data)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(flat), data)


def test_which_layers_keras_passes_training_to():
    class NoContext(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self._call_context_args = set()

    assert _keras_graph.takes_training(keras.layers.Dropout(0.5))
    assert _keras_graph.takes_training(keras.layers.BatchNormalization())
    assert not _keras_graph.takes_training(NoContext())
