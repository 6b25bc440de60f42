"""`StepTimer` on JAX: host timing of each execution, across the matrix.

The expected examples and steps come from the data fed; the input time
from an iterator whose batches are known to take a while (a generator that
sleeps), measured beside it in the test.
"""

import time
import warnings

import jax
import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import StepTimer
from kerasdbg.rules import DiagnosisWarning

BATCH, STEPS = 8, 8
X = np.random.default_rng(0).normal(size=(BATCH * STEPS, 3)).astype("float32")
Y = X.sum(1, keepdims=True)
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


def _model(spe=1, jit=True):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def _fit(model, callbacks=(), x=X, y=Y, **kwargs):
    kwargs.setdefault("epochs", 1)
    return model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                     callbacks=list(callbacks), **kwargs)


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_each_execution_is_timed_and_training_is_bitwise_plain(tmp_path, spe, jit):
    plain = _model(spe, jit)
    plain_history = _fit(plain).history
    model = _model(spe, jit)
    timer = StepTimer(log_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no kerasdbg warning on a healthy run
        history = _fit(model, [timer]).history
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    table = timer.history
    assert table.step.tolist() == list(range(spe, STEPS + 1, spe))
    assert table.steps.tolist() == [spe] * (STEPS // spe)
    assert table.examples.tolist() == [float(BATCH * spe)] * (STEPS // spe)
    assert (table.execution_seconds > 0).all()
    np.testing.assert_allclose(table.input_seconds + table.compute_seconds,
                               table.execution_seconds, rtol=1e-9)
    assert ((table.input_fraction >= 0) & (table.input_fraction <= 1)).all()
    scalars = kerasdbg.load_run(str(tmp_path)).scalars(r"time/.*")
    assert set(scalars.tag) == {f"time/{c}" for c in (
        "execution_seconds", "step_seconds", "input_seconds", "compute_seconds",
        "input_fraction", "examples_per_second")}


@pytest.mark.parametrize("spe", [1, 2])
def test_a_slow_input_is_measured_and_diagnosed(spe):
    delay = 0.05

    def batches():
        for i in range(0, len(X), BATCH):
            time.sleep(delay)
            yield X[i:i + BATCH], Y[i:i + BATCH]

    model = _model(spe)
    timer = StepTimer(warmup=0)
    with pytest.warns(DiagnosisWarning, match="StepTimer: training is input-bound"):
        model.fit(batches(), epochs=1, verbose=0, steps_per_epoch=STEPS, shuffle=False,
                  callbacks=[timer])
    table = timer.history
    # Each batch but the two Keras's generator adapter peeked at before the
    # fit's loop took at least `delay` of the host's time to come.
    assert table.input_seconds.sum() >= delay * (STEPS - 2) * 0.9, table.input_seconds
    assert (table.input_seconds <= table.execution_seconds).all()
    assert table.examples.sum() == len(X)


def test_a_last_short_execution_counts_the_steps_it_ran():
    from kerasdbg.callbacks import GradientStatistics

    model = _model(spe=3)
    timer, gradients = StepTimer(), GradientStatistics()
    _fit(model, [timer, gradients], epochs=2)  # 8 steps an epoch: executions of 3, 3 and 2
    assert timer.history.steps.tolist() == [3, 3, 2] * 2
    assert timer.history.step.tolist() == [3, 6, 8, 11, 14, 16]
    assert timer.history.examples.tolist() == [24.0, 24.0, 16.0] * 2
    # The other instruments get each step once, the short execution's last one too.
    assert gradients.history.step.tolist() == list(range(1, 2 * STEPS + 1))


def test_data_parallel_counts_the_global_batch():
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices("cpu")))
    try:
        model = _model(spe=2)
        timer = StepTimer()
        _fit(model, [timer])
    finally:
        keras.distribution.set_distribution(None)
    assert timer.history.examples.tolist() == [2.0 * BATCH] * (STEPS // 2)


def test_the_timer_beside_the_statistics_and_in_a_second_fit():
    from kerasdbg.callbacks import GradientStatistics, StopOnRule

    model = _model(spe=2)
    timer, gradients = StepTimer(), GradientStatistics()
    _fit(model, [timer, gradients, StopOnRule(verbose=False)])
    assert timer.history.step.tolist() == [2, 4, 6, 8]
    assert gradients.history.step.tolist() == list(range(1, STEPS + 1))
    _fit(model, [timer])
    assert timer.history.step.tolist() == [10, 12, 14, 16]
    assert "stateless_apply" not in vars(model.optimizer)
