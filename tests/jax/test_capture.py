"""JAX's capture against an independent computation, across the matrix.

Runs on the JAX backend only (`KERAS_BACKEND=jax`, see tests/conftest.py).
Expected values come from a class-level wrapper of the optimizer's
`stateless_apply`, written here, that hands the gradients it receives to the
host (`jax.debug.callback`) during a plain `fit`, or from `jax.value_and_grad`
of `model.stateless_call`.
"""

import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import kerasdbg
import kerasdbg.layers
from kerasdbg.callbacks import (
    ActivationStatistics, GradientStatistics, StepRecorder, StepTimer, StopOnRule,
    WeightStatistics,
)
from kerasdbg.capture import supported
from kerasdbg.records.capture_record import records_of
from kerasdbg.errors import UnsupportedBackendError
from kerasdbg.rules import NonFiniteLoss
from tests.conftest import reference_stats


BATCH, STEPS = 32, 8
RNG = np.random.default_rng(7)
X = RNG.normal(size=(BATCH * STEPS, 6)).astype("float32")
Y = (X[:, :3].sum(1, keepdims=True) + 0.1 * RNG.normal(size=(BATCH * STEPS, 1))).astype("float32")
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


def make_model(spe=1, jit=True, batch_norm=False, optimizer=None):
    keras.utils.set_random_seed(3)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(name="norm"))
    layers.append(keras.layers.Dense(1, name="out"))
    model = keras.Sequential(layers, name="m")
    model.compile(optimizer or keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe,
                  jit_compile=jit)
    return model


def fit(model, callbacks=(), x=X, y=Y, epochs=1):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def captured_gradients(monkeypatch, model):
    """The gradients each step of a plain fit of `model` applies, in order,
    from a wrapper of the optimizer class's `stateless_apply`."""
    seen = []
    cls = type(model.optimizer)
    original = cls.stateless_apply

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        jax.debug.callback(lambda *g: seen.append([np.asarray(a) for a in g]), *grads,
                           ordered=True)
        return original(self, optimizer_variables, grads, trainable_variables)

    monkeypatch.setattr(cls, "stateless_apply", stateless_apply)
    fit(model)
    monkeypatch.setattr(cls, "stateless_apply", original)
    jax.effects_barrier()
    return seen


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_gradient_and_weight_statistics_match_the_gradients_keras_applies(monkeypatch, spe, jit):
    reference = make_model()
    paths = [v.path for v in reference.trainable_variables]
    grads = captured_gradients(monkeypatch, reference)
    assert len(grads) == STEPS
    weights_after = reference.get_weights()

    model = make_model(spe, jit)
    gradient_stats, weight_stats = GradientStatistics(), WeightStatistics()
    fit(model, [gradient_stats, weight_stats])
    history = gradient_stats.history.set_index("step")
    assert list(history.index) == list(range(1, STEPS + 1))
    for step in (1, 5, STEPS):
        for path, gradient in zip(paths, grads[step - 1]):
            expected = reference_stats(gradient)
            for statistic in ("l2_norm", "mean", "std", "max"):
                np.testing.assert_allclose(history.loc[step, f"{path}/{statistic}"],
                                           expected[statistic], rtol=2e-5, atol=1e-7,
                                           err_msg=f"{path}/{statistic} at step {step}")
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads[step - 1]))
        np.testing.assert_allclose(history.loc[step, "global_norm"], norm, rtol=2e-5)
    weights = weight_stats.history.set_index("step")
    for path, value in zip(paths, weights_after):
        np.testing.assert_allclose(weights.loc[STEPS, f"{path}/l2_norm"],
                                   np.linalg.norm(value.astype(np.float64)), rtol=2e-5)


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_every_instrument_leaves_training_bitwise_plain_keras(spe, jit):
    epochs = 2
    plain = make_model(spe, jit, batch_norm=True)
    plain_history = fit(plain, epochs=epochs).history
    model = make_model(spe, jit, batch_norm=True)
    history = fit(model, [GradientStatistics(), WeightStatistics(), StopOnRule()],
                  epochs=epochs).history
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(plain.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    assert "stateless_apply" not in vars(model.optimizer)
    assert "_update_metrics_variables" not in vars(model)


def test_a_long_first_step_says_so_and_how_long_it_took(capsys, monkeypatch):
    """As on TensorFlow: past `progress.AFTER` seconds (0 here) of the first
    jitted execution, one line says what is traced (the trainable variables
    counted from the model, no taps), one how long it took; the later steps
    and the second epoch say nothing."""
    from kerasdbg.capture import progress

    monkeypatch.setattr(progress, "AFTER", 0.0)
    model = make_model()
    fit(model, [StopOnRule(NonFiniteLoss(), verbose=False)], x=X[:2 * BATCH], y=Y[:2 * BATCH],
        epochs=2)
    captured = capsys.readouterr()
    assert "kerasdbg" not in captured.out  # stderr: stdout stays the user's
    printed = [line for line in captured.err.splitlines() if line.startswith("kerasdbg")]
    variables = len(model.trainable_variables)
    assert printed[0] == ("kerasdbg: tracing and compiling the instrumented train step of 'm' "
                          f"({variables} trainable variables, 0 taps) ...")
    assert re.fullmatch(r"kerasdbg: traced and compiled; the first step took \d+\.\d s",
                        printed[1]), printed
    assert len(printed) == 2, printed


def test_a_first_step_that_raises_is_not_said_to_have_compiled(capsys, monkeypatch):
    """A train step whose trace raises after the progress line (here at 0 s
    and a 0.5 s trace): kerasdbg's step gives way to Keras's own (one warning
    says why), which raises the user's error; no line says the step was
    traced and compiled."""
    import time

    from kerasdbg.capture import progress

    class Failing(keras.Sequential):
        def train_step(self, state, data):
            time.sleep(0.5)
            raise ValueError("a broken train step")

    monkeypatch.setattr(progress, "AFTER", 0.0)
    model = Failing([keras.Input((4,)), keras.layers.Dense(1)], name="m")
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="a broken train step"), \
            pytest.warns(RuntimeWarning, match="could not run its step around this model's"):
        model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0,
                  callbacks=[StopOnRule(NonFiniteLoss(), verbose=False)])
    printed = [line for line in capsys.readouterr().err.splitlines()
               if line.startswith("kerasdbg")]
    assert len(printed) == 1 and printed[0].startswith("kerasdbg: tracing and compiling"), printed


