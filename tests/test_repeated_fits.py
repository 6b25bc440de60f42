"""Repeated fits reuse the instrumented train function (no retrace per fit).

A `fit` whose kerasdbg callbacks ask for what the previous `fit` on the same
model asked for (the same instances, or new ones with the same
configuration) runs the train function that fit traced; anything that
changes the graph (another configuration, `compile`, another train step,
a layer's `trainable`) traces again; and a `fit` without kerasdbg runs
Keras's own function as kerasdbg found it.
"""

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg import capture as _capture
from kerasdbg.backends.tensorflow import engine as tf_engine
from kerasdbg.callbacks import (
    ActivationStatistics, GradientStatistics, StepTimer, StopOnRule, WeightStatistics,
)
from kerasdbg.layers import TapLayer
from kerasdbg.rules import ClassImbalance, NonFiniteLoss
from tests.conftest import make_strategy, matrix, only_upstream_failure, reference_stats
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = len(X) // BATCH  # 10 per fit


def _compile(model, spe=1, jit=False):
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe,
                  jit_compile=jit)


def _fit(model, callbacks, x=X, y=Y, epochs=1):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)


class _Makes:
    """Counts the train functions made by force (a new function: a trace)."""

    def __init__(self, model, monkeypatch):
        self.forced = 0
        original = model.make_train_function

        def counting(force=False):
            self.forced += bool(force)
            return original(force=force)

        monkeypatch.setattr(model, "make_train_function", counting)


def _statistics():
    return [GradientStatistics(every_n_steps=1), WeightStatistics(every_n_steps=1)]


def _check_fit(grads_cb, weights_cb, model, reference, first, last):
    """The records of steps `first`..`last` against NumPy on the reference
    training; distances count from the weights at `first`'s start."""
    assert grads_cb.history.step.tolist() == list(range(first, last + 1))
    assert weights_cb.history.step.tolist() == list(range(first, last + 1))
    start = reference[first - 1]["before"]
    for step in range(first, last + 1):
        ref = reference[step - 1]
        g_row = grads_cb.history[grads_cb.history.step == step].iloc[0]
        w_row = weights_cb.history[weights_cb.history.step == step].iloc[0]
        for i, variable in enumerate(model.trainable_variables):
            path = variable.path
            expected = reference_stats(ref["grads"][i])
            for name in ("l2_norm", "mean", "max", "min"):
                np.testing.assert_allclose(g_row[f"{path}/{name}"], expected[name], rtol=1e-4,
                                           atol=1e-6, err_msg=f"step {step} grad {path} {name}")
            after, before = ref["after"][i], ref["before"][i]
            np.testing.assert_allclose(w_row[f"{path}/l2_norm"], np.linalg.norm(after), rtol=1e-5)
            np.testing.assert_allclose(
                w_row[f"{path}/update_ratio"],
                np.linalg.norm(after - before) / np.linalg.norm(before), rtol=1e-4)
            np.testing.assert_allclose(w_row[f"{path}/distance_from_start"],
                                       np.linalg.norm(after - start[i]), rtol=1e-4, atol=1e-7)
        global_norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in ref["grads"]))
        np.testing.assert_allclose(g_row["global_norm"], global_norm, rtol=1e-5)


@pytest.mark.parametrize("strategy_name,spe,jit", matrix())
def test_a_fit_with_new_equivalent_callbacks_runs_the_traced_function(
        strategy_name, spe, jit, monkeypatch):
    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = make_mlp()
        _compile(model, spe, jit)
    initial = [v.numpy() for v in model.trainable_variables]
    makes = _Makes(model, monkeypatch)
    engine = _capture.engine_for(model)
    with only_upstream_failure(strategy_name, jit):
        _fit(model, _statistics())
        traces = engine.trace_count
        second = _statistics()
        _fit(model, second)
        third = _statistics()
        _fit(model, third)
    assert makes.forced == 1  # the first fit's instrumented function, no other
    assert engine.trace_count == traces
    reference = reference_training(initial, 3 * STEPS)
    _check_fit(*second, model, reference, STEPS + 1, 2 * STEPS)
    _check_fit(*third, model, reference, 2 * STEPS + 1, 3 * STEPS)


