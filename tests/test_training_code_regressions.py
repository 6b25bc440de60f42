"""The eleven ways real training code broke kerasdbg, one regression test (or a few) each.

Numbered as in the issue that reported them: several optimizers (1), a train step that
computes its own loss (2), lazily built models (3), rules on healthy layers (4), a `fit`
that ends by an exception (5), an unusable log directory (6), nothing trainable (7),
non-finite norms (8), a rolled-back run (9), gradient accumulation (10), clipping (11).
Expected values come from GradientTape, NumPy or the test's own capture of what the
optimizers' `apply` receives (`tests/examples/capture.py`).
"""

import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.sinks import events as _events
from kerasdbg.capture import keras_objects
from kerasdbg.backends.tensorflow import optimizer_routing as routing
from kerasdbg.callbacks import GradientStatistics, StepRecorder, StepTimer, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.rules import ExplodingTensor, FreezeOnFault, NaNSource, NonFiniteLoss
from kerasdbg.rules import LossNotDecreasing, VanishingGradient
from tests.conftest import make_strategy
from tests.examples.capture import capture_applies

RNG = np.random.default_rng(3)
X = RNG.normal(size=(32, 4)).astype("float32")
Y = RNG.normal(size=(32, 1)).astype("float32")


def _plain_state(model):
    """Nothing of kerasdbg left in the model, its optimizers or Keras's classes."""
    assert "train_step" not in vars(model) and "compute_loss" not in vars(model)
    for _, optimizer in keras_objects.find_optimizers(model):
        assert not {"apply", routing.REDUCE_METHOD} & set(vars(optimizer))
    assert not routing.routes_active()


def _norms_match_capture(rows, captured):
    """Each step's recorded `<path>/l2_norm` equals the capture's (one dict per apply)."""
    for step, norms in enumerate(captured, start=1):
        row = rows[rows.step == step].iloc[0]
        for path, norm in norms.items():
            np.testing.assert_allclose(row[f"{path}/l2_norm"], norm, rtol=1e-5,
                                       err_msg=f"step {step} {path}")


# ------------------------------------------------ 1. several optimizers
class TwoOptimizers(keras.Model):
    """The issue's minimal case: two sub-models, each trained by its own optimizer."""

    def __init__(self):
        super().__init__()
        self.first = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="f")],
                                      name="first")
        self.second = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="s")],
                                       name="second")

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.a = keras.optimizers.SGD(0.1)
        self.b = keras.optimizers.Adam(0.01)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            hidden = self.first(x)
            loss_a = tf.reduce_mean(tf.square(hidden))
            loss_b = tf.reduce_mean(tf.square(self.second(tf.stop_gradient(hidden)) - y))
        self.a.apply(tape.gradient(loss_a, self.first.trainable_variables),
                     self.first.trainable_variables)
        self.b.apply(tape.gradient(loss_b, self.second.trainable_variables),
                     self.second.trainable_variables)
        return {"loss_a": loss_a, "loss_b": loss_b}


def test_1_every_optimizer_the_train_step_applies_is_recorded(tmp_path):
    keras.utils.set_random_seed(1)
    model = TwoOptimizers()
    model.compile(steps_per_execution=2)
    grads, weights = GradientStatistics(str(tmp_path)), WeightStatistics(stats=["l2_norm"])
    with capture_applies() as capture:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[grads, weights])
    history = grads.history
    assert history[["step", "optimizer"]].values.tolist() == [
        [s, name] for s in (1, 2, 3, 4) for name in ("a", "b")]
    for name, optimizer in (("a", model.a), ("b", model.b)):
        rows = history[history.optimizer == name]
        _norms_match_capture(rows, capture.norms(optimizer))
        for step, norms in enumerate(capture.norms(optimizer), start=1):
            row = rows[rows.step == step].iloc[0]
            np.testing.assert_allclose(row[f"{name}/global_norm"],
                                       np.sqrt(sum(n ** 2 for n in norms.values())), rtol=1e-5)
    assert sorted(weights.history.optimizer.unique()) == ["a", "b"]
    # Each optimizer's global norm and step counter in TensorBoard.
    run = kerasdbg.load_run(str(tmp_path))
    assert run.tags(r"global_norm") == ["gradients/a/global_norm", "gradients/b/global_norm"]
    assert run.scalars("gradients/b/global_norm").step.tolist() == [1, 2, 3, 4]
    _plain_state(model)


def test_1_each_optimizer_s_weights_are_described_at_its_steps():
    class Weights(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.after = []

        def on_train_batch_end(self, batch, logs=None):
            self.after.append({v.path: np.linalg.norm(v.numpy().astype(np.float64))
                               for v in self.model.trainable_variables})

    keras.utils.set_random_seed(1)
    model = TwoOptimizers()
    model.compile()
    weights, seen = WeightStatistics(stats=["l2_norm"]), Weights()
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[weights, seen])
    history = weights.history
    assert history[["step", "optimizer"]].values.tolist() == [
        [s, name] for s in (1, 2, 3, 4) for name in ("a", "b")]
    for name, sub_model in (("a", model.first), ("b", model.second)):
        rows = history[history.optimizer == name].set_index("step")
        for step in (1, 2, 3, 4):
            for variable in sub_model.trainable_variables:
                np.testing.assert_allclose(rows.loc[step, f"{variable.path}/l2_norm"],
                                           seen.after[step - 1][variable.path], rtol=1e-6)
        # Only its own variables: the other optimizer's are NaN in its rows.
        others = [v.path for v in model.trainable_variables
                  if v.path not in {w.path for w in sub_model.trainable_variables}]
        assert rows[[f"{p}/l2_norm" for p in others]].isna().all().all()


