"""The debug layers (TapLayer, PrintLayer, insert_taps) and ActivationStatistics on JAX.

Runs on the JAX backend only (`KERAS_BACKEND=jax`, see tests/conftest.py).
Expected values are NumPy on the tapped layer's input, computed here from the
weights of a plain copy of the model (no kerasdbg layer) trained batch by
batch with `train_on_batch`: the weights before each step give that step's
activations.
"""

import io
import warnings

import jax
import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics
from kerasdbg.errors import UnsupportedBackendError
from kerasdbg.layers import PrintLayer, TapLayer

BATCH, STEPS = 8, 6
RNG = np.random.default_rng(11)
X = RNG.normal(size=(BATCH * STEPS, 5)).astype("float32")
Y = RNG.normal(size=(BATCH * STEPS, 1)).astype("float32")
STATS = ("mean", "std", "min", "max", "zero_fraction")
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


def make_model(spe=1, jit=True, tap=None, dead_unit=False):
    """Input(5) -> Dense(6, relu) "hidden" [-> tap] -> Dense(1) "out", seeded."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(6, activation="relu", name="hidden")
    h = hidden(inputs)
    if tap is not None:
        h = tap(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h), name="net")
    if dead_unit:
        kernel, bias = hidden.get_weights()
        kernel[:, 0], bias[0] = 0.0, -1.0  # unit 0 never fires, and gets no gradient
        hidden.set_weights([kernel, bias])
    model.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def fit(model, callbacks=(), epochs=1):
    return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def reference_activations(steps=STEPS, dead_unit=False):
    """The hidden activations each step of a plain fit sees, and the final weights."""
    model = make_model(dead_unit=dead_unit)
    seen = []
    for step in range(steps):
        kernel, bias = model.get_layer("hidden").get_weights()
        rows = slice((step % STEPS) * BATCH, (step % STEPS + 1) * BATCH)
        seen.append(np.maximum(X[rows] @ kernel + bias, 0.0))
        model.train_on_batch(X[rows], Y[rows])
    return seen, [np.asarray(w) for w in model.get_weights()]


def numpy_stats(x):
    return {"mean": x.mean(), "std": x.std(), "min": x.min(), "max": x.max(),
            "zero_fraction": np.mean(x == 0)}


def kerasdbg_warnings(record):
    return [str(w.message) for w in record if "kerasdbg" in str(w.filename)
            or "TapLayer" in str(w.message) or "PrintLayer" in str(w.message)
            or "ActivationStatistics" in str(w.message)]


@pytest.fixture
def data_parallel():
    devices = jax.devices("cpu")  # also on a machine with a GPU
    assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


def check_history(tap, expected, steps):
    history = tap.history
    assert history.step.tolist() == list(steps)
    assert set(history["mode"]) == {"fit"}
    for row, step in zip(history.itertuples(), steps):
        want = numpy_stats(expected[step - 1])
        for name in STATS:
            np.testing.assert_allclose(getattr(row, name), want[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} at step {step}")


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_tap_records_each_fit_step_as_numpy_on_its_input(spe, jit):
    expected, weights = reference_activations()
    tap = TapLayer(stats=STATS, activation="relu", name="tap")
    model = make_model(spe, jit, tap)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(model)
    assert not kerasdbg_warnings(record)
    check_history(tap, expected, range(1, STEPS + 1))
    # The tap is an identity: training is the plain one's.
    trained = [np.asarray(v.value) for v in model.trainable_variables]
    for got, want in zip(trained, weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_training_with_taps_is_bitwise_the_plain_fit(spe, jit):
    plain = make_model(spe, jit)
    fit(plain, epochs=2)
    tapped = make_model(spe, jit, TapLayer(activation="relu", histogram=True, name="tap"))
    fit(tapped, [ActivationStatistics()], epochs=2)
    for got, want in zip(tapped.trainable_variables, plain.trainable_variables):
        assert np.array_equal(np.asarray(got.value), np.asarray(want.value)), got.path
    assert np.array_equal(np.asarray(tapped.optimizer.iterations.value),
                          np.asarray(plain.optimizer.iterations.value))


def test_steps_continue_across_fits_and_every_n_steps_selects():
    expected, _ = reference_activations(2 * STEPS)
    tap = TapLayer(stats=STATS, every_n_steps=4, name="tap")
    model = make_model(4, True, tap)
    fit(model)
    fit(model)  # a second fit: the optimizer's steps go on
    steps = [4, 8, 12]
    check_history(tap, expected, steps)


def test_data_parallel_records_the_global_batch_once_per_step(data_parallel):
    expected, _ = reference_activations()
    tap = TapLayer(stats=STATS, activation="relu", name="tap")
    model = make_model(2, True, tap)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(model)
    assert not kerasdbg_warnings(record)
    check_history(tap, expected, range(1, STEPS + 1))
    assert {r["mode"] for r in [tap.latest]} == {"fit"}


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_evaluate_predict_and_eager_calls_count_their_own_calls(spe, jit):
    tap = TapLayer(stats=STATS, name="tap")
    model = make_model(spe, jit, tap)
    fit(model)
    kernel, bias = model.get_layer("hidden").get_weights()
    hidden = np.maximum(X @ kernel + bias, 0.0)
    seen = []
    tap.add_listener(lambda layer, rows: seen.extend(rows))
    model.evaluate(X, Y, batch_size=16, verbose=0)
    assert tap.latest_by_mode["evaluate"]["step"] == 3  # 48 rows, batches of 16
    np.testing.assert_allclose(tap.latest_by_mode["evaluate"]["mean"], hidden[32:].mean(),
                               rtol=1e-5)
    model.predict(X, batch_size=24, verbose=0)
    model.predict(X[:24], batch_size=24, verbose=0)
    assert tap.latest_by_mode["predict"]["step"] == 3
    np.testing.assert_allclose(tap.latest_by_mode["predict"]["max"], hidden[:24].max(),
                               rtol=1e-5)
    tap(hidden[:2])
    tap(hidden[2:4])
    assert tap.latest["mode"] == "call" and tap.latest["step"] == 2
    np.testing.assert_allclose(tap.latest["mean"], hidden[2:4].mean(), rtol=1e-5)
    assert seen == []  # listeners see fit's records only
    assert len(tap.history) == STEPS


def test_insert_taps_on_a_functional_model_records_every_selected_layer():
    expected, _ = reference_activations()
    model = make_model()
    tapped = kerasdbg.insert_taps(model, layers=["hidden", "out"],
                                  tap=TapLayer(stats=STATS))
    assert [layer.name for layer in tapped.layers] == ["x", "hidden", "hidden_tap", "out",
                                                       "out_tap"]
    callback = ActivationStatistics()
    fit(tapped, [callback])
    check_history(tapped.get_layer("hidden_tap"), expected, range(1, STEPS + 1))
    assert tapped.get_layer("hidden_tap").activation == "relu"
    assert callback.history.step.tolist() == list(range(1, STEPS + 1))
    assert "hidden_tap/dead_fraction" in callback.history.columns
    # The shared weights were trained: the original model's are the tapped one's.
    for a, b in zip(model.trainable_variables, tapped.trainable_variables):
        assert a is b


@pytest.mark.parametrize("spe, jit", [(1, True), (4, False)], ids=["spe1-jit", "spe4-nojit"])
def test_print_layer_prints_each_step_in_order(spe, jit):
    expected, _ = reference_activations()
    stream = io.StringIO()
    layer = PrintLayer("hidden out", stats=["mean", "max"], summarize=2,
                       output_stream=stream, name="p")
    model = make_model(spe, jit, layer)
    fit(model)
    lines = stream.getvalue().splitlines()
    assert len(lines) == STEPS
    for step, line in enumerate(lines, start=1):
        x = expected[step - 1]
        flat = x.reshape(-1)
        want = (f"kerasdbg fit step {step} replica 0 | hidden out | shape ({BATCH}, 6) | "
                f"mean={x.mean():.6g} max={x.max():.6g} | "
                f"[{flat[0]:.6g} {flat[1]:.6g} ... {flat[-2]:.6g} {flat[-1]:.6g}]")
        head, _, _ = line.partition(" | mean=")
        assert head == want.partition(" | mean=")[0]
        values = line.split(" | ")[3]
        np.testing.assert_allclose([float(v.split("=")[1]) for v in values.split()],
                                   [x.mean(), x.max()], rtol=1e-5)


def test_activation_statistics_find_a_planted_dead_unit():
    tap = TapLayer(stats=["mean"], activation="relu", min_examples=16, name="tap")
    model = make_model(2, True, tap, dead_unit=True)
    callback = ActivationStatistics()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(model, [callback])
    assert not kerasdbg_warnings(record)
    expected, _ = reference_activations(dead_unit=True)
    # Dead: inactive in every example of the last 16 (two batches of 8).
    runs = np.zeros(6)
    wanted = []
    for x in expected:
        runs = np.where((x == 0).mean(0) >= 0.99, np.minimum(runs + BATCH, 16), 0)
        wanted.append(np.mean(runs >= 16))
    history = callback.history
    assert history.step.tolist() == list(range(1, STEPS + 1))
    np.testing.assert_allclose(history["tap/dead_fraction"], wanted)
    assert wanted[-1] >= 1 / 6


def test_saturated_units_after_tanh():
    x = np.array([[20.0, 0.1], [-30.0, 0.2]], "float32")
    tap = TapLayer(stats=["mean"], activation="tanh", min_examples=2, name="t")
    tap(np.tanh(x))
    assert tap.latest["saturated_fraction"] == 0.5


class _GuideModel(keras.Model):
    """The keras.io guide's custom `train_step` for JAX (one optimizer)."""

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True)
        return keras.ops.mean((y - y_pred) ** 2), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        return _guide_step(self, state, data)