def test_an_op_by_op_fit_with_every_instrument_compiles_once_not_at_each_step():
    # With jit_compile=False JAX compiles each new operation (shape, dtype) once;
    # a lax.cond run op by op compiles again at each call (new branch functions),
    # which made such a fit 20 times slower. A second fit of the same model
    # compiles nothing, as a second plain fit does.
    compiled = []

    def listen(name, seconds, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        # The listener hears a compile (the event still has its name; no cache hides it).
        jax.jit(lambda x: x * 3.25 + 0.5)(jnp.ones((7, 3)))
        assert compiled
        for _ in range(2):
            compiled.clear()
            fit(make_model(1, False, batch_norm=True),
                [GradientStatistics(histogram_every_n_steps=2), WeightStatistics(), StopOnRule()],
                epochs=2)
        assert compiled == []
        # The same with the debug layers, each call taking its recording branch or not.
        for _ in range(2):
            compiled.clear()
            model = kerasdbg.insert_taps(
                make_model(1, False),
                tap=lambda layer, name: kerasdbg.layers.TapLayer(every_n_steps=3, name=name))
            fit(model, [ActivationStatistics()])
        assert compiled == []
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_a_nan_in_one_batch_stops_at_its_step_with_the_weights_of_the_step_before(spe, jit):
    bad = 5
    y = Y.copy()
    y[(bad - 1) * BATCH] = np.nan
    before = make_model(spe, jit, batch_norm=True)
    fit(before, x=X[:(bad - 1) * BATCH], y=Y[:(bad - 1) * BATCH])
    model = make_model(spe, jit, batch_norm=True)
    stop = StopOnRule()
    gradients, weights = GradientStatistics(), WeightStatistics()
    fit(model, [stop, gradients, weights], y=y)
    # No weights the freeze threw away: the last row is the step before the fault's.
    assert list(weights.history["step"]) == list(range(1, bad)), weights.history["step"]
    assert [v.step for v in stop.verdicts][:1] == [bad], stop.verdicts
    assert stop.verdicts[0].rule in ("NonFiniteLoss", "ExplodingTensor"), stop.verdicts
    located = [v for v in stop.verdicts if v.rule == "NaNSource"]
    assert [v.step for v in located] == [bad], stop.verdicts
    assert "every layer output was finite (the loss or its gradient was not)" in located[0].reason
    assert "non-finite gradients: m/hidden/bias, m/hidden/kernel" in located[0].reason
    for a, b in zip(before.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)  # BatchNormalization's moving statistics too
    history = gradients.history.set_index("step")
    assert np.isnan(history.loc[bad, "global_norm"])  # the faulty step is recorded, NaN and all
    assert history.index.is_unique


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_the_step_records_of_a_read_hold_each_steps_loss_and_a_fault_its_source(
        monkeypatch, spe, jit):
    # The step records of a read are made as one array (the steps of a layout share their
    # tags); a faulty step's own, with what the capture found of its source.
    from kerasdbg.capture.step_rows import StepRows

    bad = 6
    y = Y.copy()
    y[(bad - 1) * BATCH] = np.nan
    # Independently: the loss of each step before the fault, in NumPy, from the weights a
    # plain model trained batch by batch holds before the step.
    plain = make_model(1, jit)
    want = []
    for k in range(bad - 1):
        xb, yb = X[k * BATCH:(k + 1) * BATCH], Y[k * BATCH:(k + 1) * BATCH]
        want.append(float(np.mean((np.asarray(plain(xb), np.float64) - yb) ** 2)))
        plain.train_on_batch(xb, yb)
    taken = []
    original = StepRows.take

    def take(self, request, records):
        if request.kind == "step":
            taken.append(records_of(records))  # (blocks: a record per step)
        return original(self, request, records)

    monkeypatch.setattr(StepRows, "take", take)
    model = make_model(spe, jit)
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"], steps_per_execution=spe,
                  jit_compile=jit)
    stop = StopOnRule(verbose=False)
    fit(model, [stop], y=y)
    records = [r for read in taken for r in read]
    # The steps of the fault's execution ran, frozen, and those up to the read that stopped.
    steps = [r.step for r in records]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= (bad + spe - 1) // spe * spe
    plain_tags = ("step/loss", "step/frozen", "step/fault", "step/mae")
    for record in records[:bad - 1]:
        assert record.tags == plain_tags and list(record.values[1:3]) == [0.0, 0.0]
        assert np.isfinite(record.values[3])
    np.testing.assert_allclose([r.values[0] for r in records[:bad - 1]], want, rtol=1e-5)
    faulty = dict(zip(records[bad - 1].tags, records[bad - 1].values))
    assert np.isnan(faulty["step/loss"]) and faulty["step/fault"] == 1.0
    assert faulty["faults/nan_source/gradient/m/hidden/kernel"] == 1.0
    for record in records[bad:]:
        assert record.tags == plain_tags and list(record.values[1:3]) == [1.0, 0.0]
    assert [v.step for v in stop.verdicts][:1] == [bad]


