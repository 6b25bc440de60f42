"""Fails loudly when a Keras upgrade moves what kerasdbg hooks into."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.backends.tensorflow import distribute, multi_worker_fit
from kerasdbg.backends.tensorflow import optimizer_routing as routing
from kerasdbg.capture import keras_objects
from tests.conftest import make_strategy
from tests.helpers import make_mlp


def test_optimizer_methods_and_signatures_are_where_kerasdbg_expects_them():
    optimizer = keras.optimizers.SGD()
    routing.check_supported(optimizer)
    reduce = getattr(optimizer, routing.REDUCE_METHOD)
    assert list(inspect.signature(reduce).parameters) == ["grads_and_vars"]
    assert list(inspect.signature(optimizer.apply).parameters) == ["grads", "trainable_variables"]
    assert "force" in inspect.signature(keras.Model.make_train_function).parameters
    scaled = keras.optimizers.LossScaleOptimizer(optimizer)
    assert keras_objects.inner_optimizer(scaled) is optimizer
    routing.check_supported(scaled)


def test_the_learning_rate_as_set_is_the_schedule_the_variable_or_the_callable():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    scheduled = keras.optimizers.SGD(learning_rate=schedule)
    assert keras_objects.learning_rate_as_set(scheduled) is schedule
    assert keras_objects.learning_rate_as_set(keras.optimizers.LossScaleOptimizer(scheduled)) \
        is schedule
    plain = keras.optimizers.SGD(learning_rate=0.25)
    assert isinstance(keras_objects.learning_rate_as_set(plain), keras.Variable)
    np.testing.assert_allclose(np.asarray(keras_objects.learning_rate_as_set(plain)), 0.25)

    def rate():
        return 0.5

    assert keras_objects.learning_rate_as_set(keras.optimizers.SGD(learning_rate=rate)) is rate


@pytest.mark.parametrize("kind", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_the_gradients_are_clipped_by_the_optimizers_own_method(kind):
    """kerasdbg records the applied gradient as Keras's `_clip_gradients`
    makes it; the expected values here are the clipping written in NumPy."""
    grads = [np.array([3.0, 4.0], np.float32), None, np.array([[12.0, -5.0]], np.float32)]
    optimizer = keras.optimizers.SGD(**{kind: 2.0})
    clipped = keras_objects.clip_gradients(optimizer, [None if g is None else tf.constant(g)
                                                   for g in grads])
    assert clipped[1] is None
    if kind == "clipnorm":
        expected = [g * 2.0 / np.linalg.norm(g) for g in (grads[0], grads[2])]
    elif kind == "global_clipnorm":
        total = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in (grads[0], grads[2])))
        expected = [g * 2.0 / total for g in (grads[0], grads[2])]
    else:
        expected = [np.clip(g, -2.0, 2.0) for g in (grads[0], grads[2])]
    for got, want in zip((clipped[0], clipped[2]), expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_fit_goes_through_the_patched_instance_methods():
    model = make_mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    optimizer = model.optimizer
    seen = {"apply": 0, "reduce": 0}
    original_apply, original_reduce = optimizer.apply, getattr(optimizer, routing.REDUCE_METHOD)

    def apply(grads, trainable_variables=None):
        seen["apply"] += 1
        return original_apply(grads, trainable_variables)

    def reduce(grads_and_vars):
        seen["reduce"] += 1
        reduced = original_reduce(grads_and_vars)
        # The result pairs every gradient with the tf.Variable of a model weight.
        keys = {keras_objects.variable_key(optimizer, v) for v in model.trainable_variables}
        assert {keras_objects.variable_key(optimizer, v) for _, v in reduced} == keys
        return reduced

    keras_objects.patch(optimizer, "apply", apply)
    keras_objects.patch(optimizer, routing.REDUCE_METHOD, reduce)
    try:
        model.fit(np.ones((4, 6)), np.ones((4, 3)), batch_size=2, epochs=1, verbose=0)
    finally:
        keras_objects.unpatch(optimizer, "apply")
        keras_objects.unpatch(optimizer, routing.REDUCE_METHOD)
    assert seen == {"apply": 1, "reduce": 1}  # traced once
    assert "apply" not in vars(optimizer)


def test_callbacks_see_on_train_begin_before_the_first_trace():
    model = make_mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    order = []

    class Spy(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            order.append("on_train_begin")
            original = self.model.optimizer.apply

            def apply(grads, trainable_variables=None):
                order.append("trace")
                return original(grads, trainable_variables)

            keras_objects.patch(self.model.optimizer, "apply", apply)
            self.model.make_train_function(force=True)

        def on_train_end(self, logs=None):
            keras_objects.unpatch(self.model.optimizer, "apply")

    model.fit(np.ones((4, 6)), np.ones((4, 3)), batch_size=2, epochs=1, verbose=0, callbacks=[Spy()])
    assert order == ["on_train_begin", "trace"]


def test_double_patch_is_refused():
    optimizer = keras.optimizers.SGD()
    keras_objects.patch(optimizer, "apply", lambda *a: None)
    try:
        with pytest.raises(keras_objects.KerasInternalsError, match="already patched"):
            keras_objects.patch(optimizer, "apply", lambda *a: None)
    finally:
        keras_objects.unpatch(optimizer, "apply")


def test_the_loop_names_the_debug_layers_rely_on_still_exist():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    for step_method in keras_objects.STEP_METHODS:
        assert callable(getattr(TensorFlowTrainer, step_method))
    for loop, attribute in keras_objects.FUNCTION_ATTRIBUTES.items():
        code = inspect.unwrap(getattr(TensorFlowTrainer, loop)).__code__
        assert "callbacks" in code.co_varnames, loop
        assert attribute in code.co_names, (loop, attribute)


def test_step_context_sees_fit_evaluate_predict_and_plain_calls():
    seen, holder = [], {}

    class Probe(keras.layers.Layer):
        def call(self, x):
            context = keras_objects.step_context()
            seen.append((context.mode, context.model is holder.get("model"),
                         context.callbacks is not None))
            return x

    model = keras.Sequential([keras.Input((2,)), Probe(), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    holder["model"] = model
    x, y = np.zeros((4, 2)), np.zeros((4, 1))
    seen.clear()
    model.fit(x, y, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    model(x)
    model.train_on_batch(x, y)
    assert seen == [("fit", True, True), ("evaluate", True, True), ("predict", True, True),
                    ("call", False, False), ("fit", True, False)]


# The functional-graph helpers' test: tests/test_keras_graph.py.


class _CountsTraces(keras.layers.Layer):
    """An identity that counts the Python calls of `call` (one per trace)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traces = 0

    def call(self, x):
        self.traces += 1
        return x