class ListedOptimizers(TwoOptimizers):
    """Optimizers kept in a list, one of them behind a LossScaleOptimizer."""

    def compile(self, **kwargs):
        keras.Model.compile(self, **kwargs)
        self.optimizers = [keras.optimizers.SGD(0.1),
                           keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            hidden = self.first(x)
            loss_a = tf.reduce_mean(tf.square(hidden))
            loss_b = tf.reduce_mean(tf.square(self.second(tf.stop_gradient(hidden)) - y))
            scaled_b = self.optimizers[1].scale_loss(loss_b)
        self.optimizers[0].apply(tape.gradient(loss_a, self.first.trainable_variables),
                                 self.first.trainable_variables)
        self.optimizers[1].apply(tape.gradient(scaled_b, self.second.trainable_variables),
                                 self.second.trainable_variables)
        return {"loss_b": loss_b}


class KeptEverywhere(keras.Model):
    """Optimizers in a dict and a sub-model compiled with its own."""

    def __init__(self):
        super().__init__()
        self.first = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="f")],
                                      name="first")
        self.second = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="s")],
                                       name="second")
        self.second.compile(optimizer=keras.optimizers.Adam(0.01))

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.optimizers = {"hidden": keras.optimizers.SGD(0.1)}

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            hidden = self.first(x)
            loss_a = tf.reduce_mean(tf.square(hidden))
            loss_b = tf.reduce_mean(tf.square(self.second(tf.stop_gradient(hidden)) - y))
        self.optimizers["hidden"].apply(tape.gradient(loss_a, self.first.trainable_variables),
                                        self.first.trainable_variables)
        self.second.optimizer.apply(tape.gradient(loss_b, self.second.trainable_variables),
                                    self.second.trainable_variables)
        return {"loss": loss_b}


@pytest.mark.parametrize("make, names, place, applied", [
    # Under the loss scale, what the inner optimizer applies: unscaled.
    (ListedOptimizers, ["optimizers[0]", "optimizers[1]"], "optimizers[1]",
     lambda model: model.optimizers[1].inner_optimizer),
    (KeptEverywhere, ["optimizers[hidden]", "second.optimizer"], "second.optimizer",
     lambda model: model.second.optimizer),
], ids=["lists-and-loss-scale", "dicts-and-sub-models"])
def test_1_optimizers_are_named_by_their_place(make, names, place, applied):
    keras.utils.set_random_seed(1)
    model = make()
    model.compile()
    grads = GradientStatistics(stats=["l2_norm"])
    with capture_applies() as capture:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[grads])
    history = grads.history
    assert sorted(history.optimizer.unique()) == names
    _norms_match_capture(history[history.optimizer == place], capture.norms(applied(model)))
    _plain_state(model)


class Assigns(keras.Model):
    """Updates its weights by hand: no Keras optimizer applies anything."""

    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.d(x) - y))
        for v, g in zip(self.trainable_variables, tape.gradient(loss, self.trainable_variables)):
            v.assign_sub(0.1 * g)
        return {"loss": loss}


NO_OPTIMIZER = ("no optimizer applied gradients in the train step (kerasdbg sees every Keras "
                "optimizer's `apply`/`apply_gradients` called inside `train_step`; the model "
                "holds: optimizer). If the train step updates the weights another way (assign, "
                "a non-Keras optimizer), there is nothing to record")


@pytest.mark.parametrize("name", ["GradientStatistics", "WeightStatistics", "StepRecorder",
                                  "StopOnRule"])
def test_1_an_optimizer_kerasdbg_does_not_see_applied_is_said_once(tmp_path, name):
    callback = {"GradientStatistics": lambda: GradientStatistics(),
                "WeightStatistics": lambda: WeightStatistics(),
                "StepRecorder": lambda: StepRecorder(str(tmp_path / "t.npz"), record=["gradients"]),
                "StopOnRule": lambda: StopOnRule(verbose=False)}[name]()
    model = Assigns()
    model.compile(optimizer="sgd")
    if name == "StopOnRule":  # one message for its gradient and weight requests
        expected = (f"StopOnRule records no gradients or weights this fit: {NO_OPTIMIZER}; the "
                    "rules that read them have nothing to read and will not fire.")
    else:
        expected = f"{name} records nothing this fit: {NO_OPTIMIZER}."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == [expected]
    _plain_state(model)


def test_1_a_fault_the_second_optimizer_finds_freezes_from_it_on_and_says_what_it_kept(
        tmp_path):
    """The NaN reaches only the second optimizer's loss: the first one had applied that
    train step's update, which no freeze can undo, and the verdicts say so."""
    def fresh():
        keras.utils.set_random_seed(1)
        model = TwoOptimizers()
        model.compile(steps_per_execution=4)
        return model

    reference = fresh()  # clean data: `a` never reads y
    reference.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)
    b_after_2 = [w.numpy() for w in reference.second.weights]
    reference.fit(X[16:24], Y[16:24], batch_size=8, shuffle=False, verbose=0)
    a_after_3 = [w.numpy() for w in reference.first.weights]

    model = fresh()
    y = Y.copy()
    y[16] = np.nan  # train step 3: loss_b only
    stop = StopOnRule([NonFiniteLoss(), ExplodingTensor()], loss="loss_b", verbose=False,
                      log_dir=str(tmp_path))
    model.fit(X, y, batch_size=8, shuffle=False, verbose=0,
              callbacks=[stop, GradientStatistics(str(tmp_path), stats=["nan_count", "inf_count"])])
    for got, want in zip(model.first.weights, a_after_3):
        np.testing.assert_array_equal(got.numpy(), want)  # a's step 3 kept, 4 frozen
    for got, want in zip(model.second.weights, b_after_2):
        np.testing.assert_array_equal(got.numpy(), want)  # b frozen from step 3 on
    by_rule = {v.rule: v for v in stop.verdicts}
    assert {v.step for v in stop.verdicts} == {3}
    assert sorted(by_rule) == ["ExplodingTensor", "FreezeOnFault", "NaNSource", "NonFiniteLoss"]
    assert by_rule["NaNSource"].reason.endswith(
        "non-finite gradients (applied by b): second/s/bias, second/s/kernel")
    freeze = by_rule["FreezeOnFault"]
    assert freeze.severity == "info" and freeze.reason == (
        "FreezeOnFault at step 3: a had applied this train step's update before b's apply "
        "found the fault; a freeze acts from the apply that finds the fault on and cannot "
        "undo an earlier one, so a's weights include step 3's update")
    # The same verdicts offline, from what the run wrote.
    offline = kerasdbg.check_run(str(tmp_path), [NonFiniteLoss(), ExplodingTensor(),
                                                 FreezeOnFault(), NaNSource()])
    assert [(v.rule, v.step, v.reason, v.severity) for v in offline] == [
        (v.rule, v.step, v.reason, v.severity) for v in stop.verdicts]
    _plain_state(model)