@pytest.mark.parametrize("spe, jit", [MATRIX[0], MATRIX[3]])
def test_data_parallel_describes_the_global_gradient_once_per_step(spe, jit):
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        model = make_model(spe, jit, optimizer=keras.optimizers.SGD(0.01))
        start = [np.asarray(v.value) for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        gradients = GradientStatistics()
        fit(model, [gradients])
    finally:
        keras.distribution.set_distribution(None)
    history = gradients.history.set_index("step")
    assert list(history.index) == list(range(1, STEPS + 1))

    def loss(trainable, x, y):
        prediction, _ = model.stateless_call(trainable, non_trainable, x)
        return jnp.mean(jnp.square(prediction - y))

    # On the devices the fit ran on (a GPU's float32 matrix products are TF32 by default).
    with jax.default_device(devices[0]):
        _, first = jax.value_and_grad(loss)([jnp.asarray(w) for w in start], X[:BATCH],
                                            Y[:BATCH])
    for variable, gradient in zip(model.trainable_variables, first):
        np.testing.assert_allclose(history.loc[1, f"{variable.path}/l2_norm"],
                                   np.linalg.norm(np.asarray(gradient, np.float64)), rtol=1e-4)


@pytest.mark.parametrize("spe, jit", [MATRIX[1], MATRIX[2]])
def test_a_nan_in_one_devices_shard_stops_data_parallel_training_at_its_step(spe, jit):
    devices = jax.devices("cpu")
    bad = 3
    y = Y.copy()
    y[(bad - 1) * BATCH + BATCH - 1] = np.nan  # the second device's half of the batch
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        before = make_model(spe, jit)
        fit(before, x=X[:(bad - 1) * BATCH], y=Y[:(bad - 1) * BATCH])
        model = make_model(spe, jit)
        stop = StopOnRule()
        fit(model, [stop], y=y)
    finally:
        keras.distribution.set_distribution(None)
    assert stop.verdicts and stop.verdicts[0].step == bad, stop.verdicts
    for a, b in zip(before.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_every_instrument_is_made_on_jax_and_a_kind_it_lacks_says_what_works():
    for make in (GradientStatistics, WeightStatistics, StopOnRule, StepTimer,
                 ActivationStatistics, lambda: StepRecorder("trace.npz")):
        make()
    with pytest.raises(UnsupportedBackendError,
                       match=r"Probe works on the TensorFlow backend only so far; Keras runs on "
                             r"'jax'.*GradientStatistics, WeightStatistics, ActivationStatistics, "
                             r"StopOnRule, StepTimer, StepRecorder"):
        supported("Probe", "a kind no capture records")
    model = make_model()
    fit(model, [GradientStatistics()])  # the others go on working
    assert "stateless_apply" not in vars(model.optimizer)


def test_mixed_precision_records_unscaled_gradients_and_no_false_alarm(mixed_precision):
    """Under mixed_float16 the optimizer is a LossScaleOptimizer: its
    `stateless_apply` receives the gradients times the loss scale, and an
    overflow (which the scaler skips) is not a fault."""
    plain = make_model(spe=2)
    plain_history = fit(plain, epochs=2).history
    model = make_model(spe=2)
    stop, gradients = StopOnRule(), GradientStatistics()
    history = fit(model, [stop, gradients], epochs=2).history
    assert stop.verdicts == []
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    recorded = gradients.history
    applied = recorded[~recorded["skipped"]]
    # Unscaled: the norms of a small regression's gradients, not x 2**15.
    assert len(applied) and applied["global_norm"].max() < 1e3, applied["global_norm"]


class GuideModel(keras.Sequential):
    """A train step written for JAX as the keras.io guide "Customizing what
    happens in fit() with JAX" writes it: stateless, its own loss and metric
    updates, `stateless_apply` called by hand."""

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss = self.step_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def step_loss(self, x, y, y_pred):
        return jnp.mean(jnp.square(y_pred - y))

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = \
            state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        logs, metrics_variables = self.metrics_of(metrics_variables, loss, y, y_pred)
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      metrics_variables)

    def metrics_of(self, metrics_variables, loss, y, y_pred):
        return {"loss": loss}, metrics_variables


def make_guide_model(spe=1, jit=True):
    keras.utils.set_random_seed(3)
    model = GuideModel([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                        keras.layers.Dense(1, name="out")], name="guide")
    model.compile(keras.optimizers.SGD(0.01), steps_per_execution=spe, jit_compile=jit)
    return model


@pytest.mark.parametrize("spe, jit", [MATRIX[0], MATRIX[3]])
def test_a_train_step_written_for_jax_is_recorded_and_guarded(monkeypatch, spe, jit):
    reference = make_guide_model()
    paths = [v.path for v in reference.trainable_variables]
    grads = captured_gradients(monkeypatch, reference)
    plain = make_guide_model(spe, jit)
    fit(plain)
    model = make_guide_model(spe, jit)
    gradients, stop = GradientStatistics(), StopOnRule()
    fit(model, [gradients, stop])
    assert stop.verdicts == []
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = gradients.history.set_index("step")
    for step in (1, STEPS):
        for path, gradient in zip(paths, grads[step - 1]):
            np.testing.assert_allclose(history.loc[step, f"{path}/l2_norm"],
                                       np.linalg.norm(gradient.astype(np.float64)), rtol=2e-5)

    bad = 3
    y = Y.copy()
    y[(bad - 1) * BATCH] = np.nan
    before = make_guide_model(spe, jit)
    fit(before, x=X[:(bad - 1) * BATCH], y=Y[:(bad - 1) * BATCH])
    model = make_guide_model(spe, jit)
    stop = StopOnRule()
    fit(model, [stop], y=y)
    assert stop.verdicts and stop.verdicts[0].step == bad, stop.verdicts
    for a, b in zip(before.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


class KerasIoGuideModel(GuideModel):
    """The first train step of the keras.io guide "Customizing what happens in
    fit() with JAX": `GuideModel`'s step with the guide's loss, `self.compute_loss`
    inside `jax.value_and_grad`, and its metrics loop, the metric named "loss"
    updated with the step's loss (`stateless_update_state`); Keras's own
    `_update_metrics_variables` is never called."""

    def step_loss(self, x, y, y_pred):
        return self.compute_loss(x, y, y_pred)

    def metrics_of(self, metrics_variables, loss, y, y_pred):
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, new_metrics_vars


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_the_keras_io_guides_jax_train_step_records_each_steps_loss(tmp_path, spe, jit):
    def make():
        keras.utils.set_random_seed(3)
        model = KerasIoGuideModel([keras.Input((6,)), keras.layers.Dense(8, name="hidden"),
                                   keras.layers.Dense(1, name="out")], name="guide")
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"],
                      steps_per_execution=spe, jit_compile=jit)
        return model

    # The loss of each step, independently: the model before the step, in NumPy (a fit
    # of one batch at a time: the guide's step takes `x, y = data`, as `fit` gives it).
    plain, want = make(), []
    for k in range(STEPS):
        xb, yb = X[k * BATCH:(k + 1) * BATCH], Y[k * BATCH:(k + 1) * BATCH]
        want.append(float(np.mean((np.asarray(plain(xb), np.float64) - yb) ** 2)))
        fit(plain, x=xb, y=yb)
    model = make()
    stop = StopOnRule(log_dir=str(tmp_path), verbose=False, strict=True)
    history = fit(model, [stop])
    assert stop.verdicts == []
    assert stop.loss_source == "the value the train step gives its metric 'loss'"
    loss = kerasdbg.load_run(str(tmp_path)).scalars("step/loss")
    assert loss.step.tolist() == list(range(1, STEPS + 1))
    np.testing.assert_allclose(loss.value, want, rtol=1e-5)
    # Training and Keras's own logs as without kerasdbg.
    reference = make()
    plain_history = fit(reference)
    assert history.history == plain_history.history
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert "stateless_update_state" not in vars(model.metrics[0])  # put back


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_model_parallel_describes_a_sharded_kernel_whole(spe, jit):
    devices = jax.devices("cpu")
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout = keras.distribution.LayoutMap(mesh)
    layout["hidden/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch"))
    try:
        model = make_model(spe, jit, optimizer=keras.optimizers.SGD(0.01))
        kernel = model.get_layer("hidden").kernel
        assert len(kernel.value.sharding.device_set) == 2  # really sharded
        weights = WeightStatistics()
        fit(model, [weights])
        final = np.asarray(kernel.value)
    finally:
        keras.distribution.set_distribution(None)
    history = weights.history.set_index("step")
    for statistic, expected in (("l2_norm", np.linalg.norm(final.astype(np.float64))),
                                ("max", final.max()), ("mean", final.mean())):
        np.testing.assert_allclose(history.loc[STEPS, f"{kernel.path}/{statistic}"], expected,
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_model_parallel_trains_bitwise_as_plain_keras(spe, jit):
    """A kernel sharded over a (1, 2) mesh whose output the next layer contracts
    (a cross-device sum): the instruments change no bit of training."""
    def trained(callbacks):
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], jax.devices("cpu"))
        layout = keras.distribution.LayoutMap(mesh)
        layout["hidden/kernel"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch"))
        try:
            keras.utils.set_random_seed(3)
            model = keras.Sequential([
                keras.Input((6,)), keras.layers.Dense(512, activation="relu", name="hidden"),
                keras.layers.Dense(1, name="out")], name="m")
            model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe,
                          jit_compile=jit)
            fit(model, callbacks, epochs=2)
            return model.get_weights()
        finally:
            keras.distribution.set_distribution(None)

    plain = trained([])
    instrumented = trained([GradientStatistics(every_n_steps=1), WeightStatistics(),
                            StopOnRule(verbose=False)])
    for a, b in zip(plain, instrumented):
        np.testing.assert_array_equal(a, b)


