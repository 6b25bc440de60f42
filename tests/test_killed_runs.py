"""A run killed with SIGKILL is read up to the last step its event files hold.

A child process trains a small model with the instruments on an endless
dataset and is killed (`kill -9`) at several points: before the analysis
store was ever flushed (it holds no row), between two flushes (it holds the
first epochs), and at the first step. What TensorBoard's own reader
(`EventAccumulator`) reads from the event files is the expected value:
`load_run`, `kerasdbg report` and `kerasdbg check` must see every step of it.
"""

import glob
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from kerasdbg import load_run
from kerasdbg.sinks import store as _store
from kerasdbg.cli import main

_CHILD = r"""
import os, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import keras
import tensorflow as tf
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

log_dir, steps_per_epoch, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
interval, pause = sys.argv[4], float(sys.argv[5])
import kerasdbg
kerasdbg.set_read_interval(None if interval == "default" else float(interval))


class Progress(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        time.sleep(pause)  # a step of `pause` seconds more
        print(step, flush=True)
        if step >= kill_step:
            # Waits for its SIGKILL here: a loaded machine's parent reads the
            # line late, and the child must not train on past the kill point.
            time.sleep(3600)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="d1"),
                          keras.layers.Dense(1, name="d2")], name="m")
model.compile("sgd", "mse")
x = np.random.default_rng(0).random((256, 4)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).repeat().batch(4)
model.fit(data, steps_per_epoch=steps_per_epoch, epochs=10**6, verbose=0,
          callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir),
                     StopOnRule(log_dir=log_dir, verbose=False), Progress()])
"""

TIMEOUT = 180  # seconds for a child to reach its step

# The kill points: (steps per epoch, the step at which the child is killed,
# the read interval (`kerasdbg.set_read_interval`), seconds added to each step).
# The first two read after every execution: the event file then holds every
# step before the kill, which the store does not.
KILLS = {
    # One long epoch: the store was never flushed.
    "before-the-first-store-flush": (10**6, 60, "0", 0.0),
    # The store flushed at each epoch's end (steps 20, 40), then steps the event file holds.
    "between-two-store-flushes": (20, 50, "0", 0.0),
    "at-the-first-step": (10**6, 1, "default", 0.0),
    # The default interval (0.1 s) over steps of 20 ms or more: a read every 5 steps or
    # fewer; the kill loses the steps since the last read, at most one interval.
    "default-interval": (10**6, 60, "default", 0.02),
}


