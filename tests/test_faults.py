"""Faults of the file system during a fit, injected for real (a tmpfs mounted
as root): a disk that fills up, a read-only directory. Every sink warns once
for all the callbacks writing there, training goes on bitwise as plain
Keras, `strict=True` raises a `RecordingError`, and no file is left open."""

import os
import re
import shutil
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_file_loader

import kerasdbg
from kerasdbg.callbacks import (ActivationStatistics, GradientStatistics, StepRecorder,
                                StopOnRule, WeightStatistics)
from kerasdbg.layers import TapLayer
from tests.mounts import open_files_under, tmpfs

STEPS_PER_EPOCH, EPOCHS, BATCH = 50, 10, 2  # 500 steps
RNG = np.random.default_rng(0)
X = RNG.normal(size=(STEPS_PER_EPOCH * BATCH, 8, 8, 1)).astype("float32")
Y = RNG.integers(0, 2, size=(STEPS_PER_EPOCH * BATCH,))


def _cnn(taps=False):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 8, 1), name="image")
    hidden = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    if taps:
        hidden = TapLayer(stats=["mean", "std"], activation="relu", name="conv_tap")(hidden)
    hidden = keras.layers.Flatten(name="flat")(hidden)
    outputs = keras.layers.Dense(2, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="cnn")
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit(model, callbacks, epochs=EPOCHS):
    return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


def _plain_weights(taps=False, epochs=EPOCHS):
    model = _cnn(taps)
    _fit(model, [], epochs)
    return [w.numpy() for w in model.weights]


def _kerasdbg_failures(caught):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _event_steps(run_dir, tag):
    steps = []
    for name in sorted(os.listdir(run_dir)):
        if "tfevents" in name:
            for event in event_file_loader.EventFileLoader(os.path.join(run_dir, name)).Load():
                steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


def test_a_disk_that_fills_up_warns_once_per_sink_and_training_is_plain_keras(tmp_path):
    disk, small = str(tmp_path / "disk"), str(tmp_path / "small")
    with tmpfs(disk), tmpfs(small, size="4k"):
        log_dir = os.path.join(disk, "logs")
        model = _cnn()
        grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
        stop = StopOnRule(log_dir=log_dir, verbose=False)
        # The trace (about 10 kB) on a disk of one page.
        recorder = StepRecorder(os.path.join(small, "trace.npz"), steps=[400])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = _fit(model, [grads, weights, stop, recorder])
        failures = _kerasdbg_failures(caught)
        # One warning for the shared event file, naming its three callbacks;
        # one for the trace, which its disk cannot hold.
        events = [m for m in failures if "TensorBoard events" in m]
        assert len(events) == 1, failures
        assert re.match(
            r"GradientStatistics, WeightStatistics, StopOnRule could not record: kerasdbg could "
            rf"not write TensorBoard events to '{re.escape(log_dir)}/train'"
            r"; the records stay in Python only \(`history`\), and training goes on\. "
            r"Cause: \w+Error: .*No space left on device", events[0]), events[0]
        traces = [m for m in failures if "trace.npz" in m]
        assert len(traces) == 1 and traces[0].startswith("StepRecorder could not record"), failures
        assert "No space left on device" in traces[0]
        assert len(failures) == 2, failures
        assert open_files_under(disk) == [] and open_files_under(small) == []
        assert os.listdir(small) == []  # no partial trace left
        # Training went on to the end, and the records in Python hold every step.
        assert len(history.history["loss"]) == EPOCHS
        assert grads.history.step.tolist() == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
        assert weights.history.step.tolist() == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
        # The event file holds the steps written before the disk filled up, in order.
        written = _event_steps(os.path.join(log_dir, "train"), "gradients/global_norm")
        assert written and written == list(range(1, len(written) + 1))
        assert len(written) < STEPS_PER_EPOCH * EPOCHS
        read = kerasdbg.load_run(log_dir).scalars("gradients/global_norm")
        assert read.step.tolist() == written
        trained = [w.numpy() for w in model.weights]
    for mine, plain in zip(trained, _plain_weights()):
        np.testing.assert_array_equal(mine, plain)


def test_a_disk_that_fills_up_raises_a_recording_error_when_strict(tmp_path):
    disk = str(tmp_path / "disk")
    with tmpfs(disk):
        log_dir = os.path.join(disk, "logs")
        model = _cnn()
        callbacks = [GradientStatistics(log_dir, strict=True), WeightStatistics(log_dir)]
        with pytest.raises(kerasdbg.RecordingError, match=(
                r"GradientStatistics, WeightStatistics could not record: kerasdbg could not "
                rf"write TensorBoard events to '{re.escape(log_dir)}/train'"
                r"; the fit stops \(`strict=True`\)\. Cause: \w+Error: "
                r".*No space left on device")) as raised:
            _fit(model, callbacks)
        # The event file or the store, whichever met the full disk first.
        assert isinstance(raised.value.__cause__, (tf.errors.ResourceExhaustedError, OSError))
        assert raised.value.owners == ["GradientStatistics", "WeightStatistics"]
        assert raised.value.path == os.path.join(log_dir, "train")
        assert open_files_under(disk) == []