def test_a_later_fit_with_equivalent_callbacks_runs_the_step_jitted_before():
    from kerasdbg.backends.jax.engine import engine_for

    plain = make_model(spe=2)
    for _ in range(3):
        fit(plain)
    model = make_model(spe=2)
    histories = []
    for _ in range(3):  # new callback instances, the same configuration
        gradients = GradientStatistics()
        fit(model, [gradients, StopOnRule()])
        histories.append(gradients.history)
    # The step's two variants (the full statistics at steps 1-10, the every-step
    # ones after), each traced once over the three fits.
    assert engine_for(model).trace_count == 2
    assert [list(h["step"]) for h in histories] == [list(range(1 + k * STEPS, 1 + (k + 1) * STEPS))
                                                   for k in range(3)]
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Another graph, traced again: one variant (its statistic is taken at every step).
    fit(model, [GradientStatistics(stats=["l2_norm"])])
    assert engine_for(model).trace_count == 3


def test_clipping_records_the_applied_gradients_and_histograms(monkeypatch, tmp_path):
    limit = 0.05
    reference = make_model(optimizer=keras.optimizers.SGD(0.01, global_clipnorm=limit))
    paths = [v.path for v in reference.trainable_variables]
    grads = captured_gradients(monkeypatch, reference)  # before clipping: what apply receives
    model = make_model(optimizer=keras.optimizers.SGD(0.01, global_clipnorm=limit))
    gradients = GradientStatistics(log_dir=str(tmp_path), histogram_every_n_steps=2)
    fit(model, [gradients])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = gradients.history.set_index("step")
    columns = list(history.columns)
    for step in (1, STEPS):
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads[step - 1]))
        scale = min(1.0, limit / norm)
        assert history.loc[step, "clipped"] == float(norm > limit)
        for path, gradient in zip(paths, grads[step - 1]):
            applied = [c for c in columns if c.endswith(f"{path}/l2_norm") and "applied" in c]
            assert len(applied) == 1, columns
            np.testing.assert_allclose(history.loc[step, applied[0]],
                                       np.linalg.norm(gradient.astype(np.float64)) * scale,
                                       rtol=1e-5)
    from kerasdbg import load_run

    run = load_run(str(tmp_path))
    tags = run.tags(kind="histograms")
    assert sorted(t for t in tags if t.startswith("gradients/")) == sorted(
        f"gradients/{p}" for p in paths), tags


