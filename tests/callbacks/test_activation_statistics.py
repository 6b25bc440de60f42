"""ActivationStatistics: taps of a real fit written to TensorBoard and read back."""

import re

import keras
import numpy as np
import pytest

from kerasdbg import load_run
from kerasdbg.callbacks import ActivationStatistics
from kerasdbg.layers import TapLayer

RNG = np.random.default_rng(5)
X = RNG.normal(size=(16, 4)).astype("float32")
Y = RNG.normal(size=(16, 1)).astype("float32")


def _model():
    keras.utils.set_random_seed(2)
    inner_in = keras.Input((6,))
    inner = keras.Model(inner_in, TapLayer(stats=["max"], name="inner_tap")(inner_in), name="inner")
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", name="dense")(inputs)
    h = TapLayer(stats=["mean", "std"], activation="tanh", histogram=True, name="dense_tap")(h)
    h = inner(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile("sgd", "mse", steps_per_execution=3)
    return model


def test_fit_writes_every_tap_and_histograms(tmp_path):
    model = _model()
    kernel, bias = (w.numpy() for w in model.get_layer("dense").weights)
    callback = ActivationStatistics(str(tmp_path))
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[callback])
    history = callback.history
    # Step 1 runs on the initial weights: an independent NumPy value.
    step_one = np.tanh(X[:4] @ kernel + bias)
    np.testing.assert_allclose(history["dense_tap/mean"][0], step_one.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["dense_tap/std"][0], step_one.std(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["inner_tap/max"][0], step_one.max(), rtol=1e-5, atol=1e-6)
    assert history.step.tolist() == list(range(1, 9))
    assert list(history.columns) == ["step", "dense_tap/mean", "dense_tap/std",
                                     "dense_tap/saturated_fraction", "inner_tap/max"]
    tap_history = model.get_layer("dense_tap").history
    np.testing.assert_allclose(history["dense_tap/mean"], tap_history["mean"])

    run = load_run(str(tmp_path))
    assert run.tags("^activations/") == [
        "activations/dense_tap/mean", "activations/dense_tap/saturated_fraction",
        "activations/dense_tap/std", "activations/inner_tap/max"]
    frame = run.scalars("activations/inner_tap/max")
    assert frame.step.tolist() == list(range(1, 9))
    np.testing.assert_allclose(frame.value, history["inner_tap/max"], rtol=1e-6)
    assert run.tags(kind="histograms") == ["activations/dense_tap"]
    counts = run.histograms("activations/dense_tap").iloc[-1].counts
    assert counts.sum() == 4 * 6


def test_batch_ends_read_only_taps_that_recorded_and_one_trace():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    counted = TapLayer(stats=["mean"], every_n_steps=4, name="every_4")
    h = counted(keras.layers.Dense(6, name="dense")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile("adam", "mse")  # Adam: built inside the first trace unless built before
    callback = ActivationStatistics()
    reads, traces, at_batch_end = [], [], [False]
    original_read, original_values = counted._read, counted._compute_values

    def counting_read():
        reads.append(at_batch_end[0])
        return original_read()

    def counting_values(key, inputs, state, mode):
        traces.append(1)
        return original_values(key, inputs, state, mode)

    class Mark(keras.callbacks.Callback):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def on_train_batch_end(self, batch, logs=None):
            at_batch_end[0] = self.value

    counted._read, counted._compute_values = counting_read, counting_values
    # The reads between the two marks are the callback's own.
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False,
              callbacks=[Mark(True), callback, Mark(False)])
    assert callback.history.step.tolist() == [4, 8]
    # 8 steps: the callback reads at step 1 (its first check) and then never:
    # the layer sink read steps 4 and 8 right after their executions.
    assert reads.count(True) == 1
    assert len(traces) == 1


def test_include_exclude_and_a_model_without_taps():
    model = _model()
    callback = ActivationStatistics(exclude="inner")
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert "inner_tap/max" not in callback.history.columns
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")])
    plain.compile("sgd", "mse")
    message = re.escape(
        "ActivationStatistics records nothing this fit: the model has no TapLayer matching "
        "include=None, exclude=None. Taps: (none; add TapLayer()s after the layers to watch")
    # Training goes on with a warning; strict=True raises.
    with pytest.warns(RuntimeWarning, match=message):
        history = plain.fit(X, Y, verbose=0, callbacks=[ActivationStatistics()])
    assert len(history.history["loss"]) == 1
    with pytest.raises(ValueError, match=message):
        plain.fit(X, Y, verbose=0, callbacks=[ActivationStatistics(strict=True)])


def test_config_round_trip_and_bad_arguments():
    callback = ActivationStatistics("logs", include="a", history_size=3)
    assert ActivationStatistics.from_config(callback.get_config()).get_config() == callback.get_config()
    with pytest.raises(ValueError, match=re.escape("ActivationStatistics: `history_size` must be")):
        ActivationStatistics(history_size=-1)
