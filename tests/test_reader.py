"""load_run on real event files, truncated ones included."""

import glob
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2

from kerasdbg.sinks import events as _events
from kerasdbg.sinks import store as _store
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


def test_scalar_table_keeps_nan_values_and_the_last_of_a_rewritten_step(tmp_path):
    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    writer.write(1, {"a/loss": 1.0})
    writer.write(2, {"a/loss": np.nan, "b/only_nan": np.nan})
    writer.write(2, {"b/only_nan": np.nan})
    writer.write(3, {"a/loss": 2.0})
    writer.write(3, {"a/loss": 3.0})
    writer.flush()
    table = load_run(str(tmp_path)).scalar_table(r"(a|b)/.*")
    assert table.index.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(table["a/loss"].to_numpy(), [1.0, np.nan, 3.0])
    assert table["b/only_nan"].isna().all()


def test_tensor_value_keeps_a_recorded_nan_and_leaves_out_what_was_not_written(tmp_path):
    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    writer.write(1, {"g/x/min": -2.0, "g/x/max": 1.0, "g/x/nan_count": 0.0})
    writer.write(2, {"g/x/min": np.nan, "g/x/max": np.nan, "g/x/nan_count": 3.0})
    writer.write(3, {"g/x/nan_count": 0.0})
    writer.flush()
    tensor = load_run(str(tmp_path)).tensor("g/x")
    assert tensor.steps() == [1, 2, 3]
    assert tensor.reduction(1, "max", abs=True) == 2.0
    assert np.isnan(tensor.reduction(2, "max", abs=True))  # all NaN: no finite max
    assert tensor.value(2)["nan_count"] == 3.0
    assert tensor.value(3) == {"nan_count": 0.0}
    assert set(tensor.values()) == {1, 2, 3}
    with pytest.raises(KeyError, match="needs the statistics min, max, not recorded at step 3"):
        tensor.reduction(3, "max", abs=True)


def test_unique_scalars_are_written_once_per_step_and_value(tmp_path):
    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    for step, value in [(1, 1.0), (1, 1.0), (2, np.nan), (2, np.nan), (2, 5.0), (3, 5.0)]:
        writer.write(step, {"s": value}, unique=True)
    writer.write(3, {"s": 5.0})  # not unique: written again
    writer.flush()
    written = []
    for record in tf.data.TFRecordDataset(writer.path):
        event = event_pb2.Event.FromString(record.numpy())
        written += [(event.step, v.simple_value) for v in event.summary.value]
    assert [step for step, _ in written] == [1, 2, 2, 3, 3]
    np.testing.assert_array_equal([v for _, v in written], [1.0, np.nan, 5.0, 5.0, 5.0])
    # The reader keeps the last value written at each step.
    frame = load_run(str(tmp_path)).scalars("s")
    assert frame.step.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(frame.value.to_numpy(), [1.0, 5.0, 5.0])


def test_steps_with_changing_tag_sets_keep_each_tag_its_own_values(tmp_path):
    # The writer reuses one Summary per set of tags; alternating sets, a set
    # in another order and a set that grows must not mix values up.
    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    expected = {}
    for step in range(1, 9):
        tags = [["a", "b"], ["b", "a"], ["a", "b", "c"], ["c"]][step % 4]
        scalars = {tag: step * 10.0 + ord(tag) for tag in tags}
        writer.write(step, scalars)
        for tag, value in scalars.items():
            expected.setdefault(tag, []).append((step, value))
    writer.flush()
    run = load_run(str(tmp_path))
    for tag, points in expected.items():
        frame = run.scalars(tag)
        assert list(zip(frame.step, frame.value)) == points, tag


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


# --------------------------------------------------- trial-style access
def _trained_run(tmp_path):
    """A recorded fit and the GradientTape gradients of each step (SGD, so
    the weights of step k+1 follow from those of step k)."""
    import keras
    import tensorflow as tf

    from kerasdbg.callbacks import GradientStatistics, StopOnRule
    from kerasdbg.rules import NonFiniteLoss

    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d"),
                              keras.layers.Dense(1, name="o")], name="m")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    weights = [w.copy() for w in model.get_weights()]
    log_dir = str(tmp_path / "logs")
    callbacks = [GradientStatistics(log_dir, histogram_every_n_steps=2),
                 StopOnRule(NonFiniteLoss(), log_dir=log_dir, verbose=False)]
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
    expected = []
    for step in range(3):
        variables = [tf.Variable(w) for w in weights]
        xb, yb = x[4 * step: 4 * step + 4], y[4 * step: 4 * step + 4]
        with tf.GradientTape() as tape:
            out = (xb @ variables[0] + variables[1]) @ variables[2] + variables[3]
            loss = tf.reduce_mean(tf.square(out - yb))
        grads = [g.numpy() for g in tape.gradient(loss, variables)]
        expected.append({"loss": float(loss), "kernel": grads[0]})
        weights = [w - 0.1 * g for w, g in zip(weights, grads)]
    return load_run(log_dir), expected


