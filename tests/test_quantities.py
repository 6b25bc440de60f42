"""Quantities, not requests: each statistic of each tensor computed once per
step whatever the number of consumers, one weight copy for update ratios,
no buffer write at an idle histogram step, and the default schedule."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg import capture as _capture
from kerasdbg.backends.tensorflow import graph_functions
from kerasdbg.backends.tensorflow import quantities
from kerasdbg import schedule as schedule_lib
from kerasdbg import stats as stats_lib
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.rules import (AllZero, ExplodingTensor, NonFiniteLoss, UnchangedTensor,
                            VanishingGradient, WeightUpdateRatio)
from kerasdbg.schedule import Schedule
from tests.conftest import make_strategy, matrix, only_upstream_failure
from tests.helpers import traced_functions

BATCH, STEPS = 4, 12
RNG = np.random.default_rng(3)
X = RNG.normal(size=(BATCH * STEPS, 5)).astype("float32")
Y = RNG.normal(size=(BATCH * STEPS, 2)).astype("float32")


def _model(strategy_name="default", spe=1, jit=False):
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="a"),
                                  keras.layers.Dense(2, name="b")], name="m")
        model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe,
                      jit_compile=jit)
    return model


def _fit(model, callbacks, steps=STEPS):
    model.fit(X[:steps * BATCH], Y[:steps * BATCH], batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0, callbacks=callbacks)


class _Counting:
    """Wraps `statistics_table` and `write_row` as the engine calls them,
    adding in-graph counters next to each call, so that what the compiled
    train step *ran* is counted (a call in an untaken `tf.cond` branch counts
    nothing): per statistic, the (tensor, statistic) computations; per
    buffer name, the rows written. The shared graph functions start afresh
    and are put back afterwards, so that every trace sees the wrapper (and
    no later test a function holding its counters)."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(graph_functions, "_FUNCTIONS", type(graph_functions._FUNCTIONS)())
        self.computed = collections.defaultdict(lambda: tf.Variable(0, dtype=tf.int64))
        self.written = collections.defaultdict(lambda: tf.Variable(0, dtype=tf.int64))
        original_stats, original_write = graph_functions.statistics_table, _buffers.write_row
        for name in stats_lib.ALL_STATISTICS:
            self.computed[name]  # created eagerly, outside the trace
        for name in ("gradients", "weights", "gradients_hist", "weights_hist"):
            self.written[name]

        def statistics_table(tensors, stats):
            for name in stats:
                self.computed[name].assign_add(len(tensors))
            return original_stats(tensors, stats)

        def write_row(buffer, row, value):
            name = buffer.name.split(":")[0].split("/")[-1]
            for key in ("gradients_hist", "weights_hist", "gradients", "weights"):
                if name.startswith(f"kerasdbg_{key}") and "_ids" not in name \
                        and "_ranges" not in name:
                    self.written[key].assign_add(1)
                    break
            return original_write(buffer, row, value)

        monkeypatch.setattr(graph_functions, "statistics_table", statistics_table)
        monkeypatch.setattr(quantities._buffers, "write_row", write_row)

    def counts(self):
        return ({k: int(v.numpy()) for k, v in self.computed.items()},
                {k: int(v.numpy()) for k, v in self.written.items()})


def _graph_ops(model):
    """Op types of the compiled train function, cond branches included."""
    found = traced_functions(model)
    ops = collections.Counter()
    for function in found:
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            ops.update(node.op for node in graph.node)
            for library in graph.library.function:
                ops.update(node.op for node in library.node_def)
    return ops


class _GraphOps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.ops = _graph_ops(self.model)