# ------------------------------------------- 2. a train step's own loss

class OwnLoss(keras.Model):
    """Computes its loss itself (no `compute_loss`) and returns it, per step."""

    def __init__(self, name_of_loss="loss"):
        super().__init__()
        self.d = keras.layers.Dense(1, name="d")
        self.name_of_loss = name_of_loss

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.d(x) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {self.name_of_loss: loss, "doubled": 2.0 * loss}


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_2_the_loss_a_custom_train_step_returns_is_the_step_loss(tmp_path, spe):
    keras.utils.set_random_seed(2)
    model = OwnLoss()
    model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=spe)
    assert not model.built  # built inside fit
    stop = StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path))
    with capture_applies() as capture:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    assert stop.verdicts == [] and stop.loss_source == "the train step's 'loss'"
    run = kerasdbg.load_run(str(tmp_path))
    losses = run.scalars("step/loss")
    assert losses.step.tolist() == [1, 2, 3, 4]
    # Each step's loss from NumPy: the weights before each step, walked back from the
    # final ones with the gradients SGD(0.1) applied (the test's own capture).
    kernel, bias = (model.d.kernel.numpy().astype(np.float64),
                    model.d.bias.numpy().astype(np.float64))
    gradients = capture.gradients(model.optimizer)
    expected = []
    for step in reversed(range(4)):
        kernel = kernel + 0.1 * gradients[step]["d/kernel"]
        bias = bias + 0.1 * gradients[step]["d/bias"]
        rows = slice(8 * step, 8 * (step + 1))
        expected.insert(0, np.mean(np.square(X[rows] @ kernel + bias - Y[rows])))
    np.testing.assert_allclose(losses.value, expected, rtol=1e-5)
    # Per step, not Keras's running mean: twice the loss is recorded as returned.
    np.testing.assert_allclose(run.scalars("step/doubled").value, 2 * losses.value, rtol=1e-6)


class LowerLevel(keras.Model):
    """The keras.io guide's lower-level TensorFlow step ("Customizing what happens in
    fit()"): its own loss function, a `Mean` named "loss" it updates, and that
    metric's `result()` returned as `loss`: the mean since the epoch began."""

    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(1, name="d")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def call(self, x):
        return self.d(x)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


@pytest.mark.parametrize("strategy_name, spe", [("default", 1), ("default", 4),
                                                 ("mirrored", 1)])
def test_2_the_loss_a_train_step_gives_its_loss_metric_is_the_step_loss(
        tmp_path, strategy_name, spe):
    """Under MirroredStrategy each replica gives the metric its own batch's loss; the
    step's loss is the global batch's (the metric's mean over the replicas)."""
    def fit(callbacks, spe):
        keras.utils.set_random_seed(2)
        with make_strategy(strategy_name).scope():
            model = LowerLevel()
            model.compile(optimizer=keras.optimizers.SGD(0.1), steps_per_execution=spe)
        means = []
        logged = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: means.append(logs["loss"]))
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[*callbacks, logged])
        return model, np.asarray(means, np.float64)

    # Each step's loss from a plain fit's running means, one a step (equal weights):
    # the k-th loss is k m_k - (k-1) m_(k-1).
    _, means = fit([], 1)
    expected = means * np.arange(1, 5) - np.concatenate([[0.0], means[:-1] * np.arange(1, 4)])
    plain, _ = fit([], spe)
    stop = StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path), verbose=False, strict=True)
    model, _ = fit([stop], spe)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert stop.verdicts == []
    assert stop.loss_source == "the value the train step gives its metric 'loss'"
    losses = kerasdbg.load_run(str(tmp_path)).scalars("step/loss")
    assert losses.step.tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(losses.value, expected, rtol=1e-4)
    assert not np.allclose(expected[1:], means[1:], rtol=1e-3)  # not the running mean
    assert "update_state" not in vars(model.loss_tracker)  # put back


def test_2_a_named_loss_and_a_missing_one(tmp_path):
    keras.utils.set_random_seed(2)
    model = OwnLoss("g_loss")
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    x = X.copy()
    x[17] = np.nan  # train step 3
    named = StopOnRule(NonFiniteLoss(), loss="g_loss", verbose=False, freeze_on_fault=False)
    model.fit(x, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[named])
    assert [(v.rule, v.step) for v in named.verdicts] == [("NonFiniteLoss", 3), ("NaNSource", 3)]
    # Not named: no single loss, so NonFiniteLoss watches each scalar named a loss
    # (g_loss, not doubled); a rule that needs one loss says so once and never fires.
    # The loss that was not captured is absent from the records, not NaN.
    keras.utils.set_random_seed(2)
    model = OwnLoss("g_loss")
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    silent = StopOnRule([NonFiniteLoss(), LossNotDecreasing()], log_dir=str(tmp_path),
                        freeze_on_fault=False, locate_nan=False)
    with pytest.warns(RuntimeWarning, match=re.escape(
            "StopOnRule: LossNotDecreasing reads step/loss, which this model does not give: the "
            "train step neither calls `compute_loss` nor returns a `loss`; name the scalar to "
            "read with StopOnRule(loss=...), one of: doubled, g_loss. They will not fire.")):
        model.fit(x, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[silent])
    assert [(v.rule, v.step, v.tensors) for v in silent.verdicts] == [
        ("NonFiniteLoss", 3, ("step/g_loss",))]
    assert silent.loss_source == "the train step's 'g_loss'"
    assert "step/loss" not in kerasdbg.load_run(str(tmp_path)).tags()


