"""Reads whose rows mix tag layouts that share tags, through the event
writer, its store and the reader.

A read hands the writer the rows of many steps at once; at a scheduled step
the full statistics' layout holds the tags the every-step layout holds at the
steps around it, and the store keeps each layout in a set of its own. The
expected values are the rows themselves; each way of writing (a `write` per
row, a `write_rows` per read, with real wall times) must read back as them,
and so must files of the earlier writer, which gave all rows of a read one
wall time.
"""

import itertools

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from kerasdbg import load_run
from kerasdbg.sinks import events as _events

EVERY = ("gradients/m/d/kernel/l2_norm", "gradients/m/d/kernel/nan_count",
         "gradients/global_norm")
FULL = ("gradients/global_norm", "gradients/m/d/kernel/l2_norm", "gradients/m/d/kernel/mean",
        "gradients/m/d/kernel/nan_count", "gradients/m/d/kernel/std")
OWN = ("step/loss", "step/frozen")
STEPS = 30

PATTERNS = {
    # Which steps have the full layout (the others: the every-step one).
    "full-first": lambda s: s <= 3 or s % 10 == 0,
    "every-first": lambda s: s in (6, 7, 20),
    "alternating": lambda s: s % 2 == 1,
    "full-last": lambda s: s == STEPS,
}
READS = {
    # The read sizes, in steps, one after the other.
    "a-step-a-read": [1] * STEPS,
    "one-read": [STEPS],
    "reads-of-7": [7, 7, 7, 7, 2],
    "reads-ending-at-full-steps": [3, 7, 10, 10],
}


def _rows(pattern: str, own_first: bool, seed: int = 0):
    """Per step: its statistics' row (the full or the every-step layout) and
    the loss's row of another layout, in the order `own_first` says."""
    rng = np.random.default_rng(seed)
    steps = []
    for step in range(1, STEPS + 1):
        tags = FULL if PATTERNS[pattern](step) else EVERY
        statistics = _events.ScalarRow(step, tags, rng.normal(size=len(tags)), {})
        own = _events.ScalarRow(step, OWN, np.array([rng.uniform(), 0.0]), {})
        steps.append([own, statistics] if own_first else [statistics, own])
    return steps


def _expected(steps) -> dict:
    return {(tag, row.step): value for rows in steps for row in rows
            for tag, value in zip(row.tags, row.values.tolist())}


def _write(log_dir, steps, reads, how: str):
    writer = _events.EventWriter(str(log_dir / "train"))
    at = 0
    for size in reads:
        read = [row for rows in steps[at:at + size] for row in rows]
        at += size
        if how == "write":
            for row in read:
                writer.write(row.step, dict(zip(row.tags, row.values.tolist())))
        else:
            writer.write_rows(read)
    writer.close()
    return writer


def _read(log_dir) -> dict:
    frame = load_run(str(log_dir)).scalars(".*")
    return {(tag, step): value for tag, step, value in
            zip(frame.tag, frame.step.tolist(), frame.value.tolist())}


@pytest.mark.parametrize("how", ["write", "write_rows", "earlier-writer"])
@pytest.mark.parametrize("reads", READS, ids=list(READS))
@pytest.mark.parametrize("pattern, own_first",
                         list(itertools.product(PATTERNS, [False, True])),
                         ids=[f"{p}-{'own' if o else 'stats'}-first"
                              for p, o in itertools.product(PATTERNS, [False, True])])
def test_rows_of_layouts_sharing_tags_read_back_as_written(tmp_path, monkeypatch, pattern,
                                                           own_first, reads, how):
    steps = _rows(pattern, own_first)
    if how == "earlier-writer":
        # The writer of before: every row of a read at the read's wall time.
        monkeypatch.setattr(_events.EventWriter, "_walls",
                            lambda self, count, wall_time=None: np.full(count, 1.7e9 + len(steps)))
    _write(tmp_path, steps, READS[reads], "write" if how == "write" else "write_rows")
    expected = _expected(steps)
    assert _read(tmp_path) == expected
    run = load_run(str(tmp_path))
    assert run.rollbacks().empty
    # The table of steps (what `check` and the report read) has every value too.
    table = run.scalar_table(".*")
    for (tag, step), value in expected.items():
        assert table.loc[step, tag] == value, (tag, step)
    # TensorBoard's reader of the event file: every tag at every step written.
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "train"),
                                                     size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    for tag in set(t for t, _ in expected):
        want = sorted(s for t, s in expected if t == tag)
        assert [e.step for e in accumulator.Scalars(tag)] == want, tag


def test_every_row_of_a_writer_has_its_own_later_wall_time(tmp_path):
    """What lets the reader order a tag's rows across the store's sets."""
    steps = _rows("full-first", False)
    writer = _events.EventWriter(str(tmp_path / "train"))
    writer.write_rows([row for rows in steps[:10] for row in rows], wall_time=1.7e9)
    writer.write(11, {"step/loss": 1.0}, wall_time=1.0)  # a wall time from the past
    writer.write_rows([row for rows in steps[11:] for row in rows])
    writer.close()
    loader = event_accumulator.EventAccumulator(str(tmp_path / "train"))
    loader.Reload()
    # (A row is one event: its tags share its wall time.)
    events = sorted({(e.wall_time, e.step) for tag in loader.Tags()["scalars"]
                     for e in loader.Scalars(tag)})
    assert len({wall for wall, _ in events}) == len(events) == 2 * (STEPS - 1) + 1
    assert [s for _, s in events] == sorted(s for _, s in events)
    assert events[0][0] == 1.7e9


@pytest.mark.parametrize("how", ["write", "write_rows"])
def test_a_rollback_across_layouts_is_still_one(tmp_path, how):
    """A run resumed from step 21 (a backup restored) with the same layouts:
    the reader keeps the later writes and reports the rollback."""
    first = _rows("full-first", False, seed=1)
    again = _rows("full-first", False, seed=2)[20:]
    writer = _events.EventWriter(str(tmp_path / "train"))
    for part in (first, again):
        read = [row for rows in part for row in rows]
        if how == "write":
            for row in read:
                writer.write(row.step, dict(zip(row.tags, row.values.tolist())))
        else:
            writer.write_rows(read)
    writer.close()
    expected = _expected(first)
    expected.update(_expected(again))
    assert _read(tmp_path) == expected
    rollbacks = load_run(str(tmp_path)).rollbacks().to_dict("records")
    assert rollbacks == [{"run": "train", "step": 21, "dropped": list(range(21, STEPS + 1))}]


def test_a_store_flushed_halfway_reads_its_tail_from_the_event_file(tmp_path):
    """The store covers the first reads; the rest is only in the event file
    (a run being written, or killed): the same values."""
    steps = _rows("full-first", True)
    writer = _events.EventWriter(str(tmp_path / "train"))
    for start in range(0, STEPS, 6):
        writer.write_rows([row for rows in steps[start:start + 6] for row in rows])
        if start == 12:
            writer.flush()
    writer.flush(events_only=True)
    expected = _expected(steps)
    # The event file holds float32 values; the store, written up to step 18, float64.
    expected = {(tag, step): value if step <= 18 else float(np.float32(value))
                for (tag, step), value in expected.items()}
    assert _read(tmp_path) == expected
    assert load_run(str(tmp_path)).rollbacks().empty
    writer.close()
