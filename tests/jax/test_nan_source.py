"""NaNSource on the JAX backend: the first layer output and the gradients
that held NaN/Inf at the first faulty step, as on TensorFlow.

Runs on the JAX backend only (`KERAS_BACKEND=jax`, see tests/conftest.py).
Where the NaN first appears is worked out here in NumPy from the model's
weights; the weights after the fit are compared with a plain fit's.
"""

import jax
import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import FreezeOnFault, NaNSource, NonFiniteLoss

BATCH, STEPS = 4, 10
RNG = np.random.default_rng(11)
X = RNG.normal(size=(BATCH * STEPS, 3)).astype("float32")
Y = RNG.normal(size=(BATCH * STEPS, 1)).astype("float32")
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


class _Log(keras.layers.Layer):
    """log(x): NaN for negative inputs, the planted source of NaN."""

    def call(self, x):
        return keras.ops.log(x)


def _nested(spe=1, jit=True):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,), name="x")
    hidden = keras.layers.Dense(4, activation="relu", name="d1")(inputs)
    block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d2"),
                              _Log(name="log")], name="block")
    outputs = keras.layers.Dense(1, name="o")(block(hidden))
    model = keras.Model(inputs, outputs, name="net")
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def _model(spe=1, jit=True):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((3,), name="x"), keras.layers.Dense(4, name="d"),
                              keras.layers.Dense(1, name="o")], name="m")
    model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def _subclassed():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = keras.layers.Dense(1, name="dense")

        def call(self, x):
            return self.dense(x)

    keras.utils.set_random_seed(5)
    model = Net()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _with_batch(step, value, sample=0):
    x = X.copy()
    x[(step - 1) * BATCH + sample] = value
    return x


def _fit(model, x, callbacks, steps=STEPS, y=Y):
    return model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=1,
                     shuffle=False, verbose=0, callbacks=callbacks)


def _source(stop):
    found = [v for v in stop.verdicts if v.rule == "NaNSource"]
    assert len(found) == 1, stop.verdicts
    return found[0]


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_the_first_non_finite_layer_and_gradients_are_reported(spe, jit):
    model = _nested(spe, jit)
    start = [np.asarray(w) for w in model.get_weights()]
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(model, X, [stop])
    # Independently: the first step's forward pass, layer by layer, in NumPy.
    d1, d2 = model.get_layer("d1"), model.get_layer("block").get_layer("d2")
    h1 = np.maximum(X[:BATCH] @ np.asarray(d1.kernel) + np.asarray(d1.bias), 0)
    h2 = h1 @ np.asarray(d2.kernel) + np.asarray(d2.bias)
    assert np.all(np.isfinite(h1)) and np.all(np.isfinite(h2)) and np.any(h2 < 0)
    source = _source(stop)
    assert (source.step, source.tensors[0]) == (1, "block/log"), source
    assert source.reason.startswith(
        "NaNSource at step 1: the first layer whose output held NaN/Inf is 'block/log'"), source
    assert set(source.tensors[1:]) == {"d1/kernel", "d1/bias", "block/d2/kernel",
                                       "block/d2/bias", "o/kernel", "o/bias"}
    for a, b in zip(start, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # the faulty first step reached no weight


@pytest.mark.parametrize("spe, jit", [MATRIX[0], MATRIX[3]])
def test_a_non_finite_input_is_reported_as_the_source(spe, jit):
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(_model(spe, jit), _with_batch(7, np.inf), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("NonFiniteLoss", 7), ("NaNSource", 7)]
    assert stop.verdicts[1].reason.startswith(
        "NaNSource at step 7: the first layer whose output held NaN/Inf is 'x'"), stop.verdicts


def test_a_nan_label_is_reported_as_the_loss_with_every_layer_output_finite():
    y = Y.copy()
    y[2 * BATCH] = np.nan
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(_model(), X, [stop], y=y)
    source = _source(stop)
    assert source.step == 3
    assert "every layer output was finite (the loss or its gradient was not)" in source.reason
    assert set(source.tensors) == {"m/d/kernel", "m/d/bias", "m/o/kernel", "m/o/bias"}


def test_a_subclassed_model_reports_the_gradients_and_says_why_not_the_layer():
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(_subclassed(), _with_batch(3, np.nan), [stop])
    source = _source(stop)
    assert source.step == 3
    assert "subclassed model 'sub' are not visible" in source.reason
    assert set(source.tensors) == {"sub/dense/kernel", "sub/dense/bias"}


def test_a_nan_in_one_devices_shard_names_the_input_under_data_parallel():
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        model = _model(spe=2)
        stop = StopOnRule(NonFiniteLoss(), verbose=False)
        _fit(model, _with_batch(5, np.nan, sample=BATCH - 1), [stop])  # the second device's half
    finally:
        keras.distribution.set_distribution(None)
    source = _source(stop)
    assert source.step == 5
    assert "the first layer whose output held NaN/Inf is 'x'" in source.reason, source


@pytest.mark.parametrize("case", ["nested", "input", "subclassed"])
def test_the_verdicts_are_the_same_offline(tmp_path, case):
    """`check_run` on the run's log directory gives what StopOnRule said online."""
    model, x = {"nested": (_nested(4), X), "input": (_model(4), _with_batch(6, np.nan)),
                "subclassed": (_subclassed(), _with_batch(3, np.nan))}[case]
    stop = StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path), verbose=False)
    _fit(model, x, [stop])
    online = [(v.rule, v.step, v.reason, v.tensors, v.severity) for v in stop.verdicts]
    assert "NaNSource" in {v[0] for v in online}
    offline = kerasdbg.check_run(str(tmp_path), [NonFiniteLoss(), FreezeOnFault(), NaNSource()])
    assert [(v.rule, v.step, v.reason, v.tensors, v.severity) for v in offline] == online


