"""Debug layers on layers whose output is a structure (issue 32, item 7).

A `TapLayer` or `PrintLayer` given a dict, list or tuple of tensors records
each tensor through a part of its own, named by its path in the structure
(`parts`); `insert_taps` puts one tap after each output of such a layer. Both
are checked against NumPy values of the layer's outputs, under `fit` with
steps_per_execution 1 and 4 and XLA on and off (and under MirroredStrategy).
"""

import copy
import re

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics
from kerasdbg.layers import PrintLayer, TapLayer
from tests.conftest import make_strategy, reference_stats
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = len(X) // BATCH  # one epoch


@keras.saving.register_keras_serializable(package="tests")
class Split(keras.layers.Layer):
    """Two outputs in a dict: 2h and 4h (exact in float: powers of two)."""

    def call(self, h):
        return {"double": h * 2.0, "quadruple": h * 4.0}

    def compute_output_spec(self, h):
        return {key: keras.KerasTensor(h.shape, h.dtype) for key in ("double", "quadruple")}


def _split_model(*debug_layers):
    """The MLP of `tests.helpers` with `Split` after its hidden layer (then
    `debug_layers` on its dict); the output is `out(0.25 * double + 0.125 *
    quadruple) = out(hidden)` exactly, so the model trains as the MLP does
    (`reference_training`)."""
    mlp = make_mlp()
    inputs = keras.Input((6,))
    parts = Split(name="split")(mlp.get_layer("hidden")(inputs))
    for layer in debug_layers:
        parts = layer(parts)
    merged = keras.layers.Add(name="merge")([
        keras.layers.Rescaling(0.25, name="scale_double")(parts["double"]),
        keras.layers.Rescaling(0.125, name="scale_quadruple")(parts["quadruple"]),
    ])
    return keras.Model(inputs, mlp.get_layer("out")(merged), name="split_model"), mlp


@pytest.mark.parametrize("layer_class", [TapLayer, PrintLayer], ids=lambda c: c.__name__)
@pytest.mark.parametrize("structure", ["dict", "list", "tuple", "nested"])
def test_a_debug_layer_on_a_structure_has_a_part_per_tensor(layer_class, structure):
    inputs = keras.Input((3,))
    a, b, c = (keras.layers.Dense(2)(inputs) for _ in range(3))
    outputs = {"dict": {"b": b, "a": a}, "list": [a, b], "tuple": (a, b),
               "nested": {"a": a, "b": [b, c]}}[structure]
    paths = {"dict": ["a", "b"], "list": ["0", "1"], "tuple": ["0", "1"],
             "nested": ["a", "b/0", "b/1"]}[structure]
    layer = layer_class(name="debug")
    returned = layer(outputs)
    keras.tree.assert_same_structure(returned, outputs)
    assert list(layer.parts) == paths
    for path, part in layer.parts.items():
        assert type(part) is layer_class and part.built
        assert part.name == "debug_" + path.replace("/", "_")
    if layer_class is PrintLayer:
        assert [p.message for p in layer.parts.values()] == [f"debug/{p}" for p in paths]


def test_a_tap_on_a_structure_is_read_through_its_parts():
    tap = TapLayer(stats=["mean", "max"], name="tap")
    tap({"x": np.ones((2, 2), "float32"), "y": np.full((2, 2), 3.0, "float32")})
    assert tap.parts["y"].latest == {"step": 1, "mode": "call", "mean": 3.0, "max": 3.0}
    for what in ("history", "latest", "latest_by_mode", "latest_histogram", "latest_rows"):
        with pytest.raises(ValueError, match=re.escape(
                f"TapLayer 'tap' records a structure of tensors, one part per tensor; read "
                f"`{what}` on a part: `layer.parts[key].{what}` with key in ['x', 'y']")):
            getattr(tap, what)
    assert TapLayer(name="single").parts == {}


