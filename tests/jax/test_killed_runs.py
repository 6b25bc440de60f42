"""A run killed with SIGKILL on the JAX backend is read up to the last step
its event files hold: the same kill points and the same checks as on
TensorFlow (tests/test_killed_runs.py, whose tests run here again with this
module's `killed` fixture), the child training on JAX without TensorFlow.

Runs on the JAX backend only (`KERAS_BACKEND=jax`, see tests/conftest.py).
"""

import pytest

from tests.test_killed_runs import (  # noqa: F401 - the tests run here on JAX
    kill_children,
    test_a_killed_run_reads_every_step_its_event_files_hold,
    test_a_run_killed_at_its_first_step_says_what_it_holds,
)

_CHILD = r"""
import os, sys, time
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import keras
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

assert "tensorflow" not in sys.modules
log_dir, steps_per_epoch, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
interval, pause = sys.argv[4], float(sys.argv[5])
import kerasdbg
kerasdbg.set_read_interval(None if interval == "default" else float(interval))


class Progress(keras.callbacks.Callback):
    # Counts the optimizer steps itself: `self.model` would sync Keras's JAX
    # state at every batch, which plain training does not do.
    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        Progress.steps += 1
        time.sleep(pause)  # a step of `pause` seconds more
        print(Progress.steps, flush=True)
        if Progress.steps >= kill_step:
            # Waits for its SIGKILL here: a loaded machine's parent reads the
            # line late, and the child must not train on past the kill point.
            time.sleep(3600)


def batches():
    x = np.random.default_rng(0).random((256, 4)).astype("float32")
    while True:
        for start in range(0, 256, 4):
            chunk = x[start:start + 4]
            yield chunk, chunk.sum(1, keepdims=True)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="d1"),
                          keras.layers.Dense(1, name="d2")], name="m")
model.compile("sgd", "mse")
model.fit(batches(), steps_per_epoch=steps_per_epoch, epochs=10**6, verbose=0,
          callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir),
                     StopOnRule(log_dir=log_dir, verbose=False), Progress()])
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """name -> the log directory of a JAX child SIGKILLed at its step."""
    return kill_children(tmp_path_factory.mktemp("killed"), _CHILD)
