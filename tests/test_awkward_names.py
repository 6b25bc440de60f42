"""Any name Keras accepts works with every instrument (issue 32, item 2).

A user's name reaches kerasdbg as a layer name (the NaN replay's and the
trace's scopes, the taps' buffer variables, tags), a model name, a variable
name (tags, trace keys) and the attribute that holds an optimizer in a custom
`train_step` (tags with several optimizers). Each awkward name is given, in one
model, to all four wherever Keras accepts it there, and the model trains with
every instrument at `learning_rate=1e30`: `StopOnRule` must stop at the first
step whose loss is not finite, found by a plain Keras twin of the model (same
weights, no kerasdbg), keeping the weights the twin had one step earlier, and
the records must exist and name the layer, variable and optimizer as given.
Names that plain Keras itself refuses in a role are tested as refused there
(a Keras that starts accepting them fails here and gets them added).
"""

import glob
import os
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StepRecorder
from kerasdbg.callbacks import StopOnRule, WeightStatistics
from kerasdbg.layers import TapLayer
from kerasdbg.rules import NonFiniteLoss

RNG = np.random.default_rng(5)
X = RNG.uniform(size=(32, 4)).astype("float32")
Y = RNG.uniform(size=(32, 1)).astype("float32")
BATCH, EPOCHS, LR = 8, 2, 1e30

NAMES = {"leading_underscore": "_d", "double_underscore": "__d", "leading_dot": ".d",
         "leading_dash": "-d", "digit_first": "1d", "dots_and_dashes": "a.b-c", "angle": "a>b",
         "thousand_characters": "d" * 1000, "space": "a b", "non_ascii": "é層",
         "punctuation": "a,b|c:d"}
# Where Keras (TensorFlow) takes a name as a scope: a layer's inside its
# model's, a model's at the root of the train step's graph.
LAYER_SCOPE = re.compile(r"^[A-Za-z0-9_.\\/>-]*$")
ROOT_SCOPE = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
REFUSED = [("layer", "space"), ("layer", "non_ascii"), ("model", "leading_underscore"),
           ("model", "double_underscore"), ("model", "leading_dash"), ("model", "space"),
           ("model", "non_ascii")]


class Scaled(keras.layers.Layer):
    """`x @ w` with one weight of a given name."""

    def __init__(self, weight_name="w", **kwargs):
        super().__init__(**kwargs)
        self.weight_name = weight_name

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 3), name=self.weight_name,
                                 initializer=keras.initializers.GlorotUniform(seed=1))

    def call(self, x):
        return tf.matmul(x, self.w)


class Named(keras.Sequential):
    """A Sequential model with a custom train step and two optimizers, the first
    (for the layer `Scaled`) held at the attribute `attribute`."""

    def __init__(self, name, **kwargs):
        layer = name if LAYER_SCOPE.match(name) else "d"
        super().__init__([keras.Input((4,)), Scaled(name, name=layer),
                          TapLayer(name=f"{layer}_tap"), keras.layers.Dense(1, name="out")],
                         name=name if ROOT_SCOPE.match(name) else "m", **kwargs)
        self.attribute, self.layer = name, layer

    def compile(self, learning_rate):
        super().compile()
        setattr(self, self.attribute, keras.optimizers.SGD(learning_rate))
        self.head_optimizer = keras.optimizers.SGD(learning_rate)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        body, head = self.layers[0].trainable_variables, self.layers[2].trainable_variables
        getattr(self, self.attribute).apply(tape.gradient(loss, body), body)
        self.head_optimizer.apply(tape.gradient(loss, head), head)
        return {"loss": loss}


def _model(name):
    model = Named(name)
    model.compile(LR)
    return model


def _trainable(model):
    return [np.array(v) for v in model.trainable_variables]


class _Steps(keras.callbacks.Callback):
    """The twin's loss and weights after each step (plain Keras)."""

    def __init__(self):
        super().__init__()
        self.losses, self.weights = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        self.weights.append(_trainable(self.model))


