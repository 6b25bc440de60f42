"""An event file and its analysis store read as one (`kerasdbg.sinks.event_tail`).

The store is flushed with the event writer; a process killed between two
flushes leaves the event file ahead of it. The states such a kill leaves are
made here from real writes: the store as it was after one of its flushes,
the event file as it was at the end. What `load_run` reads then must be what
TensorBoard's own reader reads from the event file alone.
"""

import doctest
import json
import os
import shutil

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from kerasdbg import load_run
from kerasdbg.sinks import event_tail as _event_tail
from kerasdbg.sinks import events as _events
from kerasdbg.sinks import store as _store
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from tests.test_reader import _assert_same, _everything

# A rollback (steps 3-4 written again), two tag sets, a NaN, histograms and text.
WRITES = [1, 2, 3, 4, 3, 4, 5, 6]


def _write(writer, step, index):
    scalars = {"gradients/m/d/kernel/l2_norm": step * 1.5 + index, "step/loss": 1.0 / step}
    if step % 2:
        scalars["gradients/m/d/kernel/mean"] = float("nan") if step == 3 else -step - index
    writer.write(step, scalars, {"gradients/m/d/kernel": (np.arange(4.0) * step, -1.0, 1.0)},
                 {"rules/verdicts": f"| r | {step} |"} if step in (2, 4, 6) else {})


def _run_with_snapshots(log_dir, flushes):
    """Writes WRITES, flushing after the writes of index `flushes`; returns the
    event file and a copy of the store after each flush."""
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    store = _store.store_path(writer.path)
    snapshots = []
    for index, step in enumerate(WRITES):
        _write(writer, step, index)
        if index in flushes:
            writer.flush()
            snapshot = f"{log_dir}-store-{index}"
            shutil.copytree(store, snapshot)
            snapshots.append(snapshot)
    writer.close()
    return writer.path, store, snapshots


def _killed(store, snapshot, rows_after_marker):
    """The store as a kill after `snapshot`'s flush leaves it: the snapshot's
    rows, or (`rows_after_marker`) all rows but the snapshot's marker."""
    if rows_after_marker:
        shutil.copy(os.path.join(snapshot, _store.MARKER), os.path.join(store, _store.MARKER))
    else:
        shutil.rmtree(store)
        shutil.copytree(snapshot, store)


def _event_file_only(log_dir, copy):
    """The same log directory without its stores: read by TensorBoard's reader."""
    shutil.copytree(log_dir, copy)
    for store in [os.path.join(d, _store.DIRECTORY) for d, _, _ in os.walk(copy)]:
        shutil.rmtree(store, ignore_errors=True)
    return load_run(copy)


@pytest.mark.parametrize("rows_after_marker", [False, True],
                         ids=["store-rows-lost", "store-rows-after-its-marker"])
@pytest.mark.parametrize("flushed", [0, 2, 4, 6], ids=lambda i: f"last-flush-after-write-{i}")
def test_a_run_killed_after_any_flush_reads_as_its_event_file(tmp_path, flushed,
                                                              rows_after_marker):
    log_dir = str(tmp_path / "logs")
    path, store, snapshots = _run_with_snapshots(log_dir, {flushed})
    _killed(store, snapshots[0], rows_after_marker)
    run, events = load_run(log_dir), _event_file_only(log_dir, str(tmp_path / "events"))
    got, want = _everything(run), _everything(events)
    _assert_same(got, want)
    # What check_run feeds the rules, step by step.
    records, expected = list(run._records("train")), list(events._records("train"))
    assert [step for step, _ in records] == [step for step, _ in expected]
    for (_, record), (_, reference) in zip(records, expected):
        assert record.keys() == reference.keys()
        np.testing.assert_array_equal(np.float32(list(record.values())),
                                      np.float32(list(reference.values())))
    # Each write once: the rows the store holds are not read again from the event file.
    source = _event_tail.EventSource(path, store)
    source.refresh()
    for kind in ("scalars", "histograms"):
        assert sum(t.rows for t in source.tables() if t.kind == kind) == len(WRITES), kind
    assert [line["step"] for line in source.text_lines()] == [2, 4, 4, 6]
    # Every write reached the reader, the rollback across the store's end included.
    assert got[7] == [1, 2, 3, 4, 5, 6]
    assert got[3].to_dict("records") == [{"run": "train", "step": 3, "dropped": [3, 4]}]
    assert got[2].step.tolist() == [2, 4, 6]