# ------------------------------------------------- 3. lazily built models
class LazyMLP(keras.Model):
    def __init__(self):
        super().__init__(name="lazy")
        self.d1 = keras.layers.Dense(5, activation="relu", name="d1",
                                     kernel_initializer=keras.initializers.GlorotUniform(7))
        self.d2 = keras.layers.Dense(1, name="d2",
                                     kernel_initializer=keras.initializers.GlorotUniform(8))

    def call(self, x):
        return self.d2(self.d1(x))


def _functional_mlp():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5, activation="relu", name="d1",
                           kernel_initializer=keras.initializers.GlorotUniform(7))(inputs)
    outputs = keras.layers.Dense(1, name="d2",
                                 kernel_initializer=keras.initializers.GlorotUniform(8))(h)
    return keras.Model(inputs, outputs, name="lazy")


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_3_a_model_built_inside_fit_records_as_its_functional_twin(tmp_path, jit):
    histories = []
    for model in (LazyMLP(), _functional_mlp()):
        model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2, jit_compile=jit)
        callbacks = [GradientStatistics(), WeightStatistics(), StopOnRule(verbose=False),
                     StepRecorder(str(tmp_path / f"{model.__class__.__name__}.npz"), steps=[0, 2])]
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        histories.append(callbacks)
        _plain_state(model)
    (lazy_g, lazy_w, lazy_stop, _), (func_g, func_w, func_stop, _) = histories
    for lazy, functional in ((lazy_g, func_g), (lazy_w, func_w)):
        left, right = lazy.history, functional.history
        # Keras names a subclassed model's variables under its name: lazy/d1/kernel.
        assert [c.replace("lazy/", "") for c in left.columns] == list(right.columns)
        assert len(left) == 4
        np.testing.assert_allclose(left.drop(columns="skipped").to_numpy(float),
                                   right.drop(columns="skipped").to_numpy(float), rtol=1e-6)
    assert lazy_stop.verdicts == func_stop.verdicts == []
    lazy_trace = kerasdbg.load_trace(str(tmp_path / "LazyMLP.npz"))
    functional_trace = kerasdbg.load_trace(str(tmp_path / "Functional.npz"))
    assert lazy_trace.steps == functional_trace.steps == [0, 2]
    for name in functional_trace.names("weights"):
        np.testing.assert_array_equal(lazy_trace.get(name.replace("weights/", "weights/lazy/"), 0),
                                      functional_trace.get(name, 0))


def test_3_taps_inside_a_model_built_inside_fit_record():
    from kerasdbg.callbacks import ActivationStatistics
    from kerasdbg.layers import TapLayer

    class Tapped(keras.Model):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(5, activation="relu", name="d1")
            self.tap = TapLayer(stats=["mean"], activation="relu", name="d1_tap")
            self.d2 = keras.layers.Dense(1, name="d2")

        def call(self, x):
            return self.d2(self.tap(self.d1(x)))

    keras.utils.set_random_seed(3)
    model = Tapped()
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
    activations = ActivationStatistics()
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[activations])
    history = activations.history
    assert history.step.tolist() == [1, 2, 3, 4]
    assert list(history.columns) == ["step", "d1_tap/mean", "d1_tap/dead_fraction"]


# ------------------------------------------ never silent: the other reasons
class TrainsHeadOnly(keras.Model):
    """Holds a tapped probe model that its train step never calls."""

    def __init__(self):
        super().__init__()
        from kerasdbg.layers import TapLayer

        inputs = keras.Input((4,))
        tapped = TapLayer(name="unused_tap")(keras.layers.Dense(3, name="p")(inputs))
        self.probe = keras.Model(inputs, tapped, name="probe")
        self.head = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="h")],
                                     name="head")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.head(x) - y))
        variables = self.head.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def test_taps_the_train_step_never_calls_are_said_once():
    from kerasdbg.callbacks import ActivationStatistics

    model = TrainsHeadOnly()
    model.compile(optimizer="sgd")
    with pytest.warns(RuntimeWarning, match=re.escape(
            "ActivationStatistics records nothing this fit: none of its taps (unused_tap) ran in "
            "the train step of model 'trains_head_only'; the train step does not call the layers "
            "they are in. Put the taps in the model or sub-model that `train_step` calls.")):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[ActivationStatistics()])


class Classifier(keras.Model):
    """A custom train step with its own cross-entropy: no `compute_loss`, no labels seen."""

    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(3, activation="softmax")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, self.d(x)))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"loss": loss}


def test_class_counts_a_train_step_does_not_give_are_said_once():
    from kerasdbg.rules import ClassImbalance

    model = Classifier()
    model.compile(optimizer="sgd")
    labels = (np.arange(32) % 3).astype("int64")
    stop = StopOnRule(ClassImbalance(), verbose=False)
    with pytest.warns(RuntimeWarning, match=re.escape(
            "StopOnRule: ClassImbalance reads classes/<k>/seen and classes/<k>/mispredicted, "
            "which this model does not give: the train step does not call `compute_loss` with "
            "labels and class predictions (at most 1000 classes), so there is nothing to count. "
            "They will not fire.")):
        model.fit(X, labels, batch_size=8, epochs=1, verbose=0, callbacks=[stop])
    assert stop.verdicts == []


