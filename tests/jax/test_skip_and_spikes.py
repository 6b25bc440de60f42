"""`StopOnRule(action="skip" and "rollback")` and the in-graph spike tests on JAX.

Runs on the JAX backend only (`KERAS_BACKEND=jax`, see tests/conftest.py).
As tests/callbacks/test_skip_and_spikes.py does on TensorFlow: a spike
planted in one batch (its targets x 1e4) of a healthy regression is skipped
in the step; the reference is a plain Keras `fit` on the same batches
without that one, compiled alike, so a skipped step must leave the weights,
the optimizer's slots and step count as if its batch had not come.
`action="rollback"` likewise (tests/callbacks/test_rollback.py): the
reference is a plain fit without the batches rolled back and skipped.
"""

import re
import warnings

import jax
import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.capture import keras_objects
from kerasdbg.layers import TapLayer
from kerasdbg.rules import GradientNormSpike, LossSpike, NonFiniteLoss, SkippedStep

BATCH, STEPS, WINDOW, SPIKE = 8, 24, 8, 14
RNG = np.random.default_rng(3)
X = RNG.normal(size=(BATCH * STEPS, 4)).astype("float32")
Y = (X @ RNG.normal(size=(4, 1)) + 0.1 * RNG.normal(size=(BATCH * STEPS, 1))).astype("float32")
MATRIX = [pytest.param(spe, jit, id=f"spe{spe}-{'jit' if jit else 'nojit'}")
          for spe in (1, 4) for jit in (True, False)]


def _spiked(*steps, scale=1e4):
    """Y with the targets of the batches of optimizer steps `steps` (1-based) scaled."""
    y = Y.copy()
    for step in steps:
        y[(step - 1) * BATCH:step * BATCH] *= scale
    return y


def _model(spe=1, jit=True, optimizer="sgd", tap=False, batchnorm=False):
    keras.utils.set_random_seed(2)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="d")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    if tap:
        layers.append(TapLayer(stats=["mean"], name="tap"))
    layers.append(keras.layers.Dense(1, name="o"))
    model = keras.Sequential(layers, name="m")
    chosen = keras.optimizers.SGD(0.02) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    model.compile(chosen, "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def _fit(model, y, callbacks, x=X):
    return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                     callbacks=callbacks)


def _without(skipped, steps=STEPS, **kwargs):
    """A plain fit on the batches of steps 1..`steps` but `skipped`."""
    model = _model(**kwargs)
    index = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH)
                            for s in range(1, steps + 1) if s not in skipped])
    _fit(model, Y[index], [], x=X[index])
    return model


def _assert_same_state(model, reference, exact=True):
    """Weights and optimizer variables (slots, step count) alike."""
    check = np.testing.assert_array_equal if exact else (
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7))
    for mine, plain in zip(model.weights, reference.weights):
        check(np.asarray(mine.value), np.asarray(plain.value))
    assert len(model.optimizer.variables) == len(reference.optimizer.variables)
    for mine, plain in zip(model.optimizer.variables, reference.optimizer.variables):
        assert mine.path.partition("/")[2] == plain.path.partition("/")[2]
        check(np.asarray(mine.value), np.asarray(plain.value))


@pytest.mark.parametrize("spe, jit", MATRIX)
def test_a_planted_spike_is_skipped_as_if_its_batch_had_not_come(spe, jit):
    model = _model(spe, jit)
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    history = _fit(model, _spiked(SPIKE), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("LossSpike", SPIKE)]
    assert stop.skipped_steps == [SPIKE]
    assert history.history["skipped_steps"] == [1]
    # Keras's step count does not count the skipped step; kerasdbg's numbering does.
    assert int(model.optimizer.iterations) == STEPS - 1
    assert keras_objects.step_number(model.optimizer) == STEPS
    _assert_same_state(model, _without({SPIKE}, spe=spe, jit=jit))


