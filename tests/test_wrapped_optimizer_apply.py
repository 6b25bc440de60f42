"""An optimizer class whose `apply` another tool wrapped is recorded (issue 32, item 9).

A monitoring tool (or a test) replaces `AdamW.apply`, or
`keras.optimizers.Optimizer.apply`, by a function that calls the one it saved
first: that saved function is Keras's own, not kerasdbg's route. kerasdbg
routes every class's own `apply` while it traces, so it records through the
wrapper, with Keras's standard train step and with a custom one; the values
are checked against GradientTape and NumPy. An `apply` put on the instance is
not routed: kerasdbg says so, once, naming the optimizer and what it holds.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.backends.tensorflow import optimizer_routing as routing
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics

RNG = np.random.default_rng(9)
X = RNG.normal(size=(64, 4)).astype("float32")
Y = RNG.normal(size=(64, 1)).astype("float32")
BATCH, STEPS = 8, 8


class CustomStep(keras.Model):
    """A custom train step applying its own AdamW."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(3, name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.hidden(x))

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.adamw = keras.optimizers.AdamW(0.01)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y))
        self.adamw.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def _model(step):
    keras.utils.set_random_seed(2)
    if step == "custom":
        model = CustomStep(name="m")
        model.compile()
        model(X[:1])
        return model, model.adamw
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="hidden"),
                              keras.layers.Dense(1, name="out")], name="m")
    model.compile(keras.optimizers.AdamW(0.01), "mse")
    return model, model.optimizer


def _reference(model):
    """Per step: the gradient norms (GradientTape, NumPy) and the weights after
    the update, by a fresh AdamW in an eager loop from the same weights."""
    twin = keras.models.clone_model(model) if not isinstance(model, CustomStep) else CustomStep()
    twin(X[:1])
    twin.set_weights(model.get_weights())
    optimizer = keras.optimizers.AdamW(0.01)
    norms, weights = [], []
    for start in range(0, len(X), BATCH):
        x, y = X[start:start + BATCH], Y[start:start + BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(twin(x) - y))
        grads = tape.gradient(loss, twin.trainable_variables)
        norms.append([float(np.sqrt(np.sum(np.square(g.numpy().astype(np.float64)))))
                      for g in grads])
        optimizer.apply(grads, twin.trainable_variables)
        weights.append([v.numpy() for v in twin.trainable_variables])
    return norms, weights


@pytest.fixture(params=["AdamW", "Optimizer", "AdamW-wraps"],
                ids=["on_AdamW", "on_keras_Optimizer", "on_AdamW_functools_wraps"])
def wrapped_class(request):
    """`<class>.apply` replaced by a wrapper of the inherited function, saved
    first (also with `functools.wraps`, which gives the wrapper Keras's
    `__module__` and name); the wrapper counts its calls (at trace time, in a
    compiled step)."""
    owner = {"AdamW": keras.optimizers.AdamW, "Optimizer": keras.optimizers.Optimizer}[
        request.param.split("-")[0]]
    saved = owner.apply
    had = owner.__dict__.get("apply")
    calls = []

    def apply(self, grads, trainable_variables=None):
        calls.append(type(self).__name__)
        return saved(self, grads, trainable_variables)

    if request.param.endswith("wraps"):
        apply = functools.wraps(saved)(apply)

    owner.apply = apply
    try:
        yield owner, apply, calls
    finally:
        if had is None:
            del owner.apply
        else:
            owner.apply = had


@pytest.mark.parametrize("step", ["standard", "custom"])
def test_gradients_and_weights_are_recorded_through_a_wrapped_class_apply(wrapped_class, step):
    owner, wrapper, calls = wrapped_class
    model, optimizer = _model(step)
    norms, weights = _reference(model)
    gradients, statistics = GradientStatistics(), WeightStatistics()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[gradients, statistics])
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert calls  # the wrapper was in the traced step
    assert int(optimizer.iterations) == STEPS

    history = gradients.history.sort_values("step")
    assert list(history.step) == list(range(1, STEPS + 1))
    paths = ["m/hidden/kernel", "m/hidden/bias", "m/out/kernel", "m/out/bias"]
    for step_norms, (_, row) in zip(norms, history.iterrows()):
        for path, norm in zip(paths, step_norms):
            np.testing.assert_allclose(row[f"{path}/l2_norm"], norm, rtol=1e-5, err_msg=path)
    # The weights recorded after each update, and the model's at the end.
    recorded = statistics.history.sort_values("step")
    for step_weights, (_, row) in zip(weights, recorded.iterrows()):
        for path, value in zip(paths, step_weights):
            np.testing.assert_allclose(
                row[f"{path}/l2_norm"], np.sqrt(np.sum(np.square(value.astype(np.float64)))),
                rtol=1e-5, err_msg=path)
    for actual, expected in zip(model.trainable_variables, weights[-1]):
        np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-5, atol=1e-7)
    # The tool's wrapper is back where it put it; nothing of kerasdbg is left.
    assert owner.__dict__["apply"] is wrapper
    assert not routing.routes_active()


