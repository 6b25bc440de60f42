"""MultiOutputModel: trains exactly the original outputs, returns intermediates."""

import re

import keras
import numpy as np
import pytest

import kerasdbg
from tests.conftest import make_strategy, matrix, only_upstream_failure
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training
from tests.test_tapping import BRANCHY_X, _branchy


def _hidden(weights, x):
    return np.maximum(x @ weights[0] + weights[1], 0)


@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_fit_trains_the_original_outputs_as_plain_training_does(strategy_name, spe, jit):
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = make_mlp()
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", metrics=["mae"],
                      steps_per_execution=spe, jit_compile=jit)
        wrapped = kerasdbg.MultiOutputModel(model, outputs=["hidden"])
    assert wrapped.optimizer is model.optimizer
    initial = [w.numpy() for w in model.weights]
    with only_upstream_failure(strategy_name, jit):
        logs = wrapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    assert set(logs) == {"loss", "mae"}
    steps = len(X) // BATCH
    reference = reference_training(initial, steps)
    for got, want in zip(model.get_weights(), reference[-1]["after"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    weights = model.get_weights()
    out, intermediates = wrapped.predict(X, batch_size=BATCH, verbose=0)
    assert list(intermediates) == ["hidden"]
    hidden = _hidden(weights, X)
    np.testing.assert_allclose(intermediates["hidden"], hidden, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, hidden @ weights[2] + weights[3], rtol=1e-5, atol=1e-5)
    loss, mae = wrapped.evaluate(X, Y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(loss, np.mean((out - Y) ** 2), rtol=1e-5)


def test_weights_and_logs_equal_training_the_original_with_adam_and_dict_losses():
    twin, model = _branchy(), _branchy()
    y = {"o1": np.ones((6, 1), "float32"), "o2": np.linspace(0, 1, 6, dtype="float32")[:, None]}
    for m in (twin, model):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss={"o1": "mse", "o2": "mae"},
                  metrics={"o1": ["mae"]})
    wrapped = kerasdbg.MultiOutputModel(model, outputs="inner/h$|split")
    assert wrapped.intermediate_names == ("inner/h", "split")
    want = twin.fit(BRANCHY_X, y, batch_size=2, epochs=2, verbose=0, shuffle=False).history
    got = wrapped.fit(BRANCHY_X, y, batch_size=2, epochs=2, verbose=0, shuffle=False).history
    assert got == want
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(a, b)
    outputs, intermediates = wrapped(BRANCHY_X)
    weights = model.get_layer("inner").get_layer("h").get_weights()
    concat = np.concatenate([BRANCHY_X["a"], BRANCHY_X["b"]], 1)
    np.testing.assert_allclose(
        intermediates["inner/h"], np.tanh(concat @ weights[0] + weights[1]), rtol=1e-5, atol=1e-6,
    )
    assert [t.shape for t in intermediates["split"]] == [(6, 1), (6, 1)]
    np.testing.assert_array_equal(outputs["o2"], intermediates["split"][1])


def test_uncompiled_model_is_compiled_on_the_wrapper():
    model = make_mlp()
    wrapped = kerasdbg.MultiOutputModel(model, outputs=lambda layer: layer.name == "hidden",
                                        name="probe")
    assert wrapped.name == "probe" and not wrapped.compiled
    wrapped.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    initial = [w.numpy() for w in model.weights]
    wrapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference = reference_training(initial, len(X) // BATCH)
    for got, want in zip(model.get_weights(), reference[-1]["after"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_save_and_load_keeps_weights_optimizer_and_intermediates(tmp_path, strategy_name):
    with make_strategy(strategy_name).scope():
        model = make_mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse")
        wrapped = kerasdbg.MultiOutputModel(model, outputs=["hidden"])
        wrapped.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        wrapped.save(tmp_path / "wrapped.keras")
    loaded = keras.saving.load_model(tmp_path / "wrapped.keras")  # outside any strategy
    assert isinstance(loaded, kerasdbg.MultiOutputModel)
    assert loaded.intermediate_names == ("hidden",)
    assert int(loaded.optimizer.iterations.numpy()) == len(X) // BATCH
    for a, b in zip(loaded.wrapped_model.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    want_out, want_inter = wrapped.predict(X, verbose=0)
    got_out, got_inter = loaded.predict(X, verbose=0)
    # (Under MirroredStrategy each replica predicts half the batch: other matmul blocking.)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5)
    np.testing.assert_allclose(got_inter["hidden"], want_inter["hidden"], rtol=1e-5)
    # Training goes on from the saved optimizer state.
    loaded.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 2 * (len(X) // BATCH)


def test_errors():
    with pytest.raises(ValueError, match=re.escape(
        "MultiOutputModel: no layer named 'nope' in `branchy`. Layers: a, b, cat, inner"
    )):
        kerasdbg.MultiOutputModel(_branchy(), outputs=["nope"])
    with pytest.raises(ValueError, match="`outputs` selects no layer of `branchy`"):
        kerasdbg.MultiOutputModel(_branchy(), outputs="zzz")
    with pytest.raises(TypeError, match="`outputs` must be None, a regular expression"):
        kerasdbg.MultiOutputModel(_branchy(), outputs=3)
    with pytest.raises(TypeError, match="MultiOutputModel: `model` must be a keras.Model"):
        kerasdbg.MultiOutputModel(None, outputs="a")