def test_with_adam_the_slots_and_bias_correction_are_those_without_the_batch():
    model = _model(4, True, optimizer="adam")
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [SPIKE]
    _assert_same_state(model, _without({SPIKE}, spe=4, optimizer="adam"))
    # A later fit numbers its steps on from kerasdbg's count (no step twice).
    gradients = GradientStatistics(every_n_steps=1)
    model.fit(X[:4 * BATCH], Y[:4 * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[gradients])
    assert list(gradients.history["step"]) == list(range(STEPS + 1, STEPS + 5))


def test_batch_normalizations_moving_statistics_are_put_back_at_a_skipped_step():
    model = _model(4, True, batchnorm=True)
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [SPIKE]
    _assert_same_state(model, _without({SPIKE}, spe=4, batchnorm=True))
    moving = np.asarray(model.get_layer("bn").moving_variance.value)
    assert np.all(moving < 100), "the spiked batch's statistics were not put back"


def test_mixed_precision_skip_leaves_the_loss_scale_as_without_the_batch(mixed_precision):
    def scaled():
        model = _model()
        model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.02)), "mse")
        return model

    model = scaled()
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE, scale=30.0), [stop])
    # The loss scaler skips overflowing steps at first, which share their
    # number with the next (Keras does not count them): the batch is SPIKE's.
    assert len(stop.skipped_steps) == 1 and stop.verdicts[0].values["step/loss"] > 100
    reference = scaled()
    index = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH)
                            for s in range(1, STEPS + 1) if s != SPIKE])
    _fit(reference, Y[index], [], x=X[index])
    _assert_same_state(model, reference)


def test_the_verdict_gives_the_windows_statistics_computed_independently():
    model = _model()
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    # The losses of the steps before the spike, replayed with a plain model
    # on the same batches: the window is the WINDOW steps before it.
    reference = _model()
    losses = [float(reference.train_on_batch(X[(s - 1) * BATCH:s * BATCH],
                                             Y[(s - 1) * BATCH:s * BATCH]))
              for s in range(1, SPIKE)]
    window = np.array(losses[-WINDOW:], np.float64)
    said = re.search(r"\(mean ([\d.e+-]+), standard deviation ([\d.e+-]+), largest ([\d.e+-]+)\)",
                     stop.verdicts[0].reason)
    assert said, stop.verdicts[0].reason
    np.testing.assert_allclose([float(v) for v in said.groups()],
                               [window.mean(), window.std(), window.max()], rtol=2e-3)
    assert stop.verdicts[0].values["step/loss"] > 1e6


def test_data_parallel_skips_the_global_batchs_spike():
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
    y = Y.copy()
    y[SPIKE * BATCH - 1] *= 1e5  # one example of the second device's half
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        model = _model(2, True)
        stop = StopOnRule([LossSpike(window=WINDOW), GradientNormSpike(window=WINDOW)],
                          action="skip", verbose=False)
        _fit(model, y, [stop])
        reference = _without({SPIKE}, spe=2, jit=True)
    finally:
        keras.distribution.set_distribution(None)
    assert [(v.rule, v.step) for v in stop.verdicts] == [
        ("LossSpike", SPIKE), ("GradientNormSpike", SPIKE)]
    assert stop.skipped_steps == [SPIKE]
    _assert_same_state(model, reference)