def _scalar_tags(directory):
    accumulator = EventAccumulator(os.path.join(directory, "train"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator.Tags()["scalars"]


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
def test_every_instrument_guards_and_records_under_an_awkward_name(tmp_path, name):
    model = _model(name)
    twin = _model(name)
    twin.set_weights(model.get_weights())
    steps = _Steps()
    twin.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[steps])
    first_bad = next(i for i, loss in enumerate(steps.losses, start=1) if not np.isfinite(loss))

    stop = StopOnRule(rules=[NonFiniteLoss()])
    callbacks = [GradientStatistics(str(tmp_path / "g")), WeightStatistics(str(tmp_path / "w")),
                 ActivationStatistics(str(tmp_path / "a")),
                 StepRecorder(str(tmp_path / "t.npz"), steps=[1]), stop]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=callbacks)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []

    # Guarded: stopped at the first non-finite loss, with the weights of the step
    # before; the NaN replay (layer by layer, under the layers' scopes) ran too.
    assert {v.step for v in stop.verdicts} == {first_bad}
    assert {v.rule for v in stop.verdicts} == {"NonFiniteLoss", "NaNSource"}
    assert model.stop_training
    for actual, expected in zip(_trainable(model), steps.weights[first_bad - 2]):
        np.testing.assert_array_equal(actual, expected)

    # Recorded under the names as given (read back by TensorBoard's reader).
    path = f"{model.name}/{model.layer}/{name}"
    gradients, weights = _scalar_tags(str(tmp_path / "g")), _scalar_tags(str(tmp_path / "w"))
    assert {f"gradients/{path}/l2_norm", f"gradients/{name}/global_norm",
            "gradients/head_optimizer/global_norm"} <= set(gradients)
    assert f"weights/{path}/l2_norm" in weights
    tap = f"{model.layer}_tap"
    assert any(t.startswith(f"activations/{tap}/") for t in _scalar_tags(str(tmp_path / "a")))
    trace = set(np.load(str(tmp_path / "t.npz"), allow_pickle=False).keys())
    assert {f"gradients/{path}@1", f"weights/{path}@1", f"layer_outputs/{tap}@1"} <= trace


def _sequential(role, name):
    return keras.Sequential([keras.Input((4,)), Scaled(name=name if role == "layer" else "d"),
                             keras.layers.Dense(1, name="out")],
                            name=name if role == "model" else "m")


@pytest.mark.parametrize("role, key", REFUSED, ids=[f"{r}-{k}" for r, k in REFUSED])
def test_plain_keras_refuses_these_names_in_this_role(role, key):
    name = NAMES[key]
    model = _sequential(role, name)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(ValueError, match="is not a valid (root )?scope name"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)


def test_leading_underscore_stops_at_step_1_with_the_default_rules_as_a_plain_name_does(
        read_every_execution):
    """The issue's case: a layer `_d`, learning rate 1e30, `StopOnRule()` (read after
    every execution: the step the fit stops at does not depend on the machine's speed)."""
    stopped = {}
    for name in ("d", "_d"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name=name),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(LR), "mse")
        stop = StopOnRule()
        model.fit(X, Y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[stop])
        stopped[name] = ([(v.rule, v.step) for v in stop.verdicts],
                         int(model.optimizer.iterations))
    assert stopped["d"][0]
    assert stopped["_d"] == stopped["d"]


@pytest.mark.parametrize("name, expected", [
    ("_d_rows", "kerasdbg__d_rows"), ("-d", "kerasdbg_-d"), (".d", ".d"), ("1d", "1d"),
    ("a b", "a_b"), ("é層_tap", "kerasdbg____tap"), ("a>b", "a_b")],
    ids=["leading_underscore", "leading_dash", "leading_dot", "digit_first", "space",
         "non_ascii", "angle"])
def test_buffer_variables_get_names_tensorflow_accepts_at_a_graph_root(name, expected):
    assert _buffers.variable_name(name) == expected

    @tf.function(autograph=False)
    def make():
        with tf.init_scope():
            pass
        return tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="x",
                                      name=_buffers.variable_name(name))

    make.get_concrete_function()  # a node of that name at the root of a graph