def test_taps_and_the_step_timer_on_a_full_disk_warn_once(tmp_path):
    disk = str(tmp_path / "disk")
    with tmpfs(disk, size="64k"):
        log_dir = os.path.join(disk, "logs")
        model = _cnn(taps=True)
        activations = ActivationStatistics(log_dir)
        timer = kerasdbg.callbacks.StepTimer(log_dir)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(model, [activations, timer], epochs=3)
        failures = _kerasdbg_failures(caught)
        assert len(failures) == 1, failures
        assert failures[0].startswith("ActivationStatistics, StepTimer could not record: "
                                      f"kerasdbg could not write TensorBoard events to '{log_dir}")
        assert "No space left on device" in failures[0]
        assert activations.history.step.tolist() == list(range(1, 3 * STEPS_PER_EPOCH + 1))
        assert open_files_under(disk) == []
        trained = [w.numpy() for w in model.weights]
    for mine, plain in zip(trained, _plain_weights(taps=True, epochs=3)):
        np.testing.assert_array_equal(mine, plain)


def test_a_read_only_log_dir_warns_once_for_every_callback(tmp_path):
    disk = str(tmp_path / "disk")
    with tmpfs(disk, size="64k", read_only=True):
        log_dir = os.path.join(disk, "logs")
        model = _cnn()
        grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
        stop = StopOnRule(log_dir=log_dir, verbose=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(model, [grads, weights, stop], epochs=1)
        failures = _kerasdbg_failures(caught)
        assert len(failures) == 1, failures
        assert failures[0].startswith(
            "GradientStatistics, WeightStatistics, StopOnRule could not record: kerasdbg could "
            f"not write TensorBoard events to '{log_dir}/train'; the records stay in Python only")
        assert "Read-only file system" in failures[0]
        assert len(grads.history) == STEPS_PER_EPOCH
        # A later fit tries again (and says so again, once).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(model, [grads, weights], epochs=1)
        assert len(_kerasdbg_failures(caught)) == 1
        with pytest.raises(kerasdbg.RecordingError, match=(
                rf"StopOnRule could not record: kerasdbg could not write TensorBoard events to "
                rf"'{re.escape(log_dir)}/train'; the fit stops \(`strict=True`\)\. Cause: "
                r".*Read-only file system")) as raised:
            _fit(model, [StopOnRule(log_dir=log_dir, verbose=False, strict=True)], epochs=1)
        assert raised.value.__cause__ is not None
        assert open_files_under(disk) == []


class _RemoveAt(keras.callbacks.Callback):
    def __init__(self, path, step):
        super().__init__()
        self.path, self.step = path, step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == self.step:
            shutil.rmtree(self.path)


def test_a_log_dir_removed_during_the_fit_warns_once_and_the_next_fit_writes_again(tmp_path):
    log_dir = str(tmp_path / "logs")
    model = _cnn()
    grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, [grads, weights, _RemoveAt(log_dir, 10)], epochs=2)
    failures = _kerasdbg_failures(caught)
    assert len(failures) == 1, failures
    assert failures[0].startswith(
        "GradientStatistics, WeightStatistics could not record: kerasdbg could not write "
        f"TensorBoard events to '{log_dir}/train'; the records stay in Python only")
    assert "No such file or directory" in failures[0]
    assert len(grads.history) == 2 * STEPS_PER_EPOCH
    _fit(model, [grads, weights], epochs=1)  # no warning: written again
    written = _event_steps(os.path.join(log_dir, "train"), "gradients/global_norm")
    assert written == list(range(2 * STEPS_PER_EPOCH + 1, 3 * STEPS_PER_EPOCH + 1))


class _Raises(keras.callbacks.Callback):
    """Ends the fit with an exception at its second batch (no on_train_end runs)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise KeyboardInterrupt("the user stopped the fit")


def test_a_strict_fit_that_raised_does_not_make_a_later_fit_strict(tmp_path):
    """A fit that raises runs no `on_train_end`: its callbacks still leave the
    shared writer, so a full disk in a later fit with `strict=False` warns
    (it raised a RecordingError for the strict callback of the earlier fit)."""
    disk = str(tmp_path / "disk")
    with tmpfs(disk):
        log_dir = os.path.join(disk, "logs")
        model = _cnn()
        with pytest.raises(KeyboardInterrupt, match="the user stopped the fit"):
            _fit(model, [GradientStatistics(log_dir, strict=True), _Raises()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(model, [GradientStatistics(log_dir), WeightStatistics(log_dir)])
        failures = _kerasdbg_failures(caught)
        assert len(failures) == 1 and "No space left on device" in failures[0], failures
        assert failures[0].startswith("GradientStatistics, WeightStatistics could not record")
        assert open_files_under(disk) == []


def test_a_disk_that_fills_up_in_a_fit_that_reuses_the_traced_step(tmp_path):
    # The second fit runs the function the first traced (no retrace): the full
    # disk is said once, every step is in `history`, training is plain Keras.
    disk = str(tmp_path / "disk")
    model = _cnn()
    forced = []
    original = model.make_train_function
    model.make_train_function = lambda force=False: (forced.append(force), original(force))[1]
    _fit(model, [GradientStatistics(str(tmp_path / "first")),
                 WeightStatistics(str(tmp_path / "first"))], epochs=1)
    with tmpfs(disk):
        log_dir = os.path.join(disk, "logs")
        grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(model, [grads, weights], epochs=EPOCHS - 1)
        failures = _kerasdbg_failures(caught)
        assert len(failures) == 1 and "No space left on device" in failures[0], failures
        assert forced.count(True) == 1  # the first fit's instrumented function only
        assert grads.history.step.tolist() == list(range(STEPS_PER_EPOCH + 1,
                                                         STEPS_PER_EPOCH * EPOCHS + 1))
        assert open_files_under(disk) == []
        trained = [w.numpy() for w in model.weights]
    for mine, plain in zip(trained, _plain_weights()):
        np.testing.assert_array_equal(mine, plain)
