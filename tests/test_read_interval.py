"""When the host reads the records (`kerasdbg.capture.reads`), on TensorFlow.

The host reads after a fit's first execution, then once per interval or
before a ring could overflow, and at the epoch's and the fit's end: the
number of reads, buffer reads and event writes per fit is what that says,
not one per step, across the execution matrix; the records are those of a
read after every execution; a verdict decided on the host stops training at
the next read and names its step; the NaN guard freezes the weights at the
faulty step whatever the interval.
"""

import collections

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg import load_run
from kerasdbg import capture as _capture
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.capture import reads as read_clock
from kerasdbg.rules import NonFiniteLoss, Rule, RuleFired
from tests.conftest import make_strategy, matrix
from tests.helpers import BATCH, LEARNING_RATE, make_mlp, reference_training
from tests.read_helpers import BatchEndWork, FiresAt, expected_reads

STEPS = 40
RING = 8
RNG = np.random.default_rng(11)
X = RNG.normal(size=(STEPS * BATCH, 6)).astype("float32")
Y = RNG.normal(size=(STEPS * BATCH, 3)).astype("float32")


@pytest.fixture
def small_ring(monkeypatch):
    """Rings of `RING` steps and an interval longer than any fit here: the
    reads are those the ring's size says."""
    monkeypatch.setattr(read_clock, "RING_STEPS", RING)
    kerasdbg.set_read_interval(1e6)


def _compiled(strategy_name="default", spe=1, jit=False):
    with make_strategy(strategy_name).scope():
        model = make_mlp()
        model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                      jit_compile=jit)
    return model


