"""WeightStatistics: arguments and what is specific to weights.

The values at every step, across the execution matrix, are checked against
a NumPy reference in tests/test_engine.py.
"""

import keras
import numpy as np
import pytest

from kerasdbg.callbacks import WeightStatistics
from kerasdbg.callbacks.weight_statistics import WEIGHT_STATISTICS
from tests.helpers import BATCH, X, Y, make_mlp


def test_update_ratio_and_distance_with_every_n_steps():
    model = make_mlp()
    model.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=4)
    snapshots = []

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            snapshots.append([v.numpy() for v in self.model.trainable_variables])

    start = [v.numpy() for v in model.trainable_variables]
    weights_cb = WeightStatistics(every_n_steps=2, stats=["update_ratio", "distance_from_start"])
    model.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=1)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[weights_cb, Snapshot()])
    history = weights_cb.history
    assert history.step.tolist() == [2, 4, 6, 8, 10]
    for _, row in history.iterrows():
        step = int(row.step)
        for i, v in enumerate(model.trainable_variables):
            after, before = snapshots[step - 1][i], snapshots[step - 2][i]
            np.testing.assert_allclose(
                row[f"{v.path}/distance_from_start"], np.linalg.norm(after - start[i]), rtol=1e-5)
            ratio = np.linalg.norm(after - before) / np.linalg.norm(before)
            np.testing.assert_allclose(row[f"{v.path}/update_ratio"], ratio, rtol=1e-4)


def test_frozen_variable_is_not_described_and_zero_update_ratio_is_zero():
    model = make_mlp()
    model.get_layer("hidden").trainable = False
    model.compile(keras.optimizers.SGD(0.0), "mse")
    weights_cb = WeightStatistics(stats=["update_ratio"])
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[weights_cb])
    columns = [c for c in weights_cb.history.columns if c.endswith("update_ratio")]
    assert columns and not [c for c in columns if "hidden" in c]
    assert (weights_cb.history[columns] == 0).all().all()


def test_get_config_round_trip_and_defaults():
    callback = WeightStatistics()
    assert callback.stats == WEIGHT_STATISTICS
    clone = WeightStatistics.from_config(callback.get_config())
    assert clone.get_config() == callback.get_config()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"stats": ["update"]}, ValueError, r"WeightStatistics: `stats` must be a non-empty list of names from .*update_ratio, distance_from_start, p05, p50, p95. Received: stats=\['update'\]"),
        ({"every_n_steps": 0}, ValueError, r"WeightStatistics: `every_n_steps` must be a positive int. Received: every_n_steps=0"),
    ],
    ids=["unknown-stat", "every_n_steps"],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        WeightStatistics(**kwargs)
