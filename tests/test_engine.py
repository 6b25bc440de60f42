"""The capture engine across the execution matrix, and its life cycle."""

import collections
import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg import load_run
from kerasdbg import capture as _capture
from kerasdbg.backends.tensorflow import graph_functions
from kerasdbg import stats as stats_lib
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.rules import NonFiniteLoss
from tests.conftest import (
    assert_stats_close, make_strategy, matrix, only_upstream_failure, reference_stats,
)
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

EPOCHS = 2
STEPS = EPOCHS * len(X) // BATCH  # 20; with spe=4 each epoch runs 4 + 4 + 2


def _compile(model, spe=1, jit=False):
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                  jit_compile=jit)


def _row(history, step):
    rows = history[history.step == step]
    assert len(rows) == 1, f"step {step} recorded {len(rows)} times"
    return rows.iloc[0]


def check_against_reference(grads_cb, weights_cb, model, reference, steps):
    paths = [v.path for v in model.trainable_variables]
    initial = reference[0]["before"]
    for step in steps:
        ref = reference[step - 1]
        g_row, w_row = _row(grads_cb.history, step), _row(weights_cb.history, step)
        for i, path in enumerate(paths):
            grad = ref["grads"][i]
            got = {s: g_row[f"{path}/{s}"] for s in stats_lib.STATISTICS}
            assert_stats_close(got, reference_stats(grad), np.abs(grad).max(), f"step {step} grad {path}")
            after, before = ref["after"][i], ref["before"][i]
            expected = reference_stats(after)
            with np.errstate(divide="ignore"):
                expected["update_ratio"] = np.linalg.norm(after - before) / np.linalg.norm(before)
            expected["distance_from_start"] = np.linalg.norm(after - initial[i])
            got = {s: w_row[f"{path}/{s}"] for s in expected}
            assert_stats_close(got, expected, np.abs(after).max(), f"step {step} weight {path}")
        global_norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in ref["grads"]))
        np.testing.assert_allclose(g_row["global_norm"], global_norm, rtol=1e-5)


@pytest.mark.parametrize("strategy_name,spe,jit", matrix())
def test_matrix_records_every_step_with_reference_values(strategy_name, spe, jit):
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = make_mlp()
        _compile(model, spe, jit)
    initial = [v.numpy() for v in model.trainable_variables]
    grads_cb = GradientStatistics(every_n_steps=1, histogram_every_n_steps=5, histogram_bins=6)
    weights_cb = WeightStatistics(every_n_steps=1)
    with only_upstream_failure(strategy_name, jit):
        model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[grads_cb, weights_cb])
    assert grads_cb.history.step.tolist() == list(range(1, STEPS + 1))
    assert weights_cb.history.step.tolist() == list(range(1, STEPS + 1))
    assert not grads_cb.history.skipped.any()
    reference = reference_training(initial, STEPS)
    check_against_reference(grads_cb, weights_cb, model, reference, range(1, STEPS + 1))
    # The hooks are gone after fit.
    assert "apply" not in vars(model.optimizer)


@pytest.mark.parametrize("strategy_name,spe,jit", [
    pytest.param("default", 4, True, id="default-spe4-jit"),
    pytest.param("mirrored", 1, False, id="mirrored-spe1-nojit"),
])
def test_quantiles_of_gradients_and_weights_match_numpy(strategy_name, spe, jit):
    with make_strategy(strategy_name).scope():
        model = make_mlp()
        _compile(model, spe, jit)
    initial = [v.numpy() for v in model.trainable_variables]
    quantiles = list(stats_lib.QUANTILES)
    grads_cb = GradientStatistics(stats=quantiles)
    weights_cb = WeightStatistics(stats=quantiles)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[grads_cb, weights_cb])
    steps = len(X) // BATCH
    reference = reference_training(initial, steps)
    for step in range(1, steps + 1):
        g_row, w_row = _row(grads_cb.history, step), _row(weights_cb.history, step)
        for i, variable in enumerate(model.trainable_variables):
            for row, tensor in ((g_row, reference[step - 1]["grads"][i]),
                                (w_row, reference[step - 1]["after"][i])):
                got = [row[f"{variable.path}/{q}"] for q in quantiles]
                np.testing.assert_allclose(got, np.percentile(tensor, [5, 50, 95]), rtol=1e-4,
                                           atol=1e-6 * np.abs(tensor).max(),
                                           err_msg=f"step {step} {variable.path}")