@pytest.mark.parametrize("step", ["standard", "custom"])
def test_stop_on_rule_freezes_through_a_wrapped_class_apply(wrapped_class, step):
    """A NaN in the data of step 3: the weights stay those of step 2."""
    model, optimizer = _model(step)
    _, weights = _reference(model)
    x = X.copy()
    x[2 * BATCH] = np.nan
    stop = StopOnRule(verbose=False)
    model.fit(x, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    assert ("NonFiniteLoss", 3) in [(v.rule, v.step) for v in stop.verdicts]
    for actual, expected in zip(model.trainable_variables, weights[1]):
        np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("step", ["standard", "custom"])
def test_an_apply_held_by_the_instance_is_said_once_with_what_it_is(step):
    model, optimizer = _model(step)
    saved = type(optimizer).apply

    def monitored(grads, trainable_variables=None):
        return saved(optimizer, grads, trainable_variables)

    object.__setattr__(optimizer, "apply", monitored)
    name = "adamw" if step == "custom" else "optimizer"
    expected = (f"GradientStatistics records nothing this fit: {name} (AdamW) applied gradients "
                "without its `apply` passing through kerasdbg: the optimizer holds an `apply` "
                "of its own (test_an_apply_held_by_the_instance_is_said_once_with_what_it_is."
                "<locals>.monitored) that reaches Keras's update without the class's `apply`, "
                "where kerasdbg records.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[GradientStatistics()])
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [expected]
    assert int(optimizer.iterations) == 2 * STEPS  # training went on, as plain Keras's


def test_a_strict_callback_raises_on_an_apply_held_by_the_instance():
    model, optimizer = _model("standard")
    saved = type(optimizer).apply
    object.__setattr__(optimizer, "apply", functools.partial(saved, optimizer))
    with pytest.raises(ValueError, match=r"optimizer \(AdamW\) applied gradients without its "
                                         r"`apply` passing through kerasdbg"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[GradientStatistics(strict=True)])


class PairsApply(keras.optimizers.SGD):
    """An optimizer whose own `apply` takes (gradient, variable) pairs."""

    def apply(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        return super().apply(list(grads), list(variables))


class PairsStep(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.pairs.apply(list(zip(grads, self.trainable_variables)))
        return {"loss": loss}


def test_an_apply_of_another_signature_is_left_alone_and_recorded_through_keras_apply():
    """A class's own `apply` that Keras's signature does not fit is not routed
    (routing it would break the call); the `apply` it calls is."""
    keras.utils.set_random_seed(3)
    model = PairsStep(name="m")
    model.compile()
    model.pairs = PairsApply(0.1)
    model(X[:1])
    twin = PairsStep(name="m")
    twin(X[:1])
    twin.set_weights(model.get_weights())
    norms = []
    for start in range(0, len(X), BATCH):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(twin(X[start:start + BATCH]) - Y[start:start + BATCH]))
        grads = tape.gradient(loss, twin.trainable_variables)
        norms.append(float(np.sqrt(np.sum(np.square(grads[0].numpy().astype(np.float64))))))
        for variable, grad in zip(twin.trainable_variables, grads):
            variable.assign_sub(0.1 * grad)
    gradients = GradientStatistics()
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[gradients])
    history = gradients.history.sort_values("step")
    np.testing.assert_allclose(history["m/out/kernel/l2_norm"], norms, rtol=1e-5)
    assert "apply" in PairsApply.__dict__ and not routing.routes_active()