def test_a_named_loss_the_train_step_does_not_return_is_said_once():
    model = OwnLoss()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    stop = StopOnRule(NonFiniteLoss(), loss="g_loss", verbose=False)
    with pytest.warns(RuntimeWarning, match=re.escape(
            "StopOnRule: NonFiniteLoss reads step/loss, which this model does not give: the "
            "train step returns no scalar 'g_loss' (`loss`); it returns: doubled, loss. They "
            "will not fire.")):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[stop])
    assert stop.loss_source is None


def test_step_recorder_says_it_cannot_record_the_layers_of_a_subclassed_model(tmp_path):
    model = LazyMLP()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    recorder = StepRecorder(str(tmp_path / "t.npz"), steps=1)
    with pytest.warns(RuntimeWarning, match=re.escape(
            "StepRecorder records no layer outputs: LazyMLP is not a Functional or Sequential "
            "model, whose forward pass it can replay.")):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    trace = kerasdbg.load_trace(str(tmp_path / "t.npz"))
    assert trace.names("layer_outputs") == [] and trace.names("gradients")


# --------------------------------------- 4. rules on healthy standard layers
def test_4_zero_by_construction_is_information_not_a_stop():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6, 4))
    attended = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
    h = keras.layers.Conv1D(4, 3, name="conv")(attended)  # a bias BatchNormalization removes
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(1, name="out")(keras.layers.Flatten()(h))
    model = keras.Model(inputs, outputs, name="healthy")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    stop = StopOnRule(VanishingGradient(), verbose=False)  # default action: stop
    x = RNG.normal(size=(64, 6, 4)).astype("float32")
    history = model.fit(x, RNG.normal(size=(64, 1)).astype("float32"), batch_size=8,
                        epochs=1, verbose=0, callbacks=[stop])
    assert model.optimizer.iterations.numpy() == 8, stop.verdicts
    # Reported once each, as information; the key bias from step 1. (The bias before
    # the normalization, which SGD moves from a zero start by update ratios of 0.1 and
    # more, is no vanishing gradient at all: VanishingGradient judges the update too.)
    assert {v.severity for v in stop.verdicts} == {"info"}
    named = [t for v in stop.verdicts for t in v.tensors]
    assert len(named) == len(set(named))
    first = stop.verdicts[0]
    assert first.step == 1 and "mha/key/bias" in first.tensors
    assert "zero by construction, not a fault" in first.reason


def test_4_an_unused_output_head_is_information_not_a_stop():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, {"main": keras.layers.Dense(1, name="main")(hidden),
                                 "aux": keras.layers.Dense(1, name="aux")(hidden)}, name="heads")
    # The auxiliary head is switched off by its loss weight: its gradient is exactly 0.
    model.compile(keras.optimizers.SGD(0.05), loss={"main": "mse", "aux": "mse"},
                  loss_weights={"main": 1.0, "aux": 0.0})
    stop = StopOnRule(VanishingGradient(), verbose=False)
    model.fit(X, {"main": Y, "aux": Y}, batch_size=8, epochs=2, verbose=0, callbacks=[stop])
    assert int(model.optimizer.iterations.numpy()) == 8, stop.verdicts
    assert [(v.severity, v.step, sorted(v.tensors)) for v in stop.verdicts] == [
        ("info", 1, ["aux/bias", "aux/kernel"])]


def test_4_embedding_rows_a_batch_does_not_touch_are_not_vanishing():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(100, 4, name="embedding")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h), name="embedded")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    tokens = RNG.integers(0, 10, size=(32, 6)).astype("int32")  # rows 10-99 never seen
    stop = StopOnRule(VanishingGradient(), verbose=False)
    grads = GradientStatistics(stats=["mean_abs", "zero_fraction"])
    model.fit(tokens, Y, batch_size=8, epochs=2, verbose=0, callbacks=[stop, grads])
    assert stop.verdicts == []
    assert (grads.history["embedding/embeddings/zero_fraction"] >= 0.9).all()


# ------------------------------------- 5. a fit that ends by an exception
def _mlp():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")], name="m")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _trains(model):
    """A later plain fit: the weights move and the loss falls, no freeze left."""
    before = model.get_layer("d").kernel.numpy().copy()
    losses = model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"]
    assert not np.array_equal(model.get_layer("d").kernel.numpy(), before)
    assert losses[0] > losses[1] > losses[2], losses


class Interrupt(keras.callbacks.Callback):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise self.error


