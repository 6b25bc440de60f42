"""The scalar events `EventWriter` serializes itself (`_ScalarTemplate`): byte for byte
what TensorBoard's `Event` proto serializes, for every value a step can hold, and read back
by TensorBoard's own reader."""

import math
import struct

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.proto import event_pb2, summary_pb2

from kerasdbg.sinks import events as _events

AWKWARD = [0.0, -0.0, 1.0, -1.5, float("nan"), -float("nan"), float("inf"), -float("inf"),
           1e40, -1e40, 1e-50, 3.4028234663852886e38, 1.401298464324817e-45, 123456789.123]
TAGS = ["step/loss", "gradients/model/dense/kernel/l2_norm", "views/ü/max", "x" * 200,
        "weights/" + "/".join(["block"] * 40) + "/mean"]


def _proto(step, wall_time, tags, values):
    """The reference: TensorBoard's proto, each value set as a float."""
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
        for tag, value in zip(tags, values)])).SerializeToString()


@pytest.mark.parametrize("step", [1, 0, 2, 127, 128, 300, 2 ** 31, 2 ** 62, -1, -5])
@pytest.mark.parametrize("wall_time", [1796197613.135163, 0.0, -0.0, 1.5])
def test_a_scalar_event_is_the_bytes_the_proto_serializes(step, wall_time):
    rng = np.random.default_rng(step % 1000)
    values = AWKWARD[:len(TAGS)] + rng.normal(size=3).tolist()
    tags = TAGS + [f"t{i}" for i in range(len(values) - len(TAGS))]
    template = _events._ScalarTemplate(tuple(tags))
    with np.errstate(over="ignore"):  # the reference's own cast of 1e40 warns in NumPy only
        got = template.event(step, wall_time, np.asarray(values, np.float64))
    assert got == _proto(step, wall_time, tags, values)
    # The template is reused: another step's values in the same slots.
    again = rng.normal(size=len(tags)) * 10.0 ** rng.integers(-30, 30, len(tags))
    assert template.event(step + 1, wall_time, again) == _proto(step + 1, wall_time, tags, again)


def test_every_awkward_value_alone_is_the_protos_bytes():
    template = _events._ScalarTemplate(("a",))
    for value in AWKWARD:
        with np.errstate(over="ignore"):
            got = template.event(7, 2.0, np.asarray([value]))
        assert got == _proto(7, 2.0, ["a"], [value]), value