def test_tensor_values_and_reductions_match_gradient_tape(tmp_path):
    run, expected = _trained_run(tmp_path)
    assert "gradients/m/d/kernel" in run.tensor_names()
    assert run.tensor_names("^step/") == ["step/fault", "step/frozen", "step/loss"]
    kernel = run.tensor("gradients/m/d/kernel")
    assert kernel.steps() == run.steps("gradients/m/d/kernel/mean") == [1, 2, 3]
    for step, want in enumerate(expected, 1):
        g = want["kernel"].astype(np.float64)
        value = kernel.value(step)
        np.testing.assert_allclose(value["mean"], g.mean(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(kernel.reduction(step, "max", abs=True), np.abs(g).max(),
                                   rtol=1e-5)
        np.testing.assert_allclose(kernel.reduction(step, "mean", abs=True), np.abs(g).mean(),
                                   rtol=1e-5)
        np.testing.assert_allclose(kernel.reduction(step, "norm"), np.linalg.norm(g), rtol=1e-5)
        np.testing.assert_allclose(run.tensor("step/loss").value(step), want["loss"], rtol=1e-5)
    assert list(kernel.values()) == [1, 2, 3]
    edges, counts = kernel.histogram(2)
    assert counts.sum() == want["kernel"].size and len(edges) == len(counts) + 1
    np.testing.assert_allclose([edges[0], edges[-1]],
                               [expected[1]["kernel"].min(), expected[1]["kernel"].max()],
                               rtol=1e-5)


def test_a_mistyped_tag_names_the_closest_few_not_every_tag(tmp_path):
    """A small CNN records some 200 tags: the error names the closest three and
    how to list them, on one short line (on the commit before, all 200)."""
    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    tags = [f"gradients/cnn/{layer}/{part}/{stat}" for layer in ("conv1", "conv2", "dense")
            for part in ("kernel", "bias") for stat in ("l2_norm", "max", "min", "mean")]
    writer.write(1, {tag: 1.0 for tag in tags})
    writer.flush()
    run = load_run(str(tmp_path))
    for call in (lambda: run.scalars("gradients/cnn/conv2/kernal/l2_norm"),
                 lambda: run.steps("gradients/cnn/conv2/kernal/l2_norm")):
        with pytest.raises(KeyError) as raised:
            call()
        said = raised.value.args[0]
        assert "24 tags; the closest: gradients/cnn/conv2/kernel/l2_norm, " in said, said
        assert said.count("gradients/") == 4  # the one asked for and three close ones
        assert said.endswith("List them with run.tags(kind='scalars'), or those a regular "
                             "expression finds with run.tags(r'l2_norm')"), said
    with pytest.raises(KeyError, match=r"24 tags; none close to it\."):
        run.scalars("epoch/learning_rate_of_the_other_optimizer")


def test_tensor_errors_say_what_exists(tmp_path):
    run, _ = _trained_run(tmp_path)
    with pytest.raises(KeyError, match=r"nothing recorded under 'gradients/m/x'.*gradients/m/d/kernel"):
        run.tensor("gradients/m/x")
    kernel = run.tensor("gradients/m/d/kernel")
    with pytest.raises(KeyError, match=r"step 9 was not recorded. Steps: 1, 2, 3"):
        kernel.value(9)
    with pytest.raises(ValueError, match=r"`name` must be one of mean, std.*Received: name='median'"):
        kernel.reduction(1, "median")
    with pytest.raises(ValueError, match="min of \\|x\\| is not derivable"):
        kernel.reduction(1, "min", abs=True)
    with pytest.raises(KeyError, match="no histogram recorded at step 1"):
        kernel.histogram(1)
    with pytest.raises(KeyError, match="Run.steps: no scalar or histogram tag 'nope'"):
        run.steps("nope")


def test_a_run_being_written_shows_its_new_steps_through_tensor(tmp_path):
    writer = _write_steps(str(tmp_path), [1, 2])
    run = load_run(str(tmp_path))
    loss = run.tensor("a/loss")
    assert loss.steps() == [1, 2]
    writer.write(3, {"a/loss": 1.5}, {}, {})
    writer.flush()
    assert loss.steps() == [1, 2, 3] and loss.value(3) == 1.5


# ------------------------------------------------------------ the analysis store
def _mixed_run(log_dir):
    """Steps with two tag sets, a NaN, a rollback (steps 3-4 written again), histograms
    and text; returns the writer."""
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    for step in [1, 2, 3, 4, 3, 4, 5]:
        scalars = {"gradients/m/d/kernel/l2_norm": step * 1.5, "step/loss": 1.0 / step}
        if step % 2:
            scalars["gradients/m/d/kernel/mean"] = float("nan") if step == 3 else -step
        writer.write(step, scalars, {"gradients/m/d/kernel": (np.arange(4.0) * step, -1.0, 1.0)},
                     {"rules/verdicts": f"| r | {step} |"} if step == 4 else {})
    writer.flush()
    return writer


def _everything(run):
    return (run.scalars(".*"), run.histograms(".*"), run.texts(".*"), run.rollbacks(),
            run.tags(), run.tags(kind="histograms"), run.tags(kind="text"),
            run.steps("step/loss"), run.tensor("gradients/m/d/kernel").values())


def _assert_same(got, want):
    for a, b in zip(got, want):
        if isinstance(a, __import__("pandas").DataFrame):
            assert list(a.columns) == list(b.columns) and len(a) == len(b)
            for column in a.columns:
                for x, y in zip(a[column], b[column]):
                    if isinstance(x, np.ndarray):
                        np.testing.assert_array_equal(x, y)
                    elif isinstance(x, float):
                        # Event files hold float32 scalars; the store float64.
                        assert np.float32(x) == np.float32(y) or (np.isnan(x) and np.isnan(y)), (
                            column, x, y)
                    else:
                        assert x == y, (column, x, y)
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_allclose(list(a[key].values()), list(b[key].values()),
                                           rtol=1e-7)
        else:
            assert a == b


def test_a_run_reads_the_same_from_its_store_and_from_its_event_file(tmp_path):
    writer = _mixed_run(str(tmp_path / "logs"))
    store = _store.store_path(writer.path)
    assert os.path.isdir(store)
    from_store = _everything(load_run(str(tmp_path / "logs")))
    shutil.copytree(tmp_path / "logs", tmp_path / "old")  # a run written before the store
    shutil.rmtree(tmp_path / "old" / "train" / _store.DIRECTORY)
    from_events = _everything(load_run(str(tmp_path / "old")))
    _assert_same(from_store, from_events)
    frame = from_store[0]
    loss = frame[frame.tag == "step/loss"]
    assert loss.step.tolist() == [1, 2, 3, 4, 5]  # the rollback keeps the later writes
    assert from_store[3].to_dict("records") == [{"run": "train", "step": 3, "dropped": [3, 4]}]
    assert np.isnan(frame[(frame.tag == "gradients/m/d/kernel/mean") & (frame.step == 3)]
                    .value.iloc[0])


def test_a_store_cut_by_a_crash_reads_up_to_its_last_complete_row(tmp_path):
    writer = _mixed_run(str(tmp_path))
    store = _store.store_path(writer.path)
    before = load_run(str(tmp_path))
    want = before.scalars(".*")
    # A crash in the middle of a row, of a line, and before a set's header was renamed.
    for name in os.listdir(store):
        if name.endswith(".f64"):
            with open(os.path.join(store, name), "ab") as stream:
                stream.write(b"\x00" * 12)
    with open(os.path.join(store, "texts.jsonl"), "a") as stream:
        stream.write('{"step": 6, "wall_ti')
    with open(os.path.join(store, ".s9.json.tmp"), "w") as stream:
        stream.write('{"format": 1, "kind": "sca')
    with open(os.path.join(store, "s9.f64"), "wb") as stream:
        stream.write(np.ones(5).tobytes())
    after = load_run(str(tmp_path))
    _assert_same([after.scalars(".*")], [want])
    assert after.texts(".*").step.tolist() == [4]


def test_a_store_that_cannot_be_written_is_removed_and_the_event_file_read(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(13, "Permission denied")  # a full disk stops the event file too

    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    writer.write(1, {"a/x": 1.0})
    monkeypatch.setattr(_store.StoreWriter, "scalar_row", fail)
    with pytest.warns(RuntimeWarning, match=re.escape(
            "kerasdbg could not write the analysis store")):
        writer.write(2, {"a/x": 2.0})
    writer.write(3, {"a/x": 3.0})
    writer.flush()
    assert not os.path.exists(_store.store_path(writer.path))
    assert load_run(str(tmp_path)).scalars("a/x").value.tolist() == [1.0, 2.0, 3.0]


def test_the_store_is_invisible_to_tensorboard(tmp_path):
    """TensorBoard takes any path with "tfevents" in its name for an event file."""
    from tensorboard.backend.event_processing import io_wrapper, plugin_event_multiplexer

    _mixed_run(str(tmp_path))
    paths = [os.path.join(d, n) for d, ds, fs in os.walk(tmp_path) for n in ds + fs]
    assert [p for p in paths if io_wrapper.IsSummaryEventsFile(p)] == glob.glob(
        str(tmp_path / "train" / "events.out.tfevents.*"))
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    assert list(multiplexer.Runs()) == ["train"]


def test_a_store_of_another_format_or_half_removed_leaves_the_event_file_to_read(tmp_path):
    writer = _mixed_run(str(tmp_path / "a"))
    want = load_run(str(tmp_path / "a")).scalars(".*")
    store = _store.store_path(writer.path)
    header = os.path.join(store, "s0.json")
    with open(header) as stream:
        text = stream.read()
    with open(header, "w") as stream:  # a later version's set
        stream.write(text.replace('"format": 1', '"format": 99'))
    assert not _store.usable(store)
    got = load_run(str(tmp_path / "a")).scalars(".*")
    assert len(got) == len(want) and got.tag.tolist() == want.tag.tolist()
    os.remove(header)
    os.remove(os.path.join(store, _store.MARKER))  # a drop that stopped half-way
    assert not _store.usable(store)
    assert len(load_run(str(tmp_path / "a")).scalars(".*")) == len(want)


def test_the_store_holds_no_file_open_between_flushes(tmp_path):
    writer = _events.EventWriter(os.path.join(str(tmp_path), "train"))
    for step in range(1, 4):
        for set_index in range(50):  # 50 tag sets, as 50 taps write them
            writer.write(step, {f"activations/t{set_index}/mean": float(step)},
                         {f"activations/t{set_index}": (np.ones(3), 0.0, 1.0)})
    store = _store.store_path(writer.path)
    opened = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [path for path in opened if path.startswith(store)]
    # Nothing flushed to the store yet: the tags are those the event file holds.
    accumulator = event_accumulator.EventAccumulator(writer.path)
    accumulator.Reload()
    assert load_run(str(tmp_path)).tags() == sorted(accumulator.Tags()["scalars"])
    writer.flush()
    assert len(load_run(str(tmp_path)).tags()) == 50


def test_runs_behind_symbolic_links_are_read(tmp_path):
    _mixed_run(str(tmp_path / "elsewhere"))
    (tmp_path / "logs").mkdir()
    os.symlink(tmp_path / "elsewhere" / "train", tmp_path / "logs" / "train")
    os.symlink(tmp_path / "logs", tmp_path / "logs" / "loop")  # a cycle is walked once
    run = load_run(str(tmp_path / "logs"))
    assert run.runs == ["train"] and run.steps("step/loss") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("source", ["store", "event-file"])
def test_the_records_check_run_reads_are_the_scalars_by_step(tmp_path, source):
    writer = _mixed_run(str(tmp_path))
    if source == "event-file":
        shutil.rmtree(os.path.dirname(_store.store_path(writer.path)))
    run = load_run(str(tmp_path))
    frame = run.scalars(".*")
    want = {int(step): dict(zip(rows.tag, rows.value)) for step, rows in frame.groupby("step")}
    got = list(run._records("train"))
    assert [step for step, _ in got] == sorted(want)  # each step once, in order
    for step, record in got:
        assert list(record) == sorted(record)  # tag order, as online
        assert record.keys() == want[step].keys()
        for tag, value in record.items():
            assert np.float32(value) == np.float32(want[step][tag]) or (
                np.isnan(value) and np.isnan(want[step][tag])), (step, tag)
