"""load_run on real event files, truncated ones included."""

import glob
import os
import shutil

import numpy as np
import pytest

from kerasdbg import _events
from kerasdbg import load_run


def _write_steps(log_dir, steps):
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    for step in steps:
        writer.write(step, {"a/loss": step * 0.5, "b/other": -step},
                     {"a/hist": (np.array([1.0, 2.0, 3.0]), 0.0, 3.0)},
                     {"a/note": f"step {step}"})
    writer.flush()
    return writer


def test_scalars_histograms_and_text_round_trip(tmp_path):
    _write_steps(str(tmp_path), [1, 2, 3])
    run = load_run(str(tmp_path))
    assert run.runs == ["train"]
    assert run.tags() == ["a/loss", "b/other"]
    assert run.tags("^a/") == ["a/loss"]
    assert run.tags(kind="histograms") == ["a/hist"]
    assert run.tags(kind="text") == ["a/note"]
    frame = run.scalars("a/loss")
    assert frame.step.tolist() == [1, 2, 3]
    np.testing.assert_allclose(frame.value, [0.5, 1.0, 1.5])
    both = run.scalars(r"(a|b)/.*")
    assert sorted(set(both.tag)) == ["a/loss", "b/other"]
    hist = run.histograms("a/hist").iloc[0]
    np.testing.assert_allclose(hist.edges, [0, 1, 2, 3])
    np.testing.assert_allclose(hist.counts, [1, 2, 3])


def test_new_steps_appear_on_the_next_call(tmp_path):
    writer = _write_steps(str(tmp_path), [1, 2])
    run = load_run(str(tmp_path))
    assert run.scalars("a/loss").step.tolist() == [1, 2]
    writer.write(3, {"a/loss": 9.0})
    writer.flush()
    assert run.scalars("a/loss").step.tolist() == [1, 2, 3]


def test_truncated_last_record_is_tolerated(tmp_path):
    source = tmp_path / "source"
    _write_steps(str(source), [1, 2, 3, 4])
    (event_file,) = glob.glob(str(source / "train" / "events.out.tfevents.*"))
    target = tmp_path / "truncated" / "train"
    target.mkdir(parents=True)
    copy = target / os.path.basename(event_file)
    shutil.copy(event_file, copy)
    size = os.path.getsize(copy)
    with open(copy, "r+b") as handle:
        handle.truncate(size - 7)  # cut into the last record
    frame = load_run(str(tmp_path / "truncated")).scalars("a/loss")
    assert frame.step.tolist() == [1, 2, 3]


def test_errors_name_what_was_received(tmp_path):
    with pytest.raises(FileNotFoundError, match="`log_dir` is not a directory. Received: log_dir='.*missing'"):
        load_run(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="`log_dir` must be a str or os.PathLike. Received: log_dir=3"):
        load_run(3)
    _write_steps(str(tmp_path), [1])
    run = load_run(str(tmp_path))
    with pytest.raises(KeyError, match="no scalars tag matches 'nope'.*Tags: a/loss, b/other"):
        run.scalars("nope")
    with pytest.raises(ValueError, match="`kind` must be one of scalars, histograms, text. Received: kind='images'"):
        run.tags(kind="images")


def test_shared_writer_is_renewed_when_its_directory_was_removed(tmp_path):
    log_dir = str(tmp_path / "train")
    first = _events.writer_for(log_dir)
    assert _events.writer_for(log_dir) is first
    shutil.rmtree(log_dir)
    second = _events.writer_for(log_dir)
    assert second is not first
    second.write(7, {"a/loss": 1.5})
    second.flush()
    frame = load_run(str(tmp_path)).scalars("a/loss")
    assert frame.step.tolist() == [7]
    np.testing.assert_allclose(frame.value, [1.5])


def test_event_file_is_named_for_tensorboard_and_starts_with_the_version(tmp_path):
    from tensorboard.backend.event_processing import event_file_loader

    writer = _events.EventWriter(str(tmp_path))
    writer.write(1, {"a/loss": 2.0})
    writer.flush()
    assert "tfevents" in os.path.basename(writer.path)
    events = list(event_file_loader.EventFileLoader(writer.path).Load())
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 1 and events[1].summary.value[0].tag == "a/loss"
