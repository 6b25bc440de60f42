"""A real KerasTuner search with every instrument (issue 32, items 3 and 5).

KerasTuner deep-copies each callback for every trial (it refuses one that
cannot be copied) and gives only Keras's `TensorBoard` a directory per trial
(`<log_dir>/<trial id>/execution0`). The kerasdbg instruments all share one
`log_dir`: each trial must still be a run of its own there, readable alone.
The search runs once (a module fixture); each test checks one promise, with
the values read independently: TensorBoard's `EventAccumulator` on the event
files, and the trial losses from Keras's own `TensorBoard` callback.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

keras_tuner = pytest.importorskip("keras_tuner")  # in the test extra (setup.cfg)

import kerasdbg  # noqa: E402
from kerasdbg import callbacks as kdc  # noqa: E402
from kerasdbg.layers import TapLayer  # noqa: E402

TRIALS, SAMPLES, BATCH, EPOCHS = 3, 16, 4, 2
STEPS = SAMPLES // BATCH * EPOCHS  # optimizer steps of each trial
EPOCH_END_STEPS = [SAMPLES // BATCH * (e + 1) for e in range(EPOCHS)]


def _build(hp):
    inputs = keras.Input((3,))
    h = keras.layers.Dense(hp.Int("units", 4, 8, step=2), activation="relu", name="hidden")(inputs)
    h = TapLayer(activation="relu", name="tap")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(keras.optimizers.SGD(hp.Float("learning_rate", 1e-3, 1e-1, sampling="log")),
                  "mse")
    return model


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tuner")
    logs = str(tmp / "logs")
    instruments = {
        "GradientStatistics": kdc.GradientStatistics(logs),
        "WeightStatistics": kdc.WeightStatistics(logs),
        "StopOnRule": kdc.StopOnRule(log_dir=logs, verbose=False),
        "ActivationStatistics": kdc.ActivationStatistics(logs),
        "StepTimer": kdc.StepTimer(logs),
        "StepRecorder": kdc.StepRecorder(str(tmp / "trace.npz"), steps=2),
    }
    tensorboard = keras.callbacks.TensorBoard(str(tmp / "tensorboard"))
    tuner = keras_tuner.RandomSearch(
        _build, objective="loss", max_trials=TRIALS, overwrite=True,
        directory=str(tmp / "tuner"), project_name="search", seed=1)
    # Seeded: every trial's initial weights are the same whatever ran before
    # in this process (an unseeded draw once gave a trial whose ReLU units
    # were all dead, which StopOnRule rightly stopped).
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 3)).astype("float32")
    y = rng.normal(size=(SAMPLES, 1)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuner.search(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     callbacks=[*instruments.values(), tensorboard])
    return {"tmp": tmp, "logs": logs, "tuner": tuner, "instruments": instruments,
            "warnings": caught}


def _scalars(directory):
    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def _run_directories(logs):
    """Every directory under `logs` that holds kerasdbg's event files."""
    found = []
    for directory, _, files in os.walk(logs):
        if any(f.startswith("events.out.tfevents") for f in files):
            found.append(directory)
    return sorted(found)


def _trial_losses(tmp):
    """{trial id: [epoch loss, ...]} from Keras's TensorBoard callback, which
    KerasTuner moved to `<log_dir>/<trial id>/execution0`."""
    losses = {}
    root = tmp / "tensorboard"
    for trial in sorted(os.listdir(root)):
        accumulator = EventAccumulator(str(root / trial / "execution0" / "train"),
                                       size_guidance={"tensors": 0})
        accumulator.Reload()
        losses[trial] = [float(tf.make_ndarray(e.tensor_proto))
                         for e in accumulator.Tensors("epoch_loss")]
    return losses


def test_the_search_completes_without_a_kerasdbg_failure(search):
    assert len(search["tuner"].oracle.trials) == TRIALS
    failures = [str(w.message) for w in search["warnings"]
                if issubclass(w.category, RuntimeWarning)]
    assert failures == []


def test_each_trial_is_a_run_of_its_own(search):
    """Every trial's records in a run directory of their own: steps 1-8 once
    each, and the epoch losses of exactly one trial (Keras's TensorBoard
    callback, which KerasTuner gives a directory per trial, says which)."""
    directories = _run_directories(search["logs"])
    assert len(directories) == TRIALS, (
        f"{TRIALS} trials wrote into {len(directories)} run directories: "
        f"{[os.path.relpath(d, search['logs']) for d in directories]}")
    trial_losses = _trial_losses(search["tmp"])
    assert len(trial_losses) == TRIALS
    matched = []
    for directory in directories:
        scalars = _scalars(directory)
        for tag in ("gradients/global_norm", "weights/hidden/kernel/l2_norm", "step/loss",
                    "activations/tap/mean", "time/step_seconds"):
            assert [s for s, _ in scalars[tag]] == list(range(1, STEPS + 1)), (directory, tag)
        epochs = scalars["epoch/loss"]
        assert [s for s, _ in epochs] == EPOCH_END_STEPS, directory
        trial = [t for t, losses in trial_losses.items()
                 if np.allclose([v for _, v in epochs], losses, rtol=1e-6)]
        assert len(trial) == 1, (directory, epochs, trial_losses)
        matched += trial
    assert sorted(matched) == sorted(trial_losses)


def test_each_trial_reads_back_alone_with_load_run(search):
    run = kerasdbg.load_run(search["logs"])
    assert len(run.runs) == TRIALS, run.runs
    for name in run.runs:
        frame = run.scalars("gradients/global_norm", run=name)
        assert sorted(frame["step"].tolist()) == list(range(1, STEPS + 1)), name


def test_the_original_callbacks_stay_fresh(search):
    """KerasTuner trains copies: the callbacks given to `search` never run,
    so they hold no records (their copies wrote them to `log_dir`)."""
    instruments = search["instruments"]
    for name in ("GradientStatistics", "WeightStatistics", "ActivationStatistics", "StepTimer"):
        assert len(instruments[name].history) == 0, name
        assert instruments[name].model is None, name
    assert instruments["StopOnRule"].verdicts == []


def test_the_step_recorder_trace_is_readable(search):
    """One `path` for every trial: the file holds the last trial's steps."""
    with np.load(search["instruments"]["StepRecorder"].path) as trace:
        steps = sorted({int(k.rpartition("@")[2]) for k in trace.files if k.startswith("loss@")})
    assert steps == [1, 2]
