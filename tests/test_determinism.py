"""deterministic(seed): bitwise-repeatable training on CPU, state put back."""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.backends.tensorflow import randomness
from kerasdbg.callbacks import StepRecorder
from tests.helpers import BATCH, X, Y


def _run(path, seed):
    with kerasdbg.deterministic(seed):
        inputs = keras.Input((6,), name="x")
        h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        h = keras.layers.Dropout(0.5, name="drop")(h)
        model = keras.Model(inputs, keras.layers.Dense(3, name="out")(h), name="dropout_net")
        model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=2)
        # Shuffling and Dropout both draw from the seeded generators.
        model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=True, verbose=0,
                  callbacks=[StepRecorder(path, steps=[0, 1, 2, 3, 15])])
    return np.load(path)


def test_two_runs_give_bitwise_equal_traces(tmp_path):
    first = _run(str(tmp_path / "a.npz"), 3)
    second = _run(str(tmp_path / "b.npz"), 3)
    assert first.files == second.files and len(first.files) > 30
    for key in first.files:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    result = kerasdbg.compare_traces(str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), atol=0.0)
    assert result.passed and (result.table.max_abs == 0).all()
    # Another seed trains differently (the test can tell runs apart).
    third = _run(str(tmp_path / "c.npz"), 4)
    assert not np.array_equal(first["weights/hidden/kernel@15"], third["weights/hidden/kernel@15"])


def test_previous_state_is_restored_on_exit_and_on_error():
    random.seed(11)
    np.random.seed(11)
    tf.random.set_seed(None)
    before = (random.getstate(), np.random.get_state()[1].copy(), randomness.random_state())
    with pytest.raises(RuntimeError, match="inside"):
        with kerasdbg.deterministic(1):
            assert randomness.random_state()["op_determinism"] is True
            assert randomness.random_state()["tf_seed"] == 1
            random.random()
            np.random.rand()
            raise RuntimeError("inside")
    assert random.getstate() == before[0]
    np.testing.assert_array_equal(np.random.get_state()[1], before[1])
    assert randomness.random_state() == before[2]
    assert randomness.random_state()["op_determinism"] is False


def test_the_same_block_cannot_be_entered_twice():
    block = kerasdbg.deterministic(0)
    with block:
        with pytest.raises(RuntimeError, match="already entered"):
            block.__enter__()


@pytest.mark.parametrize("seed,error,match", [
    (-1, ValueError, "`seed` must be a non-negative int"),
    (2**32, ValueError, r"in \[0, 2\*\*32 - 1\]"),
    (1.0, TypeError, "`seed` must be a non-negative int"),
    (True, TypeError, "`seed` must be a non-negative int"),
], ids=["negative", "too-large", "float", "bool"])
def test_bad_seeds_are_refused(seed, error, match):
    with pytest.raises(error, match=match):
        kerasdbg.deterministic(seed)