def test_histograms_recorded_at_their_steps_match_numpy(tmp_path):
    from kerasdbg import load_run

    model = make_mlp()
    _compile(model, spe=4)
    initial = [v.numpy() for v in model.trainable_variables]
    grads_cb = GradientStatistics(str(tmp_path), every_n_steps=3, histogram_every_n_steps=5,
                                  histogram_bins=6)
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[grads_cb])
    assert grads_cb.history.step.tolist() == [3, 6, 9, 12, 15, 18]
    reference = reference_training(initial, STEPS)
    run = load_run(str(tmp_path))
    path = model.trainable_variables[0].path
    frame = run.histograms(f"gradients/{path}")
    assert frame.step.tolist() == [5, 10, 15, 20]
    for _, row in frame.iterrows():
        grad = reference[row.step - 1]["grads"][0].astype(np.float64)
        want, edges = np.histogram(grad, bins=6, range=(grad.min(), grad.max()))
        np.testing.assert_allclose(row.edges, edges, rtol=1e-5, atol=1e-7)
        assert row.counts.sum() == want.sum()
        assert np.abs(row.counts - want).sum() <= 2  # float32 vs float64 bin edges


@pytest.mark.xfail(strict=True, raises=tf.errors.InvalidArgumentError,
                   reason="Keras: MirroredStrategy + steps_per_execution>1 with the default "
                          "collective all-reduce: 'You must feed a value for placeholder tensor "
                          "'.../while/cond/Placeholder' with dtype int32' (keras-team/keras#19246; "
                          "tests/test_keras_limitations.py shows it on plain Keras)")
def test_mirrored_collective_with_steps_per_execution_fails_in_keras():
    strategy = make_strategy("mirrored", collective=True)
    with strategy.scope():
        model = make_mlp()
        _compile(model, spe=4)
    with only_upstream_failure("mirrored", jit=False, collective=True):
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientStatistics()])


def test_steps_continue_across_fits_and_plain_fit_afterwards_is_uninstrumented():
    model = make_mlp()
    _compile(model, spe=4)
    initial = [v.numpy() for v in model.trainable_variables]
    grads_cb, weights_cb = GradientStatistics(), WeightStatistics(stats=["l2_norm", "mean"])
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[grads_cb, weights_cb])
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[grads_cb, weights_cb])
    # One instance across fits: its per-run history restarts, steps continue.
    assert grads_cb.history.step.tolist() == list(range(11, 21))
    reference = reference_training(initial, 20)
    row = _row(grads_cb.history, 15)
    path = model.trainable_variables[2].path
    np.testing.assert_allclose(row[f"{path}/l2_norm"],
                               np.linalg.norm(reference[14]["grads"][2]), rtol=1e-5)
    engine = _capture.engine_for(model)
    traces = engine.trace_count
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert engine.trace_count == traces
    assert not engine.installed and "apply" not in vars(model.optimizer)
    # ... and the plain fit trained correctly: weights equal the reference after 30 steps.
    reference = reference_training(initial, 30)
    for v, want in zip(model.trainable_variables, reference[-1]["after"]):
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-5, atol=1e-6)


def test_several_callbacks_share_one_hook_and_one_retrace(monkeypatch):
    model = make_mlp()
    _compile(model)
    calls = []
    original = model.make_train_function

    def counting(force=False):
        calls.append(force)
        return original(force=force)

    monkeypatch.setattr(model, "make_train_function", counting)
    callbacks = [GradientStatistics(), WeightStatistics(), GradientStatistics(include="hidden")]
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks)
    # Keras's own call, then one forced make of the instrumented function; at
    # the end Keras's own function is put back, not made again.
    assert calls.count(True) == 1
    assert _capture.engine_for(model).trace_count == 1
    assert all(len(cb.history) == 10 for cb in callbacks)


def test_fit_that_crashed_is_recovered_by_the_next_fit():
    model = make_mlp()
    _compile(model)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("boom")

    grads_cb = GradientStatistics()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[grads_cb, Boom()])
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[grads_cb])
    assert grads_cb.history.step.tolist() == list(range(4, 14))
    assert not _capture.engine_for(model).installed


def test_every_n_steps_records_only_those_steps():
    model = make_mlp()
    _compile(model, spe=4)
    grads_cb = GradientStatistics(every_n_steps=3)
    weights_cb = WeightStatistics(every_n_steps=4)
    model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[grads_cb, weights_cb])
    assert grads_cb.history.step.tolist() == [3, 6, 9, 12, 15, 18]
    assert weights_cb.history.step.tolist() == [4, 8, 12, 16, 20]


