"""`StepRows`: the records of a fit merged into one row per step, called
directly (no fit): what each kind of record adds, the loss it reads, the
order the rows come out in. `StopOnRule`'s fits are in
tests/callbacks/test_stop_on_rule.py."""

import math
import types

import keras
import numpy as np
import pytest

from kerasdbg.capture.step_rows import StepRows, learning_rate_at
from kerasdbg.records import CaptureRecord

STEP = types.SimpleNamespace(kind="step")
GRADIENTS = types.SimpleNamespace(kind="gradients")
WEIGHTS = types.SimpleNamespace(kind="weights")


def _model(optimizer="sgd"):
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="d")(inputs))
    model.compile(optimizer, "mse")
    return model


def _rows(loss=None, captured=True, model=None):
    first = []
    rows = StepRows(model if model is not None else _model(), loss, lambda: captured,
                    lambda values, returned, source: first.append((dict(values), returned, source)))
    return rows, first


def _record(step, tags, values, skipped=False, applied=True):
    return CaptureRecord(step=step, skipped=skipped, values=np.asarray(values, np.float64),
                         histograms=None, tags=tuple(tags), applied=applied)


def test_rows_come_out_in_step_order_each_in_tag_order_and_once():
    rows, _ = _rows()
    rows.take(GRADIENTS, [_record(2, ["gradients/d/kernel/l2_norm", "gradients/d/bias/l2_norm"],
                                  [3.0, 4.0])])
    rows.take(GRADIENTS, [_record(1, ["gradients/d/kernel/l2_norm", None], [1.0, 9.0])])
    rows.add(2, {"replicas/d/kernel/spread": 0.5})
    taken = list(rows.pop_in_order())
    assert taken == [
        (1, {"gradients/d/kernel/l2_norm": 1.0}),
        (2, {"gradients/d/bias/l2_norm": 4.0, "gradients/d/kernel/l2_norm": 3.0,
             "replicas/d/kernel/spread": 0.5}),
    ]
    assert [list(record) for _, record in taken] == [sorted(record) for _, record in taken]
    assert list(rows.pop_in_order()) == []


def test_rows_merged_while_they_are_handed_out_wait_for_the_next_call():
    rows, _ = _rows()
    rows.add(1, {"a": 1.0})
    rows.add(2, {"a": 2.0})
    seen = []
    for step, record in rows.pop_in_order():
        seen.append(step)
        rows.add(0, {"late": 0.0})  # a record a rule's action made arrive
    assert seen == [1, 2]
    assert list(rows.pop_in_order()) == [(0, {"late": 0.0})]


def test_skipped_and_accumulating_steps_and_absent_values_add_nothing():
    rows, _ = _rows()
    rows.take(GRADIENTS, [_record(1, ["gradients/d/kernel/l2_norm"], [1.0], skipped=True)])
    rows.take(WEIGHTS, [_record(2, ["weights/d/kernel/l2_norm"], [1.0], applied=False)])
    rows.take(WEIGHTS, [CaptureRecord(step=3, skipped=False, values=None, histograms=None)])
    assert list(rows.pop_in_order()) == []


def test_a_non_finite_loss_of_a_skipped_step_is_not_overwritten_by_the_next():
    """A step the loss scaler skipped shares its number with the next."""
    rows, _ = _rows()
    rows.take(STEP, [_record(4, ["step/loss"], [math.inf], skipped=True),
                     _record(4, ["step/loss"], [0.25])])
    rows.take(STEP, [_record(5, ["step/loss"], [0.5]), _record(5, ["step/loss"], [0.75])])
    assert dict(rows.pop_in_order()) == {4: {"step/loss": math.inf}, 5: {"step/loss": 0.75}}


@pytest.mark.parametrize("loss, captured, tags, expected, source", [
    (None, True, ["step/loss", "step/acc"], 1.0, "compute_loss"),
    (None, False, ["step/loss", "step/acc"], 1.0, "the train step's 'loss'"),
    ("acc", True, ["step/loss", "step/acc"], 2.0, "the train step's 'acc'"),
    ("g_loss", True, ["step/loss", "step/acc"], None, None),
    (None, True, ["step/acc"], None, None),
], ids=["compute-loss", "returned-loss", "named", "named-absent", "none"])
def test_the_loss_of_a_step_and_where_it_was_read_said_once(loss, captured, tags, expected,
                                                            source):
    rows, first = _rows(loss=loss, captured=captured)
    values = [float(k) for k in range(1, len(tags) + 1)]  # step/loss 1.0, step/acc 2.0
    rows.take(STEP, [_record(1, tags + ["step/frozen"], values + [0.0])])
    rows.take(STEP, [_record(2, tags, [v + 2.0 for v in values])])
    taken = dict(rows.pop_in_order())
    assert taken[1].get("step/loss") == expected
    assert len(first) == 1
    values, returned, said = first[0]
    assert said == source and values.get("step/loss") == expected
    assert returned == sorted(t.split("/", 1)[1] for t in tags)


def test_the_weight_decay_fraction_goes_with_the_weights_records():
    model = _model(keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.004))
    rows, _ = _rows(model=model)
    rows.take(WEIGHTS, [_record(3, ["weights/d/kernel/l2_norm"], [1.0])])
    rows.take(GRADIENTS, [_record(4, ["gradients/d/kernel/l2_norm"], [1.0])])
    taken = dict(rows.pop_in_order())
    np.testing.assert_allclose(taken[3]["step/weight_decay_fraction"], 0.01 * 0.004, rtol=1e-6)
    assert "step/weight_decay_fraction" not in taken[4]


def test_the_learning_rate_of_a_schedule_is_the_one_before_the_step():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.004)
    model = _model(optimizer)
    np.testing.assert_allclose(learning_rate_at(model, optimizer, 3), 0.1 * 0.5 ** 2, rtol=1e-6)
    np.testing.assert_allclose(learning_rate_at(model, optimizer, 1), 0.1, rtol=1e-6)


def test_tap_rows_go_into_the_row_of_their_step():
    rows, _ = _rows()
    tap = types.SimpleNamespace(name="t")
    rows.take_tap(tap, [({"step": 2, "mode": "fit", "mean": 0.5, "zero_fraction": 0.25}, None)])
    assert dict(rows.pop_in_order()) == {
        2: {"activations/t/mean": 0.5, "activations/t/zero_fraction": 0.25}}


def test_during_an_epoch_rows_after_the_last_step_read_wait_for_their_read():
    """A tap flushes its rows on its own, before the capture read their
    steps: during the epoch (`final=False`) the rows after the last step
    record wait, so that the rules see each step whole and in order."""
    rows, _ = _rows()
    rows.take(STEP, [_record(s, ["step/loss"], [float(s)]) for s in (1, 2)])
    rows.add(5, {"activations/tap/dead_fraction": 1.0})  # read ahead of its step
    assert [step for step, _ in rows.pop_in_order(final=False)] == [1, 2]
    assert list(rows.pop_in_order(final=False)) == []
    rows.take(STEP, [_record(s, ["step/loss"], [float(s)]) for s in (3, 4, 5)])
    taken = dict(rows.pop_in_order(final=False))
    assert list(taken) == [3, 4, 5]
    assert taken[5] == {"activations/tap/dead_fraction": 1.0, "step/loss": 5.0}
    rows.add(9, {"a": 1.0})
    assert dict(rows.pop_in_order()) == {9: {"a": 1.0}}  # the epoch's end: every row