def test_the_same_instances_reuse_it_and_a_plain_fit_runs_keras_function(monkeypatch):
    model = make_mlp()
    _compile(model)
    initial = [v.numpy() for v in model.trainable_variables]
    model.make_train_function()
    keras_function = model.train_function
    makes = _Makes(model, monkeypatch)
    callbacks = _statistics()
    _fit(model, callbacks)
    # The model holds Keras's own function again, and nothing of kerasdbg's.
    assert model.train_function is keras_function
    assert not [name for name in vars(model) if "kerasdbg" in name]
    _fit(model, callbacks)
    assert makes.forced == 1
    _check_fit(*callbacks, model, reference_training(initial, 2 * STEPS), STEPS + 1, 2 * STEPS)
    # A fit without kerasdbg runs Keras's own function, traced once, untouched.
    _fit(model, [])
    assert model.train_function is keras_function
    assert "train_step" not in vars(model) and "compute_loss" not in vars(model)
    assert "apply" not in vars(model.optimizer)
    # ... and a kerasdbg fit after it still reuses the instrumented one.
    callbacks = _statistics()
    _fit(model, callbacks)
    assert makes.forced == 1
    reference = reference_training(initial, 4 * STEPS)
    _check_fit(*callbacks, model, reference, 3 * STEPS + 1, 4 * STEPS)
    for variable, want in zip(model.trainable_variables, reference[-1]["after"]):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6)


def _tapped(seed=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    return model


def test_every_instrument_records_in_reused_fits_bitwise_as_plain_keras(tmp_path, monkeypatch):
    model = kerasdbg.insert_taps(_tapped(), tap=TapLayer(every_n_steps=2))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    twin = _tapped()
    twin.compile(keras.optimizers.Adam(0.01), "mse")
    makes = _Makes(model, monkeypatch)
    for fit in range(3):
        log_dir = str(tmp_path / f"fit{fit}")
        grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
        stop = StopOnRule(log_dir=log_dir, verbose=False)
        activations, timer = ActivationStatistics(log_dir), StepTimer(log_dir)
        _fit(model, [grads, weights, stop, activations, timer])
        _fit(twin, [])
        first = fit * STEPS + 1
        assert grads.history.step.tolist() == list(range(first, first + STEPS))
        assert weights.history.step.tolist() == list(range(first, first + STEPS))
        assert stop.verdicts == []
        steps = sorted(set(activations.history.step))
        assert steps == [s for s in range(first, first + STEPS) if s % 2 == 0]
        assert len(timer.history) == STEPS
        assert np.isfinite(timer.history.compute_seconds).all()
        assert (timer.history.compute_seconds > 0).all()
        # The taps' own counters aside, every variable equals plain Keras's.
        assert len(model.trainable_variables) == len(twin.trainable_variables)
        for mine, plain in zip(model.trainable_variables + model.optimizer.variables,
                               twin.trainable_variables + twin.optimizer.variables):
            np.testing.assert_array_equal(mine.numpy(), plain.numpy())
    assert makes.forced == 1


def test_a_nan_in_a_reused_fit_freezes_and_stops_at_its_step(monkeypatch):
    model = make_mlp()
    _compile(model)
    initial = [v.numpy() for v in model.trainable_variables]
    makes = _Makes(model, monkeypatch)
    _fit(model, [StopOnRule([NonFiniteLoss()], verbose=False)])
    x = X.copy()
    x[4 * BATCH] = np.nan  # the 5th batch of the second fit: step 15
    stop = StopOnRule([NonFiniteLoss()], verbose=False)
    _fit(model, [stop], x=x)
    assert makes.forced == 1
    # Stopped at the NaN batch's step. Which rule says so depends on the CPU: where a
    # fused ReLU gives 0 for NaN the loss stays finite and only the first layer's
    # gradient holds NaN (FreezeOnFault), elsewhere the loss is NaN (NonFiniteLoss).
    first = stop.verdicts[0]
    assert (first.step, first.severity) == (STEPS + 5, "fault")
    assert first.rule in ("NonFiniteLoss", "FreezeOnFault"), first
    # Frozen at the faulty step: the weights after the 14 healthy steps.
    reference = reference_training(initial, STEPS + 4)
    for variable, want in zip(model.trainable_variables, reference[-1]["after"]):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6)
    # The next fit, healthy, is not frozen by the last one's fault.
    weights = WeightStatistics(stats=["l2_norm"], every_n_steps=1)
    stop = StopOnRule([NonFiniteLoss()], verbose=False)
    before = [v.numpy() for v in model.trainable_variables]
    _fit(model, [stop, weights])
    assert stop.verdicts == []
    assert not np.allclose(model.trainable_variables[0].numpy(), before[0])