def _adam_model():
    inputs = keras.Input((6,))
    counter = _CountsTraces()
    model = keras.Model(inputs, keras.layers.Dense(3)(counter(keras.layers.Dense(4)(inputs))))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    counter.traces = 0
    return model, counter


def test_the_first_fit_traces_once_when_the_optimizer_is_built_before_it():
    from kerasdbg.callbacks import GradientStatistics

    x, y = np.ones((4, 6)), np.ones((4, 3))
    # Keras builds Adam inside the first trace; the variables it creates
    # make tf.function trace again.
    model, counter = _adam_model()
    model.fit(x, y, batch_size=2, verbose=0)
    assert counter.traces == 2
    # The engine builds it first (as Keras does under an explicit strategy).
    model, counter = _adam_model()
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[GradientStatistics()])
    assert counter.traces == 1
    assert model.optimizer.built
    # Not before a subclassed model's first call: its variables do not exist yet.
    sub = keras.Sequential([keras.layers.Dense(3)])
    sub.compile(keras.optimizers.Adam(0.01), "mse")
    assert not routing.build_optimizer_before_trace(sub) and not sub.optimizer.built


# ------------------------------------------------------------ multi-worker fit
@pytest.mark.parametrize("name", sorted(multi_worker_fit._MULTI_WORKER_BUGS))
def test_keras_still_has_the_multi_worker_bug_the_fix_replaces(name):
    """Fails loudly when Keras fixes keras-team/keras#20585 or #19246 or moves
    the functions: the fix, its docs and the doctor's findings need a look then."""
    assert multi_worker_fit.multi_worker_fit_is_broken([name])