@pytest.mark.parametrize("interval", [None, 0], ids=["interval", "every-execution"])
def test_the_host_reads_only_buffers_that_the_steps_wrote(monkeypatch, tmp_path, interval):
    """With the statistics callbacks alone and a ring of 32 steps, the host
    reads after the first execution and at the epoch's end (a read once per
    interval, here longer than the fit); with an interval of 0, after every
    execution. Either way a buffer no step wrote is not read, and between
    two reads the host reads nothing, not even the step counter."""
    from kerasdbg.backends.tensorflow import buffers as _buffers
    from kerasdbg.capture import reads as read_clock
    monkeypatch.setattr(read_clock, "RING_STEPS", 32)
    read_clock.set_read_interval(1e6 if interval is None else interval)
    reads = []
    read = _buffers.read
    monkeypatch.setattr(_buffers, "read", lambda b: reads.append(b.name.split(":")[0]) or read(b))
    model = make_mlp()
    _compile(model)
    grads_cb = GradientStatistics(str(tmp_path), every_n_steps=2, histogram_every_n_steps=4)
    weights_cb = WeightStatistics(str(tmp_path), every_n_steps=4)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[grads_cb, weights_cb])  # 10 executions of one step
    assert grads_cb.history.step.tolist() == [2, 4, 6, 8, 10]
    assert weights_cb.history.step.tolist() == [4, 8]
    hist = sorted(load_run(str(tmp_path)).histograms("gradients/" + model.trainable_variables[0].path).step.unique())
    assert hist == [4, 8]
    counts = collections.Counter(reads)
    if interval == 0:
        assert counts["kerasdbg_gradients"] == 5  # ids in column 0: one read
        assert counts["kerasdbg_weights"] == 2
        assert counts["kerasdbg_gradients_hist_ids"] == counts["kerasdbg_gradients_hist"] == 2
        # The step counter once per batch end (the second callback reads nothing
        # more) and at the epoch and train ends.
        assert counts["kerasdbg_meta"] == 10
        # The step counter once per batch end, whatever the number of callbacks,
        # and once per callback at the epoch's and the fit's end.
        assert counts["kerasdbg_calls"] == 10 + 2 * 2
    else:
        # Step 1 (nothing written) after the first execution, steps 2-10 at the end.
        assert counts["kerasdbg_meta"] == 2
        assert counts["kerasdbg_gradients"] == counts["kerasdbg_weights"] == 1
        assert counts["kerasdbg_gradients_hist_ids"] == counts["kerasdbg_gradients_hist"] == 1
        # The step counter after the first execution, then only at the
        # epoch's and the fit's end (once per callback): no read in between.
        assert counts["kerasdbg_calls"] == 1 + 2 * 2