def _guide_step(model, state, data):
    trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = \
        state
    x, y = data
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
    (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
        trainable_variables, non_trainable_variables, x, y)
    trainable_variables, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables)
    return {"loss": loss}, (trainable_variables, non_trainable_variables,
                            optimizer_variables, metrics_variables)


@pytest.mark.parametrize("spe, jit", [(1, True), (4, False)], ids=["spe1-jit", "spe4-nojit"])
def test_a_custom_jax_train_step_numbers_by_its_optimizer(spe, jit):
    expected, _ = reference_activations()
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,), name="x")
    h = keras.layers.Dense(6, activation="relu", name="hidden")(inputs)
    tap = TapLayer(stats=STATS, name="tap")
    model = _GuideModel(inputs, keras.layers.Dense(1, name="out")(tap(h)))
    model.compile(keras.optimizers.SGD(0.05), steps_per_execution=spe, jit_compile=jit)
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0)
    check_history(tap, expected, range(1, STEPS + 1))


class _TwoOptimizers(keras.Model):
    """Two optimizers in one stateless step (as a GAN's): `model.optimizer`
    trains "out", a second one, whose variables the model tracks (so they are
    in the non-trainable state), trains "hidden"; the second is built with 10
    steps done, so the records follow the larger count."""

    def build_second(self, optimizer):
        self.second = optimizer
        optimizer.build(self.get_layer("hidden").trainable_variables)
        optimizer.iterations.assign(10)
        self.second_variables = list(optimizer.variables)

    def loss_of(self, trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True)
        return keras.ops.mean((y - y_pred) ** 2), non_trainable_variables

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        (loss, non_trainable), grads = jax.value_and_grad(self.loss_of, has_aux=True)(
            trainable, non_trainable, x, y)
        index = {id(v): i for i, v in enumerate(self.trainable_variables)}
        hidden = [index[id(v)] for v in self.get_layer("hidden").trainable_variables]
        out = [index[id(v)] for v in self.get_layer("out").trainable_variables]
        new_out, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, [grads[i] for i in out], [trainable[i] for i in out])
        positions = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        second = [positions[id(v)] for v in self.second_variables]
        new_hidden, second_values = self.second.stateless_apply(
            [non_trainable[i] for i in second], [grads[i] for i in hidden],
            [trainable[i] for i in hidden])
        trainable, non_trainable = list(trainable), list(non_trainable)
        for i, v in zip(out + hidden, list(new_out) + list(new_hidden)):
            trainable[i] = v
        for i, v in zip(second, second_values):
            non_trainable[i] = v
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables,
                                metrics_variables)