def _failing_dataset():
    """Three good batches, then one of the wrong shape: the train function raises."""
    def batches():
        for i in range(3):
            yield X[i * 8:(i + 1) * 8], Y[i * 8:(i + 1) * 8]
        yield np.ones((8, 5), "float32"), Y[:8]

    spec = (tf.TensorSpec((None, None), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    return tf.data.Dataset.from_generator(batches, output_signature=spec)


@pytest.mark.parametrize("way", ["validation", "keyboard", "train_function", "rule_raises"])
def test_5_whatever_way_fit_ends_the_model_is_as_kerasdbg_found_it(way):
    model = _mlp()
    callbacks = [StopOnRule([NonFiniteLoss()], verbose=False), GradientStatistics(),
                 StepTimer()]
    x, y, kwargs = X, Y, {}
    if way == "validation":  # the repro: validation data of the wrong shape
        kwargs["validation_data"] = (np.ones((8, 7), "float32"), Y[:8])
        error = ValueError
    elif way == "keyboard":
        callbacks.append(Interrupt(KeyboardInterrupt()))
        error = KeyboardInterrupt
    elif way == "train_function":
        x, y = _failing_dataset(), None
        error = Exception
    else:
        x = X.copy()
        x[9] = np.nan
        callbacks[0] = StopOnRule([NonFiniteLoss()], action="raise", verbose=False)
        error = kerasdbg.rules.RuleFired
    with pytest.raises(error):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks,
                  **kwargs)
    _plain_state(model)
    # Later plain fits train, and a NaN batch reaches the weights as in plain Keras (the
    # issue saw a freeze left behind: constant losses and an unchanged kernel).
    _trains(model)
    bad = X.copy()
    bad[3] = np.nan
    model.fit(bad[:16], Y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert not np.all(np.isfinite(model.get_layer("d").kernel.numpy()))


def test_5_a_freeze_never_outlives_its_fit():
    model = _mlp()
    x = X.copy()
    x[9] = np.nan  # train step 2
    stop = StopOnRule([NonFiniteLoss()], verbose=False)
    model.fit(x, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    assert [v.step for v in stop.verdicts if v.rule == "NonFiniteLoss"] == [2]
    _plain_state(model)
    _trains(model)


# --------------------------------------------- 6. an unusable log directory
@pytest.mark.parametrize("make", [
    lambda d: GradientStatistics(d), lambda d: WeightStatistics(d),
    lambda d: StopOnRule(NonFiniteLoss(), log_dir=d), lambda d: StepTimer(d),
    lambda d: kerasdbg.callbacks.ActivationStatistics(d)],
    ids=["gradients", "weights", "stop", "timer", "activations"])
def test_6_a_log_dir_that_is_a_file_is_refused_at_construction(tmp_path, make):
    path = tmp_path / "events"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match=re.escape(
            f"`log_dir` must be a directory (TensorBoard writes event files into it); "
            f"{str(path)!r} is a file. Received: log_dir={str(path)!r}")):
        make(str(path))


@pytest.mark.parametrize("error", [
    tf.errors.PermissionDeniedError(None, None, "no permission"),
    tf.errors.ResourceExhaustedError(None, None, "no space left on device")],
    ids=["permission", "full-disk"])
@pytest.mark.parametrize("name", ["GradientStatistics", "StopOnRule"])
def test_6_a_log_dir_that_fails_at_run_time_warns_once_and_training_goes_on(
        tmp_path, monkeypatch, error, name):
    def failing(path, key=None):
        raise error

    def make(**kwargs):
        if name == "StopOnRule":
            return StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path), verbose=False, **kwargs)
        return GradientStatistics(str(tmp_path), **kwargs)

    monkeypatch.setattr(_events, "writer_for", failing)
    model = _mlp()
    callback = make()
    where = os.path.join(str(tmp_path), "train")
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"{name} cannot write TensorBoard events to {where!r} (`log_dir`): "
            f"{type(error).__name__}: {error.message}. It keeps its records in Python only; "
            "training goes on.")) as caught:
        history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert len([w for w in caught if "cannot write" in str(w.message)]) == 1
    assert len(history.history["loss"]) == 1
    if name == "GradientStatistics":
        assert len(callback.history) == 4
    with pytest.raises(kerasdbg.RecordingError, match=re.escape(
            f"{name} could not record: kerasdbg could not write TensorBoard events to {where!r}; "
            "the fit stops (`strict=True`).")) as raised:
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[make(strict=True)])
    assert raised.value.__cause__ is error
    _plain_state(model)


def test_6_a_write_that_fails_part_way_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    from kerasdbg.sinks import tfrecord

    original = tfrecord.write_all
    calls = []

    def write_all(writer, records):
        calls.extend(records)
        if len(calls) > 2:  # the disk fills up at the third step's event
            raise OSError(28, "No space left on device")
        return original(writer, records)

    monkeypatch.setattr(tfrecord, "write_all", write_all)
    model = _mlp()
    grads = GradientStatistics(str(tmp_path))
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"GradientStatistics could not record: kerasdbg could not write TensorBoard "
            f"events to {str(tmp_path / 'train')!r}; the records stay in Python only "
            "(`history`), and training goes on. Cause: OSError: [Errno 28] No space left on "
            "device")) as caught:
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[grads])
    assert len([w for w in caught if "could not record" in str(w.message)]) == 1
    assert len(grads.history) == 8 and model.optimizer.iterations.numpy() == 8
    _plain_state(model)


# -------------------------------------------------- 7. nothing trainable
def test_7_a_model_with_nothing_trainable_trains_with_a_warning(tmp_path):
    model = _mlp()
    model.trainable = False
    model.compile(keras.optimizers.SGD(0.1), "mse")
    for callback, name in ((GradientStatistics(), "GradientStatistics"),
                           (WeightStatistics(), "WeightStatistics"),
                           (StepRecorder(str(tmp_path / "t.npz"), steps=2), "StepRecorder")):
        with pytest.warns(RuntimeWarning, match=re.escape(
                f"{name} records nothing this fit: the model 'm' has no trainable variables, "
                "so no optimizer applied gradients.")):
            history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
        assert len(history.history["loss"]) == 1
        _plain_state(model)


# --------------------------------------------------- 8. non-finite norms
def test_8_a_norm_over_non_finite_values_is_nan_or_inf_not_zero():
    model = _mlp()
    x = X.copy()
    x[8:16] = np.nan  # every element of train step 2's gradient is NaN
    x[16, 0] = np.inf  # train step 3: one infinite input
    grads = GradientStatistics(stats=["l2_norm", "nan_count", "inf_count"])
    model.fit(x, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[grads])
    history = grads.history.set_index("step")
    assert np.isfinite(history.loc[1, "global_norm"])
    assert np.isnan(history.loc[2, "m/d/kernel/l2_norm"]) and np.isnan(history.loc[2, "global_norm"])
    assert history.loc[2, "m/d/kernel/nan_count"] == 4
    step3 = history.loc[3]
    assert np.isnan(step3["global_norm"]) or np.isinf(step3["global_norm"])
    assert step3["m/d/kernel/nan_count"] + step3["m/d/kernel/inf_count"] > 0
    assert not np.isfinite(step3["m/d/kernel/l2_norm"])