# ------------------------------------------------------ computed once
def test_two_consumers_of_a_statistic_compute_it_once_per_step(monkeypatch):
    """GradientStatistics and StopOnRule on the default schedule, every step
    of a 12-step fit: each (gradient, statistic) is computed once per step it
    is recorded at, as with either consumer alone."""
    variables = 4
    runs = {}
    for name, callbacks in [
        ("statistics", lambda: [GradientStatistics()]),
        ("rules", lambda: [StopOnRule([ExplodingTensor(), VanishingGradient()],
                                      verbose=False)]),
        ("both", lambda: [GradientStatistics(), StopOnRule(
            [ExplodingTensor(), VanishingGradient()], verbose=False)]),
    ]:
        counting = _Counting(monkeypatch)
        _fit(_model(), callbacks())
        runs[name] = counting.counts()[0]
        monkeypatch.undo()
    scheduled = sum(Schedule(50, first_steps=10).at(s) for s in range(1, STEPS + 1))
    assert scheduled == 10
    # The every-step statistics: once per step; the others: at the scheduled steps.
    # (VanishingGradient also reads the weights' update ratio: two norms per variable,
    # the update's and the weights' before it, at the scheduled steps.)
    assert runs["both"]["l2_norm"] == variables * STEPS + 2 * variables * scheduled
    assert runs["both"]["nan_count"] == variables * STEPS
    assert runs["both"]["mean_abs"] == variables * scheduled
    assert runs["both"]["std"] == variables * scheduled
    for statistic in stats_lib.STATISTICS:
        assert runs["both"][statistic] == max(runs["statistics"][statistic],
                                              runs["rules"][statistic]), statistic


def test_two_callbacks_asking_for_the_same_statistics_build_one_set_of_reductions():
    ops = {}
    for name, callbacks in [
        ("one", lambda: [GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1)]),
        ("two", lambda: [GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1),
                         GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1),
                         StopOnRule([AllZero(collections=["gradients", "weights"]),
                                     UnchangedTensor(collections=["weights"])], every_n_steps=1,
                                    freeze_on_fault=False, locate_nan=False, verbose=False)]),
    ]:
        grab = _GraphOps()
        _fit(_model(), callbacks() + [grab], steps=2)
        ops[name] = grab.ops
    # Sum of squares, min, max, |x| sums: one per tensor, whatever the consumers.
    for op in ("L2Loss", "Min", "Max", "Abs"):
        assert ops["two"][op] == ops["one"][op], (op, ops["one"][op], ops["two"][op])


def test_statistics_on_different_schedules_share_the_steps_where_both_record(monkeypatch):
    counting = _Counting(monkeypatch)
    every_third = GradientStatistics(every_n_steps=3, stats=["l2_norm", "mean", "max"])
    every_second = GradientStatistics(every_n_steps=2, stats=["l2_norm", "max"])
    _fit(_model(), [every_third, every_second])
    computed, _ = counting.counts()
    steps = range(1, STEPS + 1)
    either = sum(s % 3 == 0 or s % 2 == 0 for s in steps)
    assert computed["l2_norm"] == 4 * either
    assert computed["max"] == 4 * either
    # "mean" is computed at the steps of the larger set (every third), and may be
    # at most at the others, never twice.
    assert 4 * sum(s % 3 == 0 for s in steps) <= computed["mean"] <= 4 * either
    assert every_third.history["step"].tolist() == [3, 6, 9, 12]
    assert every_second.history["step"].tolist() == [2, 4, 6, 8, 10, 12]


