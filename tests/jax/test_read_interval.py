"""When the host reads the records (`kerasdbg.capture.reads`), on JAX.

After a fit's first execution, then once per interval or before the steps
kept on the device exceed a ring, and at the epoch's and the fit's end: the
reads (device-to-host transfers) per fit are what that says, not one per
step, with spe 1 and 4, jit on and off, with and without DataParallel; the
records equal those of a read after every execution; a verdict decided on
the host stops training at the next read and names its step; the NaN guard
keeps the weights of the step before the fault whatever the interval.
"""

import jax
import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg import capture as _capture
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.capture import reads as read_clock
from kerasdbg.rules import NonFiniteLoss, RuleFired
from tests.read_helpers import BatchEndWork, FiresAt, expected_reads

BATCH, STEPS, RING = 16, 40, 8
RNG = np.random.default_rng(13)
X = RNG.normal(size=(BATCH * STEPS, 6)).astype("float32")
Y = (X[:, :3].sum(1, keepdims=True) + 0.1 * RNG.normal(size=(BATCH * STEPS, 1))).astype("float32")
MATRIX = [pytest.param(spe, jit, parallel,
                       id=f"{'data_parallel' if parallel else 'default'}-spe{spe}-"
                          f"{'jit' if jit else 'nojit'}")
          for parallel in (False, True) for spe in (1, 4) for jit in (True, False)]


@pytest.fixture
def small_ring(monkeypatch):
    monkeypatch.setattr(read_clock, "RING_STEPS", RING)
    kerasdbg.set_read_interval(1e6)


def make_model(spe=1, jit=True):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)], name="m")
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def fit(model, callbacks, x=X, y=Y, epochs=1):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))