def test_the_multi_worker_fix_is_idempotent_undoable_and_changes_nothing_on_one_worker(recwarn):
    from keras.src.backend.tensorflow import trainer

    import kerasdbg

    build = trainer.TensorFlowTrainer.__dict__["_maybe_symbolic_build"]
    reduce = trainer.reduce_per_replica
    make = trainer.TensorFlowTrainer.__dict__["_make_function"]
    try:
        assert kerasdbg.compat.fix_multi_worker_fit() is True
        replaced = trainer.TensorFlowTrainer.__dict__["_maybe_symbolic_build"]
        assert replaced is not build and trainer.reduce_per_replica is not reduce
        assert trainer.TensorFlowTrainer.__dict__["_make_function"] is not make
        made = trainer.TensorFlowTrainer.__dict__["_make_function"]
        assert kerasdbg.compat.fix_multi_worker_fit() is True  # idempotent
        assert trainer.TensorFlowTrainer.__dict__["_maybe_symbolic_build"] is replaced
        assert trainer.TensorFlowTrainer.__dict__["_make_function"] is made
        # The bug is still read from Keras's own code while the fix is in place.
        assert multi_worker_fit.multi_worker_fit_is_broken()
        # One process under MirroredStrategy: the same training as without the fix.
        trained = []
        for fixed in (True, False):
            if not fixed:
                kerasdbg.compat.undo_multi_worker_fit()
            strategy = make_strategy("mirrored", collective=True)
            with strategy.scope():
                model = make_mlp()
                model.compile(keras.optimizers.SGD(0.05), "mse")
            history = model.fit(np.ones((16, 6)), np.ones((16, 3)), batch_size=8, epochs=2,
                                verbose=0, shuffle=False)
            trained.append((model.get_weights(), history.history))
        for a, b in zip(trained[0][0], trained[1][0]):
            np.testing.assert_array_equal(a, b)
        assert trained[0][1] == trained[1][1]
        assert trainer.TensorFlowTrainer.__dict__["_maybe_symbolic_build"] is build
        assert trainer.reduce_per_replica is reduce
        assert trainer.TensorFlowTrainer.__dict__["_make_function"] is make
        kerasdbg.compat.undo_multi_worker_fit()  # nothing to undo: no error
    finally:
        multi_worker_fit.undo_multi_worker_fit()
    assert not [w for w in recwarn if "kerasdbg" in str(w.message)]