def test_a_non_finite_batch_is_skipped_for_any_optimizer():
    model = _model(spe=4)
    y = Y.copy()
    y[(SPIKE - 1) * BATCH] = np.nan
    stop = StopOnRule(NonFiniteLoss(), action="skip", verbose=False)
    _fit(model, y, [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("NonFiniteLoss", SPIKE),
                                                         ("NaNSource", SPIKE)]
    assert stop.skipped_steps == [SPIKE]
    _assert_same_state(model, _without({SPIKE}, spe=4))
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_more_skips_than_max_skips_freeze_and_stop(capsys):
    model = _model(spe=4)
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", max_skips=2, skip_window=8)
    history = _fit(model, _spiked(SPIKE, SPIKE + 2, SPIKE + 4), [stop])
    assert stop.skipped_steps == [SPIKE, SPIKE + 2]
    assert [(v.rule, v.step) for v in stop.verdicts][:3] == [
        ("LossSpike", SPIKE), ("LossSpike", SPIKE + 2), ("LossSpike", SPIKE + 4)]
    printed = capsys.readouterr().out
    assert "2 steps were skipped among the last 8 (max_skips=2)" in printed
    assert f"frozen at step {SPIKE + 4}" in printed
    # Frozen from the third spike on (the rest of its execution, steps
    # 17-20, too), then stopped: the weights of step SPIKE + 3.
    assert model.stop_training and len(history.history["loss"]) == 1
    reference = _without({SPIKE, SPIKE + 2}, steps=SPIKE + 3, spe=4)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_online_and_offline_verdicts_agree_and_the_records_say_skipped(tmp_path):
    model = _model(spe=4, tap=True)
    rules = [LossSpike(window=WINDOW), GradientNormSpike(window=WINDOW)]
    stop = StopOnRule(rules, action="skip", log_dir=str(tmp_path), verbose=False)
    _fit(model, _spiked(SPIKE), [stop, ActivationStatistics(log_dir=str(tmp_path))])
    online = [(v.rule, v.step, v.reason) for v in stop.verdicts]
    assert [v[:2] for v in online] == [("LossSpike", SPIKE), ("GradientNormSpike", SPIKE)]
    offline = kerasdbg.check_run(str(tmp_path), [LossSpike(window=WINDOW),
                                                 GradientNormSpike(window=WINDOW), SkippedStep()],
                                 first_only=False)
    assert [(v.rule, v.step, v.reason) for v in offline] == online
    run = kerasdbg.load_run(str(tmp_path))
    skipped = run.scalar_table("step/skipped", run="train")
    assert list(skipped.index) == list(range(1, STEPS + 1))
    assert skipped["step/skipped"].tolist() == [1.0 if s == SPIKE else 0.0
                                                for s in range(1, STEPS + 1)]
    norms = run.scalar_table("step/gradient_norm", run="train")["step/gradient_norm"]
    assert norms[SPIKE] > 100 * norms.drop(SPIKE).max()
    fractions = run.scalar_table("step/spike_fraction", run="train")["step/spike_fraction"]
    # One spiky step among the last `skip_window` (128) steps seen so far.
    np.testing.assert_allclose(fractions[SPIKE], 1 / SPIKE)
    np.testing.assert_allclose(fractions[STEPS], 1 / STEPS)
    # The taps number the steps after the skip on (no step twice, none missing).
    taps = run.scalar_table("activations/tap/mean", run="train")
    assert list(taps.index) == list(range(1, STEPS + 1))
    # A later fit in Keras's own step (no kerasdbg capture) numbers them on.
    model.fit(X[:2 * BATCH], Y[:2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    assert list(model.get_layer("tap").history["step"])[-3:] == [STEPS, STEPS + 1, STEPS + 2]


def test_a_rules_own_stop_action_freezes_under_a_skipping_stop_on_rule(read_every_execution):
    model = _model()
    stop = StopOnRule([LossSpike(window=WINDOW, action="stop")], action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [] and model.stop_training
    assert int(model.optimizer.iterations) == SPIKE - 1  # a frozen step does not count
    for a, b in zip(model.get_weights(), _without(set(), steps=SPIKE - 1).get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_rules_own_skip_action_skips_under_a_stopping_stop_on_rule():
    model = _model(4, True)
    stop = StopOnRule([NonFiniteLoss(), LossSpike(window=WINDOW, action="skip")], verbose=False)
    history = _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [SPIKE] and not model.stop_training
    assert len(history.history["loss"]) == 1 and int(model.optimizer.iterations) == STEPS - 1


def test_the_megatron_form_fires_on_ten_times_the_largest_norm():
    model = _model(4, True)
    rule = GradientNormSpike(window=WINDOW, sigmas=None, factor=10.0)
    stop = StopOnRule(rule, action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("GradientNormSpike", SPIKE)]
    assert f"more than 10 x the largest value of the last {WINDOW} steps" in \
        stop.verdicts[0].reason
    assert stop.skipped_steps == [SPIKE]


def test_a_healthy_run_is_quiet_with_the_default_window():
    # 240 steps, window 128: the float32 test runs over the last 112 and finds nothing.
    x, y = np.tile(X, (10, 1)), np.tile(Y, (10, 1))
    model = _model(8, True)
    stop = StopOnRule([LossSpike(), GradientNormSpike()], action="skip", verbose=False)
    _fit(model, y, [stop], x=x)
    assert stop.verdicts == [] and stop.skipped_steps == []
    # The same run with one batch spiked: found at its step with the defaults.
    y[(200 - 1) * BATCH:200 * BATCH] *= 1e4
    model = _model(8, True)
    stop = StopOnRule([LossSpike(), GradientNormSpike()], action="skip", verbose=False)
    _fit(model, y, [stop], x=x)
    assert [(v.rule, v.step) for v in stop.verdicts] == [
        ("LossSpike", 200), ("GradientNormSpike", 200)]
    assert stop.skipped_steps == [200]


# A run of 100 batches spiked at one step, rolled back to the snapshot of
# step 40 and the next 10 batches skipped (tests/callbacks/test_rollback.py
# on TensorFlow): the reference is a plain fit over batches 1-40 and 71-100.
ROLL_STEPS, EVERY, ROLL_SKIP = 100, 20, 10
ROLL_X = RNG.normal(size=(BATCH * ROLL_STEPS, 4)).astype("float32")
ROLL_Y = (ROLL_X @ RNG.normal(size=(4, 1)) +
          0.1 * RNG.normal(size=(BATCH * ROLL_STEPS, 1))).astype("float32")


def _rolled_reference(batches, **kwargs):
    model = _model(**kwargs)
    index = np.concatenate([np.arange((b - 1) * BATCH, b * BATCH) for b in batches])
    _fit(model, ROLL_Y[index], [], x=ROLL_X[index])
    return model


@pytest.mark.parametrize("spe, jit, optimizer, spike", [
    pytest.param(1, True, "sgd", 60, id="spe1-jit-sgd"),
    pytest.param(1, False, "adam", 60, id="spe1-nojit-adam"),
    pytest.param(4, True, "adam", 58, id="spe4-jit-adam"),
    pytest.param(4, False, "sgd", 60, id="spe4-nojit-sgd")])
def test_a_spike_rolled_back_equals_a_plain_run_over_the_batches_that_remain(
        tmp_path, spe, jit, optimizer, spike):
    model = _model(spe, jit, optimizer=optimizer)
    y = ROLL_Y.copy()
    y[(spike - 1) * BATCH:spike * BATCH] *= 1e4
    stop = StopOnRule(LossSpike(window=16), action="rollback", rollback_every=EVERY,
                      rollback_skip=ROLL_SKIP, log_dir=str(tmp_path), verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(model, y, [stop], x=ROLL_X)
    assert not [str(w.message) for w in caught if "roll" in str(w.message)]  # no refusal
    assert [(v.rule, v.step) for v in stop.verdicts] == [("LossSpike", spike)]
    assert stop.rollbacks == [(spike, 40)] and not model.stop_training
    # The skipped batches are numbered 41-50 after the rollback; Keras's
    # step count does not count them, kerasdbg's numbering does.
    assert stop.skipped_steps == list(range(41, 41 + ROLL_SKIP))
    assert history.history["skipped_steps"] == [ROLL_SKIP]
    assert int(model.optimizer.iterations) == 40 + ROLL_STEPS - 70
    assert keras_objects.step_number(model.optimizer) == 40 + ROLL_STEPS - 60
    reference = _rolled_reference([*range(1, 41), *range(71, ROLL_STEPS + 1)], spe=spe,
                                  jit=jit, optimizer=optimizer)
    _assert_same_state(model, reference)
    run = kerasdbg.load_run(str(tmp_path))
    assert run.rollbacks().to_dict("records") == [
        {"run": "train", "step": 41, "dropped": list(range(41, spike + 1))}]
    table = run.scalar_table("step/skipped_after_rollback", run="train")
    assert table.loc[41:50, "step/skipped_after_rollback"].tolist() == [1.0] * ROLL_SKIP
    assert table.loc[51:, "step/skipped_after_rollback"].eq(0).all()
    # One snapshot at a time, of the loop's weights and optimizer variables
    # (and kerasdbg's small counters): at most their size once.
    kept = sum(np.asarray(v).nbytes for v in stop._snapshot[1].values)
    weights = sum(np.asarray(v.value).nbytes
                  for v in model.weights + model.optimizer.variables)
    assert weights <= kept <= weights + 16 * 1024
    assert len(stop.snapshot_seconds) >= 3


def test_data_parallel_rolls_back_the_global_state():
    devices = jax.devices("cpu")
    assert len(devices) == 2, "tests/conftest.py gives JAX two CPU devices"
    y = ROLL_Y.copy()
    y[59 * BATCH:60 * BATCH] *= 1e4
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        model = _model(2, True)
        stop = StopOnRule(LossSpike(window=16), action="rollback", rollback_every=EVERY,
                          rollback_skip=ROLL_SKIP, verbose=False)
        _fit(model, y, [stop], x=ROLL_X)
        reference = _rolled_reference([*range(1, 41), *range(71, ROLL_STEPS + 1)], spe=2)
    finally:
        keras.distribution.set_distribution(None)
    assert stop.rollbacks == [(60, 40)]
    assert stop.skipped_steps == list(range(41, 41 + ROLL_SKIP))
    _assert_same_state(model, reference)


def test_a_nan_rolls_back_and_a_later_fit_numbers_its_steps_on():
    model = _model()
    stop = StopOnRule(NonFiniteLoss(), action="rollback", rollback_every=4, verbose=False)
    y = Y.copy()
    y[(SPIKE - 1) * BATCH] = np.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, y, [stop])
    assert not [str(w.message) for w in caught if "roll" in str(w.message)]
    # Back to the snapshot of step 12: steps 13-14 undone, batches 15-24 are steps 13-22.
    assert [(v.rule, v.step) for v in stop.verdicts][:1] == [("NonFiniteLoss", SPIKE)]
    assert stop.rollbacks == [(SPIKE, 12)] and not model.stop_training
    assert stop.skipped_steps == [] and stop.snapshot_seconds
    assert int(model.optimizer.iterations) == STEPS - 2
    assert keras_objects.step_number(model.optimizer) == STEPS - 2
    _assert_same_state(model, _without({13, 14}))
    gradients = GradientStatistics(every_n_steps=1)
    model.fit(X[:2 * BATCH], Y[:2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[gradients])
    assert list(gradients.history["step"]) == [STEPS - 1, STEPS]


class _TwoParts(keras.Model):
    """Two parts, each trained by its own optimizer on its own loss (a GAN's
    shape), in a train step written for JAX: `model.optimizer` trains
    "first"; `second_optimizer`, whose variables the model tracks (so they
    are in the non-trainable state), trains "second"."""

    def build_optimizers(self, first, second):
        first.build(self.get_layer("first").trainable_variables)
        second.build(self.get_layer("second").trainable_variables)
        self.second_optimizer = second
        self.second_variables = list(second.variables)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(trainable, non_trainable):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x)
            losses = jax.numpy.mean(jax.numpy.square(y_pred - y), axis=0)
            return jax.numpy.sum(losses), (losses, non_trainable)

        (_, (losses, non_trainable)), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable)
        index = {id(v): i for i, v in enumerate(self.trainable_variables)}
        first = [index[id(v)] for v in self.get_layer("first").trainable_variables]
        second = [index[id(v)] for v in self.get_layer("second").trainable_variables]
        new_first, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, [grads[i] for i in first], [trainable[i] for i in first])
        slots = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        slots = [slots[id(v)] for v in self.second_variables]
        new_second, second_values = self.second_optimizer.stateless_apply(
            [non_trainable[i] for i in slots], [grads[i] for i in second],
            [trainable[i] for i in second])
        trainable, non_trainable = list(trainable), list(non_trainable)
        for i, v in zip(first + second, list(new_first) + list(new_second)):
            trainable[i] = v
        for i, v in zip(slots, second_values):
            non_trainable[i] = v
        return {"first_loss": losses[0], "second_loss": losses[1]}, (
            trainable, non_trainable, optimizer_variables, metrics_variables)


def test_with_two_optimizers_only_the_one_whose_norm_spiked_skips():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    outputs = keras.layers.Concatenate()([keras.layers.Dense(1, name="first")(inputs),
                                          keras.layers.Dense(1, name="second")(inputs)])
    model = _TwoParts(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.02), steps_per_execution=2)
    model.build_optimizers(model.optimizer, keras.optimizers.SGD(0.02))
    start = {name: [np.asarray(w) for w in model.get_layer(name).get_weights()]
             for name in ("first", "second")}
    y = np.concatenate([Y, Y], axis=1)
    y[(SPIKE - 1) * BATCH:SPIKE * BATCH, 0] *= 1e4  # the first part's targets only
    stop = StopOnRule(GradientNormSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, y, [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("GradientNormSpike", SPIKE)]
    assert "the gradient norm of optimizer " in stop.verdicts[0].reason
    assert int(model.optimizer.iterations) == STEPS - 1
    assert int(model.second_optimizer.iterations) == STEPS
    # Each part as a plain Keras regression: "first" without the spiked
    # batch, "second" on every batch.
    for name, skipped in (("first", {SPIKE}), ("second", set())):
        part = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        part.set_weights(start[name])
        part.compile(keras.optimizers.SGD(0.02), "mse")
        index = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH)
                                for s in range(1, STEPS + 1) if s not in skipped])
        _fit(part, Y[index], [], x=X[index])
        for a, b in zip(model.get_layer(name).get_weights(), part.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_with_two_optimizers_a_rollback_puts_back_both_and_skips_both():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    outputs = keras.layers.Concatenate()([keras.layers.Dense(1, name="first")(inputs),
                                          keras.layers.Dense(1, name="second")(inputs)])
    model = _TwoParts(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.02), steps_per_execution=2)
    model.build_optimizers(model.optimizer, keras.optimizers.SGD(0.02))
    start = {name: [np.asarray(w) for w in model.get_layer(name).get_weights()]
             for name in ("first", "second")}
    y = np.concatenate([Y, Y], axis=1)
    y[19 * BATCH:20 * BATCH, 0] *= 1e4  # step 20, the first part's targets only
    stop = StopOnRule(GradientNormSpike(window=WINDOW), action="rollback", rollback_every=8,
                      rollback_skip=2, verbose=False)
    _fit(model, y, [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("GradientNormSpike", 20)]
    assert stop.rollbacks == [(20, 16)] and stop.skipped_steps == [17, 18]
    # Each optimizer's variables (the second's in the non-trainable state)
    # came back: both trained batches 1-16 and 23-24, and skipped 21-22.
    for optimizer in (model.optimizer, model.second_optimizer):
        assert int(optimizer.iterations) == 18
        assert keras_objects.step_number(optimizer) == 20
    for name in ("first", "second"):
        part = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        part.set_weights(start[name])
        part.compile(keras.optimizers.SGD(0.02), "mse")
        index = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH)
                                for s in [*range(1, 17), 23, 24]])
        _fit(part, Y[index], [], x=X[index])
        for a, b in zip(model.get_layer(name).get_weights(), part.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_second_nan_rolls_back_again_and_taps_and_moving_statistics_follow(tmp_path):
    """NaN targets at batches 60 and 90: back to step 40, then (numbered on
    from 41, the second NaN at step 70) back to the snapshot of step 60,
    each time 5 batches skipped (as tests/callbacks/test_rollback.py)."""
    model = _model(batchnorm=True, tap=True)
    y = ROLL_Y.copy()
    y[59 * BATCH] = y[89 * BATCH] = np.nan
    stop = StopOnRule(NonFiniteLoss(), action="rollback", rollback_every=EVERY, rollback_skip=5,
                      log_dir=str(tmp_path), verbose=False)
    _fit(model, y, [stop, ActivationStatistics(log_dir=str(tmp_path))], x=ROLL_X)
    assert stop.rollbacks == [(60, 40), (70, 60)] and not model.stop_training
    reference = _rolled_reference([*range(1, 41), *range(66, 81), *range(96, ROLL_STEPS + 1)],
                                  batchnorm=True)
    mine = [w for w in model.weights if "tap" not in w.path]
    assert len(mine) == len(reference.weights)
    for a, b in zip(mine, reference.weights):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-5,
                                   atol=1e-6, err_msg=a.path)
    # The taps' counters are not rolled back: they record the steps of the
    # run that remains, those rolled back written again.
    taps = kerasdbg.load_run(str(tmp_path)).scalar_table("activations/tap/mean", run="train")
    assert list(taps.index) == list(range(1, 71))