@pytest.mark.parametrize("spe, jit", [MATRIX[0], MATRIX[3]])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clipping", "global-clipnorm"])
def test_gradient_accumulation_records_what_each_update_applied(monkeypatch, tmp_path, spe, jit,
                                                                clip):
    """`gradient_accumulation_steps=4`: at the update steps 4 and 8 the
    applied gradient is the mean of the four batches' (then clipped), as on
    TensorFlow (tests/test_training_code_regressions.py); between updates
    nothing is applied and nothing is written under `applied_gradients/`."""
    def optimizer():
        return keras.optimizers.SGD(0.01, gradient_accumulation_steps=4, global_clipnorm=clip)

    reference = make_model(spe, jit, optimizer=optimizer())
    paths = [v.path for v in reference.trainable_variables]
    batches = captured_gradients(monkeypatch, reference)  # each batch's, as apply receives
    assert len(batches) == STEPS
    model = make_model(spe, jit, optimizer=optimizer())
    gradients = GradientStatistics(log_dir=str(tmp_path), every_n_steps=1, stats=["l2_norm"])
    stop = StopOnRule(verbose=False)
    fit(model, [gradients, stop])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = gradients.history.set_index("step")
    assert history.applied.tolist() == [step % 4 == 0 for step in range(1, STEPS + 1)]
    run = kerasdbg.load_run(str(tmp_path))
    for step in (4, 8):
        mean = [np.mean([batches[s - 1][k].astype(np.float64) for s in range(step - 3, step + 1)],
                        axis=0) for k in range(len(paths))]
        norm = np.sqrt(sum(np.sum(m ** 2) for m in mean))
        scale = 1.0 if clip is None else min(1.0, clip / norm)
        for path, m in zip(paths, mean):
            np.testing.assert_allclose(history.loc[step, f"applied_gradients/{path}/l2_norm"],
                                       np.linalg.norm(m) * scale, rtol=1e-5)
        np.testing.assert_allclose(history.loc[step, "applied_gradients/global_norm"],
                                   norm * scale, rtol=1e-5)
        if clip is not None:
            assert history.loc[step, "clipped"] == float(norm > clip)
    for path in paths:  # written at the updates only: absent between them, not NaN
        assert run.scalars(f"applied_gradients/{path}/l2_norm").step.tolist() == [4, 8]
        assert run.scalars(f"gradients/{path}/l2_norm").step.tolist() == list(
            range(1, STEPS + 1))
    if clip is not None:
        assert history.clipped[history.applied == False].eq(0).all()  # noqa: E712
    assert [v for v in stop.verdicts if v.severity == "fault"] == []


