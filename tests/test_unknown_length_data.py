"""Training with kerasdbg is bitwise plain Keras on data of unknown length (issue 32, item 13).

With a dataset of unknown cardinality (a `.filter`) and `steps_per_execution=1`,
plain Keras 3 counts one more `optimizer.iterations` at each epoch's end: the
call that meets the end of the data runs what the train step does without the
batch (the optimizer's step count; weight decay), and only then fails. A
learning-rate schedule and Adam's bias correction read that count, so
kerasdbg must let those writes run as plain Keras does: its conditions on the
gradients (the freeze of `StopOnRule`) skip only what needs the batch. The
quirk itself is checked first, on plain Keras; then each instrument alone and
all together give bitwise the weights and the step count of plain Keras,
at `steps_per_execution` 1 and 4, with `jit_compile` off and on.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StepRecorder
from kerasdbg.callbacks import StepTimer, StopOnRule, WeightStatistics

RNG = np.random.default_rng(4)
X = RNG.normal(size=(90, 4)).astype("float32")
Y = RNG.normal(size=(90, 1)).astype("float32")
BATCHES, EPOCHS = 9, 2
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'graph'}")
          for spe in (1, 4) for jit in (False, True)]


def _dataset():
    """Nine batches of unknown length (the filter keeps them all)."""
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(10)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return dataset


def _fit(callbacks=(), spe=1, jit=False, taps=False, optimizer="adam", tmp_path=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu", name="h"),
                              keras.layers.Dense(1, name="o")], name="m")
    if taps:
        model = kerasdbg.insert_taps(model)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5)
    optimizer = {
        "adam": lambda: keras.optimizers.Adam(schedule),
        "adamw": lambda: keras.optimizers.AdamW(schedule, weight_decay=0.1),
        # EMA's averages, and the variables overwritten with them every 4th step.
        "adamw_ema": lambda: keras.optimizers.AdamW(schedule, weight_decay=0.1, use_ema=True,
                                                    ema_momentum=0.5, ema_overwrite_frequency=4),
    }[optimizer]()
    model.compile(optimizer, "mse", steps_per_execution=spe, jit_compile=jit)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Your input ran out of data", UserWarning)
        model.fit(_dataset(), epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
    return int(model.optimizer.iterations), [v.numpy() for v in model.trainable_variables
                                             + model.optimizer.variables]


@functools.lru_cache(maxsize=None)
def _plain(spe, jit, optimizer="adam"):
    return _fit(spe=spe, jit=jit, optimizer=optimizer)


@pytest.mark.parametrize("spe, jit, iterations", [
    (1, False, EPOCHS * (BATCHES + 1)), (1, True, EPOCHS * BATCHES),
    (4, False, EPOCHS * BATCHES), (4, True, EPOCHS * BATCHES)],
    ids=["spe1-graph", "spe1-jit", "spe4-graph", "spe4-jit"])
def test_plain_keras_counts_a_step_at_the_end_of_data_only_at_spe_1_without_xla(
        spe, jit, iterations):
    """The quirk: the call that meets the end of the data counts a step (and
    the schedule moves on), without a batch and without an update; under XLA
    the compiled step needs its batch, and with steps_per_execution > 1 Keras's
    loop asks whether a batch is there first."""
    assert _plain(spe, jit)[0] == iterations


def _instruments(tmp_path):
    return {
        "GradientStatistics": lambda: [GradientStatistics()],
        "WeightStatistics": lambda: [WeightStatistics()],
        "StopOnRule": lambda: [StopOnRule(verbose=False)],
        "taps": lambda: [ActivationStatistics()],
        "StepRecorder": lambda: [StepRecorder(str(tmp_path / "t.npz"), steps=[1, 5])],
        "StepTimer": lambda: [StepTimer()],
        "all": lambda: [GradientStatistics(), WeightStatistics(), StopOnRule(verbose=False),
                        ActivationStatistics(), StepRecorder(str(tmp_path / "t.npz"), steps=[1, 5]),
                        StepTimer()],
    }


@pytest.mark.parametrize("spe, jit", MATRIX)
@pytest.mark.parametrize("instrument", ["GradientStatistics", "WeightStatistics", "StopOnRule",
                                        "taps", "StepRecorder", "StepTimer", "all"])
def test_every_instrument_trains_bitwise_as_plain_keras(tmp_path, instrument, spe, jit):
    callbacks = _instruments(tmp_path)[instrument]()
    iterations, weights = _fit(callbacks, spe, jit, taps=instrument in ("taps", "all"))
    plain_iterations, plain_weights = _plain(spe, jit)
    assert iterations == plain_iterations
    for actual, expected in zip(weights, plain_weights):
        np.testing.assert_array_equal(actual, expected)


def test_weight_decay_of_the_end_of_data_call_is_kept_with_every_instrument(tmp_path):
    """AdamW decays the weights in the call that meets the end of the data too
    (it needs no batch); the freeze's condition on it reads only whether an
    earlier step froze the weights. StepRecorder records no layer outputs here
    (see docs/rules.md: its replay of the forward pass reads the weights)."""
    callbacks = [GradientStatistics(), WeightStatistics(), StopOnRule(verbose=False),
                 ActivationStatistics(),
                 StepRecorder(str(tmp_path / "t.npz"), steps=[1, 5],
                              record=["loss", "learning_rate", "gradients", "weights"]),
                 StepTimer()]
    iterations, weights = _fit(callbacks, taps=True, optimizer="adamw")
    plain_iterations, plain_weights = _plain(1, False, "adamw")
    assert iterations == plain_iterations == EPOCHS * (BATCHES + 1)
    for actual, expected in zip(weights, plain_weights):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("spe, jit", MATRIX)
@pytest.mark.parametrize("instrument", ["StopOnRule", "all"])
def test_ema_trains_bitwise_as_plain_keras(tmp_path, instrument, spe, jit):
    """AdamW with EMA (`use_ema=True`, the weights overwritten with their
    averages every 4th step): the weights, the averages and the step count
    of plain Keras, also the call that meets the end of the data (on the
    commit before, StopOnRule's condition around the whole `apply` held back
    that call's count: 18 steps where plain Keras counts 20)."""
    # StepRecorder records no layer outputs (its replay of the forward pass
    # holds back weight decay: see the test above).
    callbacks = [StopOnRule(verbose=False)] if instrument == "StopOnRule" else [
        GradientStatistics(), WeightStatistics(), StopOnRule(verbose=False),
        ActivationStatistics(), StepTimer(),
        StepRecorder(str(tmp_path / "t.npz"), steps=[1, 5],
                     record=["loss", "learning_rate", "gradients", "weights"])]
    iterations, values = _fit(callbacks, spe, jit, taps=instrument == "all",
                              optimizer="adamw_ema")
    plain_iterations, plain_values = _plain(spe, jit, "adamw_ema")
    assert iterations == plain_iterations
    assert len(values) == len(plain_values)
    for actual, expected in zip(values, plain_values):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("spe", [1, 4])
def test_the_faulty_step_does_not_reach_the_weights_through_weight_decay(spe):
    """AdamW decays the weights before the gradients are known: at the step
    StopOnRule freezes, the decay is undone, so the weights are exactly
    those after the last good step (a plain fit of that many steps)."""
    def model():
        keras.utils.set_random_seed(2)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="o")], name="m")
        m.compile(keras.optimizers.AdamW(1e30, weight_decay=0.004), "mse",
                  steps_per_execution=spe)
        return m

    # Plain Keras, one step at a time: the first step whose loss is not finite.
    reference, good = model(), None
    for step in range(1, 5):
        before = [v.numpy() for v in reference.trainable_variables]
        loss = reference.train_on_batch(X[(step - 1) * 10: step * 10],
                                        Y[(step - 1) * 10: step * 10])
        if not np.isfinite(loss):
            good, faulty = before, step
            break
    assert good is not None and all(np.all(np.isfinite(w)) for w in good)
    instrumented = model()
    stop = StopOnRule(verbose=False)
    instrumented.fit(X[:40], Y[:40], batch_size=10, epochs=1, shuffle=False, verbose=0,
                     callbacks=[stop])
    assert instrumented.stop_training and stop.verdicts[0].step == faulty, stop.verdicts
    for got, want in zip(instrumented.trainable_variables, good):
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("spe", [1, 4])
def test_a_frozen_step_changes_no_ema_average_and_no_weight(spe):
    """With EMA, the step StopOnRule freezes writes neither the averages nor
    (at an overwrite step) the weights: both are those after the last good
    step of a plain fit, one step at a time."""
    def model():
        keras.utils.set_random_seed(2)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="o")], name="m")
        m.compile(keras.optimizers.AdamW(1e30, weight_decay=0.004, use_ema=True,
                                         ema_momentum=0.5, ema_overwrite_frequency=1),
                  "mse", steps_per_execution=spe)
        return m

    def averages(m):
        return [v.numpy() for v in m.optimizer._model_variables_moving_average]

    reference, good = model(), None
    reference.optimizer.build(reference.trainable_variables)
    for step in range(1, 5):
        before = ([v.numpy() for v in reference.trainable_variables], averages(reference))
        loss = reference.train_on_batch(X[(step - 1) * 10: step * 10],
                                        Y[(step - 1) * 10: step * 10])
        if not np.isfinite(loss):
            good, faulty = before, step
            break
    assert good is not None and all(np.all(np.isfinite(w)) for w in good[0] + good[1])
    instrumented = model()
    stop = StopOnRule(verbose=False)
    instrumented.fit(X[:40], Y[:40], batch_size=10, epochs=1, shuffle=False, verbose=0,
                     callbacks=[stop])
    assert instrumented.stop_training and stop.verdicts[0].step == faulty, stop.verdicts
    for got, want in zip([v.numpy() for v in instrumented.trainable_variables], good[0]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(averages(instrumented), good[1]):
        np.testing.assert_array_equal(got, want)


def test_a_skipped_step_of_an_ema_optimizer_is_plain_keras_without_its_batch():
    """`StopOnRule(action="skip")` with EMA, the weights overwritten with their
    averages every 2nd step and the faulty batch at an overwrite step (the
    4th): the weights and the averages are plain Keras's trained on the other
    batches (its EMA's overwrite and fit's final one included)."""
    faulty = 4

    def model():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="h"),
                              keras.layers.Dense(1, name="o")], name="m")
        m.compile(keras.optimizers.AdamW(0.05, weight_decay=0.01, use_ema=True,
                                         ema_momentum=0.5, ema_overwrite_frequency=2), "mse")
        return m

    x = X[:80].copy()
    x[(faulty - 1) * 10] = 3e38  # an infinite output of `h`
    reference = model()
    for step in range(1, 9):
        if step != faulty:
            reference.train_on_batch(x[(step - 1) * 10: step * 10], Y[(step - 1) * 10: step * 10])
    reference.optimizer.finalize_variable_values(reference.trainable_variables)  # as fit's end
    instrumented = model()
    stop = StopOnRule(action="skip", verbose=False)
    instrumented.fit(x, Y[:80], batch_size=10, epochs=1, shuffle=False, verbose=0,
                     callbacks=[stop])
    assert not instrumented.stop_training
    assert int(instrumented.optimizer.iterations) == int(reference.optimizer.iterations) == 7
    for got, want in zip(instrumented.trainable_variables + instrumented.optimizer.variables,
                         reference.trainable_variables + reference.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
