"""TapLayer: histograms, sample rows, health, replicas, modes, arguments, saving."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.layers import TapLayer
from tests.conftest import make_strategy, reference_stats

RNG = np.random.default_rng(3)
X = RNG.normal(size=(8, 5)).astype("float32")
Y = np.zeros((8, 1), "float32")


def _tapped(tap, strategy=None, activation=None):
    with (strategy or make_strategy("default")).scope():
        inputs = keras.Input((5,))
        h = keras.layers.Activation(activation)(inputs) if activation else inputs
        model = keras.Model(inputs, keras.layers.Dense(1, name="d")(tap(h)))
        model.compile("sgd", "mse")
    return model


def test_histogram_and_sample_rows_match_numpy():
    tap = TapLayer(histogram=True, histogram_bins=4, sample_rows=3, name="t")
    model = _tapped(tap)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    counts, (low, high) = tap.latest_histogram
    want, edges = np.histogram(X, bins=4, range=(X.min(), X.max()))
    np.testing.assert_allclose(counts, want)
    np.testing.assert_allclose([low, high], [edges[0], edges[-1]], rtol=1e-6)
    np.testing.assert_allclose(tap.latest_rows, X[:3], rtol=1e-6)


def test_sample_rows_of_a_short_batch_are_not_padded():
    tap = TapLayer(sample_rows=4, name="t")
    tap(X[:2])
    assert tap.latest_rows.shape == (2, 5)
    np.testing.assert_allclose(tap.latest_rows, X[:2], rtol=1e-6)
    record = tap._host.latest_raw.values["rows"]  # as recorded in-graph: padded
    np.testing.assert_allclose(record[:2], X[:2], rtol=1e-6)
    np.testing.assert_allclose(record[2:], 0)


@pytest.mark.parametrize(
    "activation, values, expected",
    [
        # Units are columns; a unit is flagged when flagged for the whole batch (< 100
        # rows); with min_examples=2, one batch of two decides.
        ("relu", [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]], 1 / 3),
        ("tanh", [[1.0, -1.0, 0.5], [1.0, -1.0, 0.99]], 2 / 3),
        ("sigmoid", [[1.0, 1e-11, 0.5], [1.0, 1e-12, 1e-9]], 2 / 3),
    ],
    ids=["relu-dead", "tanh-saturated", "sigmoid-saturated"],
)
def test_activation_health(activation, values, expected):
    tap = TapLayer(stats=["mean"], activation=activation, min_examples=2, name="t")
    tap(np.array(values, "float32"))
    assert tap.latest[tap.health[0]] == pytest.approx(expected)


def test_a_unit_is_dead_after_min_examples_in_a_row_not_after_one_small_batch():
    rng = np.random.default_rng(5)
    tap = TapLayer(stats=["mean"], activation="relu", name="t")  # min_examples=100
    streak = np.zeros(4, np.int64)  # the reference, per unit
    for call in range(80):
        batch = rng.integers(1, 9)
        values = np.abs(rng.normal(size=(batch, 4))).astype("float32")
        values[:, 0] = 0.0                          # never active: dead after 100 examples
        values[:, 1] *= rng.random(batch) < 0.2     # often a whole batch at 0, never dead
        if call >= 40:
            values[:, 2] = 0.0                      # dies at call 40
        tap(values)
        inactive = np.all(values == 0, axis=0)
        streak = np.where(inactive, streak + batch, 0)
        assert tap.latest["dead_fraction"] == pytest.approx(np.mean(streak >= 100)), call
    assert tap.latest["dead_fraction"] == pytest.approx(0.5)  # units 0 and 2
    # An empty batch (a replica's share of the last one) changes nothing.
    before = tap._host.flagged.numpy().copy()
    tap(np.zeros((0, 4), "float32"))
    np.testing.assert_array_equal(tap._host.flagged.numpy(), before)


def test_a_sequence_of_any_length_counts_as_more_of_the_batch():
    tap = TapLayer(stats=["mean"], activation="relu", min_examples=4, name="t")
    inputs = keras.Input((None, 3))
    model = keras.Model(inputs, tap(inputs))
    x = np.ones((2, 5, 3), "float32")
    x[:, :, 0] = 0.0                       # channel 0 never active
    x[0, 4, 1] = 0.0                       # channel 1 active elsewhere
    for calls in (1, 2):
        model(x)
        # Units are the 3 channels; 2 rows per call: 4 examples after the second.
        assert tap.latest["dead_fraction"] == pytest.approx(0.0 if calls == 1 else 1 / 3)


def test_evaluate_reads_the_runs_of_fit_and_a_replay_counts_nothing():
    from kerasdbg import _replay

    tap = TapLayer(stats=["mean"], activation="relu", min_examples=8, name="t")
    model = _tapped(tap, activation="relu")
    x = -np.abs(X)  # Dense after the relu of negative inputs: every unit zero
    model.fit(x[:8], Y[:8], batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert tap.history.dead_fraction.tolist() == [0.0, 1.0]
    runs, calls = tap._host.flagged.numpy().copy(), int(tap.calls.numpy())
    model.evaluate(x[:4], Y[:4], batch_size=4, verbose=0)
    assert tap.latest_by_mode["evaluate"]["dead_fraction"] == 1.0
    _replay.call_layer_by_layer(model, tf.constant(x[:4]), True, lambda name, value: None)
    np.testing.assert_array_equal(tap._host.flagged.numpy(), runs)
    assert int(tap.calls.numpy()) == calls + 1  # evaluate's call; the replay's: none
    with pytest.raises(ValueError, match="min_examples.*Received: min_examples=0"):
        TapLayer(activation="relu", min_examples=0)


def test_saturation_is_measured_on_real_activations():
    preactivation = np.array([[10.0, 9.0, -12.0, 0.1]] * 4, "float32")
    tap = TapLayer(stats=["max"], activation="tanh", min_examples=4, name="t")
    tap(np.tanh(preactivation))
    # float32 tanh is exactly 1 beyond ~9.01: 10 and -12 count, 9 and 0.1 do not.
    assert tap.latest["saturated_fraction"] == pytest.approx(0.5)


def test_all_replicas_are_aggregated_like_the_whole_batch():
    tap = TapLayer(replicas="all", name="t")
    model = _tapped(tap, make_strategy("mirrored"))
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    row = tap.history.iloc[0]
    for name, want in reference_stats(X).items():
        if name in tap.stats:
            np.testing.assert_allclose(row[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_first_replica_describes_replica_zero_slice():
    tap = TapLayer(name="t")
    model = _tapped(tap, make_strategy("mirrored"))
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(tap.history.iloc[0]["mean"], X[:4].mean(), rtol=1e-5)


def test_records_by_mode_and_every_n_steps():
    tap = TapLayer(stats=["mean"], every_n_steps=2, name="t")
    model = _tapped(tap)
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    assert tap.history.step.tolist() == [2, 4]
    np.testing.assert_allclose(tap.history["mean"], [X[2:4].mean(), X[6:8].mean()], rtol=1e-5)
    model.evaluate(X, Y, batch_size=4, verbose=0)
    model.predict(X, batch_size=8, verbose=0)
    modes = tap.latest_by_mode
    assert modes["evaluate"]["step"] == 2
    np.testing.assert_allclose(modes["evaluate"]["mean"], X[4:].mean(), rtol=1e-5)
    assert "predict" not in modes  # predict step 1 is not a multiple of 2
    assert tap.history.step.tolist() == [2, 4]  # only fit goes to history


def test_inputs_are_returned_unchanged_with_their_dtype():
    tap = TapLayer(name="t")
    for value in (np.arange(6, dtype="int32").reshape(2, 3), X.astype("float16")):
        out = tap(value)
        assert out.dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(out), value)


def test_saved_model_round_trips_config_and_counters(tmp_path):
    tap = TapLayer(stats=["mean", "max"], activation="relu", every_n_steps=2, name="t")
    model = _tapped(tap, make_strategy("mirrored"), activation="relu")
    model.fit(X, Y, batch_size=2, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras").get_layer("t")
    assert loaded.get_config() == tap.get_config()
    assert int(loaded.calls.numpy()) == 4
    np.testing.assert_array_equal(loaded.mode_calls.numpy(), tap.mode_calls.numpy())
    assert TapLayer.from_config(tap.get_config()).get_config() == tap.get_config()


def test_a_failure_warns_once_and_the_model_runs_on(monkeypatch):
    tap = TapLayer(name="t")
    monkeypatch.setattr(TapLayer, "_compute_values", staticmethod(lambda key, x, state, mode: 1 / 0))
    model = _tapped(tap)
    with pytest.warns(RuntimeWarning, match="TapLayer 't' stopped recording; the model runs on "
                                            "unchanged. Cause: ZeroDivisionError"):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    assert tap.history.empty


def test_strict_raises():
    tap = TapLayer(name="t", strict=True)
    tap._compute_values = lambda key, x, state, mode: 1 / 0
    with pytest.raises(ZeroDivisionError):
        tap(X)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"activation": "gelu"}, ValueError, "TapLayer: `activation` must be one of 'relu', 'tanh', 'sigmoid'. Received: activation='gelu'"),
        ({"active_fraction": 1.0}, ValueError, "TapLayer: `active_fraction` must be a fraction in [0, 1). Received: active_fraction=1.0"),
        ({"histogram": 1}, TypeError, "TapLayer: `histogram` must be a bool. Received: histogram=1"),
        ({"sample_rows": -1}, ValueError, "TapLayer: `sample_rows` must be"),
        ({"buffer_steps": 0}, ValueError, "TapLayer: `buffer_steps` must be a positive int. Received: buffer_steps=0"),
    ],
    ids=["activation", "threshold", "histogram", "rows", "buffer"],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        TapLayer(**kwargs)


def test_sample_rows_need_static_features():
    tap = TapLayer(sample_rows=1, name="t")
    with pytest.raises(ValueError, match=re.escape("TapLayer 't': `sample_rows` needs a static shape")):
        tap.build((None, None))


@pytest.mark.parametrize("spe", [1, 4, 5], ids=["spe1", "spe4", "spe5"])
def test_host_reads_only_after_executions_with_a_selected_step(monkeypatch, spe):
    from tests.helpers import X as x, Y as y

    tap = TapLayer(stats=["mean"], every_n_steps=3, name="t")
    inputs = keras.Input((6,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(3, name="d")(tap(inputs)), name="m")
    model.compile("sgd", "mse", steps_per_execution=spe)
    reads = []
    original = TapLayer._read
    monkeypatch.setattr(TapLayer, "_read", lambda self: reads.append(1) or original(self))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # steps 1..10
    # Reads: after the first execution (it traced), after the second (first
    # check of this optimizer's steps), after each later one that ran a
    # multiple of 3, and at the end of fit; never after the others.
    executions = [range(s, min(s + spe, 11)) for s in range(1, 11, spe)]
    selected = sum(any(step % 3 == 0 for step in steps) for steps in executions[2:])
    assert len(reads) == 1 + (len(executions) > 1) + selected + 1
    assert tap.history.step.tolist() == [3, 6, 9]
    for _ in range(3):  # eager calls in between: the third is recorded, as "call"
        tap(np.ones((2, 6), "float32"))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # steps 11..20
    assert tap.history.step.tolist() == [3, 6, 9, 12, 15, 18]
    assert tap.latest_by_mode["call"]["step"] == 3


def test_first_execution_is_flushed_right_after_it():
    seen = []
    tap = TapLayer(stats=["mean"], name="t")
    inputs = keras.Input((5,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(1, name="d")(tap(inputs)), name="m")
    model.compile("sgd", "mse")

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append([row["step"] for row in tap._host.history])

    model.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False, callbacks=[Probe()])
    # Probe runs before the flushing callback Keras's loop gained while tracing,
    # so it sees step 1 only at the second batch end; never later than that.
    assert seen[-1] == [1, 2]


def test_only_recorded_batches_count_towards_min_examples():
    # every_n_steps=2: steps 2 and 4 are recorded; the count costs nothing in between.
    tap = TapLayer(stats=["mean"], activation="relu", every_n_steps=2, min_examples=8, name="t")
    model = _tapped(tap, activation="relu")
    model.fit(-np.abs(X), Y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    assert tap.history.step.tolist() == [2, 4]
    assert tap.history.dead_fraction.tolist() == [0.0, 0.0]  # 2 + 2 examples counted
    model.fit(-np.abs(X), Y, batch_size=4, epochs=2, verbose=0, shuffle=False)  # steps 5-8
    assert tap.history.step.tolist() == [2, 4, 6, 8]
    assert tap.history.dead_fraction.tolist() == [0.0, 0.0, 1.0, 1.0]  # 2 + 2 + 4 at step 6


def test_a_stateless_call_counts_in_the_scope_and_the_tap_keeps_recording():
    # `Model.stateless_call` (JAX-style training loops) runs the layer in a stateless
    # scope: its counters' updates come back in the non-trainable variables.
    tap = TapLayer(stats=["mean"], name="t")
    model = keras.Sequential([keras.Input((5,)), tap])
    outputs, non_trainable = model.stateless_call(
        model.trainable_variables, model.non_trainable_variables, X)
    np.testing.assert_allclose(outputs, X)
    updated = {v.path: value for v, value in zip(model.non_trainable_variables, non_trainable)}
    assert int(updated[tap.calls.path]) == 1
    assert int(tap.calls.numpy()) == 0  # the variable itself is left alone
    assert not tap._failed
    assert tap.latest["mean"] == pytest.approx(X.mean())
    # The loop then writes the state back, as stateless training loops do; the next
    # ordinary call records as the second call.
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    tap(X[:2])
    assert tap.latest["mean"] == pytest.approx(X[:2].mean())
    assert int(tap.calls.numpy()) == 2


def test_the_percent_inactivity_threshold_is_renamed_with_a_warning():
    with pytest.warns(FutureWarning, match=re.escape(
            "TapLayer: `inactivity_threshold` is deprecated; use `active_fraction` (a fraction "
            "0-1, not a percent): inactivity_threshold=5.0 is active_fraction=0.05.")):
        tap = TapLayer(inactivity_threshold=5.0, name="t")
    assert tap.active_fraction == 0.05 and tap.get_config()["active_fraction"] == 0.05
    assert "inactivity_threshold" not in tap.get_config()
    # A layer saved before the rename (its config names the percent) loads.
    config = dict(tap.get_config())
    config["inactivity_threshold"] = config.pop("active_fraction") * 100
    with pytest.warns(FutureWarning, match="`inactivity_threshold` is deprecated"):
        assert TapLayer.from_config(config).active_fraction == pytest.approx(0.05)