# ------------------------------------------------------ one weight copy
def test_two_update_ratio_consumers_keep_one_copy_of_the_weights():
    model = _model()
    weights = WeightStatistics(stats=["update_ratio"], every_n_steps=1)
    stop = StopOnRule([WeightUpdateRatio()], every_n_steps=1, verbose=False)
    seen = {}

    class Copies(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            engine = _capture.engine_for(self.model)
            # Elements held in copies (flat buffers, the small weights of one
            # dtype in one), per optimizer.
            seen["previous"] = [sum(int(np.prod(c.shape)) for copies in h.previous.values()
                                    for c in copies) for h in engine.hooks.values()]
            seen["initial"] = [len(h.initial) for h in engine.hooks.values()]

    _fit(model, [weights, stop, Copies()], steps=3)
    elements = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert seen == {"previous": [elements], "initial": [0]}
    # Both read the same ratio, and it is right: ||w_t - w_{t-1}|| / ||w_{t-1}||.
    ratios = weights.history["m/a/kernel/update_ratio"].to_numpy()
    assert np.all(np.isfinite(ratios)) and np.all(ratios > 0)


def test_the_update_ratio_of_a_scheduled_step_describes_that_step_update():
    """Recorded every 4th step, the ratio at step 4 is ||w4 - w3|| / ||w3||
    (weights read by the test after each batch): the copy is taken at the
    recorded step, before its update, not kept from an earlier step."""
    model = _model()
    weights = WeightStatistics(stats=["l2_norm", "update_ratio"], every_n_steps=4)
    kernels = []

    class Kernels(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            kernels.append(self.model.get_layer("a").kernel.numpy())

        def on_train_batch_end(self, batch, logs=None):
            kernels.append(self.model.get_layer("a").kernel.numpy())

    _fit(model, [weights, Kernels()], steps=8)
    history = weights.history
    assert history["step"].tolist() == [4, 8]
    for step, ratio in zip(history["step"], history["m/a/kernel/update_ratio"]):
        before, after = kernels[step - 1], kernels[step]
        expected = np.linalg.norm(after - before) / np.linalg.norm(before)
        np.testing.assert_allclose(ratio, expected, rtol=1e-4)


# ------------------------------------------------------ idle histograms
@pytest.mark.parametrize("spe", [1, 4])
def test_an_idle_histogram_step_writes_no_buffer(monkeypatch, spe):
    counting = _Counting(monkeypatch)
    grads = GradientStatistics(every_n_steps=1, histogram_every_n_steps=5)
    _fit(_model(spe=spe), [grads])
    _, written = counting.counts()
    # One histogram row per histogram step (5, 10), one value row per step.
    assert written["gradients_hist"] == 2
    assert written["gradients"] == STEPS
    channel = _capture.engine_for(grads.model).channels[0]
    assert channel.slots == {}  # detached after the fit


# ------------------------------------------------------ the schedule
@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_the_default_schedule_records_norms_every_step_and_the_rest_on_schedule(
        strategy_name, spe, jit):
    model = _model(strategy_name, spe, jit)
    default = GradientStatistics(first_steps=3)
    every = GradientStatistics(every_n_steps=1)
    steps = 12
    with only_upstream_failure(strategy_name, jit):
        model.fit(X[:steps * BATCH], Y[:steps * BATCH], batch_size=BATCH, epochs=1,
                  shuffle=False, verbose=0, callbacks=[default, every],)
    scheduled = Schedule(50, first_steps=3)
    got, want = default.history, every.history
    assert got["step"].tolist() == list(range(1, steps + 1))
    for column in want.columns:
        if column in ("step", "skipped"):
            continue
        statistic = column.rsplit("/", 1)[-1]
        for row, step in enumerate(got["step"]):
            value, expected = got[column][row], want[column][row]
            if column == "global_norm" or statistic in schedule_lib.EVERY_STEP_STATISTICS \
                    or scheduled.at(step):
                np.testing.assert_allclose(value, expected, rtol=1e-6, err_msg=column)
            else:
                assert np.isnan(value), (column, step)  # not recorded: absent


def test_the_default_schedule_writes_no_tag_for_what_it_did_not_record(tmp_path):
    from kerasdbg.reader import load_run

    _fit(_model(), [GradientStatistics(str(tmp_path), first_steps=2)], steps=4)
    frame = load_run(str(tmp_path)).scalars(".*")
    means = frame[frame.tag == "gradients/m/a/kernel/mean"]
    norms = frame[frame.tag == "gradients/m/a/kernel/l2_norm"]
    assert means.step.tolist() == [1, 2]
    assert norms.step.tolist() == [1, 2, 3, 4]
    assert np.all(np.isfinite(frame.value))


def test_a_schedule_is_said_in_words_and_bad_arguments_are_refused():
    assert Schedule(50, first_steps=10).describe() == "steps 1-10 and every 50th step"
    assert Schedule(1).describe() == "every step"
    assert Schedule(5, last_step=20).describe() == "every 5th step up to step 20"
    assert schedule_lib.DEFAULT == Schedule(50, 10)
    with pytest.raises(ValueError, match="every_n_steps.*Received: every_n_steps=0"):
        GradientStatistics(every_n_steps=0)
    with pytest.raises(ValueError, match="first_steps.*Received: first_steps=-1"):
        WeightStatistics(first_steps=-1)
    with pytest.raises(TypeError, match="first_steps"):
        StopOnRule(first_steps="10")
    config = GradientStatistics(first_steps=4).get_config()
    assert config["every_n_steps"] is None and config["first_steps"] == 4
    assert GradientStatistics(**config).schedule == Schedule(50, 4)
    assert StopOnRule(every_n_steps=1).schedule == Schedule(1, 0)