def test_class_counts_start_again_at_each_reused_fit(monkeypatch):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    makes = _Makes(model, monkeypatch)
    labels = np.arange(len(X)) % 3
    seen = []
    for fit in range(2):
        stop = StopOnRule([ClassImbalance()], verbose=False)
        counts = []

        class Totals(keras.callbacks.Callback):
            def on_train_end(self, logs=None):
                request = [r for r in _capture.engine_for(model).requests if r.kind == "classes"]
                counts.append(request[0].totals.numpy()[:3, 0].copy())

        y = labels if fit == 0 else np.where(labels == 2, 0, labels)
        _fit(model, [Totals(), stop], y=y)
        seen.append(counts[0])
    assert makes.forced == 1
    np.testing.assert_array_equal(seen[0], np.bincount(labels, minlength=3))
    np.testing.assert_array_equal(seen[1], np.bincount(np.where(labels == 2, 0, labels),
                                                       minlength=3))


def _changes():
    def recompile(model):
        _compile(model)

    def other_configuration(model):
        return [GradientStatistics(every_n_steps=2), WeightStatistics(every_n_steps=1)]

    def own_train_step(model):
        step = model.train_step

        def train_step(data):
            return step(data)

        model.train_step = train_step

    def frozen_layer(model):
        model.layers[0].trainable = False

    def other_steps_per_execution(model):
        model.steps_per_execution = 2

    return {"recompile": recompile, "other_configuration": other_configuration,
            "own_train_step": own_train_step, "frozen_layer": frozen_layer,
            "other_steps_per_execution": other_steps_per_execution}


@pytest.mark.parametrize("change", sorted(_changes()))
def test_what_changes_the_graph_traces_again(change, monkeypatch):
    model = make_mlp()
    _compile(model)
    makes = _Makes(model, monkeypatch)
    engine = _capture.engine_for(model)
    _fit(model, _statistics())
    callbacks = _changes()[change](model) or _statistics()
    iterations = int(model.optimizer.iterations.numpy())
    traces = engine.trace_count
    _fit(model, callbacks)
    assert makes.forced == 2 and engine.trace_count > traces
    first = iterations + 1
    expected = list(range(first, first + STEPS))
    assert callbacks[1].history.step.tolist() == expected
    if change == "other_configuration":
        expected = [s for s in expected if s % 2 == 0]
    assert callbacks[0].history.step.tolist() == expected
    # ... and the fit after that one reuses what it traced.
    _fit(model, _changes()["other_configuration"](model) if change == "other_configuration"
         else _statistics())
    assert makes.forced == 2


def test_a_fit_that_raised_leaves_nothing_to_reuse(monkeypatch):
    model = make_mlp()
    _compile(model)
    makes = _Makes(model, monkeypatch)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("boom")

    _fit(model, _statistics())
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, _statistics() + [Boom()])
    assert makes.forced == 1  # the second fit reused the first one's function
    assert not hasattr(model.train_function, tf_engine.TRACED_ATTRIBUTE)
    callbacks = _statistics()
    _fit(model, callbacks)
    assert makes.forced == 2
    assert callbacks[0].history.step.tolist() == list(range(STEPS + 4, 2 * STEPS + 4))


def _batchnorm_model():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    _compile(model)
    return model


def test_a_nan_in_a_reused_fit_freezes_the_moving_statistics_too(monkeypatch):
    model, twin = _batchnorm_model(), _batchnorm_model()
    makes = _Makes(model, monkeypatch)
    _fit(model, [StopOnRule([NonFiniteLoss()], verbose=False)])
    x = X.copy()
    x[4 * BATCH] = np.nan  # step 15
    stop = StopOnRule([NonFiniteLoss()], verbose=False)
    _fit(model, [stop], x=x)
    assert makes.forced == 1
    assert [(v.rule, v.step) for v in stop.verdicts][:1] == [("NonFiniteLoss", STEPS + 5)]
    # Plain Keras on the same healthy batches: fit 1, then the 4 batches before the NaN.
    _fit(twin, [])
    twin.fit(X[:4 * BATCH], Y[:4 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for mine, plain in zip(model.weights, twin.weights):
        np.testing.assert_allclose(mine.numpy(), plain.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=mine.path)