def test_a_healthy_fit_with_nan_location_is_bitwise_plain_keras():
    plain = _model(spe=2)
    plain_history = _fit(plain, X, []).history
    model = _model(spe=2)
    stop = StopOnRule(verbose=False)
    history = _fit(model, X, [stop]).history
    assert stop.verdicts == []
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _regularized(spe, jit):
    """BatchNormalization, Dropout (a seed generator's state) and Adam: every
    kind of state a step changes besides the weights."""
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((3,), name="x"), keras.layers.Dense(6, name="d"),
                              keras.layers.BatchNormalization(name="bn"),
                              keras.layers.Dropout(0.3, name="drop"),
                              keras.layers.Dense(1, name="o")], name="r")
    model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe, jit_compile=jit)
    return model


@pytest.mark.parametrize("spe, jit, timed", [(1, True, False), (3, True, False),
                                              (3, False, False), (4, True, True)])
def test_the_replay_gets_the_faulty_batch_and_the_state_its_step_started_from(
        monkeypatch, spe, jit, timed):
    """A spy on the replay: its batch is the faulty step's, and its weights
    (BatchNormalization's moving statistics and the dropout seed's state too)
    are, bit for bit, those of a plain fit over the batches before it."""
    from kerasdbg.backends.jax import nan_source
    from kerasdbg.callbacks import StepTimer

    bad = 5
    seen = []
    original = nan_source.replay

    def spy(model, weights, data, names):
        seen.append(([np.asarray(w) for w in weights[0]], [np.asarray(w) for w in weights[1]],
                     np.asarray(data[0])))
        return original(model, weights, data, names)

    monkeypatch.setattr(nan_source, "replay", spy)
    y = Y.copy()
    y[(bad - 1) * BATCH + 1] = np.nan
    before = _regularized(spe, jit)
    _fit(before, X, [], steps=bad - 1)
    model = _regularized(spe, jit)
    callbacks = [StopOnRule(NonFiniteLoss(), verbose=False)]
    if timed:
        callbacks.append(StepTimer())  # the timed execution's path
    _fit(model, X, callbacks, y=y)
    assert len(seen) == 1
    trainable, non_trainable, batch = seen[0]
    np.testing.assert_array_equal(batch, X[(bad - 1) * BATCH:bad * BATCH])
    for got, variable in zip(trainable, before.trainable_variables):
        np.testing.assert_array_equal(got, np.asarray(variable.value), err_msg=variable.path)
    for got, variable in zip(non_trainable, before.non_trainable_variables):
        np.testing.assert_array_equal(got, np.asarray(variable.value), err_msg=variable.path)
    assert len(non_trainable) >= 3  # the moving mean and variance, the seed's state
    assert _source(callbacks[0]).step == bad


def test_a_gradient_norm_above_the_limit_is_frozen_but_not_looked_into_as_a_nan():
    stop = StopOnRule(NonFiniteLoss(), max_gradient_norm=1e-3, verbose=False)
    model = _model()
    start = [np.asarray(w) for w in model.get_weights()]
    _fit(model, X, [stop])
    assert [v.rule for v in stop.verdicts] == ["FreezeOnFault"], stop.verdicts
    for a, b in zip(start, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_without_the_freeze_nan_location_says_it_cannot_look():
    stop = StopOnRule(NonFiniteLoss(), freeze_on_fault=False, locate_nan=True, verbose=False)
    with pytest.warns(RuntimeWarning, match="on the JAX backend NaNSource needs the NaN guard"):
        _fit(_model(), _with_batch(3, np.nan), [stop])
    assert [v.rule for v in stop.verdicts] == ["NonFiniteLoss"], stop.verdicts
    with pytest.raises(ValueError, match="NaNSource needs the NaN guard"):
        _fit(_model(), X, [StopOnRule(NonFiniteLoss(), freeze_on_fault=False, locate_nan=True,
                                      strict=True)])