def test_parts_save_load_clone_and_copy_with_their_counters(tmp_path):
    model, _ = _split_model(TapLayer(stats=["mean"], name="tap"))
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", custom_objects={"Split": Split})
    for other in (loaded, keras.models.clone_model(model)):
        tap = other.get_layer("tap")
        assert list(tap.parts) == ["double", "quadruple"]
        other.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
        other.fit(X[:BATCH], Y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
        assert tap.parts["double"].history["step"].tolist() == [1]
    counters = {k: int(p.calls.numpy()) for k, p in loaded.get_layer("tap").parts.items()}
    assert counters == {"double": STEPS + 1, "quadruple": STEPS + 1}
    copied = copy.deepcopy(model.get_layer("tap"))
    assert {k: int(p.calls.numpy()) for k, p in copied.parts.items()} == {
        "double": STEPS, "quadruple": STEPS}


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
KEYS = ("double", "quadruple")
SCALES = {"double": 2.0, "quadruple": 4.0}


def _models(how, print_path):
    """(model for the taps, model for the prints, mlp): the debug layers on
    the dict itself, or put after each output by `insert_taps`."""
    if how == "on_the_dict":
        tapped, mlp = _split_model(TapLayer(stats=STATS, name="tap"))
        printed = _split_model(PrintLayer(stats=["mean", "max"], summarize=0,
                                          output_stream=print_path, name="print"))[0]
        # Each model has its own MLP: train the prints' copy from the same weights.
        printed_mlp = printed.get_layer("out"), printed.layers[1]
        taps = {k: tapped.get_layer("tap").parts[k] for k in KEYS}
        lines = {k: f"print/{k}" for k in KEYS}
    else:
        model, mlp = _split_model()
        tapped = kerasdbg.insert_taps(model, layers="split", tap=lambda layer, name: TapLayer(
            stats=STATS, name=name))
        printed = kerasdbg.insert_taps(model, layers="split", tap=PrintLayer(
            stats=["mean", "max"], summarize=0, output_stream=print_path))
        printed_mlp = None
        taps = {k: tapped.get_layer(f"split_tap_{k}") for k in KEYS}
        lines = {k: f"split_tap_{k}" for k in KEYS}
    return tapped, printed, mlp, printed_mlp, taps, lines


CASES = [pytest.param("default", how, spe, jit,
                      id=f"default-{how}-spe{spe}-{'jit' if jit else 'nojit'}")
         for how in ("on_the_dict", "insert_taps") for spe in (1, 4) for jit in (False, True)]
# Under MirroredStrategy (XLA there fails in plain Keras: tests/test_keras_limitations.py).
CASES += [pytest.param("mirrored", "on_the_dict", spe, False, id=f"mirrored-on_the_dict-spe{spe}")
          for spe in (1, 4)]


@pytest.mark.parametrize("strategy_name, how, spe, jit", CASES)
def test_debug_layers_on_a_dict_output_record_each_output_against_numpy(
        tmp_path, strategy_name, how, spe, jit):
    print_path = str(tmp_path / "print.txt")
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        tapped, printed, mlp, printed_mlp, taps, names = _models(how, print_path)
    replicas = strategy.num_replicas_in_sync
    rows = BATCH // replicas  # the layers record replica 0's slice of the batch
    initial = [w.numpy() for w in mlp.weights]
    reference = reference_training(initial, STEPS)

    logs = str(tmp_path / "logs")
    activations = ActivationStatistics(logs)
    with strategy.scope():
        tapped.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                       jit_compile=jit)
    tapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
               callbacks=[activations])
    for key, tap in taps.items():
        history = tap.history
        assert history["step"].tolist() == list(range(1, STEPS + 1)), key
        for _, row in history.iterrows():
            want = reference_stats(SCALES[key] * reference[int(row.step) - 1]["hidden"][:rows])
            for stat in STATS:
                np.testing.assert_allclose(row[stat], want[stat], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{key} step {row.step} {stat}")
        # ActivationStatistics records each part as a tap of its own.
        np.testing.assert_allclose(activations.history[f"{tap.name}/mean"],
                                   history["mean"], rtol=1e-12)
    # The model trained as the MLP does: the taps changed nothing.
    np.testing.assert_allclose(mlp.get_layer("out").kernel.numpy(), reference[-1]["after"][2],
                               rtol=1e-5, atol=1e-6)

    # The prints alike, trained again from the same weights.
    if printed_mlp is None:
        for weight, value in zip(mlp.weights, initial):
            weight.assign(value)
    else:
        weights = printed_mlp[1].weights + printed_mlp[0].weights
        for weight, value in zip(weights, initial):
            weight.assign(value)
    with strategy.scope():
        printed.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                        jit_compile=jit)
    printed.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with open(print_path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    key_of = {name: key for key, name in names.items()}
    pattern = re.compile(r"kerasdbg fit step (\d+) replica 0 \| (\S+) \| "
                         rf"shape \({rows}, 5\) \| mean=(\S+) max=(\S+)$")
    seen = []
    for line in lines:
        match = pattern.match(line)
        assert match and match.group(2) in key_of, line
        step, key = int(match.group(1)), key_of[match.group(2)]
        want = reference_stats(SCALES[key] * reference[step - 1]["hidden"][:rows])
        assert float(match.group(3)) == pytest.approx(want["mean"], rel=1e-5, abs=1e-6), line
        assert float(match.group(4)) == pytest.approx(want["max"], rel=1e-5, abs=1e-6), line
        seen.append((step, key))
    assert sorted(seen) == [(s, k) for s in range(1, STEPS + 1) for k in KEYS]