def test_steps_trained_without_the_guard_empty_its_windows():
    """As on TensorFlow: a fit with the guard, one without it on targets x 30,
    one with it again: the first fit's windows would call the third's losses
    spikes; emptied, they refill first. A loop of guarded fits keeps them."""
    model = _model(optimizer="adam")
    first = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, Y, [first])
    _fit(model, 30 * Y, [])
    third = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, 30 * Y, [third])
    assert first.verdicts == [] and third.verdicts == [] and third.skipped_steps == []
    model = _model()
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, Y, [stop])
    _fit(model, Y, [stop])
    assert stop.skipped_steps == []
    _fit(model, _spiked(1), [stop])
    assert stop.skipped_steps == [2 * STEPS + 1]


@pytest.mark.parametrize("skipping_first", [False, True], ids=["stopping-first", "skipping-first"])
def test_two_stop_on_rules_arm_both_their_faults_whichever_comes_first(skipping_first):
    """A spike one StopOnRule skips is skipped beside one that stops on a NaN
    (`tests.merged_faults`)."""
    from tests.merged_faults import check_two_stop_on_rules

    check_two_stop_on_rules(_model(), _fit, _spiked(SPIKE), SPIKE, WINDOW,
                            lambda: _without({SPIKE}), _assert_same_state, skipping_first)
