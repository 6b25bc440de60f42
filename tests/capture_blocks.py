"""A read hands the statistics callbacks blocks, not an object per step, for both backends.

Shared by tests/test_capture_blocks.py (TensorFlow) and
tests/jax/test_capture_blocks.py (JAX): nothing here imports a backend.

Two things are checked. On a healthy fit with the statistics callbacks, the
capture makes no `CaptureRecord` (the per-step object) but at the steps that
need one (a histogram), and the callbacks write no `ScalarRow` (the per-step
event row): counted by wrapping the classes. And what the blocks give is what
the per-step records give: the same fit with the records handed one per step
(as to a consumer that takes no blocks, `Request.deliver`) writes the same
`history`, the same `latest`, the same `clipped_steps`, and the same events
(every scalar and view that TensorBoard's own reader finds, step by step).
"""

from __future__ import annotations

import os
from typing import Dict

import keras
import numpy as np
import pandas as pd
from tensorboard.backend.event_processing import event_accumulator

from kerasdbg import capture as _capture
from kerasdbg.callbacks import GradientStatistics, WeightStatistics
from kerasdbg.capture import requests as _requests
from kerasdbg.records import capture_record
from kerasdbg.sinks import events as _events

STEPS, BATCH = 60, 8
_rng = np.random.default_rng(3)
X = _rng.normal(size=(STEPS * BATCH, 6)).astype("float32")
Y = (X[:, :2].sum(1, keepdims=True) + 0.1 * _rng.normal(size=(STEPS * BATCH, 1))
     ).astype("float32")


def make_model(spe: int, optimizer: str = "adam", jit_compile="auto") -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu",
                                                                     name="h"),
                              keras.layers.Dense(1, name="o")], name="m")
    made = {"adam": lambda: keras.optimizers.Adam(0.01),
            "clipped": lambda: keras.optimizers.SGD(0.05, global_clipnorm=0.5),
            "accumulating": lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
            # (a scale that overflows: the first steps are skipped)
            "scaled": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                                                  initial_scale=2.0 ** 127)}
    model.compile(made[optimizer](), "mse", steps_per_execution=spe, jit_compile=jit_compile)
    return model


def instruments(log_dir: str, histograms=None, history_size: int = 1000,
                every_n_steps=None) -> list:
    return [GradientStatistics(log_dir, histogram_every_n_steps=histograms,
                               history_size=history_size, every_n_steps=every_n_steps),
            WeightStatistics(log_dir, history_size=history_size, every_n_steps=every_n_steps)]


class Counted:
    """Counts the objects of `classes` made while it is entered."""

    def __init__(self, monkeypatch, *classes):
        self.counts = {c.__name__: 0 for c in classes}
        for cls in classes:
            made = cls.__new__

            def counting(klass, *args, _made=made, _name=cls.__name__, **kwargs):
                self.counts[_name] += 1
                return _made(klass, *args, **kwargs)

            monkeypatch.setattr(cls, "__new__", counting)


def check_no_object_per_step(monkeypatch, tmp_path, spe: int) -> None:
    """No record or event row per step on a healthy fit; one record per
    histogram step where histograms are asked for."""
    model = make_model(spe)
    callbacks = instruments(str(tmp_path / "a"))
    blocks = []
    original = _requests.Request.deliver

    def delivering(request, items):
        blocks.extend(i for i in items if isinstance(i, capture_record.CaptureBlock))
        return original(request, items)

    monkeypatch.setattr(_requests.Request, "deliver", delivering)
    counted = Counted(monkeypatch, capture_record.CaptureRecord, _events.ScalarRow)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    assert counted.counts == {"CaptureRecord": 0, "ScalarRow": 0}
    # Every step came, in blocks (a few per read, not one per step).
    for kind, callback in zip(("gradients", "weights"), callbacks):
        assert callback.history.step.tolist() == list(range(1, STEPS + 1)), kind
    assert 2 <= len(blocks) <= 2 * STEPS // 4
    assert sum(len(b) for b in blocks) == 2 * STEPS

    # Histograms every 7th step: a record there (8 of them), blocks between.
    model = make_model(spe)
    counted = Counted(monkeypatch, capture_record.CaptureRecord)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=instruments(str(tmp_path / "b"), histograms=7))
    assert counted.counts["CaptureRecord"] == STEPS // 7


def check_rules_take_blocks(monkeypatch, tmp_path, spe: int) -> None:
    """`StopOnRule()` with the statistics callbacks on a healthy fit: the
    rules get the read as blocks; no capture record, no step record for the
    rules (`StepRecord`) and no event row (`ScalarRow`) is made, but one of
    each of the last two at an epoch's end (its logs); no rule judges a
    step."""
    from kerasdbg.callbacks import StopOnRule
    from kerasdbg.records import step_record
    from kerasdbg.rules import _runner

    judged = []
    original = _runner.RuleRunner.check_block

    def checking(runner, block):
        found = original(runner, block)
        judged.append(runner.judged)
        return found

    monkeypatch.setattr(_runner.RuleRunner, "check_block", checking)
    counted = Counted(monkeypatch, capture_record.CaptureRecord, step_record.StepRecord,
                      _events.ScalarRow)
    model = make_model(spe)
    stop = StopOnRule(log_dir=str(tmp_path), verbose=False)
    callbacks = instruments(str(tmp_path)) + [stop]
    model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert not model.stop_training and not stop.verdicts
    # (At each epoch's end, its logs: a record for the rules, written with
    # `write_rows`, which makes a row of it again.)
    counts = dict(counted.counts)
    assert counts == {"CaptureRecord": 0, "StepRecord": 2, "ScalarRow": 2 * 2}, counts
    assert judged and judged[-1] == 0
    # Every step's loss written, once.
    board = _board(str(tmp_path / "train"))
    assert sorted(board["step/loss"]) == list(range(1, 2 * STEPS + 1))
    assert sorted(board["views/step/loss/log10"]) == list(range(1, 2 * STEPS + 1))


