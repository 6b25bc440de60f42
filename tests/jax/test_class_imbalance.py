"""`StopOnRule([ClassImbalance()])` on JAX: the class counts of each step, across the matrix.

Expected values come from NumPy: the labels fed, and the predictions of
the model's starting weights (`model.predict` before `fit`) where the
learning rate is zero, so that what is mispredicted at each step is known
without kerasdbg.
"""

import warnings

import jax
import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import ClassImbalance, NonFiniteLoss, RuleWarning

BATCH, STEPS, SAMPLES = 16, 12, 64
CENTERS = np.array([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], "float32")
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


def _data(labels, centers_of=None):
    rng = np.random.default_rng(0)
    where = labels if centers_of is None else centers_of
    noise = rng.normal(size=(len(labels), 4)).astype("float32") * 0.5
    return CENTERS[where] + noise, labels


def _model(spe=1, jit=True, learning_rate=0.3, one_hot=False):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="clf")
    loss = keras.losses.CategoricalCrossentropy(from_logits=True) if one_hot else \
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.Adam(learning_rate) if learning_rate else
                  keras.optimizers.SGD(0.0), loss, steps_per_execution=spe, jit_compile=jit)
    return model


def _fit(model, x, y, callbacks=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                         callbacks=list(callbacks))


def _run(tmp_path, x, y, spe=1, jit=True, **kwargs):
    model = _model(spe, jit, **kwargs)
    stop = StopOnRule(ClassImbalance(samples=SAMPLES), action="warn", log_dir=str(tmp_path),
                      verbose=False)
    _fit(model, x, y, [stop])
    offline = kerasdbg.check_run(str(tmp_path), [ClassImbalance(samples=SAMPLES)])
    return stop.verdicts, offline


@pytest.fixture(autouse=True)
def _reads_after_every_execution(read_every_execution):
    """The class totals are read with the records, at each read: read after
    every execution, each execution's totals are recorded at its last step
    (tests/jax/test_read_interval.py covers the interval)."""



