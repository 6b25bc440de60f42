"""Faults on JAX. A disk that fills up during a fit, injected for real (a
tmpfs mounted as root): each sink warns once, training goes on bitwise as
plain Keras, and no file is left open (the tmpfs unmounts). A NaN planted in
a batch: the steps it freezes leave every optimizer variable, the step count
included, as after a plain fit on the batches before it (tests/frozen_steps.py)."""

import os
import warnings

import jax
import keras
import numpy as np
import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.layers import TapLayer
from tests import frozen_steps
from tests.jax import examples
from tests.mounts import open_files_under, tmpfs

BATCH, STEPS, EPOCHS = 4, 50, 6  # 300 steps
RNG = np.random.default_rng(3)
X = RNG.normal(size=(BATCH * STEPS, 6)).astype("float32")
Y = X[:, :1] - X[:, 1:2]


def make(tap):
    keras.utils.set_random_seed(8)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="out")(tap(hidden))
    model = keras.Model(inputs, outputs, name="mlp")
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=2)
    return model


def test_a_disk_that_fills_up_warns_once_per_sink_and_training_is_plain_keras(tmp_path):
    plain = make(keras.layers.Identity())
    plain.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    disk = str(tmp_path / "disk")
    with tmpfs(disk, size="64k"):
        log_dir = os.path.join(disk, "logs")
        model = make(TapLayer(name="tap"))
        callbacks = [GradientStatistics(log_dir, every_n_steps=1), WeightStatistics(log_dir),
                     StopOnRule(log_dir=log_dir, verbose=False)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=callbacks)
        failures = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        # One sink (the log directory) for the three callbacks: one warning, with the cause.
        assert len(failures) == 1, failures
        assert "No space left on device" in failures[0], failures[0]
        assert callbacks[-1].verdicts == []
        assert open_files_under(disk) == []
    for got, want in zip(model.trainable_variables, plain.trainable_variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


# ------------------------------------------------------- frozen steps and the optimizer
FROZEN_MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
                 for spe in (1, 4) for jit in (True, False)]


@pytest.mark.parametrize("spe, jit", FROZEN_MATRIX)
def test_frozen_steps_leave_every_optimizer_variable_as_it_was(tmp_path, spe, jit):
    frozen_steps.check_mlp("adam", spe, jit, log_dir=str(tmp_path))


@pytest.mark.parametrize("optimizer", ["rmsprop", "adamw"])
@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_frozen_steps_leave_other_optimizers_as_they_were(optimizer, spe):
    frozen_steps.check_mlp(optimizer, spe)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_frozen_steps_leave_a_loss_scale_optimizer_as_it_was(mixed_precision, spe):
    frozen_steps.check_mlp("rmsprop", spe)


def test_frozen_steps_under_data_parallel_leave_the_optimizer_as_it_was():
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        frozen_steps.check_mlp("adam", 4)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_frozen_steps_leave_both_optimizers_of_a_stateless_gan_step_as_they_were(spe):
    """The DCGAN port's step applies two optimizers, the second one's
    variables in the non-trainable state: both as after a plain fit on the
    batches before the NaN, their step counts included."""
    port = examples.make("gan", steps=frozen_steps.STEPS, steps_per_execution=spe)
    frozen_steps.check_model(
        lambda: examples.make("gan", steps=frozen_steps.STEPS, steps_per_execution=spe).model,
        port.x, port.y, port.batch_size, list(port.optimizers))