def test_two_optimizers_number_by_the_largest_count():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,), name="x")
    h = keras.layers.Dense(6, activation="relu", name="hidden")(inputs)
    tap = TapLayer(stats=["mean"], name="tap")
    model = _TwoOptimizers(inputs, keras.layers.Dense(1, name="out")(tap(h)))
    model.compile(keras.optimizers.SGD(0.05))
    model.optimizer.build(model.get_layer("out").trainable_variables)
    model.build_second(keras.optimizers.SGD(0.05))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0)
    assert not kerasdbg_warnings(record)
    assert tap.history.step.tolist() == list(range(11, 11 + STEPS))


def test_saved_model_keeps_the_counters_not_the_buffers(tmp_path):
    tap = TapLayer(stats=["mean"], activation="relu", name="tap")
    model = make_model(tap=tap)
    fit(model)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(model.trainable_variables, loaded.trainable_variables):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    loaded_tap = loaded.get_layer("tap")
    assert int(np.asarray(loaded_tap.calls.value)) == STEPS
    assert not np.asarray(loaded_tap._ring.rows.value).any()
    model.set_weights(model.get_weights())  # the buffers are weights on JAX: a round trip
    np.testing.assert_array_equal(model.predict(X, verbose=0), loaded.predict(X, verbose=0))


