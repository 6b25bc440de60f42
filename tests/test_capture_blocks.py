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