@pytest.mark.parametrize("spe, jit, parallel", MATRIX)
def test_reads_per_fit_follow_the_interval(spe, jit, parallel, small_ring, tmp_path):
    if parallel:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices("cpu")))
    try:
        model = make_model(spe, jit)
        callbacks = [GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path)),
                     StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path), verbose=False)]
        fit(model, callbacks)
    finally:
        keras.distribution.set_distribution(None)
    engine = _capture.engine_for(model)
    executions = -(-STEPS // spe)
    per_read = read_clock.ring_rows(spe) // spe
    assert engine.clock.reads == engine.transfers == expected_reads(executions, per_read)
    assert callbacks[0].history.step.tolist() == list(range(1, STEPS + 1))
    assert callbacks[1].history.step.tolist() == list(range(1, STEPS + 1))
    assert kerasdbg.load_run(str(tmp_path)).scalars("step/loss").step.tolist() == \
        list(range(1, STEPS + 1))


@pytest.mark.parametrize("spe", [1, 3])
def test_the_records_are_those_of_a_read_after_every_execution(spe, small_ring):
    histories = []
    for interval in (1e6, 0):
        kerasdbg.set_read_interval(interval)
        model = make_model(spe)
        callbacks = [GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1),
                     StopOnRule(NonFiniteLoss(), verbose=False)]
        fit(model, callbacks)
        histories.append(([c.history for c in callbacks[:2]], _capture.engine_for(model)))
    (late, late_engine), (prompt, prompt_engine) = histories
    assert prompt_engine.clock.reads == -(-STEPS // spe)
    assert late_engine.clock.reads < prompt_engine.clock.reads
    for a, b in zip(late, prompt):
        assert a.step.tolist() == list(range(1, STEPS + 1))
        np.testing.assert_array_equal(a.to_numpy(float), b.to_numpy(float))


@pytest.mark.parametrize("action", ["stop", "raise"])
def test_a_host_verdict_stops_at_the_next_read_and_names_its_step(small_ring, action, capsys):
    model = make_model()
    stop = StopOnRule(FiresAt(5), action=action, verbose=True)
    if action == "raise":
        with pytest.raises(RuleFired) as caught:
            fit(model, [stop])
        said = str(caught.value)
    else:
        fit(model, [stop])
        said = capsys.readouterr().out
    assert [v.step for v in stop.verdicts] == [5]
    assert "FiresAt at step 5: planted" in said
    assert "the host read it after step 9, where training stops (4 steps later)" in said
    assert int(model.optimizer.iterations.numpy()) == 9


@pytest.mark.parametrize("spe, jit", [(1, True), (4, True), (1, False)])
def test_a_nan_keeps_the_weights_before_it_and_stops_at_the_next_read(small_ring, spe, jit):
    bad = 6
    y = Y.copy()
    y[(bad - 1) * BATCH] = np.nan
    before = make_model(spe, jit)
    fit(before, [], x=X[:(bad - 1) * BATCH], y=Y[:(bad - 1) * BATCH])
    model = make_model(spe, jit)
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    fit(model, [stop], y=y)
    assert stop.verdicts[0].rule == "NonFiniteLoss"
    assert {v.step for v in stop.verdicts} == {bad}
    for a, b in zip(before.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_the_callbacks_keep_keras_calling_batch_ends_on_its_worker_thread(monkeypatch):
    """Keras's JAX loop calls the batch ends on a worker thread only when every
    callback is `async_safe`: kerasdbg's are, they read at the next batch's
    begin, on the fit's thread, and never sync Keras's state per step."""
    import threading

    from keras.src.callbacks.callback_list import CallbackList

    from kerasdbg.callbacks import ActivationStatistics

    model = make_model()
    callbacks = [GradientStatistics(), WeightStatistics(), StopOnRule(NonFiniteLoss()),
                 ActivationStatistics()]
    assert CallbackList(callbacks, model=model)._async_train
    threads, syncs = set(), []
    collect = type(_capture.engine_for(model)).collect
    monkeypatch.setattr(type(_capture.engine_for(model)), "collect",
                        lambda self, *a, **k: threads.add(threading.get_ident()) or
                        collect(self, *a, **k))
    sync = model.jax_state_sync
    monkeypatch.setattr(model, "jax_state_sync", lambda: syncs.append(1) or sync())
    with pytest.warns(RuntimeWarning, match="no TapLayer"):
        fit(model, callbacks[:3] + [callbacks[3]], epochs=2)
    assert threads == {threading.get_ident()}
    assert len(syncs) <= 2 * 2 + 2  # Keras's own, per epoch and at the end, not per step
    assert callbacks[0].history.step.tolist() == list(range(1, 2 * STEPS + 1))


def test_the_batches_kept_for_nan_location_are_bounded(monkeypatch, small_ring):
    """StopOnRule's default rules locate a first NaN on the step's batch, kept
    (a reference) until its step is read: past `LOCATE_BYTES` of them the
    host reads, so more often than the ring alone would (every 8 steps)."""
    from kerasdbg.backends.jax import engine as jax_engine

    batch_bytes = BATCH * (6 + 1) * 4
    monkeypatch.setattr(jax_engine, "LOCATE_BYTES", 3 * batch_bytes)
    model = make_model()
    stop = StopOnRule(verbose=False)
    fit(model, [stop])
    engine = _capture.engine_for(model)
    assert engine.clock.reads >= STEPS // 4 > expected_reads(STEPS, RING)
    assert stop.verdicts == []


@pytest.mark.parametrize("spe", [1, 3])
def test_a_batch_begin_that_reads_nothing_does_nothing(spe, small_ring, monkeypatch, tmp_path):
    """Between two reads (at the batch begins, on JAX), the callbacks neither
    pop, judge nor write."""
    work = BatchEndWork(monkeypatch)
    model = make_model(spe)
    callbacks = [GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path)),
                 StopOnRule(log_dir=str(tmp_path), verbose=False)]
    fit(model, callbacks, epochs=2)
    executions = -(-STEPS // spe)
    reads = _capture.engine_for(model).clock.reads
    assert reads < executions  # most batch begins read nothing
    work.check(reads, epochs=2, statistics=2)
    assert callbacks[0].history.step.tolist() == list(range(1, 2 * STEPS + 1))
    assert kerasdbg.load_run(str(tmp_path)).scalars("step/loss").step.tolist() == \
        list(range(1, 2 * STEPS + 1))
    assert callbacks[2].verdicts == []