# ---------------------------------------------------- 9. a rolled-back run
def test_9_a_run_rolled_back_by_backup_and_restore_keeps_the_latest_writes(tmp_path):
    log_dir, backup = str(tmp_path / "logs"), str(tmp_path / "backup")

    class CrashInEpoch2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.params and self.model.optimizer.iterations.numpy() == 6:
                raise RuntimeError("crash")

    model = _mlp()
    with pytest.raises(RuntimeError, match="crash"):
        model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup), GradientStatistics(log_dir),
            CrashInEpoch2()])
    abandoned = kerasdbg.load_run(log_dir).scalars("gradients/global_norm")
    model = _mlp()  # a new process would start from scratch, then restore
    # Other data after the restart: the resumed steps 5-6 differ from the abandoned ones.
    resumed = GradientStatistics(log_dir)
    model.fit(X, Y * 3.0, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup), resumed])
    run = kerasdbg.load_run(log_dir)
    norms = run.scalars("gradients/global_norm")
    assert norms.step.tolist() == list(range(1, 13))  # one value per step
    latest = resumed.history.set_index("step")["global_norm"]
    for step in (5, 6):  # the latest write, not the abandoned one
        value = norms[norms.step == step].value.iloc[0]
        assert value == pytest.approx(latest[step], rel=1e-6)
        assert value != pytest.approx(abandoned[abandoned.step == step].value.iloc[0], rel=1e-3)
    assert run.rollbacks().to_dict("records") == [{"run": "train", "step": 5, "dropped": [5, 6]}]
    from kerasdbg import report
    summary = report.summary(report.collect(log_dir))
    assert "rolled back: training restarted at step 5 (1 time); steps 5-6 of the abandoned " \
           "run are left out" in summary


# ------------------------------------------------ 10. gradient accumulation
def test_10_gradient_accumulation_records_every_batch_and_the_updates_applied():
    keras.utils.set_random_seed(10)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")], name="m")
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), "mse")
    grads, weights = GradientStatistics(stats=["l2_norm"]), WeightStatistics(
        stats=["l2_norm", "update_ratio"])
    stop = StopOnRule(verbose=False)
    seen = Kernels("d")
    with capture_applies() as capture:
        model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[grads, weights, stop, seen])
    history = grads.history
    # Steps count batches (optimizer.iterations counts updates: 2 after 8 batches).
    assert history.step.tolist() == list(range(1, 9)) and model.optimizer.iterations.numpy() == 2
    assert history.applied.tolist() == [False, False, False, True] * 2
    for step, norms in enumerate(capture.norms(model.optimizer), start=1):
        for path, norm in norms.items():
            np.testing.assert_allclose(history.loc[step - 1, f"{path}/l2_norm"], norm, rtol=1e-5)
    # What was applied at steps 4 and 8: the mean of the four batches' gradients.
    batches = capture.gradients(model.optimizer)
    for step in (4, 8):
        mean = np.mean([batches[s - 1]["m/d/kernel"] for s in range(step - 3, step + 1)], axis=0)
        row = history[history.step == step].iloc[0]
        np.testing.assert_allclose(row["applied_gradients/m/d/kernel/l2_norm"],
                                   np.linalg.norm(mean), rtol=1e-5)
    # The weights are described where they changed, as they are after the update (read by
    # the test after each batch); no rule fires between updates.
    assert weights.history.step.tolist() == [4, 8]
    for step in (4, 8):
        row = weights.history[weights.history.step == step].iloc[0]
        after, before = seen.kernels[step], seen.kernels[step - 1]
        np.testing.assert_allclose(row["m/d/kernel/l2_norm"], np.linalg.norm(after), rtol=1e-5)
        np.testing.assert_allclose(row["m/d/kernel/update_ratio"],
                                   np.linalg.norm(after - before) / np.linalg.norm(before),
                                   rtol=1e-4)
    assert [v for v in stop.verdicts if v.severity == "fault"] == []


# --------------------------------------------------------- 11. clipping
class Kernels(keras.callbacks.Callback):
    """The kernel of layer `name` after each batch (with steps_per_execution=1), and before
    the first: `kernels[k]` is the kernel after train step k."""

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.kernels = []

    def on_train_begin(self, logs=None):
        self.kernels = [self.model.get_layer(self.name).kernel.numpy().copy()]

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.get_layer(self.name).kernel.numpy().copy())