def _start(child, log_dir, steps_per_epoch, kill_step, interval="0", pause=0.0):
    return subprocess.Popen([sys.executable, "-c", child, log_dir, str(steps_per_epoch),
                             str(kill_step), interval, str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def kill_children(root, child, kills=KILLS):
    """name -> the log directory of a child (the Python code `child`, with
    the arguments log_dir, steps per epoch and kill step) SIGKILLed as soon as
    it reports its step (the children run side by side: their start, the
    backend's import, is most of their time; each is killed at its own step,
    whatever the others do)."""
    children = {name: _start(child, str(root / name), *kill) for name, kill in kills.items()}
    deadline = time.monotonic() + TIMEOUT
    pending = {child.stdout.fileno(): name for name, child in children.items()}
    partial = {name: b"" for name in children}
    try:
        while pending:
            ready, _, _ = select.select(list(pending), [], [],
                                        max(deadline - time.monotonic(), 0))
            assert ready, f"{sorted(pending.values())} did not reach their step in {TIMEOUT} s"
            for fd in ready:
                name = pending[fd]
                chunk = os.read(fd, 65536)
                process = children[name]
                assert chunk, f"{name}: the child ended before its step (exit {process.poll()})"
                *lines, partial[name] = (partial[name] + chunk).split(b"\n")
                if lines and int(lines[-1]) >= kills[name][1]:
                    process.send_signal(signal.SIGKILL)
                    assert process.wait(timeout=30) == -signal.SIGKILL
                    del pending[fd]
    finally:
        for process in children.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
            process.stdout.close()
    return {name: str(root / name) for name in kills}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """name -> the log directory of a child SIGKILLed at its step (`KILLS`)."""
    return kill_children(tmp_path_factory.mktemp("killed"), _CHILD)


def _tensorboard_scalars(run_dir):
    """tag -> [(step, value)] as TensorBoard's own reader reads the event files,
    the records only: the `views/...` scalars drawn by the Custom Scalars tab,
    written in the same events, are not records (the reader leaves them out)."""
    accumulator = event_accumulator.EventAccumulator(run_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"] if not tag.startswith("views/")}


def _last_step(expected, pattern):
    import re

    return max(step for tag, points in expected.items() if re.fullmatch(pattern, tag)
               for step, _ in points)


def _stored_steps(run_dir):
    """The steps the analysis stores hold (their complete rows)."""
    steps = set()
    for store in glob.glob(os.path.join(run_dir, _store.DIRECTORY, "*")):
        for table in _store.tables(store):
            steps.update(table.column(0).astype(int).tolist())
    return steps


@pytest.mark.parametrize("name, stored", [
    pytest.param("before-the-first-store-flush", False, id="before-the-first-store-flush"),
    pytest.param("between-two-store-flushes", True, id="between-two-store-flushes")])
def test_a_killed_run_reads_every_step_its_event_files_hold(tmp_path, capsys, killed, name,
                                                            stored):
    log_dir = killed[name]
    run_dir = os.path.join(log_dir, "train")
    expected = _tensorboard_scalars(run_dir)
    last = _last_step(expected, r"step/loss")
    # The case is real: the event file holds steps the store does not.
    in_store = _stored_steps(run_dir)
    assert bool(in_store) == stored and last > max(in_store, default=0) and last >= 20

    run = load_run(log_dir)
    assert run.tags() == sorted(expected)
    frame = run.scalars(".*")
    for tag, points in expected.items():
        rows = frame[frame.tag == tag]
        assert rows.step.tolist() == [step for step, _ in points], tag
        # The event file holds float32 values; the store float64.
        np.testing.assert_array_equal(rows.value.to_numpy(np.float32),
                                      np.array([v for _, v in points], np.float32), err_msg=tag)

    assert main(["report", log_dir, "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    shown = _last_step(expected, r"step/loss|gradients/.*(global_norm|l2_norm)")
    assert f"steps recorded: {shown} (1-{shown})" in out

    # A rule that fires at every step it can read: its last firing is the last step.
    code = main(["check", log_dir, "--rule", "ExplodingTensor:threshold=1e-30", "--all-steps"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    fired = [int(line.split(" at step ")[1].split(":")[0]) for line in out]
    assert fired[-1] == _last_step(expected, r"gradients/.*/max")
    assert main(["check", log_dir]) in (0, 1)  # every default rule the run feeds
    assert "`rules` must hold at least one rule" not in capsys.readouterr().err


def test_a_run_killed_at_its_first_step_says_what_it_holds(tmp_path, capsys, killed):
    log_dir = killed["at-the-first-step"]
    expected = _tensorboard_scalars(os.path.join(log_dir, "train"))
    run = load_run(log_dir)
    assert run.runs == ["train"] and run.tags() == sorted(expected)
    report = main(["report", log_dir, "--out", str(tmp_path / "report")])
    report_err = capsys.readouterr().err
    check = main(["check", log_dir])
    check_err = capsys.readouterr().err
    if expected:  # the first steps reached the event file before the kill
        assert report == 0 and check in (0, 1)
    else:  # nothing reached it: both say so alike
        assert report == check == 2
        assert "holds no values yet: its event files hold no step" in check_err
        assert check_err.replace("kerasdbg check: ", "") == \
            report_err.splitlines()[-1].replace("kerasdbg report: ", "") + "\n"
    assert "`rules` must hold at least one rule" not in check_err


def test_a_run_killed_with_the_default_interval_loses_at_most_the_steps_since_its_last_read(
        killed):
    """Killed at step 60 with reads every 0.1 s over steps of 20 ms or more:
    the event files hold every step up to the last read, at most one
    interval (5 steps here) before the kill, the store none (never flushed)."""
    run_dir = os.path.join(killed["default-interval"], "train")
    expected = _tensorboard_scalars(run_dir)
    last = _last_step(expected, r"step/loss")
    assert 60 - 6 <= last <= 60
    for tag in ("step/loss", "gradients/global_norm"):
        assert [step for step, _ in expected[tag]] == list(range(1, last + 1)), tag
    run = load_run(killed["default-interval"])
    assert run.scalars("step/loss").step.tolist() == list(range(1, last + 1))