def test_a_run_object_reads_on_across_flushes_without_a_step_twice(tmp_path):
    log_dir = str(tmp_path / "logs")
    _, store, snapshots = _run_with_snapshots(log_dir, {1, 4})
    final = os.path.join(str(tmp_path), "final-marker")
    shutil.copy(os.path.join(store, _store.MARKER), final)
    want = _everything(_event_file_only(log_dir, str(tmp_path / "events")))
    run = load_run(log_dir)
    for marker in [os.path.join(snapshots[0], _store.MARKER),
                   os.path.join(snapshots[1], _store.MARKER), final]:
        shutil.copy(marker, os.path.join(store, _store.MARKER))  # the writer flushed again
        _assert_same(_everything(run), want)


def test_a_store_of_kerasdbg_0_1_whose_marker_covers_nothing_reads_its_event_file(tmp_path):
    log_dir = str(tmp_path / "logs")
    _, store, snapshots = _run_with_snapshots(log_dir, {2})
    _killed(store, snapshots[0], rows_after_marker=False)
    with open(os.path.join(store, _store.MARKER), "w") as stream:
        json.dump({"format": 1}, stream)  # as kerasdbg 0.1.0 wrote it
    _assert_same(_everything(load_run(log_dir)),
                 _everything(_event_file_only(log_dir, str(tmp_path / "events"))))


def _record_ends(path):
    return [end for _, end in _event_tail.records(path)]


@pytest.mark.parametrize("damage", ["cut-last-record", "garbage-after-the-last-record",
                                    "damaged-length"])
def test_the_tail_ends_where_tensorboard_stops_reading(tmp_path, damage):
    log_dir = str(tmp_path / "logs")
    path, store, snapshots = _run_with_snapshots(log_dir, {1})
    _killed(store, snapshots[0], rows_after_marker=False)
    ends = _record_ends(path)
    with open(path, "r+b") as stream:
        if damage == "cut-last-record":
            stream.truncate(ends[-1] - 5)
        elif damage == "garbage-after-the-last-record":
            stream.seek(ends[-1])
            stream.write(b"\x07" * 40)
        else:  # the length of the second-to-last record, one bit flipped
            stream.seek(ends[-3])
            byte = stream.read(1)
            stream.seek(ends[-3])
            stream.write(bytes([byte[0] ^ 1]))
    accumulator = event_accumulator.EventAccumulator(path, size_guidance={"scalars": 0})
    accumulator.Reload()
    run = load_run(log_dir)
    for tag in accumulator.Tags()["scalars"]:
        want = [e.step for e in accumulator.Scalars(tag)]
        assert run.scalars(tag).step.tolist() == sorted(set(want)), tag
    _assert_same(_everything(run), _everything(_event_file_only(log_dir, str(tmp_path / "e"))))


def test_records_frame_a_tfrecord_file_from_an_offset():
    result = doctest.testmod(_event_tail, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_reader_during_a_fit_sees_every_step_the_event_file_holds(tmp_path,
                                                                    read_every_execution):
    """Mid-epoch, before any flush of the store: load_run reads what
    TensorBoard reads from the event files, not the last epoch's end (the
    host reads after every execution here; the suite's interval would put
    the first read after the first execution's at the ring's 256th step)."""
    log_dir = str(tmp_path / "logs")
    seen = {}

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 150:
                accumulator = event_accumulator.EventAccumulator(
                    os.path.join(log_dir, "train"), size_guidance={"scalars": 0})
                accumulator.Reload()
                # Its records: not the views of the Custom Scalars charts.
                seen["tensorboard"] = {t: [e.step for e in accumulator.Scalars(t)]
                                       for t in accumulator.Tags()["scalars"]
                                       if not t.startswith("views/")}
                frame = load_run(log_dir).scalars(".*")
                seen["load_run"] = {t: rows.step.tolist() for t, rows in frame.groupby("tag")}

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(400, 3)).astype("float32")
    model.fit(x, x[:, :2], batch_size=2, epochs=1, verbose=0, shuffle=False,
              callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir),
                         StopOnRule(log_dir=log_dir, verbose=False), Read()])
    assert seen["load_run"] == seen["tensorboard"]
    assert max(seen["load_run"]["step/loss"]) >= 100  # far into the epoch