def test_the_default_schedule_computes_every_statistic_at_its_steps_only(monkeypatch):
    reference = make_model()
    grads = captured_gradients(monkeypatch, reference) + captured_gradients(monkeypatch,
                                                                           reference)
    model = make_model()
    gradients, every_third = GradientStatistics(), GradientStatistics(every_n_steps=3)
    fit(model, [gradients, every_third], epochs=2)
    history = gradients.history.set_index("step")
    path = model.trainable_variables[0].path
    assert list(history.index) == list(range(1, 2 * STEPS + 1))
    for step in range(1, 2 * STEPS + 1):
        expected = reference_stats(grads[step - 1][0])
        np.testing.assert_allclose(history.loc[step, f"{path}/l2_norm"], expected["l2_norm"],
                                   rtol=2e-5)  # every step
        std = history.loc[step, f"{path}/std"]
        if step <= 10:  # all statistics at steps 1-10 (and every 50th)
            np.testing.assert_allclose(std, expected["std"], rtol=2e-5)
        else:
            assert np.isnan(std), (step, std)
    assert list(every_third.history["step"]) == [3, 6, 9, 12, 15]


def test_a_model_fitted_with_the_instruments_is_freed_after_fit():
    import gc
    import weakref

    model = make_model(spe=2)
    fit(model, [GradientStatistics(), WeightStatistics(), StopOnRule()])
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_recompiled_model_traces_again_with_its_new_loss():
    optimizer = keras.optimizers.SGD(0.01)
    plain = make_model(optimizer=keras.optimizers.SGD(0.01))
    fit(plain)
    plain.compile(plain.optimizer, "mae")
    expected = fit(plain).history
    model = make_model(optimizer=optimizer)
    fit(model, [GradientStatistics()])
    model.compile(optimizer, "mae")
    got = fit(model, [GradientStatistics()]).history
    assert got == expected
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_mixed_precision_with_a_gradient_limit_skips_overflows_without_a_fault(mixed_precision):
    plain = make_model()
    fit(plain, x=X * 10, y=Y * 100, epochs=2)
    model = make_model()
    stop, gradients = StopOnRule(max_gradient_norm=1e6), GradientStatistics()
    fit(model, [stop, gradients], x=X * 10, y=Y * 100, epochs=2)
    assert stop.verdicts == []
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = gradients.history
    skipped = history[history["skipped"]]
    assert len(skipped), "float16 overflows at the initial loss scale"
    # A skipped step carries the number its update would have had: the next
    # applied step's, never 0.
    applied_steps = set(history[~history["skipped"]]["step"])
    assert all(step >= 1 and step in applied_steps for step in skipped["step"]), history


