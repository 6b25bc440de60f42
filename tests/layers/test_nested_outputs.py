"""Debug layers and layers whose output is a structure (issue 32, item 7).

A `TapLayer` or `PrintLayer` records one tensor: given a dict, list or tuple
of tensors it says so when the model is built, and how to tap each output.
`insert_taps` puts one tap after each output of such a layer, named by its
place in the structure; their records are checked against NumPy values of
the layer's outputs, under `fit` with steps_per_execution 1 and 4 and XLA on
and off.
"""

import re

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.layers import PrintLayer, TapLayer
from tests.conftest import reference_stats
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = len(X) // BATCH  # one epoch


class Split(keras.layers.Layer):
    """Two outputs in a dict: 2h and 4h (exact in float: powers of two)."""

    def call(self, h):
        return {"double": h * 2.0, "quadruple": h * 4.0}

    def compute_output_spec(self, h):
        return {key: keras.KerasTensor(h.shape, h.dtype) for key in ("double", "quadruple")}


def _split_model():
    """The MLP of `tests.helpers` with `Split` after its hidden layer; the
    output is `out(0.25 * double + 0.125 * quadruple) = out(hidden)` exactly,
    so the model trains as the MLP does (`reference_training`)."""
    mlp = make_mlp()
    inputs = keras.Input((6,))
    parts = Split(name="split")(mlp.get_layer("hidden")(inputs))
    merged = keras.layers.Add(name="merge")([
        keras.layers.Rescaling(0.25, name="scale_double")(parts["double"]),
        keras.layers.Rescaling(0.125, name="scale_quadruple")(parts["quadruple"]),
    ])
    return keras.Model(inputs, mlp.get_layer("out")(merged), name="split_model"), mlp


@pytest.mark.parametrize("layer_class", [TapLayer, PrintLayer], ids=lambda c: c.__name__)
@pytest.mark.parametrize("structure", ["dict", "list", "tuple"])
def test_a_debug_layer_on_several_outputs_says_what_it_takes_at_build(layer_class, structure):
    inputs = keras.Input((3,))
    a, b = keras.layers.Dense(2)(inputs), keras.layers.Dense(2)(inputs)
    outputs = {"dict": {"a": a, "b": b}, "list": [a, b], "tuple": (a, b)}[structure]
    received = {"dict": "a dict with keys ['a', 'b']", "list": "a list of 2",
                "tuple": "a tuple of 2"}[structure]
    name = layer_class.__name__
    with pytest.raises(TypeError, match=re.escape(
            f"{name} 'debug': `inputs` must be one tensor") + ".*"
            + re.escape("kerasdbg.insert_taps(model, layers=...)") + ".*"
            + re.escape(f"Received: inputs={received}")):
        layer_class(name="debug")(outputs)


def test_an_eager_dict_of_arrays_is_refused_alike():
    with pytest.raises(TypeError, match=r"Received: inputs=a dict with keys \['x'\]"):
        TapLayer(name="tap")({"x": np.ones((2, 2), "float32")})


def test_a_nested_list_of_numbers_is_one_tensor():
    tap = TapLayer(stats=["mean", "max"], name="tap")
    out = tap([[1.0, 2.0], [3.0, 6.0]])
    np.testing.assert_array_equal(np.asarray(out), [[1.0, 2.0], [3.0, 6.0]])
    assert tap.latest["mean"] == pytest.approx(3.0) and tap.latest["max"] == 6.0


def test_insert_taps_names_one_tap_per_output_by_its_place():
    model, _ = _split_model()
    tapped = kerasdbg.insert_taps(model, layers="split")
    taps = [layer.name for layer in tapped.layers if isinstance(layer, TapLayer)]
    assert taps == ["split_tap_double", "split_tap_quadruple"]


STATS = ["mean", "std", "min", "max", "l2_norm", "zero_fraction"]


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_taps_on_a_dict_output_record_each_output_against_numpy(tmp_path, spe, jit):
    model, mlp = _split_model()
    initial = [w.numpy() for w in mlp.weights]
    print_path = str(tmp_path / "print.txt")
    tapped = kerasdbg.insert_taps(model, layers="split", tap=lambda layer, name: TapLayer(
        stats=STATS, name=name))
    printed = kerasdbg.insert_taps(model, layers="split", tap=PrintLayer(
        stats=["mean", "max"], summarize=0, output_stream=print_path))
    reference = reference_training(initial, STEPS)
    scales = {"double": 2.0, "quadruple": 4.0}

    tapped.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                   jit_compile=jit)
    tapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for key, scale in scales.items():
        history = tapped.get_layer(f"split_tap_{key}").history
        assert history["step"].tolist() == list(range(1, STEPS + 1)), key
        for _, row in history.iterrows():
            want = reference_stats(scale * reference[int(row.step) - 1]["hidden"])
            for stat in STATS:
                np.testing.assert_allclose(row[stat], want[stat], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{key} step {row.step} {stat}")
    # The model trained as the MLP does: the taps changed nothing.
    np.testing.assert_allclose(mlp.get_layer("out").kernel.numpy(), reference[-1]["after"][2],
                               rtol=1e-5, atol=1e-6)

    # PrintLayers alike (a fresh copy of the weights, trained again from the start).
    for weight, value in zip(mlp.weights, initial):
        weight.assign(value)
    printed.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                    jit_compile=jit)
    printed.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with open(print_path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    pattern = re.compile(r"kerasdbg fit step (\d+) replica 0 \| split_tap_(\w+) \| "
                         r"shape \(8, 5\) \| mean=(\S+) max=(\S+)$")
    seen = []
    for line in lines:
        match = pattern.match(line)
        assert match, line
        step, key = int(match.group(1)), match.group(2)
        want = reference_stats(scales[key] * reference[step - 1]["hidden"])
        assert float(match.group(3)) == pytest.approx(want["mean"], rel=1e-5, abs=1e-6), line
        assert float(match.group(4)) == pytest.approx(want["max"], rel=1e-5, abs=1e-6), line
        seen.append((step, key))
    assert sorted(seen) == [(s, k) for s in range(1, STEPS + 1) for k in sorted(scales)]
