"""A case both backends run: `StopOnRule`'s `epoch/learning_rate` at each
epoch's end (tests/callbacks/test_stop_on_rule.py, tests/jax/test_front_page.py)."""

import warnings

import keras
import numpy as np

from kerasdbg import load_run
from kerasdbg.callbacks import StopOnRule


def check_learning_rates(tmp_path) -> None:
    """A schedule's rate at the optimizer's step at each epoch's end (by NumPy
    on the schedule's formula), and a constant rate; no warning (NumPy 2's
    deprecation of converting a Keras variable included)."""
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    y = x[:, :1]
    for name, rate, expected in [
            ("schedule", keras.optimizers.schedules.ExponentialDecay(0.1, 4, 0.5),
             lambda step: 0.1 * 0.5 ** (step / 4)),
            ("constant", 0.05, lambda step: 0.05)]:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(rate), "mse")
        log_dir = str(tmp_path / name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                      callbacks=[StopOnRule(log_dir=log_dir, verbose=False)])
        rows = load_run(log_dir).scalars("epoch/learning_rate")
        assert rows.step.tolist() == [4, 8, 12]
        np.testing.assert_allclose(rows.value, [expected(s) for s in (4, 8, 12)], rtol=1e-6)