def test_immediate_printing_refuses_on_jax():
    with pytest.raises(UnsupportedBackendError,
                       match=r"PrintLayer: printing='immediate' prints with tf.print.*'jax'"):
        PrintLayer("x", printing="immediate")


def test_a_train_step_without_keras_state_warns_once_and_trains_on():
    class Renamed(_GuideModel):
        def train_step(self, carried, data):
            return _guide_step(self, carried, data)

    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,))
    tap = TapLayer(stats=["mean"], name="tap")
    model = Renamed(inputs, keras.layers.Dense(1)(tap(inputs)))
    model.compile(keras.optimizers.SGD(0.05))
    with pytest.warns(RuntimeWarning, match=r"TapLayer 'tap' stopped recording.*`state`"):
        model.fit(X, Y, batch_size=BATCH, verbose=0)
    assert len(tap.history) == 0


def test_taps_with_kerasdbg_capture_in_two_fits_flush_every_execution():
    """GradientStatistics puts kerasdbg's train function in place of Keras's
    (and a second fit reuses its jitted step, without a new trace): the
    PrintLayer still prints each step when its execution ends."""
    from kerasdbg.callbacks import GradientStatistics

    stream = io.StringIO()
    layer = PrintLayer("p", stats=["mean"], summarize=0, output_stream=stream, name="p")
    model = make_model(2, True, layer)
    printed = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            printed.append(len(stream.getvalue().splitlines()))

    for _ in range(2):
        fit(model, [GradientStatistics(), Seen()])
    # After each execution of 2 steps, its lines are out.
    assert printed == [2, 4, 6, 8, 10, 12]
    steps = [int(line.split()[3]) for line in stream.getvalue().splitlines()]
    assert steps == list(range(1, 2 * STEPS + 1))