def test_the_weight_decay_fraction_follows_a_learning_rate_changed_during_fit(tmp_path):
    """On JAX the model's variables hold their values of the epoch's start
    during a fit; the decay's part of an update reads the learning rate the
    fit holds (here set per epoch by Keras's LearningRateScheduler)."""
    from kerasdbg import load_run

    model = make_model(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1))
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 if epoch == 0
                                                     else 0.001)
    fit(model, [schedule, StopOnRule(log_dir=str(tmp_path))], epochs=2)
    fractions = load_run(str(tmp_path)).scalars(r"step/weight_decay.*", run="train")
    by_step = dict(zip(fractions["step"], fractions["value"]))
    assert by_step, "StopOnRule records the decay's fraction with AdamW"
    np.testing.assert_allclose(by_step[2], 0.01 * 0.1, rtol=1e-6)
    np.testing.assert_allclose(by_step[STEPS + 2], 0.001 * 0.1, rtol=1e-6)


def test_gradient_accumulation_flags_the_batches_that_only_accumulate():
    plain = make_model(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=2))
    fit(plain)
    model = make_model(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=2))
    gradients = GradientStatistics()
    fit(model, [gradients, StopOnRule()])
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = gradients.history
    assert len(history) == STEPS
    # Keras updates the weights at every second batch: batches 2, 4, ...
    assert list(history["applied"]) == [step % 2 == 0 for step in range(1, STEPS + 1)], history