def test_the_fix_runs_steps_per_execution_under_the_collective_all_reduce(recwarn):
    """Keras fails MirroredStrategy's default (collective) all-reduce with
    steps_per_execution > 1 (keras-team/keras#19246, tests/test_engine.py);
    with the fix, the same training as the reference, partial last execution
    included (10 steps in executions of 4, 4 and 2), with kerasdbg's
    statistics equal to the reference's gradients."""
    from kerasdbg.callbacks import GradientStatistics
    from tests.helpers import BATCH, LEARNING_RATE, X, Y, reference_training

    multi_worker_fit.fix_multi_worker_fit()
    try:
        strategy = make_strategy("mirrored", collective=True)
        assert distribute.all_reduces_collectively(strategy)
        with strategy.scope():
            model = make_mlp()
            model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=4)
        initial = model.get_weights()
        statistics = GradientStatistics(every_n_steps=1)
        history = model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                            callbacks=[statistics])
    finally:
        multi_worker_fit.undo_multi_worker_fit()
    reference = reference_training(initial, len(X) // BATCH)
    assert int(model.optimizer.iterations.numpy()) == len(reference)
    for actual, expected in zip(model.get_weights(), reference[-1]["after"]):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(np.mean([r["loss"] for r in reference]),
                                                       rel=1e-5)
    frame = statistics.history
    assert frame["step"].tolist() == list(range(1, len(reference) + 1))
    np.testing.assert_allclose(
        frame["sequential/hidden/kernel/l2_norm"], [np.linalg.norm(r["grads"][0]) for r in reference],
        rtol=1e-5)
    assert model.train_function.__qualname__.startswith("_steps_loop.")
    assert not [w for w in recwarn if "kerasdbg" in str(w.message)]


def test_the_steps_loop_ends_with_a_dataset_of_unknown_length_and_in_evaluate():
    """A dataset whose length is unknown ends inside an execution (the empty
    Optional): 10 steps in executions of 4, 4 and 2, as the reference; and
    `evaluate` with spe 4 under the collective all-reduce."""
    from tests.helpers import BATCH, LEARNING_RATE, X, Y, reference_training

    data = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(BATCH)
    assert data.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY
    multi_worker_fit.fix_multi_worker_fit()
    try:
        with make_strategy("mirrored", collective=True).scope():
            model = make_mlp()
            model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=4)
        initial = model.get_weights()
        model.fit(data, epochs=1, verbose=0)
        evaluated = model.evaluate(data, verbose=0)
    finally:
        multi_worker_fit.undo_multi_worker_fit()
    reference = reference_training(initial, len(X) // BATCH)
    assert int(model.optimizer.iterations.numpy()) == len(reference)
    after = reference[-1]["after"]
    for actual, expected in zip(model.get_weights(), after):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    outputs = np.maximum(X @ after[0] + after[1], 0.0) @ after[2] + after[3]
    assert evaluated == pytest.approx(float(np.mean((outputs - Y) ** 2)), rel=1e-5)


def test_the_fix_leaves_keras_loop_where_it_works():
    multi_worker_fit.fix_multi_worker_fit()
    try:
        for strategy, spe in ((tf.distribute.MirroredStrategy(
                ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()), 4),
                (make_strategy("mirrored", collective=True), 1),
                (tf.distribute.get_strategy(), 4)):
            with strategy.scope():
                model = make_mlp()
                model.compile("sgd", "mse", steps_per_execution=spe)
            model.make_train_function()
            assert model.train_function.__qualname__.startswith("TensorFlowTrainer._make_function.")
    finally:
        multi_worker_fit.undo_multi_worker_fit()


@pytest.mark.parametrize("name, collective", [
    ("default", False), ("one_device", False), ("mirrored", False), ("mirrored_collective", True),
    ("mirrored_one_device", False)])
def test_the_fix_replaces_keras_steps_loop_only_under_a_collective_all_reduce(name, collective):
    strategies = {
        "default": lambda: tf.distribute.get_strategy(),
        "one_device": lambda: tf.distribute.OneDeviceStrategy("CPU:0"),
        "mirrored": lambda: tf.distribute.MirroredStrategy(
            ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()),
        "mirrored_collective": lambda: tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]),
        "mirrored_one_device": lambda: tf.distribute.MirroredStrategy(["CPU:0"]),
    }
    assert distribute.all_reduces_collectively(strategies[name]()) is collective


def test_the_multi_worker_fix_says_so_where_keras_has_no_bug(monkeypatch):
    import kerasdbg

    for name in ("_maybe_symbolic_build", "reduce_per_replica", "_make_function"):
        monkeypatch.setitem(multi_worker_fit._MULTI_WORKER_BUGS, name, "not in the code")
    with pytest.warns(UserWarning, match=r"does not have the multi-worker bugs .*20585.*19246.*nothing"):
        assert kerasdbg.compat.fix_multi_worker_fit() is False
    assert not multi_worker_fit.multi_worker_fit_fixed()


def test_set_worker_output_refuses_other_modes():
    import kerasdbg

    with pytest.raises(ValueError, match=r"set_worker_output.*mode.*chief.*per_worker.*Received.*'all'"):
        kerasdbg.compat.set_worker_output("all")