def test_taps_record_on_jax_without_tensorflow():
    import json
    import os
    import subprocess
    import sys
    import textwrap

    from tests.blockers import WITHOUT_TENSORFLOW  # tests.helpers imports TensorFlow

    code = WITHOUT_TENSORFLOW + textwrap.dedent("""
        import json, sys
        import keras, numpy as np
        from kerasdbg.callbacks import ActivationStatistics, StopOnRule
        from kerasdbg.layers import PrintLayer, TapLayer
        import kerasdbg

        inputs = keras.Input((3,))
        h = keras.layers.Dense(4, activation="relu", name="h")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(PrintLayer("p", output_stream="stdout")(h)))
        model.compile("sgd", "mse")
        tapped = kerasdbg.insert_taps(model, layers=["h"])
        callback = ActivationStatistics()
        tapped.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0,
                   callbacks=[callback, StopOnRule()])
        print(json.dumps({"steps": callback.history.step.tolist(),
                          "tensorflow": sorted(m for m in sys.modules
                                               if m.split(".")[0] == "tensorflow")}))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, timeout=300,
                            env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    printed = [line for line in lines[:-1] if line.startswith("kerasdbg fit step")]
    assert [line.split(" | ")[0] for line in printed] == [
        "kerasdbg fit step 1 replica 0", "kerasdbg fit step 2 replica 0"]
    out = json.loads(lines[-1])
    assert out == {"steps": [1, 2], "tensorflow": []}


def test_histogram_sample_rows_and_validation_in_fit(tmp_path):
    expected, _ = reference_activations()
    tap = TapLayer(stats=["mean"], histogram=True, histogram_bins=4, sample_rows=3, name="tap")
    model = make_model(2, True, tap)
    callback = ActivationStatistics(log_dir=str(tmp_path))
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback],
              validation_data=(X[:16], Y[:16]))
    x = expected[-1]
    np.testing.assert_allclose(tap.latest_by_mode["fit"]["mean"], x.mean(), rtol=1e-5)
    # Validation after the epoch: evaluate's own count, on the trained weights.
    assert tap.latest_by_mode["evaluate"]["step"] == 2
    kernel, bias = model.get_layer("hidden").get_weights()
    np.testing.assert_allclose(tap.latest["mean"],
                               np.maximum(X[8:16] @ kernel + bias, 0).mean(), rtol=1e-5)
    np.testing.assert_allclose(tap.latest_rows, np.maximum(X[8:11] @ kernel + bias, 0),
                               rtol=1e-5, atol=1e-6)
    counts, (low, high) = tap.latest_histogram
    assert counts.sum() == BATCH * 6 and low == 0.0
    np.testing.assert_allclose(high, np.maximum(X[8:16] @ kernel + bias, 0).max(), rtol=1e-5)
    assert callback.history.step.tolist() == list(range(1, STEPS + 1))
    assert list((tmp_path / "train").iterdir())


def test_a_tap_on_a_structure_records_each_tensor():
    tap = TapLayer(stats=["mean", "max"], name="tap")
    out = tap({"a": np.ones((2, 3), "float32"), "b": [np.full((2, 1), 4.0, "float32")]})
    assert sorted(tap.parts) == ["a", "b/0"]
    assert tap.parts["a"].latest["mean"] == 1.0 and tap.parts["b/0"].latest["max"] == 4.0
    assert np.asarray(out["b"][0]).tolist() == [[4.0], [4.0]]


def test_more_steps_than_buffer_steps_in_one_execution_warns_once():
    tap = TapLayer(stats=["mean"], buffer_steps=2, name="tap")
    model = make_model(3, True, tap)
    with pytest.warns(RuntimeWarning, match=r"steps_per_execution=3 is larger than "
                                            r"buffer_steps=2"):
        fit(model)
    assert tap.history.step.tolist() == [2, 3, 5, 6]


def test_a_custom_loop_over_stateless_call_records_after_flush():
    tap = TapLayer(stats=["mean"], name="tap")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(tap(inputs)))
    call = jax.jit(model.stateless_call)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    for value in (1.0, 3.0):
        _, non_trainable = call(trainable, non_trainable, np.full((4, 3), value, "float32"))
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    tap.flush()
    assert [tap.latest["step"], tap.latest["mode"], tap.latest["mean"]] == [2, "call", 3.0]


def test_a_call_inside_jax_jit_outside_keras_state_warns_once_and_runs_on():
    tap = TapLayer(stats=["mean"], name="tap")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(tap(inputs)))
    x = np.ones((4, 3), "float32")
    with pytest.warns(RuntimeWarning, match=r"TapLayer 'tap' stopped recording.*inside a JAX "
                                            r"trace.*stateless_call"):
        out = jax.jit(model)(x)
    np.testing.assert_allclose(out, model.predict(x, verbose=0), rtol=1e-6)


@pytest.mark.parametrize("spe, jit", [(1, True), (4, False)], ids=["spe1-jit", "spe4-nojit"])
def test_the_gan_of_keras_io_numbers_both_sub_models_by_its_step(spe, jit):
    """tests/jax/examples.py's DCGAN step (two optimizers, the generator's in the
    non-trainable state) with taps in both sub-models: each call of a sub-model
    in a step (the generator and the discriminator run twice) has that step's
    number, and training is bitwise the untapped GAN's."""
    from tests.examples import ports
    from tests.jax import examples

    def gan(taps):
        keras.utils.set_random_seed(0)
        port, _, x, _ = ports._gan(4, 0, {})
        discriminator, generator = port.discriminator, port.generator
        if taps:
            # The last layer of each: its Dense, its (only) Conv2D.
            discriminator = kerasdbg.insert_taps(
                discriminator, layers=lambda layer: type(layer) is keras.layers.Dense,
                tap=TapLayer(stats=["mean"]))
            generator = kerasdbg.insert_taps(
                generator, layers=lambda layer: type(layer) is keras.layers.Conv2D,
                tap=TapLayer(stats=["mean"]))
        model = examples.GAN(discriminator, generator, port.latent_dim, seed=1337)
        model.compile(d_optimizer=keras.optimizers.Adam(1e-4),
                      g_optimizer=keras.optimizers.Adam(1e-4),
                      loss_fn=keras.losses.BinaryCrossentropy(), steps_per_execution=spe,
                      jit_compile=jit)
        model.fit(x, batch_size=examples.BATCH, epochs=2, shuffle=False, verbose=0)
        return model

    plain, tapped = gan(False), gan(True)
    for got, want in zip(tapped.trainable_variables, plain.trainable_variables):
        assert np.array_equal(np.asarray(got.value), np.asarray(want.value)), got.path
    steps = [step for step in range(1, 9) for _ in range(2)]
    for sub_model in (tapped.discriminator, tapped.generator):
        tap = next(layer for layer in sub_model.layers if isinstance(layer, TapLayer))
        assert tap.history.step.tolist() == steps, tap.name