@pytest.mark.parametrize("kind", ["global_clipnorm", "clipnorm", "clipvalue"])
def test_11_clipping_records_the_gradient_before_it_and_what_is_applied(kind):
    keras.utils.set_random_seed(11)
    # No bias and a zero kernel: the first gradients are -2/n X^T y, so the size of y
    # decides which steps clip.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros", name="d")], name="m")
    lr = 0.01
    model.compile(keras.optimizers.SGD(lr, **{kind: 1.0}), "mse")
    y = Y.copy()
    y[0:8] *= 100.0  # train steps 1 and 3: gradients far above 1; 2 and 4: far below
    y[8:16] *= 0.01
    y[16:24] *= 100.0
    y[24:32] *= 0.01
    grads = GradientStatistics(stats=["l2_norm", "max", "min"])
    stop = StopOnRule(ExplodingTensor(threshold=10.0), action="warn", verbose=False,
                      freeze_on_fault=False)
    seen = Kernels("d")
    with capture_applies() as capture, pytest.warns(kerasdbg.rules.RuleWarning):
        model.fit(X, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[grads, stop, seen])
    history = grads.history
    captured = capture.gradients(model.optimizer)
    for step, batch in enumerate(captured, start=1):
        row = history[history.step == step].iloc[0]
        unclipped = batch["m/d/kernel"].astype(np.float64)
        np.testing.assert_allclose(row["global_norm"], np.linalg.norm(unclipped), rtol=1e-5)
        # What SGD applied, from the weights: (before - after) / learning rate.
        applied = (seen.kernels[step - 1].astype(np.float64) - seen.kernels[step]) / lr
        np.testing.assert_allclose(row["applied_gradients/m/d/kernel/l2_norm"],
                                   np.linalg.norm(applied), rtol=1e-4)
        np.testing.assert_allclose(row["applied_gradients/m/d/kernel/max"], applied.max(),
                                   rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(row["applied_gradients/m/d/kernel/min"], applied.min(),
                                   rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(row["applied_gradients/global_norm"], np.linalg.norm(applied),
                                   rtol=1e-4)
        assert row["clipped"] == (1.0 if step in (1, 3) else 0.0), step
    assert grads.clipped_steps == 2
    # The rules read the gradient before clipping: the explosion is seen.
    assert [(v.rule, v.step) for v in stop.verdicts] == [("ExplodingTensor", 1)]


# ------------------------------------------------- found in review
def test_5_the_first_fit_of_a_process_that_raises_is_cleaned_up_too(tmp_path):
    """`Model.fit` is wrapped when kerasdbg is imported, before the first fit resolves it."""
    import subprocess
    import sys

    script = tmp_path / "first_fit.py"
    script.write_text(
        "import numpy as np, keras\n"
        "from kerasdbg.callbacks import GradientStatistics\n"
        "from kerasdbg.backends.tensorflow import optimizer_routing as routing\n"
        "class Stop(keras.callbacks.Callback):\n"
        "    def on_train_batch_end(self, batch, logs=None):\n"
        "        raise KeyboardInterrupt\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "m.compile('sgd', 'mse')\n"
        "try:\n"
        "    m.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0,\n"
        "          callbacks=[GradientStatistics(), Stop()])\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "print('clean' if 'train_step' not in vars(m) and not routing.routes_active() "
        "else 'patched')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=root,
                          env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.stdout.strip().splitlines()[-1] == "clean", done.stderr[-2000:]


def test_a_loss_scale_overflow_is_not_a_fault_of_max_gradient_norm(mixed_precision):
    keras.utils.set_random_seed(12)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")], name="m")
    # In float16, gradients times the initial scale (32768) overflow: the scaler
    # skips those steps and comes down; the unscaled norms stay far below 1e6.
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
    stop = StopOnRule(ExplodingTensor(), max_gradient_norm=1e6, verbose=False)
    before = model.get_layer("d").kernel.numpy().copy()
    model.fit(X * 10, Y * 100, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[stop])
    assert stop.verdicts == []
    assert float(model.optimizer.dynamic_scale.numpy()) < 32768.0
    assert not np.array_equal(model.get_layer("d").kernel.numpy(), before)


class SecondOptimizer(keras.Model):
    """A custom train step that applies its own optimizer, never `model.optimizer`."""

    def __init__(self):
        super().__init__()
        from kerasdbg.layers import TapLayer

        self.d1 = keras.layers.Dense(5, activation="relu", name="d1")
        self.tap = TapLayer(stats=["mean"], activation="relu", name="d1_tap")
        self.d2 = keras.layers.Dense(1, name="d2")
        self.own = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.d2(self.tap(self.d1(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y))
        self.own.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def test_taps_count_the_steps_of_the_optimizer_a_custom_train_step_applies():
    from kerasdbg.callbacks import ActivationStatistics

    keras.utils.set_random_seed(3)
    model = SecondOptimizer()
    model.compile(optimizer="rmsprop", steps_per_execution=2)  # never applied
    activations = ActivationStatistics()
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[activations])
    assert activations.history.step.tolist() == [1, 2, 3, 4]


def test_distances_count_from_the_start_of_each_fit_and_spe_may_change():
    model = _mlp()
    weights = WeightStatistics(stats=["distance_from_start"])
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[weights])
    start = model.get_layer("d").kernel.numpy().copy()
    model.compile(keras.optimizers.SGD(0.1), "mse", steps_per_execution=2)
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[weights])
    history = weights.history
    kernel = model.get_layer("d").kernel.numpy()
    assert history.step.tolist() == [1, 2, 3, 4]  # a recompiled optimizer counts again
    np.testing.assert_allclose(history["m/d/kernel/distance_from_start"].iloc[-1],
                               np.linalg.norm(kernel - start), rtol=1e-5)


def test_check_prints_information_and_exits_0_when_no_rule_fires(tmp_path, capsys):
    from kerasdbg import cli

    log_dir = str(tmp_path)
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6, 4))
    attended = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(attended)))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    # (VanishingGradient judges the update ratio too: the run records the weights'.)
    model.fit(RNG.normal(size=(32, 6, 4)).astype("float32"), Y, batch_size=8, verbose=0,
              callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir)])
    assert cli.main(["check", log_dir, "--rule", "VanishingGradient"]) == 0
    out = capsys.readouterr()
    # The notes in one line, as a fit ends with.
    assert out.out.startswith("(info) information, not faults (1 tensor): VanishingGradient, "
                              "at step 1: zero by construction")
    assert out.out.count("\n") == 1 and "mha/key/bias" in out.out
    assert out.err.strip() == "kerasdbg check: 0 of 1 rules fired"


def test_the_sub_optimizers_of_a_multi_optimizer_are_named_by_their_place():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="first")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="second")(hidden), name="m")
    optimizer = keras.optimizers.MultiOptimizer(
        lambda v: model.first_optimizer if "first" in v.path else model.second_optimizer)
    model.first_optimizer, model.second_optimizer = keras.optimizers.SGD(0.1), \
        keras.optimizers.Adam(0.01)
    model.compile(optimizer, "mse")
    grads = GradientStatistics(stats=["l2_norm"])
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[grads])
    assert len(grads.history) == 8 and len(set(grads.history.optimizer)) == 2
