"""insert_taps and strip_debug_layers: structure, shared weights, outputs, errors."""

import re

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.layers import PrintLayer, TapLayer
from tests.conftest import make_strategy, matrix, only_upstream_failure, reference_stats
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training


def _names(model):
    return [layer.name for layer in model.layers]


def _taps(model):
    return kerasdbg.callbacks.activation_statistics.find_taps(model)


def _branchy():
    """Dict inputs, a nested model, a layer with two outputs, dict outputs."""
    keras.utils.set_random_seed(3)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    inner_in = keras.Input((5,), name="inner_in")
    hidden = keras.layers.Dense(4, activation="tanh", name="h")(inner_in)
    inner = keras.Model(inner_in, keras.layers.Dense(2, name="hd")(hidden), name="inner")
    y = inner(keras.layers.Concatenate(name="cat")([a, b]))
    first, second = keras.layers.Lambda(lambda t: [t[:, :1], t[:, 1:]], name="split")(y)
    return keras.Model(
        {"a": a, "b": b},
        {"o1": keras.layers.Dense(1, name="o1")(first), "o2": second}, name="branchy",
    )


BRANCHY_X = {
    "a": np.random.default_rng(0).normal(size=(6, 3)).astype("float32"),
    "b": np.random.default_rng(1).normal(size=(6, 2)).astype("float32"),
}


# ------------------------------------------------------------ structure
def test_sequential_gets_a_tap_after_each_layer_and_shares_weights():
    model = make_mlp()
    tapped = kerasdbg.insert_taps(model)
    input_name = model.inputs[0]._keras_history.operation.name
    assert _names(tapped) == [input_name, "hidden", "hidden_tap", "out", "out_tap"]
    assert tapped.get_layer("hidden") is model.get_layer("hidden")
    assert [id(w) for w in tapped.weights if "tap" not in w.path] == [id(w) for w in model.weights]
    assert tapped.get_layer("hidden_tap").activation == "relu"
    assert tapped.get_layer("out_tap").activation is None
    assert tapped.output_names == ["out"]  # the tap after the output keeps the output's name
    assert kerasdbg.strip_debug_layers(tapped).output_names == ["out"]
    np.testing.assert_array_equal(tapped.predict(X, verbose=0), model.predict(X, verbose=0))
    assert model.layers == [model.get_layer("hidden"), model.get_layer("out")]  # unchanged


