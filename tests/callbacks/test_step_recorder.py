"""StepRecorder: full tensors of chosen steps, checked against GradientTape."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.callbacks import StepRecorder
from tests.conftest import make_strategy, matrix, only_upstream_failure
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = [0, 1, 2, 6]


def _compile(model, spe=1, jit=False, lr=LEARNING_RATE):
    model.compile(keras.optimizers.SGD(lr), "mse", steps_per_execution=spe, jit_compile=jit)


def _paths(model):
    return [v.path for v in model.trainable_variables]


@pytest.mark.parametrize("strategy_name,spe,jit", matrix())
def test_matrix_records_the_reference_tensors(strategy_name, spe, jit, tmp_path):
    with make_strategy(strategy_name).scope():
        model = make_mlp()
        _compile(model, spe, jit)
    initial = [v.numpy() for v in model.trainable_variables]
    path = str(tmp_path / "trace.npz")
    # A static batch dimension: XLA needs it for layer outputs (tested below).
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH, drop_remainder=True)
    with only_upstream_failure(strategy_name, jit):
        model.fit(data, epochs=1, verbose=0, callbacks=[StepRecorder(path, steps=STEPS)])
    trace = np.load(path)
    reference = reference_training(initial, max(STEPS))
    for i, path_ in enumerate(_paths(model)):
        np.testing.assert_array_equal(trace[f"weights/{path_}@0"], initial[i])
    for step in STEPS[1:]:
        ref = reference[step - 1]
        np.testing.assert_allclose(trace[f"loss@{step}"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(trace[f"learning_rate@{step}"], LEARNING_RATE, rtol=1e-7)
        for i, path_ in enumerate(_paths(model)):
            np.testing.assert_allclose(trace[f"gradients/{path_}@{step}"], ref["grads"][i],
                                       rtol=1e-5, atol=1e-6, err_msg=f"step {step} {path_}")
            np.testing.assert_allclose(trace[f"weights/{path_}@{step}"], ref["after"][i],
                                       rtol=1e-5, atol=1e-6, err_msg=f"step {step} {path_}")
        # The whole global batch, the replicas' slices in order.
        np.testing.assert_allclose(trace[f"layer_outputs/hidden@{step}"], ref["hidden"],
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(trace[f"layer_outputs/out@{step}"], ref["out"],
                                   rtol=1e-5, atol=1e-6)
    steps_in_file = {int(k.rpartition("@")[2]) for k in trace.files if "@" in k}
    assert steps_in_file == set(STEPS)
    assert "apply" not in vars(model.optimizer)


def _bn_dropout_model():
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, use_bias=False, name="d1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dropout(0.3, name="drop")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="d2")(h), name="bn_dropout")


def _train(callbacks, spe, strategy_name):
    with kerasdbg.deterministic(5), make_strategy(strategy_name).scope():
        model = _bn_dropout_model()
        model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=spe)
        model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return [v.numpy() for v in model.variables]


@pytest.mark.parametrize("strategy_name,spe", [("default", 1), ("default", 4), ("mirrored", 2)],
                         ids=["default-spe1", "default-spe4", "mirrored-spe2"])
def test_recording_does_not_change_training(strategy_name, spe, tmp_path):
    """The replay for layer outputs puts back BatchNormalization's moving
    statistics and the Dropout seed: training is bitwise that of a plain fit."""
    plain = _train([], spe, strategy_name)
    recorded = _train([StepRecorder(str(tmp_path / "t.npz"), steps=[1, 3, 5])], spe, strategy_name)
    assert len(plain) == len(recorded)
    for a, b in zip(plain, recorded):
        np.testing.assert_array_equal(a, b)
    trace = kerasdbg.load_trace(str(tmp_path / "t.npz"))
    assert trace.steps == [1, 3, 5]
    assert trace.get("layer_outputs/bn", 3).shape == (BATCH, 8)


def test_learning_rate_schedule_is_recorded_per_step(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model = make_mlp()
    model.compile(keras.optimizers.SGD(schedule), "mse", steps_per_execution=2)
    path = str(tmp_path / "lr.npz")
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[StepRecorder(path, steps=4, record=["learning_rate", "loss"])])
    trace = np.load(path)
    # The update of step k uses the schedule at iteration k - 1.
    for step in range(1, 5):
        np.testing.assert_allclose(trace[f"learning_rate@{step}"], 0.1 * 0.5 ** (step - 1), rtol=1e-6)
    assert not [k for k in trace.files if k.startswith(("gradients/", "weights/", "layer_outputs/"))]


def test_xla_with_a_dynamic_batch_leaves_out_layer_outputs_with_a_warning(tmp_path):
    model = make_mlp()
    _compile(model, 1, True)
    data = tf.data.Dataset.from_tensor_slices((X[:20], Y[:20])).batch(BATCH)  # 8, 8, 4
    path = str(tmp_path / "xla.npz")
    with pytest.warns(RuntimeWarning, match="drop_remainder=True"):
        model.fit(data, epochs=1, verbose=0, callbacks=[StepRecorder(path, steps=2)])
    trace = kerasdbg.load_trace(path)
    assert trace.names("layer_outputs") == []
    assert trace.steps == [1, 2] and trace.names("gradients")


@pytest.mark.parametrize("jit,data", [
    (False, "dataset"), (True, "arrays"),
], ids=["nojit-dataset", "jit-arrays"])
def test_the_partial_last_batch_is_recorded_whole(jit, data, tmp_path):
    """Without XLA any shape goes; under XLA the fit's batch size (known for
    arrays) bounds a padded buffer, and the padding is cut off."""
    model = make_mlp()
    _compile(model, 2, jit)
    initial = [v.numpy() for v in model.trainable_variables]
    path = str(tmp_path / "partial.npz")
    recorder = StepRecorder(path, steps=3)
    if data == "dataset":
        model.fit(tf.data.Dataset.from_tensor_slices((X[:20], Y[:20])).batch(BATCH), epochs=1,
                  verbose=0, callbacks=[recorder])
    else:
        model.fit(X[:20], Y[:20], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorder])
    trace = kerasdbg.load_trace(path)
    assert [trace.get("layer_outputs/out", s).shape[0] for s in (1, 2, 3)] == [8, 8, 4]
    w0, b0, w1, b1 = reference_training(initial, 2)[1]["after"]
    expected = np.maximum(X[16:20] @ w0 + b0, 0) @ w1 + b1
    np.testing.assert_allclose(trace.get("layer_outputs/out", 3), expected, rtol=1e-5, atol=1e-6)


def test_include_and_layers_select_what_is_recorded(tmp_path):
    model = make_mlp()
    _compile(model)
    path = str(tmp_path / "some.npz")
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[StepRecorder(path, steps=1, include="kernel", layers="^out$")])
    trace = kerasdbg.load_trace(path)
    assert [n.rsplit("/", 1)[1] for n in trace.names("gradients")] == ["kernel", "kernel"]
    assert trace.names("layer_outputs") == ["layer_outputs/out"]


@pytest.mark.parametrize("layers", ["^out$", ["out"], lambda layer: layer.name == "out"],
                         ids=["regex", "list", "callable"])
def test_layers_take_the_forms_of_insert_taps(tmp_path, layers):
    model = make_mlp()
    _compile(model)
    path = str(tmp_path / "forms.npz")
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[StepRecorder(path, steps=1, layers=layers)])
    assert kerasdbg.load_trace(path).names("layer_outputs") == ["layer_outputs/out"]


def test_layers_that_name_no_layer_warn_and_record_no_output(tmp_path):
    model = make_mlp()
    _compile(model)
    path = str(tmp_path / "none.npz")
    with pytest.warns(RuntimeWarning, match=re.escape(
            "StepRecorder: no layer named 'nope' in `")) as caught:
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[StepRecorder(path, steps=1, layers=["nope"])])
    message = str(caught[0].message)
    assert "Layers: input_layer, hidden, out" in message and message.endswith(
        "StepRecorder records no layer outputs this fit.")
    trace = kerasdbg.load_trace(path)
    assert trace.names("layer_outputs") == [] and trace.names("gradients")
    with pytest.raises(ValueError, match="no layer named 'nope'"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[StepRecorder(str(tmp_path / "s.npz"), steps=1, layers=["nope"],
                                          strict=True)])


def test_a_later_fit_past_the_steps_keeps_the_file(tmp_path):
    model = make_mlp()
    _compile(model)
    path = str(tmp_path / "kept.npz")
    recorder = StepRecorder(path, steps=2)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    first = dict(np.load(path))
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    second = dict(np.load(path))
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])


def test_subclassed_model_records_all_but_layer_outputs(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Net()
    model(X[:1])
    _compile(model)
    path = str(tmp_path / "sub.npz")
    with pytest.warns(RuntimeWarning, match="not a Functional or Sequential model"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[StepRecorder(path, 1)])
    trace = kerasdbg.load_trace(path)
    assert len(trace.names("gradients")) == 2 and trace.names("layer_outputs") == []


def test_unwritable_path_warns_and_training_goes_on(tmp_path):
    folder = tmp_path / "a_folder.npz"
    folder.mkdir()
    model = make_mlp()
    _compile(model)
    with pytest.warns(RuntimeWarning, match="could not record"):
        history = model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0,
                            callbacks=[StepRecorder(str(folder), steps=1)])
    assert len(history.history["loss"]) == 2
    model = make_mlp()
    _compile(model)
    with pytest.raises(kerasdbg.RecordingError, match=re.escape(
            f"StepRecorder could not record: kerasdbg could not write its records to "
            f"{str(folder)!r}; the fit stops (`strict=True`). Cause: ")) as raised:
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[StepRecorder(str(folder), steps=[0], strict=True)])
    assert isinstance(raised.value.__cause__, OSError)


def test_get_config_round_trip(tmp_path):
    recorder = StepRecorder(str(tmp_path / "t.npz"), steps=[0, 5], record=["loss"],
                            include="kernel", exclude="out", layers="hidden", strict=True)
    config = recorder.get_config()
    assert StepRecorder.from_config(config).get_config() == config


@pytest.mark.parametrize("kwargs,error,match", [
    ({"path": None}, TypeError, "`path` must be a str"),
    ({"steps": 0}, ValueError, "`steps` must be a positive int. Received: steps=0"),
    ({"steps": [1, -2]}, ValueError, r"list of ints >= 0. Received: steps=\[1, -2\]"),
    ({"steps": "3"}, TypeError, "`steps` must be a positive int or a non-empty list"),
    ({"record": ["grads"]}, ValueError, "`record` must be a non-empty list of names from loss"),
    ({"include": "("}, ValueError, "include"),
    ({"layers": 3}, TypeError, "StepRecorder: `layers` must be None, a regular expression, a "
     "non-empty list of layer names or a callable `layer -> bool`. Received: layers=3"),
    ({"strict": 1}, TypeError, "`strict` must be a bool"),
], ids=["path", "steps-zero", "steps-negative", "steps-str", "record", "include", "layers", "strict"])
def test_bad_arguments_are_refused(kwargs, error, match, tmp_path):
    arguments = {"path": str(tmp_path / "t.npz"), **kwargs}
    with pytest.raises(error, match=match):
        StepRecorder(**arguments)


def test_no_variable_matching_lists_the_variables(tmp_path):
    model = make_mlp()
    _compile(model)
    path = str(tmp_path / "t.npz")
    with pytest.warns(RuntimeWarning, match="StepRecorder records nothing this fit: none of the "
                                            "variables that optimizer applied matches "
                                            "include='nothing'.*hidden/kernel"):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[StepRecorder(path, include="nothing")])
    # What does not need the variables is recorded all the same.
    trace = kerasdbg.load_trace(path)
    assert trace.steps == [1, 2, 3] and "loss" in trace.tensors and not trace.names("gradients")


def test_file_is_written_when_the_last_step_arrives(tmp_path):
    """A fit that later fails keeps the recorded steps."""

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                raise RuntimeError("boom")

    model = make_mlp()
    _compile(model)
    path = str(tmp_path / "early.npz")
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[StepRecorder(path, steps=2), Boom()])
    assert os.path.isfile(path)
    assert kerasdbg.load_trace(path).steps == [1, 2]


def test_steps_the_fit_does_not_reach_are_said_and_no_empty_file_is_written(tmp_path):
    path = str(tmp_path / "never.npz")
    model = make_mlp()
    _compile(model)
    steps = len(X) // BATCH
    with pytest.warns(RuntimeWarning, match=re.escape(
            "StepRecorder records nothing this fit: it was asked for step(s) 1000 "
            f"(`steps`=[1000]) and this fit ran steps 1-{steps} (the optimizer's steps, from 1; "
            f"0 is the initial weights); it wrote no file to {path!r}.")) as caught:
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[StepRecorder(path, steps=[1000])])
    assert len([w for w in caught if "StepRecorder" in str(w.message)]) == 1
    assert not os.path.exists(path)


def test_steps_partly_reached_are_said_and_the_file_holds_the_others(tmp_path):
    path = str(tmp_path / "part.npz")
    model = make_mlp()
    _compile(model)
    steps = len(X) // BATCH
    with pytest.warns(RuntimeWarning, match=re.escape(
            f"StepRecorder did not record step(s) 1000 (`steps`=[2, 1000]): this fit ran steps "
            f"1-{steps}. {path!r} holds step(s) 2.")):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[StepRecorder(path, steps=[2, 1000], record=["loss"])])
    assert np.load(path)["loss@2"].shape == ()
    assert "loss@1000" not in np.load(path).files