@pytest.mark.parametrize("spe, jit", MATRIX)
def test_a_class_never_seen_fires_once_enough_labels_were_seen(tmp_path, spe, jit):
    # Each batch: 15 labels of class 0, one of class 1, none of class 2.
    labels = np.where(np.arange(BATCH * STEPS) % BATCH == 0, 1, 0)
    online, offline = _run(tmp_path, *_data(labels), spe, jit)
    assert [(v.step, v.reason) for v in online] == [(v.step, v.reason) for v in offline]
    # Counted at each execution's last step, as on TensorFlow.
    step = -(-(SAMPLES // BATCH) // spe) * spe
    assert [v.step for v in online] == [step]
    assert online[0].reason.endswith(
        f"class counts differ infinitely (more than 10): 0={15 * step}, 1={step}, 2=0")


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_a_class_left_behind_fires_after_the_warm_up(tmp_path, spe, jit):
    pattern = np.array([0] * 7 + [1] * 7 + [2] * 2)
    labels = np.tile(pattern, STEPS)
    x, y = _data(labels, centers_of=np.where(labels == 2, 0, labels))
    online, offline = _run(tmp_path, x, y, spe, jit)
    assert [(v.step, v.reason) for v in online] == [(v.step, v.reason) for v in offline]
    assert [v.step for v in online] == [2 * SAMPLES // BATCH]
    assert online[0].tensors == ("2",) and online[0].values["2"] > 0.7
    counts = kerasdbg.load_run(str(tmp_path)).scalars(r"classes/\d/seen")
    at_step = counts[counts.step == 8].set_index("tag").value.to_dict()
    assert at_step == {"classes/0/seen": 56.0, "classes/1/seen": 56.0, "classes/2/seen": 16.0}


@pytest.mark.parametrize("one_hot", [False, True], ids=["sparse", "one_hot"])
@pytest.mark.parametrize("spe, jit", [MATRIX[0], MATRIX[3]])
def test_the_counts_are_the_labels_fed_and_the_starting_models_mistakes(tmp_path, one_hot,
                                                                        spe, jit):
    labels = np.tile(np.arange(3), BATCH * STEPS // 3)
    x, _ = _data(labels)
    y = keras.utils.to_categorical(labels, 3) if one_hot else labels
    model = _model(spe, jit, learning_rate=0.0, one_hot=one_hot)
    wrong = np.argmax(model.predict(x, verbose=0), axis=-1) != labels
    stop = StopOnRule(ClassImbalance(samples=SAMPLES), action="warn", log_dir=str(tmp_path),
                      verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no kerasdbg warning on a healthy run
        _fit(model, x, y, [stop])
    run = kerasdbg.load_run(str(tmp_path))
    for column in ("seen", "mispredicted"):
        table = run.scalars(rf"classes/\d/{column}")
        for step in sorted(set(table.step)):
            got = table[table.step == step].set_index("tag").value.to_dict()
            fed = slice(0, step * BATCH)
            expected = {f"classes/{k}/{column}": float(np.sum(
                (labels[fed] == k) & (wrong[fed] if column == "mispredicted" else True)))
                for k in range(3)}
            assert got == expected, (column, step)
    assert sorted(set(table.step)) == list(range(spe, STEPS + 1, spe))


@pytest.mark.parametrize("spe, jit", [MATRIX[0], MATRIX[3]])
def test_data_parallel_counts_the_global_batch_once(tmp_path, spe, jit):
    labels = np.where(np.arange(BATCH * STEPS) % BATCH == 0, 1, 0)
    x, y = _data(labels)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices("cpu")))
    try:
        online, _ = _run(tmp_path, x, y, spe, jit)
    finally:
        keras.distribution.set_distribution(None)
    step = -(-(SAMPLES // BATCH) // spe) * spe
    assert [v.step for v in online] == [step]
    assert online[0].reason.endswith(f"0={15 * step}, 1={step}, 2=0")


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_counting_leaves_training_bitwise_plain_keras(spe, jit):
    labels = np.tile(np.arange(3), BATCH * STEPS // 3)
    x, y = _data(labels)
    plain = _model(spe, jit)
    plain_history = _fit(plain, x, y).history
    model = _model(spe, jit)
    history = _fit(model, x, y, [StopOnRule(ClassImbalance(), verbose=False)]).history
    assert history == plain_history
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert "_update_metrics_variables" not in vars(model)


class OwnStep(keras.Sequential):
    """A train step written for JAX that updates no metrics: no labels to count."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss(trainable):
            y_pred, new = self.stateless_call(trainable, non_trainable, x, training=True)
            return keras.ops.mean(keras.ops.square(y_pred - y)), new

        (value, non_trainable), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        return {"loss": value}, (trainable, non_trainable, optimizer_variables,
                                 metrics_variables)


def test_a_train_step_that_gives_no_labels_says_so_once():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model = OwnStep([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    with pytest.warns(RuntimeWarning) as caught:
        model.fit(x, x[:, :3], batch_size=16, epochs=2, verbose=0,
                  callbacks=[StopOnRule(ClassImbalance(), verbose=False)])
    said = [str(w.message) for w in caught if "ClassImbalance" in str(w.message)]
    assert len(said) == 1, said
    assert "ClassImbalance reads classes/<k>/seen and classes/<k>/mispredicted, which this " \
        "model does not give" in said[0]


def test_the_counts_go_on_through_a_fault_the_rules_only_warn_of(tmp_path):
    labels = np.tile(np.arange(3), BATCH * STEPS // 3)
    x, y = _data(labels)
    x[2 * BATCH] = np.nan  # step 3: a NaN loss, frozen, then unfrozen (action="warn")
    model = _model()
    stop = StopOnRule([ClassImbalance(samples=SAMPLES), NonFiniteLoss()], action="warn",
                      freeze_on_fault=True, log_dir=str(tmp_path), verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(model, x, y, [stop])
    assert [v.step for v in stop.verdicts if v.rule == "NonFiniteLoss"] == [3], stop.verdicts
    counts = kerasdbg.load_run(str(tmp_path)).scalars(r"classes/\d/seen")
    last = counts[counts.step == STEPS].set_index("tag").value.to_dict()
    assert last == {f"classes/{k}/seen": BATCH * STEPS / 3 for k in range(3)}
