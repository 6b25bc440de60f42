"""GradientStatistics: special gradients, event files, arguments."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg import load_run
from kerasdbg import stats as stats_lib
from kerasdbg.callbacks import GradientStatistics
from tests.conftest import assert_stats_close, reference_stats
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training


def _fit(model, callbacks, x=X, y=Y, epochs=1, **kwargs):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks, **kwargs)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_embedding_sparse_gradient_described_as_dense(jit):
    keras.utils.set_random_seed(3)
    tokens = np.array([[1, 4, 1], [7, 1, 2]], "int32")  # token 1 repeats
    target = np.array([[0.5], [-1.0]], "float32")
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
                              keras.layers.Embedding(10, 4, name="embed"),
                              keras.layers.Flatten(), keras.layers.Dense(1, name="head")])
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit)
    weights = [v.numpy() for v in model.trainable_variables]
    grads_cb = GradientStatistics()
    model.fit(tokens, target, batch_size=2, epochs=1, verbose=0, callbacks=[grads_cb])
    tvars = [tf.Variable(w) for w in weights]
    with tf.GradientTape() as tape:
        embedded = tf.reshape(tf.gather(tvars[0], tokens), [2, 12])
        loss = tf.reduce_mean(tf.square(embedded @ tvars[1] + tvars[2] - target))
    grads = tape.gradient(loss, tvars)
    assert isinstance(grads[0], tf.IndexedSlices)
    dense = tf.convert_to_tensor(grads[0]).numpy()
    row = grads_cb.history.iloc[0]
    path = model.trainable_variables[0].path
    got = {s: row[f"{path}/{s}"] for s in stats_lib.STATISTICS}
    assert_stats_close(got, reference_stats(dense), np.abs(dense).max(), "embedding")
    assert got["zero_fraction"] == pytest.approx(0.6)  # 4 of 10 rows looked up


def test_variables_without_gradient_are_left_out(tmp_path):
    inputs = keras.Input((6,))
    used = keras.layers.Dense(2, name="used")(inputs)
    unused = keras.layers.Dense(2, name="unused")(inputs)
    model = keras.Model(inputs, [used, unused])
    model.compile(keras.optimizers.SGD(0.1), loss=["mse", None])
    grads_cb = GradientStatistics(str(tmp_path), histogram_every_n_steps=1)
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        _fit(model, [grads_cb], y=[Y[:, :2], Y[:, :2]])
    history = grads_cb.history
    assert not [c for c in history.columns if "unused" in c]
    used_norms = history[[f"{v.path}/l2_norm" for v in model.trainable_variables
                          if "unused" not in v.path]]
    np.testing.assert_allclose(history["global_norm"], np.sqrt((used_norms ** 2).sum(axis=1)), rtol=1e-6)
    run = load_run(str(tmp_path))
    assert not [t for t in run.tags() + run.tags(kind="histograms") if "unused" in t]
    assert [t for t in run.tags() if "used/kernel" in t]


def test_nan_in_the_data_is_counted_and_training_goes_on():
    x = X.copy()
    x[2 * BATCH + 1, 3] = np.nan  # a NaN in the third batch
    # Linear: relu gradients of NaN differ between tf.nn.relu and Keras's relu.
    model = make_mlp(activation=None)
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    initial = [v.numpy() for v in model.trainable_variables]
    grads_cb = GradientStatistics()
    _fit(model, [grads_cb], x=x)
    history = grads_cb.history
    assert history.step.tolist() == list(range(1, 11))
    reference = reference_training(initial, 3, x=x, activation=None)
    row = history.iloc[2]
    for v, grad in zip(model.trainable_variables, reference[2]["grads"]):
        assert row[f"{v.path}/nan_count"] == np.isnan(grad).sum()
        assert row[f"{v.path}/inf_count"] == np.isinf(grad).sum()
    assert history.iloc[2][[c for c in history.columns if c.endswith("nan_count")]].sum() > 0
    assert history.iloc[1][[c for c in history.columns if c.endswith("nan_count")]].sum() == 0


def test_mixed_precision_records_unscaled_gradients_and_skipped_steps(mixed_precision, tmp_path):
    model = make_mlp()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LEARNING_RATE),
                                                    initial_scale=2.0 ** 20)
    model.compile(optimizer, "mse")
    grads_cb = GradientStatistics(str(tmp_path))
    _fit(model, [grads_cb])
    history = grads_cb.history
    skipped = history[history.skipped]
    applied = history[~history.skipped]
    assert len(history) == 10 and len(skipped) >= 1
    # A skipped step carries the number the update would have had; applied
    # steps are numbered 1..iterations, each once.
    assert applied.step.tolist() == list(range(1, int(model.optimizer.iterations.numpy()) + 1))
    assert skipped[[c for c in history.columns if c.endswith("/l2_norm")]].isna().all().all()
    # The next step's statistics describe the unscaled gradient of that step.
    weights = [v.numpy() for v in model.trainable_variables]
    xb, yb = X[:BATCH], Y[:BATCH]
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(yb, tf.cast(model(xb, training=True), "float32"))
        loss = tf.reduce_mean(loss)
    expected = tape.gradient(loss, model.trainable_variables)
    for v, w in zip(model.trainable_variables, weights):
        v.assign(w)
    one = GradientStatistics()
    model.fit(xb, yb, batch_size=BATCH, epochs=1, verbose=0, callbacks=[one])
    row = one.history.iloc[-1]
    assert not row.skipped
    for v, g in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(row[f"{v.path}/l2_norm"], np.linalg.norm(g.numpy()), rtol=2e-2)
    run = load_run(str(tmp_path))
    counts = run.scalars("gradients/skipped_updates")
    assert counts.value.iloc[-1] == len(skipped)


def test_non_float_and_non_trainable_variables_are_skipped():
    class WithCounter(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], 2), name="kernel")
            self.count = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                         trainable=False, name="count")

        def call(self, x):
            return x @ self.kernel

    model = keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization(name="bn"),
                              WithCounter(name="counter")])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    grads_cb = GradientStatistics(stats=["l2_norm"])
    _fit(model, [grads_cb], y=Y[:, :2])
    columns = set(grads_cb.history.columns) - {"step", "skipped", "global_norm"}
    assert columns == {f"{v.path}/l2_norm" for v in model.trainable_variables}
    assert not [c for c in columns if "moving" in c or "/count/" in c]


def test_include_and_exclude_select_variables():
    model = make_mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    grads_cb = GradientStatistics(include="kernel", exclude="^.*/out/", stats=["mean"])
    _fit(model, [grads_cb])
    assert [c for c in grads_cb.history.columns if c.endswith("/mean")] == [
        f"{model.trainable_variables[0].path}/mean"
    ]
    # The global norm still covers every gradient the optimizer applies.
    everything = GradientStatistics(stats=["l2_norm"])
    model2 = make_mlp()
    model2.compile(keras.optimizers.SGD(0.1), "mse")
    model2.set_weights(make_mlp().get_weights())
    model3 = make_mlp()
    model3.compile(keras.optimizers.SGD(0.1), "mse")
    filtered = GradientStatistics(include="kernel", stats=["l2_norm"])
    _fit(model2, [everything])
    _fit(model3, [filtered])
    np.testing.assert_allclose(everything.history.global_norm, filtered.history.global_norm, rtol=1e-6)


def test_no_variable_matching_warns_listing_the_variables_and_training_goes_on():
    model = make_mlp()
    model.compile("sgd", "mse")
    message = (r"GradientStatistics records nothing this fit: none of the variables that "
               r"optimizer applied matches include='conv', exclude=None: .*hidden/kernel")
    callback = GradientStatistics(include="conv")
    with pytest.warns(RuntimeWarning, match=message):
        history = _fit(model, [callback])
    assert len(history.history["loss"]) == 1 and callback.history.empty
    assert "train_step" not in vars(model)
    with pytest.raises(ValueError, match=message):
        _fit(model, [GradientStatistics(include="conv", strict=True)])
    assert "train_step" not in vars(model)


def test_event_files_hold_the_history_and_share_a_dir_with_keras_tensorboard(tmp_path):
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=3)
    grads_cb = GradientStatistics(str(tmp_path), histogram_every_n_steps=4)
    _fit(model, [grads_cb, keras.callbacks.TensorBoard(str(tmp_path))], epochs=2)
    run = load_run(str(tmp_path))
    assert "train" in run.runs
    path = model.trainable_variables[0].path
    frame = run.scalars(f"gradients/{path}/l2_norm")
    np.testing.assert_allclose(frame.value, grads_cb.history[f"{path}/l2_norm"], rtol=1e-6)
    assert frame.step.tolist() == list(range(1, 21))
    assert "epoch_loss" in run.tags(run="train")
    assert set(run.tags("^gradients/", kind="histograms")) == {
        f"gradients/{v.path}" for v in model.trainable_variables}
    hist = run.histograms(f"gradients/{path}")
    assert hist.step.tolist() == [4, 8, 12, 16, 20]
    assert all(c.sum() == np.prod(model.trainable_variables[0].shape) for c in hist.counts)


def test_get_config_round_trip():
    callback = GradientStatistics("logs", every_n_steps=2, histogram_every_n_steps=10,
                                  include="dense", exclude="bias", stats=["mean", "max"],
                                  histogram_bins=12, history_size=5, strict=True)
    clone = GradientStatistics.from_config(callback.get_config())
    assert clone.get_config() == callback.get_config()
    assert callback.get_config()["stats"] == ["mean", "max"]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"every_n_steps": 0}, ValueError, r"GradientStatistics: `every_n_steps` must be a positive int. Received: every_n_steps=0"),
        ({"every_n_steps": 1.5}, TypeError, r"`every_n_steps` must be a positive int. Received: every_n_steps=1.5"),
        ({"every_n_steps": True}, TypeError, r"`every_n_steps` must be a positive int"),
        ({"histogram_every_n_steps": -1}, ValueError, r"`histogram_every_n_steps` must be None or a positive int. Received: histogram_every_n_steps=-1"),
        ({"include": "("}, ValueError, r"`include` is not a valid regular expression .*Received: include='\('"),
        ({"exclude": 3}, TypeError, r"`exclude` must be None or a regular expression string. Received: exclude=3"),
        ({"stats": ["median"]}, ValueError, r"`stats` must be a non-empty list of names from l2_norm, .*Received: stats=\['median'\]"),
        ({"stats": "mean"}, TypeError, r"`stats` must be a list or tuple of names"),
        ({"stats": []}, ValueError, r"`stats` must be a non-empty list"),
        ({"stats": ["update_ratio"]}, ValueError, r"Received: stats=\['update_ratio'\]"),
        ({"log_dir": 5}, TypeError, r"`log_dir` must be None, a str or an os.PathLike. Received: log_dir=5"),
        ({"log_dir": ""}, ValueError, r"`log_dir` must not be empty"),
        ({"history_size": -1}, ValueError, r"`history_size` must be a non-negative int. Received: history_size=-1"),
        ({"histogram_bins": 0}, ValueError, r"`histogram_bins` must be a positive int. Received: histogram_bins=0"),
        ({"strict": "yes"}, TypeError, r"`strict` must be a bool. Received: strict='yes'"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else "",
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientStatistics(**kwargs)


def test_model_without_optimizer_is_a_clear_error():
    model = make_mlp()
    callback = GradientStatistics()
    callback.set_model(model)
    with pytest.raises(ValueError, match="the model has no optimizer"):
        callback.on_train_begin()


def test_writer_failure_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    from kerasdbg.sinks import events as _events

    model = make_mlp()
    model.compile("sgd", "mse")
    callback = GradientStatistics(str(tmp_path / "logs"))

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    # (A read's events of scalars go through `write_block` and `write_rows`, the
    # histograms' through `write`.)
    monkeypatch.setattr(_events.EventWriter, "write", broken)
    monkeypatch.setattr(_events.EventWriter, "write_rows", broken)
    monkeypatch.setattr(_events.EventWriter, "write_block", broken)
    with pytest.warns(RuntimeWarning, match="could not write its records.*disk full"):
        history = _fit(model, [callback])
    assert len(history.history["loss"]) == 1
    assert os.path.isdir(tmp_path / "logs" / "train")


@pytest.mark.parametrize("spe", [1, 3])
def test_latest_and_history_asked_during_fit_are_up_to_date(spe):
    # The buffers are read every few dozen steps; a callback that asks at a
    # batch end (placed before the statistics callback) still sees that batch.
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", steps_per_execution=spe)
    recorder = GradientStatistics(every_n_steps=1)
    seen = []

    class Reader(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # (Keras numbers a short last execution as if it were whole.)
            step = min(batch + 1, -(-len(X) // BATCH))
            seen.append((step, recorder.latest["step"], int(recorder.history["step"].max())))

    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[Reader(), recorder])
    assert seen and all(step == latest == last for step, latest, last in seen), seen
