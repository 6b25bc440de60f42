"""Two trainings in one `log_dir` never merge into one run: another model, or
an optimizer that restarted at step 0 with other weights, gets a run of its
own (`train-2`, ...), said once as information; a continued training (a
second `fit`, a `BackupAndRestore` resume) stays in its run. Steps are read
back with TensorBoard's `EventAccumulator`, not kerasdbg's reader."""

import json
import os
import re
import socket
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import kerasdbg
from kerasdbg.sinks import events as _events
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

X = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
STEPS = 4  # per epoch, batch 4


def _model(seed, name="m", lr=0.1):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="d")(inputs), name=name)
    model.compile(keras.optimizers.SGD(lr), "mse")
    return model


def _fit(model, callbacks, epochs=1, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=callbacks, **kwargs)
    failures = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert failures == []


def _steps(run_dir, tag="gradients/global_norm"):
    accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return [e.step for e in accumulator.Scalars(tag)]


def _runs(log_dir):
    return sorted(d for d in os.listdir(log_dir) if os.path.isdir(os.path.join(log_dir, d)))


def test_two_models_in_one_log_dir_are_two_runs_said_once(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    first, second = _model(1, "first"), _model(2, "second")
    _fit(first, [GradientStatistics(log_dir), WeightStatistics(log_dir)])
    assert capsys.readouterr().out == ""
    _fit(second, [GradientStatistics(log_dir), WeightStatistics(log_dir),
                  StopOnRule(log_dir=log_dir, verbose=False)])
    train, other = os.path.join(log_dir, "train"), os.path.join(log_dir, "train-2")
    assert capsys.readouterr().out == (
        f"kerasdbg: {train!r} holds another training (model 'first'); this one (model "
        f"'second') writes its records to {other!r}.\n")
    assert _runs(log_dir) == ["train", "train-2"]
    assert _steps(train) == _steps(other) == list(range(1, STEPS + 1))
    assert _steps(other, "step/loss") == list(range(1, STEPS + 1))
    run = kerasdbg.load_run(log_dir)
    assert run.rollbacks().empty
    # The first model trained on: its run, not the second's.
    _fit(first, [GradientStatistics(log_dir)])
    assert capsys.readouterr().out == ""
    assert _steps(train) == list(range(1, 2 * STEPS + 1))
    assert _steps(other) == list(range(1, STEPS + 1))


def test_a_third_training_gets_the_next_run(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    for seed in (1, 2, 3):
        _fit(_model(seed), [GradientStatistics(log_dir)])
    assert _runs(log_dir) == ["train", "train-2", "train-3"]
    assert capsys.readouterr().out.count("kerasdbg: ") == 2


def test_a_continued_fit_stays_in_its_run(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    model = _model(1)
    grads = GradientStatistics(log_dir)
    _fit(model, [grads])
    _fit(model, [grads], epochs=2)
    _fit(model, [GradientStatistics(log_dir)])  # a new instance, the same training
    assert capsys.readouterr().out == ""
    assert _runs(log_dir) == ["train"]
    assert _steps(os.path.join(log_dir, "train")) == list(range(1, 4 * STEPS + 1))


def test_an_optimizer_that_restarts_with_other_weights_is_another_run(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    model = _model(1)
    _fit(model, [GradientStatistics(log_dir)])
    model.compile(keras.optimizers.SGD(0.01), "mse")  # step 0 again, the trained weights
    _fit(model, [GradientStatistics(log_dir)])
    assert _runs(log_dir) == ["train", "train-2"]
    assert "writes its records to" in capsys.readouterr().out
    assert kerasdbg.load_run(log_dir).rollbacks().empty


class _Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == STEPS + 2:
            raise RuntimeError("crash")


@pytest.mark.parametrize("backup_first", [True, False], ids=["backup-first", "backup-last"])
def test_a_backup_and_restore_resume_stays_in_its_run(tmp_path, capsys, backup_first):
    log_dir, backup = str(tmp_path / "logs"), str(tmp_path / "backup")

    def callbacks(*others):
        restore = keras.callbacks.BackupAndRestore(backup)
        ours = [GradientStatistics(log_dir)]
        return [restore, *ours, *others] if backup_first else [*ours, *others, restore]

    with pytest.raises(RuntimeError, match="crash"):
        _model(1).fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0,
                      callbacks=callbacks(_Crash()))
    _fit(_model(5), callbacks(), epochs=3)  # a new process would build the model anew
    assert capsys.readouterr().out == ""
    assert _runs(log_dir) == ["train"]
    rollbacks = kerasdbg.load_run(log_dir).rollbacks().to_dict("records")
    assert rollbacks == [{"run": "train", "step": STEPS + 1, "dropped": [STEPS + 1, STEPS + 2]}]


# --------------------------------------------- the rule, on markers of other processes
def _training(process, fingerprint, fresh=True, model="a"):
    return _events.Training(model=model, name="m", fresh=fresh, fingerprint=fingerprint,
                            process=process)


def _ended_process():
    """The process token (`_events.PROCESS`'s form) of a process of this host that ran
    and has ended."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, timeout=60, check=True)
    return f"{socket.gethostname()}:{int(child.stdout)}:1"


def test_another_process_restarting_the_same_training_from_scratch_is_its_run(tmp_path):
    log_dir = str(tmp_path)
    first, _ = _events.run_directory(log_dir, _training(_ended_process(), "F"))
    os.makedirs(first, exist_ok=True)
    open(os.path.join(first, "events.out.tfevents.1.host.1.0.kerasdbg"), "wb").close()
    # The same weights and optimizer from step 0, its process ended: restarted (a
    # rollback of its run).
    assert _events.run_directory(log_dir, _training(_ended_process(), "F"))[0] == first
    # Other weights: another training.
    other, note = _events.run_directory(log_dir, _training(_ended_process(), "G"))
    assert other == os.path.join(log_dir, "train-2")
    assert note == (f"{first!r} holds another training (model 'm' of another process); this "
                    f"one (model 'm') writes its records to {other!r}.")
    # A resume in another process (not from step 0): the latest run.
    assert _events.run_directory(log_dir, _training(_ended_process(), None, fresh=False))[0] \
        == other


def test_a_marker_names_its_process_with_its_start_time(tmp_path):
    path, _ = _events.run_directory(str(tmp_path), _training(_events.PROCESS, "F"))
    with open(os.path.join(path, _events.RUN_MARKER)) as stream:
        marker = json.load(stream)
    host, pid, _ = marker["process"].rsplit(":", 2)
    assert (host, int(pid)) == (socket.gethostname(), os.getpid())
    with open(f"/proc/{os.getpid()}/stat") as stream:  # (Linux) its 22nd field
        assert marker["started"] == int(stream.read().rpartition(")")[2].split()[19])
    # A pid taken again by a process started at another time is not the one named.
    assert _events._alive(marker)
    assert not _events._alive(dict(marker, started=marker["started"] - 1))
    assert not _events._alive({"process": _ended_process()})
    # A process of another host cannot be looked at: it may be running.
    assert _events._alive({"process": "another-host.example:1:1"})


# A child that only chooses its run directory: TensorFlow, which `_events` imports for
# writing but `run_directory` does not use, is left out so that it starts in 0.3 s.
_CHILD = r"""
import json, os, sys, time, types
sys.modules["tensorflow"] = types.ModuleType("tensorflow")
from kerasdbg.sinks import events as _events
log_dir, go, hold, model = sys.argv[1:5]
original = _events._holds_events
def slowly(run):
    # Widens the moment between looking at the runs and claiming one, as on a loaded
    # machine: every child looks before any claims.
    time.sleep(0.3)
    return original(run)
_events._holds_events = slowly
deadline = time.time() + 60
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.005)
training = _events.Training(model=model, name=model, fresh=True, fingerprint="F")
print(json.dumps(_events.run_directory(log_dir, training)[0]), flush=True)
while hold != "-" and not os.path.exists(hold) and time.time() < deadline:
    time.sleep(0.01)
"""


def _children(log_dir, go, count, hold="-"):
    return [subprocess.Popen([sys.executable, "-c", _CHILD, log_dir, go, hold, f"m{k}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(kerasdbg.__file__)))
            for k in range(count)]


def _chosen(child):
    line = child.stdout.readline()
    assert line, child.stderr.read()
    return os.path.basename(json.loads(line))


def test_processes_starting_at_once_in_one_log_dir_get_a_run_each(tmp_path):
    # Issue 32, review (d): each looked, found `train` free, and claimed it.
    log_dir, go = str(tmp_path / "logs"), str(tmp_path / "go")
    children = _children(log_dir, go, 3)
    open(go, "w").close()
    try:
        chosen = sorted(_chosen(child) for child in children)
    finally:
        for child in children:
            child.wait(timeout=60)
    assert chosen == ["train", "train-2", "train-3"]
    for run in chosen:  # each marker whole, naming its own process
        with open(os.path.join(log_dir, run, _events.RUN_MARKER)) as stream:
            assert json.load(stream)["model"] in {"m0", "m1", "m2"}


def test_a_sweep_with_the_same_weights_in_a_running_process_is_another_run(tmp_path):
    # Issue 32, review (d): a seeded sweep (the same weights and optimizer from step
    # 0) in another process was taken for a restart of the same run.
    log_dir, go, stop = str(tmp_path / "logs"), str(tmp_path / "go"), str(tmp_path / "stop")
    open(go, "w").close()
    (running,) = _children(log_dir, go, 1, hold=stop)
    try:
        assert _chosen(running) == "train"
        path, note = _events.run_directory(log_dir, _training(_events.PROCESS, "F", model="x"))
        assert os.path.basename(path) == "train-2"
        assert "holds another training (model 'm0' of another process)" in note
    finally:
        open(stop, "w").close()
        running.wait(timeout=60)
    # Once that process has ended, the same weights from step 0 restart its run.
    path, _ = _events.run_directory(log_dir, _training(_events.PROCESS, "F", model="y"))
    assert os.path.basename(path) == "train"


def test_a_run_written_before_markers_is_kept_for_its_training(tmp_path):
    log_dir = str(tmp_path)
    legacy = os.path.join(log_dir, "train")
    os.makedirs(legacy)
    open(os.path.join(legacy, "events.out.tfevents.1.host.1.0.kerasdbg"), "wb").close()
    path, note = _events.run_directory(log_dir, _training("host:1:1", "F"))
    assert path == os.path.join(log_dir, "train-2")
    assert re.match(r"'.*train' holds another training \(an earlier training\); this one", note)
    assert _events.run_directory(log_dir, _training("host:9:9", None, fresh=False))[0] == path