def _points(run_dir):
    """`{tag: {step: [values]}}` of the simple scalars of a run's event files."""
    points = {}
    for path in glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        for event in event_file_loader.LegacyEventFileLoader(path).Load():
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    points.setdefault(value.tag, {}).setdefault(event.step, []).append(
                        value.simple_value)
    return points


def test_two_optimizers_draw_one_point_per_step_of_every_view_from_all_variables(tmp_path):
    """A GAN-like train step (two optimizers, one after the other): the views
    of a step come from the records of both, grouped by the model's layers."""
    model = _model("d")
    model.compile(0.05)
    grads = GradientStatistics(str(tmp_path), every_n_steps=1)
    weights = WeightStatistics(str(tmp_path), every_n_steps=1)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[grads, weights])
    steps = list(range(1, len(X) // BATCH + 1))
    points = _points(str(tmp_path / "train"))
    views = {tag: by_step for tag, by_step in points.items() if tag.startswith("views/")}
    # The model's three variables: one group each, named after the layer.
    paths = [v.path for v in model.trainable_variables]
    assert paths == ["d/d/d", "d/out/kernel", "d/out/bias"]
    groups = dict(zip(paths, ["d/d", "out/kernel", "out/bias"]))
    assert {t.rpartition("/max/")[2] for t in views if "/l2_norm/max/" in t} == set(groups.values())
    for tag, by_step in views.items():
        assert all(len(values) == 1 for values in by_step.values()), tag
    norms = grads.history.groupby("step")[[f"{p}/l2_norm" for p in groups]].max()
    ratios = weights.history.groupby("step")[[f"{p}/update_ratio" for p in groups]].max()
    assert norms.index.tolist() == steps and ratios.index.tolist() == steps
    norms, ratios = norms.to_numpy(np.float64), ratios.to_numpy(np.float64)
    # Each optimizer recorded its own variables only (NaN in the other's row):
    # the rows of a step merged, each variable once.
    assert not np.isnan(norms).any()

    def drawn(tag):
        return [views[tag][step][0] for step in steps]

    view = "views/gradients/l2_norm"
    np.testing.assert_allclose(drawn(f"{view}/log10_max"), np.log10(norms.max(axis=1)), rtol=1e-6)
    np.testing.assert_allclose(drawn(f"{view}/log10_min"), np.log10(norms.min(axis=1)), rtol=1e-6)
    for i, (path, group) in enumerate(groups.items()):
        np.testing.assert_allclose(drawn(f"{view}/max/{group}"), norms[:, i], rtol=1e-6)
        np.testing.assert_allclose(drawn(f"{view}/log10_max/{group}"), np.log10(norms[:, i]),
                                   rtol=1e-6)
        finite = np.isfinite(ratios[:, i])
        ratio = views.get(f"views/weights/update_ratio/log10_max/{group}", {})
        assert sorted(ratio) == [s for s, f in zip(steps, finite) if f]
        np.testing.assert_allclose([ratio[s][0] for s in sorted(ratio)],
                                   np.log10(ratios[finite, i]), rtol=1e-6)
    # One holder of the largest and of the smallest at each step.
    for name, pick in [("log10_largest", norms.argmax(axis=1)),
                       ("log10_smallest", norms.argmin(axis=1))]:
        held = {tag[len(f"{view}/{name}/"):]: by_step for tag, by_step in views.items()
                if tag.startswith(f"{view}/{name}/")}
        assert sorted(s for by_step in held.values() for s in by_step) == steps
        for step, i in zip(steps, pick):
            assert held[paths[i]][step] == pytest.approx([np.log10(norms[step - 1, i])],
                                                          rel=1e-6)
    # Each optimizer's global norm, its own line.
    for optimizer in ("d", "head_optimizer"):
        np.testing.assert_allclose(
            drawn(f"views/gradients/global_norm/log10/{optimizer}"),
            np.log10([points[f"gradients/{optimizer}/global_norm"][s][0] for s in steps]),
            rtol=1e-6)
    fraction = [np.mean(r[np.isfinite(r)] > 0.01) for r in ratios]
    np.testing.assert_allclose(drawn("views/weights/update_ratio/fraction_above_0.01"), fraction)