@pytest.mark.parametrize("strategy_name, rows", [("default", 258), ("one_device", 258), ("mirrored", 3)])
def test_deferred_reads_keep_tall_buffers_only_where_a_row_write_is_in_place(strategy_name, rows):
    # A strategy's sync-on-read buffer is copied whole at each row write: there
    # the buffers stay one execution tall and the host reads each execution.
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = make_mlp()
        _compile(model, spe=3)
    grads_cb = GradientStatistics(every_n_steps=1)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[grads_cb])
    assert _capture.engine_for(model).rows == rows
    assert grads_cb.history.step.tolist() == list(range(1, len(X) // BATCH + 1))


@pytest.mark.parametrize("spe", [1, 3])
def test_deferred_reads_hand_out_every_step_also_after_a_crash(spe, monkeypatch):
    """70 steps with the statistics callbacks (and a StopOnRule whose rule
    never fires), rings of 32 steps (33 at spe 3), read once per interval
    (longer than the fit): every step reaches the history once, in order,
    with the values a second fit of the same model, read after every
    execution, records; a fit that raises at step 40 hands out the steps it ran."""
    x = np.random.default_rng(5).normal(size=(70 * BATCH, X.shape[1])).astype("float32")
    y = np.random.default_rng(6).normal(size=(70 * BATCH, Y.shape[1])).astype("float32")
    histories = []
    from kerasdbg.capture import reads as read_clock
    monkeypatch.setattr(read_clock, "RING_STEPS", 32)
    for deferred in (True, False):
        read_clock.set_read_interval(1e6 if deferred else 0)
        model = make_mlp()
        _compile(model, spe=spe)
        callbacks = [GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1),
                     StopOnRule(NonFiniteLoss(), verbose=False)]
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        rows = _capture.engine_for(model).rows
        assert rows == spe * -(-32 // spe)
        reads = _capture.engine_for(model).collector.clock.reads
        executions = -(-70 // spe)
        # Every execution, or after the first and whenever the ring is full, and at the end.
        assert reads == (executions if not deferred else 2 + (executions - 1) // (32 // spe))
        assert callbacks[0].history.step.tolist() == list(range(1, 71))
        assert callbacks[1].history.step.tolist() == list(range(1, 71))
        histories.append([c.history for c in callbacks[:2]])
    for deferred, prompt in zip(*histories):  # two models: their paths differ
        assert deferred.shape == prompt.shape
        np.testing.assert_allclose(deferred.to_numpy(float), prompt.to_numpy(float), rtol=1e-6)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch >= 39:  # at spe > 1 Keras numbers the batch ends spe-1, 2spe-1, ...
                raise RuntimeError("boom")

    model = make_mlp()
    _compile(model, spe=spe)
    grads_cb = GradientStatistics(every_n_steps=1)
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[grads_cb, Boom()])
    ran = -(-40 // spe) * spe
    assert grads_cb.history.step.tolist() == list(range(1, ran + 1))


def test_instrumentation_failure_warns_and_training_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    # The statistics' graph functions start afresh, so that the trace sees the failure.
    monkeypatch.setattr(graph_functions, "_FUNCTIONS", type(graph_functions._FUNCTIONS)())
    monkeypatch.setattr(stats_lib, "fast_statistics", broken)
    model = make_mlp()
    _compile(model)
    grads_cb = GradientStatistics()
    with pytest.warns(RuntimeWarning, match="injected failure"):
        history = model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[grads_cb])
    assert len(history.history["loss"]) == 1 and len(grads_cb.history) == 0
    strict = GradientStatistics(strict=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[strict])


def _train_graphs_alive() -> int:
    from tensorflow.python.framework import func_graph
    gc.collect()
    return sum(isinstance(o, func_graph.FuncGraph) for o in gc.get_objects())


@pytest.mark.parametrize("nan_guard", [False, True], ids=["statistics", "with-nan-guard"])
def test_repeated_fits_keep_no_traced_step_alive(tmp_path, nan_guard):
    # Keras's gradient reduction calls `ReplicaContext.all_reduce`, whose graph-mode
    # custom gradient keeps each traced train step alive for good (TensorFlow issue
    # #97697). With one replica the engine skips that identity reduction, so fits
    # that retrace (a notebook or a hyper-parameter loop) do not pile up graphs that
    # hold kerasdbg's ops. The NaN guard's replay, kept on the model across fits,
    # must not hold the graph of the fit that traced it either.
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    alive = []
    for fit in range(4):
        model.make_train_function(force=True)
        guard = [StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path / f"guard{fit}"))] if nan_guard else []
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=guard + [
            GradientStatistics(str(tmp_path / str(fit)), every_n_steps=1),
            WeightStatistics(str(tmp_path / str(fit)), every_n_steps=1)])
        alive.append(_train_graphs_alive())
    assert alive[-1] <= alive[0], alive
    if nan_guard:  # the replay kept on the model holds no tensor of the graph that made it
        replays = vars(model)["_kerasdbg_replays"]
        assert replays
        for function in replays.values():
            cells = [c.cell_contents for c in function.python_function.__closure__ or ()]
            held = [t for t in tf.nest.flatten(cells)
                    if tf.is_tensor(t) and not isinstance(t, tf.Variable) and hasattr(t, "graph")]
            assert not held, held
    assert load_run(str(tmp_path / "3")).scalars("gradients/.*/l2_norm").step.max() == \
        4 * len(X) // BATCH


def test_the_engines_view_is_read_only_and_holds_the_engine_weakly():
    """What `Quantities`, `Faults` and `Collector` read of the engine
    (`EngineView`): its state now, nothing written through it, and the
    engine freed with its model (a proxy, no cycle)."""
    from kerasdbg.backends.tensorflow.engine import Engine, EngineView

    model = make_mlp()
    _compile(model, spe=3)
    engine = Engine(model)
    view = EngineView(engine)
    assert view.model is model and view.requests == [] and view.rows is None
    assert view.calls is None and view.step_values is None and not view.wants("step")
    with pytest.raises(AttributeError):
        view.rows = 3
    engine.rows = 3
    assert view.rows == 3
    del engine
    gc.collect()
    with pytest.raises(ReferenceError):
        _ = view.requests


@pytest.mark.parametrize("spe", [1, 4])
def test_a_recorded_model_is_freed_with_its_last_reference(tmp_path, spe):
    """After a fit that ran both variants of the train function (the full one
    at steps 1-10, the every-step one after), nothing of kerasdbg keeps the
    model alive: the engine's table holds it weakly, and the engine drops
    the fit's requests (their callbacks hold the model) at the fit's end.
    A model kept alive leaked its graphs, fit after fit."""
    import weakref

    from kerasdbg.backends.tensorflow import engine as engine_lib

    model = make_mlp()
    _compile(model, spe=spe)
    x = np.concatenate([X] * 8)
    y = np.concatenate([Y] * 8)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[
        GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path)),
        StopOnRule(log_dir=str(tmp_path), action="warn", verbose=False)])
    assert len(x) // BATCH > 10  # the every-step variant ran
    engines = len(engine_lib._ENGINES)
    reference = weakref.ref(model)
    del model
    gc.collect()
    assert reference() is None
    assert len(engine_lib._ENGINES) == engines - 1
