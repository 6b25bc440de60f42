"""A read hands the statistics callbacks blocks, on TensorFlow (the shared
checks: tests/capture_blocks.py; JAX: tests/jax/)."""

import pytest

from tests import capture_blocks as case


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_a_healthy_read_makes_no_record_or_event_row_per_step(monkeypatch, tmp_path, spe):
    case.check_no_object_per_step(monkeypatch, tmp_path, spe)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
@pytest.mark.parametrize("optimizer", ["adam", "clipped", "scaled"])
def test_the_blocks_write_what_the_records_write(monkeypatch, tmp_path, spe, optimizer):
    case.check_blocks_write_what_records_write(monkeypatch, tmp_path, spe, optimizer)


@pytest.mark.parametrize("optimizer", ["adam", "accumulating"])
def test_the_same_with_histograms_between_the_scheduled_steps(monkeypatch, tmp_path, optimizer):
    # Every 10th step's statistics, the histograms every 4th (steps 4, 8, 12 ...
    # hold a histogram and no statistic), gradient accumulation.
    case.check_blocks_write_what_records_write(monkeypatch, tmp_path, 3, optimizer, histograms=4,
                                               every_n_steps=10)


def test_the_same_with_histograms_a_short_history_and_jit(monkeypatch, tmp_path):
    case.check_blocks_write_what_records_write(monkeypatch, tmp_path, 3, "adam", histograms=7,
                                               history_size=25, jit_compile=True)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_the_rules_take_a_healthy_read_as_blocks_and_judge_no_step(monkeypatch, tmp_path, spe):
    case.check_rules_take_blocks(monkeypatch, tmp_path, spe)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_a_read_of_the_default_schedule_writes_in_two_parts(monkeypatch, tmp_path, spe):
    case.check_a_read_writes_in_two_parts(monkeypatch, tmp_path, spe)


def test_parts_write_each_tag_in_step_order_or_leave_the_blocks_apart():
    import numpy as np

    from kerasdbg.capture.blocks import parts
    from kerasdbg.records import CaptureBlock

    def block(steps, tags, optimizer=None):
        return CaptureBlock(steps, np.zeros((len(steps), len(tags))), tags, optimizer=optimizer)

    every, full = ("n", None, None), ("n", "m", "s")
    runs = [block([1, 2], every), block([3], full), block([4, 5], every), block([6], full)]
    assert parts(runs) == [(every, [0, 1, 2, 3], True), ((None, "m", "s"), [1, 3], False)]
    # Each tag's steps in order: the shared part over every block, each other
    # tag over the blocks that name it.
    for tags, positions, _ in parts(runs):
        steps = np.concatenate([runs[p].steps for p in positions])
        assert (np.diff(steps) > 0).all()
    alone = [(b.tags, [i], True) for i, b in enumerate(runs)]
    # No column every block names: the part that holds each step once would
    # write them out of order.
    disjoint = [block([1], ("a", None)), block([2], (None, "b")), block([3], ("a", None))]
    assert parts(disjoint) == [(b.tags, [i], True) for i, b in enumerate(disjoint)]
    # A column named two ways, two sets sharing a column, other optimizers or widths.
    assert parts([runs[0], block([3], ("x", "m", None))]) == alone[:1] + [(("x", "m", None), [1], True)]
    overlapping = [block([1], ("n", "m", None)), block([2], ("n", "m", "s")), block([3], every)]
    assert parts(overlapping) == [(b.tags, [i], True) for i, b in enumerate(overlapping)]
    assert parts([runs[0], block([3], full, "other")])[1] == (full, [1], True)
    assert len(parts([runs[0], block([3], ("n", None))])) == 2