def test_functional_nested_multi_input_and_multi_output_layers():
    model = _branchy()
    tapped = kerasdbg.insert_taps(model, layers="^h$|split|cat|^a$")
    assert _names(tapped) == [
        "a", "a_tap", "b", "cat", "cat_tap", "inner", "split", "split_tap_0", "o1", "split_tap_1",
    ]
    # The nested model is rebuilt with its tap inside and keeps its name.
    assert _names(tapped.get_layer("inner")) == ["inner_in", "h", "inner_h_tap", "hd"]
    assert tapped.get_layer("inner").get_layer("h") is model.get_layer("inner").get_layer("h")
    assert tapped.get_layer("inner").get_layer("inner_h_tap").activation == "tanh"
    want, got = model(BRANCHY_X), tapped(BRANCHY_X)
    for key in ("o1", "o2"):
        np.testing.assert_array_equal(got[key], want[key])
    # The tap inside the nested model saw tanh(concat(a, b) @ W + b).
    weights = model.get_layer("inner").get_layer("h").get_weights()
    hidden = np.tanh(np.concatenate([BRANCHY_X["a"], BRANCHY_X["b"]], 1) @ weights[0] + weights[1])
    latest = tapped.get_layer("inner").get_layer("inner_h_tap").latest
    for name, value in reference_stats(hidden).items():
        if name in latest:
            np.testing.assert_allclose(latest[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # Nested models without a selected layer are not rebuilt.
    assert kerasdbg.insert_taps(model, layers=["o1"]).get_layer("inner") is model.get_layer("inner")


def test_layer_paths_select_inside_nested_models():
    model = _branchy()
    tapped = kerasdbg.insert_taps(model, layers=["inner/hd", "inner/inner_in"])
    assert _names(tapped.get_layer("inner")) == [
        "inner_in", "inner_inner_in_tap", "h", "hd", "inner_hd_tap",
    ]


def test_default_selection_skips_inputs_models_and_debug_layers():
    model = kerasdbg.insert_taps(_branchy())
    assert sorted(tap.name for tap in _taps(model)) == sorted([
        "cat_tap", "inner_h_tap", "inner_hd_tap", "split_tap_0", "split_tap_1", "o1_tap",
    ])
    # Tapping a tapped model does not tap the taps, and names stay unique.
    again = kerasdbg.insert_taps(model, layers="cat")
    assert "cat_tap_1" in _names(again)
    assert "cat_tap_tap" not in _names(again)


def test_predicate_and_shared_layers():
    shared = keras.layers.Dense(2, activation="sigmoid", name="shared")
    x = keras.Input((2,), name="x")
    model = keras.Model(x, keras.layers.Add(name="add")([shared(x), shared(x)]), name="twice")
    tapped = kerasdbg.insert_taps(model, layers=lambda layer: isinstance(layer, keras.layers.Dense))
    assert [tap.name for tap in _taps(tapped)] == ["shared_tap", "shared_tap_1"]
    assert all(tap.activation == "sigmoid" for tap in _taps(tapped))


def test_activation_layers_set_the_health_of_their_taps():
    x = keras.Input((4,), name="x")
    y = keras.layers.ReLU(6.0, name="relu6")(x)
    y = keras.layers.ReLU(negative_slope=0.1, name="leaky")(y)
    y = keras.layers.Activation("tanh", name="act")(y)
    y = keras.layers.Dense(2, activation="relu6", name="dense6")(y)
    tapped = kerasdbg.insert_taps(keras.Model(x, y, name="acts"))
    activations = {tap.name: tap.activation for tap in _taps(tapped)}
    assert activations == {
        "relu6_tap": "relu", "leaky_tap": None, "act_tap": "tanh", "dense6_tap": "relu",
    }


# ------------------------------------------------------------ the tap argument
def test_tap_template_class_and_factory():
    template = TapLayer(stats=["mean"], every_n_steps=3, histogram=True, name="ignored")
    tapped = kerasdbg.insert_taps(make_mlp(), layers=["hidden"], tap=template)
    tap = tapped.get_layer("hidden_tap")
    assert (list(tap.stats), tap.every_n_steps, tap.histogram, tap.activation) == (
        ["mean"], 3, True, "relu",
    )
    assert template.activation is None  # the template itself is not changed

    printed = kerasdbg.insert_taps(make_mlp(), layers="out", tap=PrintLayer)
    assert isinstance(printed.get_layer("out_tap"), PrintLayer)

    seen = []

    def factory(layer, name):
        seen.append((layer.name, name))
        return TapLayer(stats=["max"], name=f"{name}_custom")

    custom = kerasdbg.insert_taps(make_mlp(), tap=factory)
    assert seen == [("hidden", "hidden_tap"), ("out", "out_tap")]
    assert custom.get_layer("hidden_tap_custom").activation == "relu"


# ------------------------------------------------------------ compile and fit
def test_compiled_model_is_copied_with_its_optimizer_and_loss_dict_names():
    model = _branchy()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss={"o1": "mse", "o2": "mae"},
                  metrics={"o1": ["mae"]})
    tapped = kerasdbg.insert_taps(model, layers="o1|split")
    assert tapped.optimizer is model.optimizer
    y = {"o1": np.ones((6, 1), "float32"), "o2": np.zeros((6, 1), "float32")}
    logs = tapped.fit(BRANCHY_X, y, batch_size=3, epochs=1, verbose=0, shuffle=False).history
    assert {"loss", "o1_loss", "o2_loss", "o1_mae"} <= set(logs)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert tapped.get_layer("o1_tap").history.step.tolist() == [1, 2]


def test_uncopyable_compile_warns_and_returns_an_uncompiled_model():
    model = make_mlp()
    model.compile(optimizer="sgd", loss=lambda y_true, y_pred: (y_true - y_pred) ** 2)
    with pytest.warns(UserWarning, match="compile the new model yourself"):
        tapped = kerasdbg.insert_taps(model, layers=["out"])
    assert not tapped.compiled


@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_inserted_taps_record_every_step_of_fit(strategy_name, spe, jit):
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = make_mlp()
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                      jit_compile=jit)
        tapped = kerasdbg.insert_taps(model, layers=["hidden"])
    assert tapped.optimizer is model.optimizer
    initial = [w.numpy() for w in model.weights]
    with only_upstream_failure(strategy_name, jit):
        tapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    steps = len(X) // BATCH
    reference = reference_training(initial, steps)
    history = tapped.get_layer("hidden_tap").history
    assert history.step.tolist() == list(range(1, steps + 1))
    rows = BATCH // strategy.num_replicas_in_sync
    for _, row in history.iterrows():
        weights = reference[int(row.step) - 1]["before"]
        i = (int(row.step) - 1) % steps
        hidden = np.maximum(X[i * BATCH:(i + 1) * BATCH] @ weights[0] + weights[1], 0)[:rows]
        for name, value in reference_stats(hidden).items():
            if name in row:
                np.testing.assert_allclose(row[name], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"step {row.step} {name}")
        assert row["dead_fraction"] == pytest.approx(np.mean(np.all(hidden == 0, axis=0)))
    for got, want in zip(model.get_weights(), reference[-1]["after"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ strip
def test_strip_removes_debug_layers_everywhere_and_keeps_outputs():
    model = _branchy()
    tapped = kerasdbg.insert_taps(model, layers="h|split|cat|^a$", tap=TapLayer)
    tapped = kerasdbg.insert_taps(tapped, layers=["o1"], tap=PrintLayer)
    stripped = kerasdbg.strip_debug_layers(tapped)
    assert _names(stripped) == _names(model)
    assert _names(stripped.get_layer("inner")) == _names(model.get_layer("inner"))
    assert not _taps(stripped)
    got, want = stripped(BRANCHY_X), model(BRANCHY_X)
    for key in ("o1", "o2"):
        np.testing.assert_array_equal(got[key], want[key])
    assert stripped.get_layer("o1") is model.get_layer("o1")


def test_strip_keeps_sequential_and_compile(tmp_path):
    model = keras.Sequential(
        [keras.Input((6,), name="x"), keras.layers.Dense(5, name="d"), TapLayer(name="tap"),
         PrintLayer(name="print"), keras.layers.Dense(3, name="out")], name="seq",
    )
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    stripped = kerasdbg.strip_debug_layers(model)
    assert isinstance(stripped, keras.Sequential)
    assert _names(stripped) == ["d", "out"]
    assert stripped.optimizer is model.optimizer and stripped.jit_compile is False
    np.testing.assert_array_equal(stripped.predict(X, verbose=0), model.predict(X, verbose=0))
    # The stripped model's file names no kerasdbg class, and it exports.
    stripped.save(tmp_path / "plain.keras")
    with open(tmp_path / "plain.keras", "rb") as handle:
        assert b"kerasdbg" not in handle.read()
    stripped.export(str(tmp_path / "saved_model"), verbose=False)
    import tensorflow as tf

    reloaded = tf.saved_model.load(str(tmp_path / "saved_model"))
    # The exported graph may pick other float32 kernels than predict: a near-zero
    # output then differs in its last bits (seen 1 of 240 on a loaded machine).
    np.testing.assert_allclose(reloaded.serve(X).numpy(), model.predict(X, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_mobilenet_v2_insert_then_strip():
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=4,
    )
    tapped = kerasdbg.insert_taps(model, layers="_relu$")
    taps = _taps(tapped)
    assert len(taps) == 35 and all(tap.activation == "relu" for tap in taps)
    x = np.random.default_rng(0).uniform(size=(4, 32, 32, 3)).astype("float32")
    np.testing.assert_allclose(tapped.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)
    first = tapped.get_layer("Conv1_relu_tap").latest_by_mode["predict"]
    conv = keras.Model(model.input, model.get_layer("Conv1_relu").output)(x).numpy()
    np.testing.assert_allclose(first["mean"], conv.mean(), rtol=1e-5)
    # Units zero on every example: 4 examples are not the 100 that make a unit dead.
    assert np.any(np.all(conv == 0, axis=0)) and first["dead_fraction"] == 0.0
    stripped = kerasdbg.strip_debug_layers(tapped)
    assert _names(stripped) == _names(model)
    np.testing.assert_allclose(stripped.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ errors
def test_unknown_names_are_listed():
    with pytest.raises(ValueError, match=re.escape(
        "insert_taps: no layer named 'nope' in `branchy`. Layers: a, b, cat, inner, "
        "inner/inner_in, inner/h, inner/hd, split, o1"
    )):
        kerasdbg.insert_taps(_branchy(), layers=["cat", "nope"])


@pytest.mark.parametrize("layers, error, message", [
    ("zzz", ValueError, "`layers` selects no layer of `branchy`. Received: layers='zzz'"),
    (lambda layer: False, ValueError, "`layers` selects no layer"),
    ("(", ValueError, "`layers` is not a valid regular expression"),
    (3, TypeError, "`layers` must be None, a regular expression, a list of layer names"),
    ([1, 2], TypeError, "`layers` must be None"),
], ids=["regex-no-match", "predicate-no-match", "bad-regex", "int", "list-of-ints"])
def test_bad_layer_selections(layers, error, message):
    with pytest.raises(error, match=re.escape(message)):
        kerasdbg.insert_taps(_branchy(), layers=layers)


def test_bad_models_and_taps():
    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="the graph of the subclassed model `sub` .*not visible"):
        kerasdbg.insert_taps(Sub(name="sub"))
    with pytest.raises(TypeError, match="`model` must be a keras.Model. Received: str"):
        kerasdbg.strip_debug_layers("model")
    with pytest.raises(ValueError, match="Sequential model `lazy` is not built"):
        kerasdbg.insert_taps(keras.Sequential([keras.layers.Dense(1)], name="lazy"))
    with pytest.raises(TypeError, match="`tap` must be None, a layer instance"):
        kerasdbg.insert_taps(make_mlp(), tap="TapLayer")
    with pytest.raises(TypeError, match="the `tap` factory must return a keras layer"):
        kerasdbg.insert_taps(make_mlp(), tap=lambda layer, name: None)
    with pytest.raises(TypeError, match="`name` must be a string or None. Received: name=1"):
        kerasdbg.insert_taps(make_mlp(), name=1)


def test_tapped_model_saves_and_loads_with_counters(tmp_path):
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    tapped = kerasdbg.insert_taps(model, layers=["hidden"], tap=TapLayer(every_n_steps=2))
    tapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    tapped.save(tmp_path / "tapped.keras")
    loaded = keras.saving.load_model(tmp_path / "tapped.keras")
    tap = loaded.get_layer("hidden_tap")
    assert isinstance(tap, TapLayer)
    assert (tap.every_n_steps, tap.activation) == (2, "relu")
    assert int(tap.calls.numpy()) == len(X) // BATCH
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-6)
    stripped = kerasdbg.strip_debug_layers(loaded)
    assert _names(stripped)[1:] == ["hidden", "out"]