def test_the_events_written_read_back_in_tensorboard_with_their_float32_values(tmp_path):
    writer = _events.EventWriter(str(tmp_path))
    rows = [{"step/loss": 0.5 * k, "gradients/m/d/kernel/max": 1e40 if k == 2 else -0.0,
             "gradients/m/d/kernel/nan_count": float(k)} for k in range(1, 5)]
    for k, row in enumerate(rows, 1):
        writer.write(k, row, texts={"notes": "said"} if k == 3 else {}, views={"views/v": k / 3})
    writer.close()
    read = {}
    for event in event_file_loader.EventFileLoader(writer.path).Load():
        for value in event.summary.value:  # (the loader makes each scalar a float tensor)
            if value.metadata.plugin_data.plugin_name == "scalars":
                read.setdefault(value.tag, []).append((event.step, value.tensor.float_val[0]))
    for tag in rows[0]:
        want = [(k, math.inf if row[tag] > 1e39 else struct.unpack("<f", struct.pack(
            "<f", row[tag]))[0]) for k, row in enumerate(rows, 1)]
        assert read[tag] == want, tag
    assert [s for s, _ in read["views/v"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("tensorflow", [False, True])
def test_rows_written_together_are_the_bytes_written_one_at_a_time(tmp_path, tensorflow,
                                                                   monkeypatch):
    """`write_rows` (a read's events of scalars, one array per tag layout, one call of the
    file): the same file, byte for byte after the header, and the same store, as `write` of
    each row in turn, with two layouts interleaved, views that change their tags, step 0 and
    awkward values."""
    from kerasdbg import load_run
    from kerasdbg.sinks import tfrecord

    monkeypatch.setattr(tfrecord, "_tensorflow_loaded", lambda: tensorflow)
    rng = np.random.default_rng(3)
    a, b = ("step/loss", "weights/m/d/kernel/mean"), ("gradients/m/d/kernel/l2_norm",)
    rows = []
    for step in [0, 1, 2, 3, 300, 2 ** 40]:
        values = np.asarray(AWKWARD[step % len(AWKWARD):][:2] + [1.0, 2.0])[:2]
        rows.append(_events.ScalarRow(step, a, values, {"views/x/max/" + str(step % 2): 0.25}))
        rows.append(_events.ScalarRow(step, b, rng.normal(size=1), {}))
    wall = 1796197613.5
    one, together = tmp_path / "one" / "train", tmp_path / "together" / "train"
    first = _events.EventWriter(str(one))
    with np.errstate(over="ignore"):
        for row in rows:
            first.write(row.step, dict(zip(row.tags, row.values.tolist())), views=row.views,
                        wall_time=wall)
    first.close()
    second = _events.EventWriter(str(together))
    with np.errstate(over="ignore"):
        second.write_rows(rows, wall_time=wall)
    second.close()
    # (Each file begins with its own header: the time it was made.)
    records = [list(event_file_loader.RawEventFileLoader(w.path).Load())[1:]
               for w in (first, second)]
    assert len(records[0]) == len(rows) and records[0] == records[1]
    loaded = [load_run(str(tmp_path / name)) for name in ("one", "together")]
    for tag in a + b:
        assert loaded[0].scalars(tag).equals(loaded[1].scalars(tag)), tag
    assert len(loaded[1].scalars(a[1])) == 6


def test_rows_written_together_with_unique_and_derived_views_are_those_of_write(tmp_path):
    """`write_rows(..., unique=True)` on a writer that derives the loss's log10
    (`StopOnRule`'s): what `write(..., unique=True)` of each row writes, with a
    value written again at its step left out (two StopOnRules in one log
    directory), a new value at the same step kept, NaN equal to NaN, a row
    left with nothing to write and a loss NaN or <= 0 (no log10)."""
    from kerasdbg import load_run
    from kerasdbg.sinks import layout

    loss, frozen = "step/loss", "step/frozen"
    rows = [_events.ScalarRow(step, tags, np.asarray(values, np.float64), {})
            for step, tags, values in [
                (1, (loss, frozen), [2.0, 0.0]), (1, (loss, frozen), [2.0, 0.0]),  # nothing new
                (1, (loss,), [3.0]), (2, (loss, frozen), [float("nan"), 1.0]),
                (2, (loss, frozen), [float("nan"), 1.0]), (3, (loss,), [-0.5]),
                (3, (frozen,), [0.0]), (4, (loss, frozen), [100.0, 0.0])]]
    wall = 1796197613.5
    writers = []
    for name in ("one", "together"):
        writer = _events.EventWriter(str(tmp_path / name / "train"))
        writer.derive(layout.loss_views)
        writers.append(writer)
    for row in rows:
        writers[0].write(row.step, dict(zip(row.tags, row.values.tolist())), views=row.views,
                         wall_time=wall, unique=True)
    writers[1].write_rows(rows[:3], wall_time=wall, unique=True)
    writers[1].write_rows(rows[3:], wall_time=wall, unique=True)
    for writer in writers:
        writer.close()
    records = [list(event_file_loader.RawEventFileLoader(w.path).Load())[1:] for w in writers]
    assert len(records[0]) == 6 and records[0] == records[1]
    loaded = [load_run(str(tmp_path / name)) for name in ("one", "together")]
    for tag in (loss, frozen):
        assert loaded[0].scalars(tag).equals(loaded[1].scalars(tag)), tag
    written = [(e.step, sorted(v.tag for v in e.summary.value))
               for e in event_file_loader.EventFileLoader(writers[1].path).Load() if e.summary.value]
    view = "views/step/loss/log10"
    assert written == [(1, sorted([loss, frozen, view])), (1, [loss, view]),
                       (2, [frozen, loss]), (3, [loss]), (3, [frozen]),
                       (4, sorted([loss, frozen, view]))]


@pytest.mark.parametrize("derive", [True, False], ids=["derived", "plain"])
def test_a_block_writes_the_bytes_its_rows_write(tmp_path, derive):
    """`write_block(steps, tags, values, views, unique=True)` (what
    `StopOnRule` and the statistics callbacks write a read with): the bytes
    `write_rows` writes for one row a step, with the views of each step
    (coming and going), the loss's log10 derived (absent at a loss <= 0 or
    NaN, +inf at +inf), a block after the steps written, and one that writes
    steps again (a rollback: only what is new at a step is written)."""
    from kerasdbg.sinks import layout

    tags = ("step/loss", "step/frozen")
    values = np.array([[2.0, 0.0], [-1.0, 0.0], [np.nan, 1.0], [np.inf, 0.0], [0.5, 0.0]])
    view_tags = ("views/a", "views/b")
    views = [(view_tags, np.array([0, 3]), np.array([[1.0, 2.0], [3.0, 4.0]])),
             (("views/a",), np.array([1]), np.array([[5.0]]))]  # step 3 and 5: none
    per_step = [{}] * 5
    for view_tags_, positions, found in views:
        for k, row in zip(positions.tolist(), found.tolist()):
            per_step[k] = dict(zip(view_tags_, row))
    wall = 1796197613.5
    writers = []
    for name in ("rows", "block"):
        writer = _events.EventWriter(str(tmp_path / name / "train"))
        if derive:
            writer.derive(layout.loss_views)
        writers.append(writer)
    for steps in ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [10, 11, 12, 13, 14], [4, 5, 6, 7, 8]):
        # From step 10 again: step 10 as written (a second StopOnRule on the
        # writer: nothing new there), then new values.
        again = values[[4, 0, 1, 2, 3]] if steps[0] == 10 else \
            values + (steps[0] == 4) * np.array([[0.0, 0.0]] * 2 + [[1.0, 0.0]] * 3)
        writers[0].write_rows([_events.ScalarRow(s, tags, row, v)
                               for s, row, v in zip(steps, again, per_step)],
                              wall_time=wall, unique=True)
        writers[1].write_block(np.asarray(steps), tags, again, views, wall_time=wall,
                               unique=True)
    for writer in writers:
        writer.close()
    records = [list(event_file_loader.RawEventFileLoader(w.path).Load())[1:] for w in writers]
    assert records[0] == records[1]
    assert len(records[0]) == 20  # (step 10 again: only its views are new)
    written = {(e.step, v.tag) for e in event_file_loader.EventFileLoader(writers[1].path).Load()
               for v in e.summary.value}
    assert ((1, "views/step/loss/log10") in written) == derive
    assert (2, "views/step/loss/log10") not in written and (3, "views/a") not in written


def test_rows_written_together_after_a_failure_write_nothing_and_say_so(tmp_path):
    writer = _events.EventWriter(str(tmp_path / "train"))
    writer.attach("owner", "GradientStatistics")

    class Broken:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    writer._writer = Broken()
    with pytest.warns(RuntimeWarning, match="GradientStatistics could not record.*No space"):
        writer.write_rows([_events.ScalarRow(1, ("step/loss",), np.asarray([1.0]), {})])
    assert writer.failed
    writer.write_rows([_events.ScalarRow(2, ("step/loss",), np.asarray([1.0]), {})])  # quiet
