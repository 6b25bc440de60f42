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


def _reference(takes, loss_tag="step/loss"):
    """The rows `takes` make, merged one record at a time into a dict per step
    (what `StepRows` must give, written here as the rule it follows)."""
    rows = {}
    for kind, record in takes:
        if record.values is None or (record.skipped and kind != "step"):
            continue
        if not record.applied and kind == "weights":
            continue
        row = rows.setdefault(record.step, {})
        values = {t: float(v) for t, v in zip(record.tags, record.values) if t is not None}
        loss = row.get(loss_tag)
        row.update(values)
        if loss is not None and not math.isfinite(loss) and loss_tag in values:
            row[loss_tag] = loss
    return [(step, {t: rows[step][t] for t in sorted(rows[step])}) for step in sorted(rows)]


@pytest.mark.parametrize("seed", range(12))
def test_blocks_and_records_merge_as_one_record_at_a_time_would(seed):
    """Records and blocks of every kind, in random reads: steps twice (a
    skipped step's loss, non-finite or not), absent values, tags absent at some
    steps, accumulation, taps' rows; merged as arrays, they give the rows that
    merging one record at a time gives, step by step."""
    from kerasdbg.records import CaptureBlock

    rng = np.random.default_rng(seed)
    rows, _ = _rows()
    takes, handed = [], []
    kinds = {"step": STEP, "gradients": GRADIENTS, "weights": WEIGHTS}
    layouts = {"step": [("step/loss", "step/frozen"), ("step/loss", "step/frozen", "step/fault")],
               "gradients": [("gradients/a/l2_norm", None, "gradients/global_norm"),
                             ("gradients/a/l2_norm", "gradients/a/max", "gradients/b/max")],
               "weights": [("weights/a/l2_norm",), ("weights/a/l2_norm", "weights/a/max")]}
    step = 0
    for read in range(6):
        steps = list(range(step + 1, step + 1 + int(rng.integers(1, 9))))
        step = steps[-1]
        for kind in ("step", "gradients", "weights"):
            tags = layouts[kind][int(rng.integers(2))]
            chosen = [s for s in steps for _ in range(2 if rng.random() < 0.15 else 1)]
            values = rng.normal(size=(len(chosen), len(tags)))
            values[rng.random(values.shape) < 0.1] = np.inf
            skipped = rng.random(len(chosen)) < 0.2
            applied = rng.random(len(chosen)) > 0.1
            records = [CaptureRecord(step=s, skipped=bool(k), values=v, histograms=None,
                                     tags=tags, applied=bool(a))
                       for s, k, v, a in zip(chosen, skipped, values, applied)]
            if rng.random() < 0.2:
                records[0] = records[0]._replace(values=None)
            takes += [(kind, r) for r in records]
            if rng.random() < 0.5:
                rows.take(kinds[kind], records)  # one record a step
            else:
                rows.take(kinds[kind], [CaptureBlock(chosen, values, tags, skipped, applied)
                                        if records[0].values is not None else records[0]] +
                          ([] if records[0].values is not None else
                           [CaptureBlock(chosen[1:], values[1:], tags, skipped[1:],
                                         applied[1:])]))
        if rng.random() < 0.5:
            # The same steps again in another take (a later value wins, a
            # non-finite loss stays).
            again = [CaptureRecord(step=s, skipped=False, values=rng.normal(size=2), histograms=None,
                                   tags=("step/loss", "step/frozen")) for s in steps[:3]]
            for record in again:
                if rng.random() < 0.2:
                    record.values[0] = np.inf
            takes += [("step", r) for r in again]
            rows.take(STEP, again)
        if rng.random() < 0.5:
            tap = {"activations/t/mean": float(rng.normal())}
            rows.add(steps[0], tap)
            takes.append(("tap", CaptureRecord(step=steps[0], skipped=False, histograms=None,
                                               values=list(tap.values()), tags=tuple(tap))))
        handed += list(rows.pop_in_order(final=bool(rng.random() < 0.3)))
    handed += list(rows.pop_in_order())
    want = _reference(takes)
    assert [s for s, _ in handed] == [s for s, _ in want]
    for (step, got), (_, expected) in zip(handed, want):
        assert list(got) == list(expected), step
        np.testing.assert_array_equal(list(got.values()), list(expected.values()))
