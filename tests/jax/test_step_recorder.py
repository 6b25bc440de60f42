"""`StepRecorder` on JAX: full tensors of chosen steps, across the matrix.

The reference is a training written here: `jax.value_and_grad` of the loss
over `model.stateless_call`, plain SGD in NumPy, on the same batches, with
the layer outputs from `stateless_call` of a model that exposes them.
"""

import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from kerasdbg.callbacks import StepRecorder

BATCH, STEPS, RATE = 8, 8, 0.05
RNG = np.random.default_rng(4)
X = RNG.normal(size=(BATCH * STEPS, 5)).astype("float32")
Y = (X[:, :2].sum(1, keepdims=True) + 0.1).astype("float32")
RECORDED = [0, 1, 3, 6]
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


def _model(spe=1, jit=True, rate=RATE, clipnorm=None):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden), name="mlp")
    model.compile(keras.optimizers.SGD(rate, clipnorm=clipnorm), "mse", steps_per_execution=spe,
                  jit_compile=jit)
    return model


def _fit(model, callbacks=()):
    return model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def _reference(model, steps, clipnorm=None):
    """Per step: loss, gradients (clipped as SGD clips), weights after, layer outputs."""
    probe = keras.Model(model.inputs, [model.get_layer("hidden").output, model.output])
    weights = [np.asarray(v.value) for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable, x, y):
        prediction, _ = model.stateless_call(trainable, non_trainable, x)
        return jnp.mean(jnp.square(prediction - y))

    result = []
    for step in range(steps):
        x, y = X[step * BATCH:(step + 1) * BATCH], Y[step * BATCH:(step + 1) * BATCH]
        value, grads = jax.value_and_grad(loss)([jnp.asarray(w) for w in weights], x, y)
        grads = [np.asarray(g, np.float64) for g in grads]
        if clipnorm is not None:
            grads = [g * min(1.0, clipnorm / np.linalg.norm(g)) for g in grads]
        (hidden, out), _ = probe.stateless_call([jnp.asarray(w) for w in weights], [], [x])
        weights = [w - RATE * g for w, g in zip(weights, grads)]
        result.append({"loss": float(value), "grads": grads, "after": weights,
                       "hidden": np.asarray(hidden), "out": np.asarray(out)})
    return result


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_the_recorded_steps_hold_the_reference_tensors(tmp_path, spe, jit):
    model = _model(spe, jit)
    initial = [np.asarray(v.value) for v in model.trainable_variables]
    reference = _reference(model, max(RECORDED))
    paths = [v.path for v in model.trainable_variables]
    path = str(tmp_path / "trace.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no kerasdbg warning on a healthy run
        _fit(model, [StepRecorder(path, steps=RECORDED)])
    trace = np.load(path)
    for i, name in enumerate(paths):
        np.testing.assert_array_equal(trace[f"weights/{name}@0"], initial[i])
    for step in RECORDED[1:]:
        ref = reference[step - 1]
        np.testing.assert_allclose(trace[f"loss@{step}"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(trace[f"learning_rate@{step}"], RATE, rtol=1e-7)
        for i, name in enumerate(paths):
            np.testing.assert_allclose(trace[f"gradients/{name}@{step}"], ref["grads"][i],
                                       rtol=1e-4, atol=1e-6, err_msg=f"step {step} {name}")
            np.testing.assert_allclose(trace[f"weights/{name}@{step}"], ref["after"][i],
                                       rtol=1e-4, atol=1e-6, err_msg=f"step {step} {name}")
        np.testing.assert_allclose(trace[f"layer_outputs/hidden@{step}"], ref["hidden"],
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trace[f"layer_outputs/out@{step}"], ref["out"],
                                   rtol=1e-5, atol=1e-6)
    steps_in_file = {int(k.rpartition("@")[2]) for k in trace.files if "@" in k}
    assert steps_in_file == set(RECORDED)
    assert "stateless_apply" not in vars(model.optimizer)


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_recording_leaves_training_bitwise_plain_keras(tmp_path, spe, jit):
    plain = _model(spe, jit)
    plain_history = _fit(plain).history
    model = _model(spe, jit)
    history = _fit(model, [StepRecorder(str(tmp_path / "t.npz"), steps=RECORDED)]).history
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_clipped_gradients_and_a_learning_rate_schedule(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(RATE, decay_steps=1, decay_rate=0.5)
    model = _model()
    model.compile(keras.optimizers.SGD(schedule, clipnorm=0.01), "mse")
    reference = _reference(model, 3, clipnorm=0.01)
    path = str(tmp_path / "trace.npz")
    _fit(model, [StepRecorder(path, steps=[1, 3], record=["gradients", "learning_rate"])])
    trace = np.load(path)
    assert sorted(k for k in trace.files if k.startswith("learning_rate")) == [
        "learning_rate@1", "learning_rate@3"]
    np.testing.assert_allclose(trace["learning_rate@1"], RATE, rtol=1e-6)
    np.testing.assert_allclose(trace["learning_rate@3"], RATE * 0.25, rtol=1e-6)
    kernel = model.get_layer("hidden").kernel.path
    np.testing.assert_allclose(trace[f"gradients/{kernel}@1"], reference[0]["grads"][0],
                               rtol=1e-4, atol=1e-7)
    assert not any(k.startswith(("weights", "loss", "layer_outputs")) for k in trace.files)


def test_data_parallel_records_the_global_batch(tmp_path):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices("cpu")))
    try:
        model = _model(spe=2)
        reference = _reference(model, 3)
        path = str(tmp_path / "trace.npz")
        _fit(model, [StepRecorder(path, steps=[1, 3])])
    finally:
        keras.distribution.set_distribution(None)
    trace = np.load(path)
    kernel = model.get_layer("out").kernel.path
    for step in (1, 3):
        np.testing.assert_allclose(trace[f"gradients/{kernel}@{step}"],
                                   reference[step - 1]["grads"][2], rtol=1e-4, atol=1e-6)
        assert trace[f"layer_outputs/out@{step}"].shape == (BATCH, 1)


def test_steps_the_fit_does_not_reach_are_said_once(tmp_path):
    path = str(tmp_path / "trace.npz")
    with pytest.warns(RuntimeWarning, match=r"StepRecorder did not record step\(s\) 20 "):
        _fit(_model(spe=4), [StepRecorder(path, steps=[2, 20])])
    assert {k.rpartition("@")[2] for k in np.load(path).files if "@" in k} == {"2"}


def test_beside_every_other_instrument_and_in_a_second_fit(tmp_path):
    from kerasdbg.callbacks import GradientStatistics, StepTimer, StopOnRule

    plain = _model(spe=2)
    _fit(plain)
    plain_history = _fit(plain).history
    model = _model(spe=2)
    gradients, timer = GradientStatistics(), StepTimer()
    first, second = str(tmp_path / "first.npz"), str(tmp_path / "second.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit(model, [StepRecorder(first, steps=[1, 4]), gradients, timer,
                     StopOnRule(verbose=False)])
        history = _fit(model, [StepRecorder(second, steps=[0, 10]), gradients, timer]).history
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert gradients.history.step.tolist() == list(range(STEPS + 1, 2 * STEPS + 1))
    kernel = model.get_layer("hidden").kernel.path
    trace = np.load(first)
    assert {k.rpartition("@")[2] for k in trace.files if "@" in k} == {"1", "4"}
    # A later fit: step 0 is behind it (the weights before training are not these).
    trace = np.load(second)
    assert {k.rpartition("@")[2] for k in trace.files if "@" in k} == {"10"}
    np.testing.assert_allclose(
        np.linalg.norm(trace[f"gradients/{kernel}@10"]),
        gradients.history.set_index("step").loc[10, f"{kernel}/l2_norm"], rtol=1e-5)


@pytest.mark.parametrize("spe, batches, step", [(1, 2, 1), (4, 3, 2)])
def test_a_step_the_loss_scaler_skips_is_recorded_when_its_update_is_made(
        tmp_path, mixed_precision, spe, batches, step):
    """Under mixed_float16 an overflow at the first batch is skipped and the
    step counter does not move: step `step` is batch `step + 1`'s update,
    whose weights a plain fit of the same batches makes (also when the skip
    is an earlier call of the same execution, which the host learns only
    after it)."""
    y = Y.copy()
    y[:BATCH] *= 1e4  # the first batch overflows float16
    x2, y2 = X[:batches * BATCH], y[:batches * BATCH]

    def model():
        keras.utils.set_random_seed(5)
        made = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, name="hidden"),
                                 keras.layers.Dense(1, name="out", dtype="float32")])
        made.compile(keras.optimizers.SGD(RATE), "mse", steps_per_execution=spe)
        return made

    plain = model()
    plain.fit(x2, y2, batch_size=BATCH, shuffle=False, verbose=0)
    # One update fewer than batches: the first was skipped.
    assert int(plain.optimizer.iterations.numpy()) == step
    recorded = model()
    path = str(tmp_path / "trace.npz")
    recorded.fit(x2, y2, batch_size=BATCH, shuffle=False, verbose=0,
                 callbacks=[StepRecorder(path, steps=[step], record=["gradients", "weights"])])
    trace = np.load(path)
    for variable, value in zip(recorded.trainable_variables, plain.get_weights()):
        np.testing.assert_array_equal(trace[f"weights/{variable.path}@{step}"], value)
        assert np.all(np.isfinite(trace[f"gradients/{variable.path}@{step}"]))


def test_no_variable_matching_lists_the_variables_and_records_the_rest(tmp_path):
    model = _model()
    path = str(tmp_path / "t.npz")
    with pytest.warns(RuntimeWarning) as caught:
        _fit(model, [StepRecorder(path, include="nothing")])
    said = [str(w.message) for w in caught if str(w.message).startswith("StepRecorder")]
    assert len(said) == 1, said
    assert said[0].startswith("StepRecorder records nothing this fit: none of the variables "
                              "that optimizer applied matches include='nothing', "
                              "exclude=None: hidden/bias, hidden/kernel, out/bias, out/kernel")
    # What does not need the variables is recorded all the same.
    trace = np.load(path)
    assert sorted({k.rpartition("@")[2] for k in trace.files if "@" in k}) == ["1", "2", "3"]
    assert {"loss@1", "learning_rate@1", "layer_outputs/out@1"} <= set(trace.files)
    assert not any(k.startswith(("gradients", "weights")) for k in trace.files)
