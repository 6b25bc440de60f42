"""A disk that fills up during a fit on JAX, injected for real (a tmpfs
mounted as root): each sink warns once, training goes on bitwise as plain
Keras, and no file is left open (the tmpfs unmounts)."""

import os
import warnings

import keras
import numpy as np

from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.layers import TapLayer
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