def _board(run_dir: str) -> Dict[str, Dict[int, float]]:
    accumulator = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.SCALARS: 0,
                                event_accumulator.TENSORS: 0})
    accumulator.Reload()
    out = {tag: {e.step: e.value for e in accumulator.Scalars(tag)}
           for tag in accumulator.Tags()["scalars"]}
    for tag in accumulator.Tags()["tensors"]:  # the histograms
        out[tag] = {e.step: e.tensor_proto.SerializeToString()
                    for e in accumulator.Tensors(tag)}
    return out


def _recorded(monkeypatch, log_dir: str, spe: int, optimizer: str, histograms,
              history_size: int, per_step: bool, jit_compile="auto", every_n_steps=None):
    if per_step:
        # Requests that take no blocks: the captures' record per step.
        made = _requests.Request.__init__

        def per_step_request(request, *args, **kwargs):
            made(request, *args, **kwargs)
            request.blocks = False

        monkeypatch.setattr(_requests.Request, "__init__", per_step_request)
    model = make_model(spe, optimizer, jit_compile)
    callbacks = instruments(log_dir, histograms, history_size, every_n_steps)
    model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    monkeypatch.undo()
    assert not _capture.engine_for(model).requests
    return ([c.history for c in callbacks], [c.latest for c in callbacks],
            callbacks[0].clipped_steps, _board(os.path.join(log_dir, "train")))


def check_blocks_write_what_records_write(monkeypatch, tmp_path, spe: int, optimizer: str,
                                          histograms=None, history_size: int = 1000,
                                          jit_compile="auto", every_n_steps=None) -> None:
    blocked = _recorded(monkeypatch, str(tmp_path / "blocks"), spe, optimizer, histograms,
                        history_size, per_step=False, jit_compile=jit_compile,
                        every_n_steps=every_n_steps)
    stepped = _recorded(monkeypatch, str(tmp_path / "steps"), spe, optimizer, histograms,
                        history_size, per_step=True, jit_compile=jit_compile,
                        every_n_steps=every_n_steps)
    recorded = 2 * STEPS if every_n_steps is None else 2 * STEPS // every_n_steps
    for got, want in zip(blocked[0], stepped[0]):
        pd.testing.assert_frame_equal(got, want)
        assert len(got) == min(history_size, recorded)
        assert ("applied" in got) == (optimizer == "accumulating")
    assert blocked[1] == stepped[1]
    assert blocked[2] == stepped[2]
    board, want = blocked[3], stepped[3]
    assert sorted(board) == sorted(want)
    for tag in want:
        assert board[tag] == want[tag], tag
    # What the fit recorded is there at all (not two empty runs alike).
    written = recorded if optimizer != "scaled" else \
        recorded - int(blocked[0][0].skipped.sum())  # (a skipped step writes no event)
    assert len(want["gradients/global_norm"]) == written
    assert any(tag.startswith("views/gradients/") for tag in want)
    if optimizer == "scaled":
        skipped = want["gradients/skipped_updates"]
        assert max(skipped.values()) >= 1  # the scaler skipped its first steps
    if optimizer == "clipped":
        assert 0 < blocked[2] <= 2 * STEPS
    if histograms:
        assert len(want["gradients/m/h/kernel"]) == 2 * STEPS // histograms


def check_a_read_writes_in_two_parts(monkeypatch, tmp_path, spe: int) -> None:
    """The default schedule takes every statistic at steps 1-10 and 50 and
    the norms at the others: a read alternates the two layouts, a block
    each run. Each callback writes a read's steps in at most two writes
    (the columns of every step; the scheduled steps' others), whatever the
    runs, and TensorBoard shows each tag at each of its steps once."""
    from kerasdbg.callbacks import _statistics

    writes = []
    original_consume = _statistics.StatisticsCallback._consume
    original_write = _events.EventWriter.write_block

    def consume(callback, items):
        writes.append([sum(isinstance(i, capture_record.CaptureBlock) for i in items), 0])
        return original_consume(callback, items)

    def write_block(writer, *args, **kwargs):
        writes[-1][1] += 1
        return original_write(writer, *args, **kwargs)

    monkeypatch.setattr(_statistics.StatisticsCallback, "_consume", consume)
    monkeypatch.setattr(_events.EventWriter, "write_block", write_block)
    model = make_model(spe)
    callbacks = instruments(str(tmp_path))
    import kerasdbg

    kerasdbg.set_read_interval(1e6)  # a read after the first execution, then at the end
    try:
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
    finally:
        kerasdbg.set_read_interval(None)
    monkeypatch.undo()
    assert max(blocks for blocks, _ in writes) >= 4, writes  # runs of both layouts in a read
    assert all(written <= min(blocks, 2) for blocks, written in writes), writes
    board = _board(str(tmp_path / "train"))
    for kind, callback in zip(("gradients", "weights"), callbacks):
        history = callback.history
        assert history.step.tolist() == list(range(1, STEPS + 1))
        checked = 0
        for column in history.columns:
            if not str(column).endswith(("/l2_norm", "/mean")):
                continue
            tag = f"{kind}/{column}"
            chosen = history[column].notna().to_numpy()
            steps = history.step.to_numpy()[chosen]
            assert sorted(board[tag]) == steps.tolist(), tag
            np.testing.assert_allclose([board[tag][s] for s in steps.tolist()],
                                       history[column].to_numpy()[chosen], rtol=1e-6)
            checked += column.endswith("/mean")
        assert checked, kind  # the scheduled steps' statistics are there