@pytest.mark.parametrize("strategy_name,spe,jit", matrix())
def test_reads_buffer_reads_and_event_writes_per_fit_follow_the_interval(
        strategy_name, spe, jit, small_ring, monkeypatch, tmp_path):
    from kerasdbg.backends.tensorflow import buffers as _buffers
    from kerasdbg.sinks import events as _events

    transfers = collections.Counter()
    read, read_replicas = _buffers.read, _buffers.read_replicas

    def name(buffer):
        return buffer.name.split(":")[0].split("/")[-1]

    monkeypatch.setattr(_buffers, "read", lambda b: transfers.update([name(b)]) or read(b))
    monkeypatch.setattr(_buffers, "read_replicas", lambda b, *a, **k: transfers.update(
        [name(b)]) or read_replicas(b, *a, **k))
    model = _compiled(strategy_name, spe, jit)
    engine = _capture.engine_for(model)
    bursts = []  # the read each event write belongs to
    def counted(original):
        return lambda self, *a, **k: bursts.append(engine.collector.clock.reads) or \
            original(self, *a, **k)

    for method in ("write", "write_rows", "write_block"):
        monkeypatch.setattr(_events.EventWriter, method,
                            counted(getattr(_events.EventWriter, method)))
    callbacks = [GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path)),
                 StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path), verbose=False)]
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    executions = -(-STEPS // spe)
    # A strategy's sync-on-read ring is one execution tall: read every execution.
    per_read = 1 if strategy_name == "mirrored" else engine.rows // spe
    assert engine.rows == (spe if strategy_name == "mirrored" else spe * -(-RING // spe))
    assert engine.collector.clock.reads == expected_reads(executions, per_read)
    # Every step recorded once, in order, whatever the reads.
    assert callbacks[0].history.step.tolist() == list(range(1, STEPS + 1))
    assert callbacks[1].history.step.tolist() == list(range(1, STEPS + 1))
    run = load_run(str(tmp_path))
    assert run.scalars("step/loss").step.tolist() == list(range(1, STEPS + 1))
    reads = engine.collector.clock.reads
    # The step counter at each read, and at each callback's epoch- and fit-end read
    # (and a few more at the fit's end, which find nothing new); every other
    # buffer at most twice a read (the step rows: for the rules and the guard).
    assert transfers["kerasdbg_calls"] <= reads + 4 * len(callbacks)
    assert max(n for name, n in transfers.items() if name != "kerasdbg_calls") <= 2 * reads
    # The events of a step are written at the read that handed it out.
    assert len(set(bursts)) <= reads + 1


def test_the_records_are_those_of_a_read_after_every_execution(small_ring):
    histories = []
    for interval in (1e6, 0):
        kerasdbg.set_read_interval(interval)
        keras.utils.set_random_seed(3)
        model = _compiled(spe=3)
        callbacks = [GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1),
                     StopOnRule(NonFiniteLoss(), verbose=False)]
        model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        reads = _capture.engine_for(model).collector.clock.reads
        histories.append(([c.history for c in callbacks[:2]], reads))
    (late, late_reads), (prompt, prompt_reads) = histories
    executions = -(-STEPS // 3)
    assert prompt_reads == 2 * executions
    # Epoch 1 reads after its first execution; epoch 2 starts on an empty
    # ring (the epoch's end read it): after every 3 executions, and at its end.
    per_read = (RING // 3 + 1)
    second = executions // per_read + (1 if executions % per_read else 0)
    assert late_reads == expected_reads(executions, per_read) + second
    for a, b in zip(late, prompt):
        assert a.step.tolist() == list(range(1, 2 * STEPS + 1))
        np.testing.assert_array_equal(a.to_numpy(float), b.to_numpy(float))


@pytest.mark.parametrize("action", ["stop", "raise"])
def test_a_host_verdict_stops_at_the_next_read_and_names_its_step(small_ring, action, capsys):
    """FiresAt(5): a rule judged on the host. Read after step 1, then when
    the ring of 8 is full (after step 9): the verdict names step 5, the fit
    stops after step 9 and says so."""
    model = _compiled()
    stop = StopOnRule(FiresAt(5), action=action, verbose=True)
    if action == "raise":
        with pytest.raises(RuleFired) as caught:
            model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[stop])
        said = str(caught.value)
    else:
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
        said = capsys.readouterr().out
    assert [v.step for v in stop.verdicts] == [5]
    assert "FiresAt at step 5: planted" in said
    assert "the host read it after step 9, where training stops (4 steps later)" in said
    assert int(model.optimizer.iterations.numpy()) == 9


def test_a_host_verdict_read_after_every_execution_stops_at_its_step(read_every_execution,
                                                                     capsys):
    model = _compiled()
    stop = StopOnRule(FiresAt(5), verbose=True)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    said = capsys.readouterr().out
    assert "FiresAt at step 5: planted" in said and "later" not in said
    assert int(model.optimizer.iterations.numpy()) == 5


@pytest.mark.parametrize("spe", [1, 4])
def test_a_nan_is_frozen_at_its_step_and_stopped_at_the_next_read(small_ring, spe, capsys):
    """A NaN target at step 6: the in-graph guard keeps the weights of step 5
    (those of plain SGD over batches 1-5, from GradientTape) whatever the
    interval; the fit stops at the read after it."""
    model = _compiled(spe=spe)
    initial = [w.copy() for w in model.get_weights()]
    y = Y.copy()
    y[5 * BATCH] = np.nan
    stop = StopOnRule(NonFiniteLoss(), verbose=True)
    model.fit(X, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    assert stop.verdicts[0].rule == "NonFiniteLoss"
    assert {v.step for v in stop.verdicts} == {6}
    expected = reference_training(initial, 5, x=X, y=y)[-1]["after"]
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    read = spe * (1 + RING // spe) if spe == 1 else 12  # the ring's first overflow
    said = capsys.readouterr().out
    assert f"the host read it after step {read}" in said
    assert "the weights are those the in-graph freeze kept" in said


def test_the_interval_is_set_by_function_or_environment(monkeypatch):
    monkeypatch.delenv(read_clock.ENVIRONMENT, raising=False)
    kerasdbg.set_read_interval(None)
    assert read_clock.interval() == read_clock.DEFAULT_SECONDS == 0.1
    monkeypatch.setenv(read_clock.ENVIRONMENT, "0.5")
    assert read_clock.interval() == 0.5
    kerasdbg.set_read_interval(2)
    assert read_clock.interval() == 2.0  # the function wins
    kerasdbg.set_read_interval(None)
    monkeypatch.setenv(read_clock.ENVIRONMENT, "soon")
    with pytest.raises(ValueError, match="KERASDBG_READ_INTERVAL must be a number of seconds "
                                         ">= 0. Received: 'soon'"):
        read_clock.interval()


@pytest.mark.parametrize("value, error, message", [
    (-1, ValueError, "set_read_interval: `seconds` must be a finite number of seconds >= 0 "
                     r"\(0: after every execution\). Received: seconds=-1"),
    (float("inf"), ValueError, "Received: seconds=inf"),
    ("0.1", TypeError, "set_read_interval: `seconds` must be a number of seconds >= 0 or None. "
                       "Received: seconds='0.1'"),
    (True, TypeError, "Received: seconds=True"),
])
def test_a_bad_interval_is_refused(value, error, message):
    before = read_clock.interval()
    with pytest.raises(error, match=message):
        kerasdbg.set_read_interval(value)
    assert read_clock.interval() == before  # nothing lost


class _EpochLoss(Rule):
    """Fires at the first epoch's end (it reads Keras's epoch logs)."""

    requires = (("epoch", "loss"),)

    def check(self, step, record):
        if "epoch/loss" in record:
            return self.verdict(step, "an epoch ended", {"epoch/loss": record["epoch/loss"]})
        return None


def test_an_epoch_verdict_raises_at_that_epochs_end(small_ring):
    model = _compiled()
    stop = StopOnRule(_EpochLoss(), action="raise", verbose=False)
    with pytest.raises(RuleFired, match="_EpochLoss at step 40: an epoch ended"):
        model.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[stop])
    assert int(model.optimizer.iterations.numpy()) == STEPS  # the second epoch never ran


def test_a_bad_interval_in_the_environment_is_said_at_the_fits_start(monkeypatch):
    monkeypatch.setenv(read_clock.ENVIRONMENT, "soon")
    kerasdbg.set_read_interval(None)  # the environment's, not the suite's
    model = _compiled()
    with pytest.raises(ValueError, match="KERASDBG_READ_INTERVAL must be a number of seconds"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientStatistics()])
    assert int(model.optimizer.iterations.numpy()) <= 1


def test_the_clock_reads_once_the_interval_went_by(monkeypatch):
    """The time-based part of the default (the suite runs with a longer interval:
    tests/conftest.py): after the first read, a read once 0.1 s went by, or
    when the ring would overflow, or at every execution with an interval of 0."""
    now = [100.0]
    monkeypatch.setattr(read_clock.time, "monotonic", lambda: now[0])
    kerasdbg.set_read_interval(None)
    monkeypatch.delenv(read_clock.ENVIRONMENT, raising=False)
    clock = read_clock.ReadClock()
    clock.begin_fit()
    assert clock.due(1, 1, 256)  # the fit's first execution
    clock.read()
    now[0] += 0.05
    assert not clock.due(5, 1, 256)
    assert clock.due(256, 1, 256)  # the next execution would overwrite a row not read
    now[0] += 0.06
    assert clock.due(5, 1, 256)  # 0.11 s went by
    clock.read()
    assert clock.reads == 2 and not clock.due(0, 1, 256)
    assert clock.due(0, 1, 256, every_execution=True)
    kerasdbg.set_read_interval(0)
    assert clock.due(0, 1, 256)


def test_the_first_callback_at_a_batch_decides_for_the_others():
    clock = read_clock.ReadClock()
    clock.begin_fit()
    assert clock.first_at(3) and not clock.first_at(3) and clock.first_at(4)
    assert clock.first_at(None) and clock.first_at(None)  # no batch: always
    clock.final()  # an epoch's end: batch numbers start again
    assert clock.first_at(4)


def test_a_new_interval_holds_from_the_next_batch_end(monkeypatch):
    """The deadline kept since the last read follows `set_read_interval`."""
    now = [50.0]
    monkeypatch.setattr(read_clock.time, "monotonic", lambda: now[0])
    kerasdbg.set_read_interval(10)
    clock = read_clock.ReadClock()
    clock.begin_fit()
    clock.read()
    now[0] += 1
    assert not clock.due(1, 1, 256)
    kerasdbg.set_read_interval(0.5)
    assert clock.due(1, 1, 256)
    kerasdbg.set_read_interval(5)
    assert not clock.due(1, 1, 256)


@pytest.mark.parametrize("spe", [1, 3])
def test_a_batch_end_that_reads_nothing_does_nothing(spe, small_ring, monkeypatch, tmp_path):
    """Between two reads, the batch ends neither pop, judge nor write."""
    work = BatchEndWork(monkeypatch)
    model = _compiled(spe=spe)
    engine = _capture.engine_for(model)
    callbacks = [GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path)),
                 StopOnRule(log_dir=str(tmp_path), verbose=False)]
    model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    executions = -(-STEPS // spe)
    reads = engine.collector.clock.reads
    assert reads < executions  # most batch ends read nothing
    work.check(reads, epochs=2, statistics=2)
    assert callbacks[0].history.step.tolist() == list(range(1, 2 * STEPS + 1))
    assert load_run(str(tmp_path)).scalars("step/loss").step.tolist() == \
        list(range(1, 2 * STEPS + 1))
    assert callbacks[2].verdicts == []


def test_the_environments_interval_is_looked_up_once_after_each_read(monkeypatch):
    """`KERASDBG_READ_INTERVAL` holds from the first batch end after a read;
    a bad value set during a fit is said there, never by a final read."""
    now = [10.0]
    monkeypatch.setattr(read_clock.time, "monotonic", lambda: now[0])
    kerasdbg.set_read_interval(None)
    monkeypatch.setenv(read_clock.ENVIRONMENT, "10")
    clock = read_clock.ReadClock()
    clock.begin_fit()
    clock.read()
    now[0] += 1
    assert not clock.due(1, 1, 256)  # the deadline: 10 s after the read
    monkeypatch.setenv(read_clock.ENVIRONMENT, "0.5")
    assert not clock.due(1, 1, 256)  # until the next read
    clock.read()
    now[0] += 1
    assert clock.due(1, 1, 256)
    monkeypatch.setenv(read_clock.ENVIRONMENT, "soon")
    clock.read()  # a read (a final one too) does not look it up
    with pytest.raises(ValueError, match=read_clock.ENVIRONMENT):
        clock.due(1, 1, 256)
