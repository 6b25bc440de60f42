"""StepTimer: execution time split into input and compute, across the matrix."""

import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.callbacks import StepTimer
from kerasdbg.rules import DiagnosisWarning
from kerasdbg.reader import load_run
from tests.conftest import make_strategy, matrix, only_upstream_failure
from tests.helpers import BATCH, X, Y, make_mlp

SLEEP = 0.03


def _sleep(x):
    time.sleep(SLEEP)
    return x


class Sleepy(keras.layers.Layer):
    """A layer whose forward pass takes SLEEP seconds (compute-bound steps)."""

    def call(self, x):
        return tf.ensure_shape(tf.py_function(_sleep, [x], x.dtype), x.shape)

    def compute_output_shape(self, input_shape):
        return input_shape


@pytest.mark.parametrize("strategy_name,spe,jit", matrix())
def test_matrix_one_row_per_execution(strategy_name, spe, jit, tmp_path):
    with make_strategy(strategy_name).scope():
        model = make_mlp()
        model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=spe, jit_compile=jit)
    timer = StepTimer(log_dir=str(tmp_path))
    with only_upstream_failure(strategy_name, jit):
        model.fit(X[:76], Y[:76], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[timer])
    history = timer.history
    # 10 steps (the last one with 4 examples), grouped by execution.
    expected_steps = [min(spe, 10 - i) for i in range(0, 10, spe)]
    assert history.steps.tolist() == expected_steps
    assert history.step.tolist() == list(np.cumsum(expected_steps))
    assert (history.execution_seconds > 0).all()
    np.testing.assert_allclose(history.step_seconds, history.execution_seconds / history.steps)
    if jit:  # XLA cannot compile tf.timestamp: wall time only
        assert history.input_seconds.isna().all() and history.examples.isna().all()
    else:
        expected_examples = [BATCH * s for s in expected_steps]
        expected_examples[-1] -= 4
        assert history.examples.tolist() == expected_examples
        assert (history.input_seconds >= 0).all() and (history.compute_seconds > 0).all()
        assert (history.input_seconds + history.compute_seconds
                <= history.execution_seconds + 1e-3).all()
    scalars = load_run(str(tmp_path)).scalars("time/execution_seconds")
    assert scalars.step.tolist() == history.step.tolist()
    assert "train_step" not in vars(model)


def _fit(model, data, timer, epochs=1):
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=2)
    model.fit(data, epochs=epochs, verbose=0, callbacks=[timer])


def test_a_slow_input_pipeline_is_input_bound_and_warns_once():
    slow = tf.data.Dataset.from_tensor_slices((X, Y)).map(
        lambda x, y: (tf.py_function(_sleep, [x], tf.float32), y)).batch(BATCH)
    slow = slow.map(lambda x, y: (tf.ensure_shape(x, [None, 6]), y))
    timer = StepTimer(warmup=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(make_mlp(), slow, timer, epochs=2)
    said = [w for w in caught if "input-bound" in str(w.message)]
    assert len(said) == 1
    # A diagnosis, not a kerasdbg failure (a RuntimeWarning): a busy machine
    # makes any run input-bound, and tests that allow no failure must pass.
    assert said[0].category is DiagnosisWarning
    assert not issubclass(said[0].category, RuntimeWarning)
    later = timer.history.iloc[1:]
    # Each step waits for BATCH sleeps of the map, one after the other.
    assert (later.input_seconds >= 0.8 * SLEEP * BATCH * later.steps).all()
    assert (later.input_fraction > 0.5).all()


def test_a_slow_model_is_compute_bound_and_does_not_warn(recwarn):
    inputs = keras.Input((6,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(3, name="out")(Sleepy(name="sleepy")(inputs)))
    fast = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).cache().prefetch(4)
    timer = StepTimer(warmup=1)
    _fit(model, fast, timer, epochs=2)
    assert not [w for w in recwarn if "input-bound" in str(w.message)]
    later = timer.history.iloc[1:]
    assert (later.compute_seconds >= 0.8 * SLEEP * later.steps).all()
    assert (later.input_fraction < 0.5).all()


def test_compute_covers_the_whole_step_of_stateless_ops():
    """Matmuls are not ordered by tf.function: the timestamps must still
    bracket the forward pass and the update (they once measured a quarter
    of the step, and called the rest input)."""
    rng = np.random.default_rng(0)
    x = rng.random((256, 512), dtype=np.float32)
    y = rng.random((256, 1), dtype=np.float32)
    inputs = keras.Input((512,))
    h = inputs
    for _ in range(3):
        h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).cache().prefetch(8)
    timer = StepTimer(warmup=1)
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=1, jit_compile=False)
    model.fit(data, epochs=3, verbose=0, callbacks=[timer])
    later = timer.history.iloc[2:]
    # The fault measured compute as 0.25 of the step and input as 0.75; the
    # margins leave room for a loaded machine (0.69 seen beside other tests).
    assert later.compute_seconds.median() >= 0.5 * later.execution_seconds.median()
    assert later.input_fraction.median() < 0.35


def test_get_config_round_trip(tmp_path):
    timer = StepTimer(log_dir=str(tmp_path), input_bound_threshold=0.3, warmup=0, strict=True)
    assert StepTimer.from_config(timer.get_config()).get_config() == timer.get_config()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"input_bound_threshold": 1.5}, ValueError, "`input_bound_threshold` must be a finite number"),
    ({"warmup": -1}, ValueError, "`warmup` must be a non-negative int"),
    ({"log_dir": 3}, TypeError, "`log_dir` must be None, a str"),
    ({"strict": "no"}, TypeError, "`strict` must be a bool"),
], ids=["threshold", "warmup", "log_dir", "strict"])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        StepTimer(**kwargs)