def test_train_on_batch_then_fit_number_on():
    expected, _ = reference_activations()
    tap = TapLayer(stats=STATS, name="tap")
    model = make_model(1, True, tap)
    for step in range(2):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        model.train_on_batch(X[rows], Y[rows])
    assert tap.history.step.tolist() == [1, 2]
    model.fit(X[2 * BATCH:], Y[2 * BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    check_history(tap, expected, range(1, STEPS + 1))


def test_mixed_precision_taps_record_every_step(mixed_precision):
    """Under mixed_float16 (a LossScaleOptimizer, float16 activations) the
    buffer is not autocast: its int32 head survives, and the values are the
    float16 activations' statistics."""
    tap = TapLayer(stats=["mean", "max"], activation="relu", name="tap")
    model = make_model(2, True, tap)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(model)
    assert not kerasdbg_warnings(record)
    assert not [w for w in record if "scatter inputs have incompatible types" in str(w.message)]
    assert tap.history.step.tolist() == list(range(1, STEPS + 1))
    kernel, bias = model.get_layer("hidden").get_weights()
    model.predict(X[:BATCH], batch_size=BATCH, verbose=0)
    hidden = np.maximum(X[:BATCH].astype("float16") @ kernel.astype("float16")
                        + bias.astype("float16"), 0)
    np.testing.assert_allclose(tap.latest["max"], hidden.max(), rtol=1e-2)


@pytest.mark.parametrize("spe, jit", [(2, True), (1, False)])
def test_the_taps_record_the_faulty_step_that_stop_on_rule_freezes(spe, jit):
    """A NaN in step 3's batch: the freeze throws the step's update away, but
    not what the tap recorded of it (on TensorFlow the buffers are no weights);
    the tap's record of step 3 counts the NaN rows NumPy finds."""
    from kerasdbg.callbacks import StopOnRule

    bad = X.copy()
    bad[2 * BATCH + 1, 0] = np.nan
    tap = TapLayer(stats=("mean", "nan_count"), name="tap")
    model = make_model(spe, jit, tap)
    stop = StopOnRule(verbose=False)
    model.fit(bad, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[stop])
    assert [v.step for v in stop.verdicts][:1] == [3]
    steps = list(tap.history["step"])
    assert steps[:3] == [1, 2, 3], steps
    expected_nan = np.isnan(np.maximum(bad[2 * BATCH:3 * BATCH] @ np.ones((5, 6)), 0)).sum()
    row = tap.history.set_index("step").loc[3]
    assert row["nan_count"] == expected_nan and expected_nan > 0
    assert np.isfinite(tap.history.set_index("step").loc[2, "mean"])


class _TappedCell(keras.layers.Layer):
    """An RNN cell with a tap inside: Keras's JAX RNN runs it under lax.scan."""

    def __init__(self, tap, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.tap = tap
        self.state_size = 4

    def build(self, shape):
        self.dense.build((None, shape[-1] + 4))
        self.tap.build((None, 4))

    def call(self, x, states):
        h = self.tap(self.dense(keras.ops.concatenate([x, states[0]], -1)))
        return h, [h]


@pytest.mark.parametrize("where", ["rnn_cell", "remat"])
def test_a_tap_inside_a_nested_jax_transform_says_so_once_and_the_fit_trains_plain(where):
    """Inside lax.scan (an RNN cell) or jax.checkpoint (a RematScope), the
    layer cannot record: it says so once, and the fit trains as without it."""
    x = RNG.normal(size=(32, 5, 3)).astype("float32")
    y = x.sum((1, 2))[:, None]

    def make(tap):
        keras.utils.set_random_seed(4)
        if where == "rnn_cell":
            model = keras.Sequential([keras.Input((5, 3)), keras.layers.RNN(_TappedCell(tap)),
                                      keras.layers.Dense(1)])
        else:
            with keras.RematScope(mode="full"):
                model = keras.Sequential([keras.Input((5, 3)), keras.layers.Flatten(),
                                          keras.layers.Dense(4, activation="relu"), tap,
                                          keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    plain = make(keras.layers.Identity())
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    tap = TapLayer(name="inner_tap")
    model = make(tap)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    said = [w for w in kerasdbg_warnings(record) if "stopped recording" in w]
    assert len(said) == 1 and "within the step" in said[0], kerasdbg_warnings(record)
    for got, want in zip(model.trainable_variables, plain.trainable_variables):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


@pytest.mark.parametrize("capture", [False, True], ids=["taps", "taps+GradientStatistics"])
def test_each_loop_gives_the_model_its_functions_back_and_the_next_records_again(capture):
    """The sink wraps the model's train/test/predict functions for a loop only:
    after fit (also one that raised), evaluate and predict, the model holds
    Keras's own functions, and the next loop records again."""
    from kerasdbg.callbacks import GradientStatistics

    def callbacks():
        return [GradientStatistics()] if capture else []

    def unwrapped():
        for attribute in ("train_function", "test_function", "predict_function"):
            function = vars(model).get(attribute)
            assert not getattr(function, "_kerasdbg_flushes", False), attribute

    tap = TapLayer(stats=STATS, name="tap")
    model = make_model(2, True, tap)
    fit(model, callbacks())
    unwrapped()
    assert list(tap.history["step"]) == list(range(1, STEPS + 1))
    fit(model, callbacks())
    unwrapped()
    assert list(tap.history["step"]) == list(range(1, 2 * STEPS + 1))
    if capture:
        from kerasdbg.backends.jax import engine

        # The second fit reused the steps jitted for the first (a fit that
        # raises, below, leaves none to reuse): the full variant traced for
        # steps 1-10, the every-step one once, for steps 11 and 12.
        assert engine.engine_for(model).trace_count == 2
    model.evaluate(X, Y, batch_size=16, verbose=0)
    unwrapped()
    assert tap.latest_by_mode["evaluate"]["step"] == 3
    model.predict(X, batch_size=24, verbose=0)
    unwrapped()
    assert tap.latest_by_mode["predict"]["step"] == 2

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch >= 1:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(model, callbacks() + [Boom()])
    unwrapped()

    class EarlyBoom(keras.callbacks.Callback):  # after kerasdbg's capture is in place
        def on_epoch_begin(self, epoch, logs=None):
            raise RuntimeError("early boom")

    with pytest.raises(RuntimeError, match="early boom"):
        fit(model, callbacks() + [EarlyBoom()])
    unwrapped()
    fit(model, callbacks())
    unwrapped()
    # The fit that raised ran one execution (2 steps) and recorded it.
    assert list(tap.history["step"]) == list(range(1, 3 * STEPS + 3))



_SAVE = """
import keras, kerasdbg
from kerasdbg import insert_taps
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d"),
                          keras.layers.Dense(1, name="o")], name="m")
insert_taps(model, layers="^d$").save(sys.argv[1])
"""

_LOAD = """
{imports}
loaded = keras.saving.load_model(sys.argv[1])
print("LAYERS", [type(layer).__name__ for layer in loaded.layers],
      sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
"""


@pytest.mark.parametrize("imports", ["import kerasdbg, keras", "import keras, kerasdbg"])
def test_a_tapped_model_file_loads_after_import_kerasdbg_without_tensorflow(imports, tmp_path):
    """A `.keras` file that holds a TapLayer loads after `import kerasdbg` (before or after
    `import keras`), in a fresh interpreter on JAX where TensorFlow cannot be imported
    (on the commit before: "Could not locate class 'TapLayer'" unless `import
    kerasdbg.layers`)."""
    import os
    import subprocess
    import sys

    from tests.blockers import WITHOUT_TENSORFLOW

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=root)
    path = str(tmp_path / "tapped.keras")
    for code in (_SAVE, _LOAD.format(imports=imports)):
        result = subprocess.run(
            [sys.executable, "-c", WITHOUT_TENSORFLOW + "import sys\n" + code, path],
            capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "LAYERS ['InputLayer', 'Dense', 'TapLayer', 'Dense'] []" in result.stdout, result.stdout
