"""Keeping a run alive: `StopOnRule(action="skip")` and the spike rules.

A spike planted in one batch (its targets x 1e4) of a healthy regression is
skipped in the graph; the reference is a plain Keras `fit` on the same
batches without that one, so a skipped step must leave the weights, the
optimizer's slots and step count, and BatchNormalization's moving
statistics as if its batch had not come.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, StopOnRule, WeightStatistics
from kerasdbg.layers import TapLayer
from kerasdbg.rules import (
    GradientNormSpike, LossNotDecreasing, LossSpike, NonFiniteLoss, SkippedStep,
)
from tests.conftest import make_strategy, matrix, only_upstream_failure

BATCH, STEPS, WINDOW, SPIKE = 8, 40, 16, 30
RNG = np.random.default_rng(3)
X = RNG.normal(size=(BATCH * STEPS, 4)).astype("float32")
Y = (X @ RNG.normal(size=(4, 1)) + 0.1 * RNG.normal(size=(BATCH * STEPS, 1))).astype("float32")


def _spiked(*steps, scale=1e4):
    """Y with the targets of the batches of optimizer steps `steps` (1-based) scaled."""
    y = Y.copy()
    for step in steps:
        y[(step - 1) * BATCH:step * BATCH] *= scale
    return y


def _model(strategy_name="default", spe=1, jit=False, optimizer="sgd", batchnorm=False, tap=False):
    with make_strategy(strategy_name).scope():
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


def _fit(model, y, callbacks, x=X, epochs=1):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


def _without(strategy_name, skipped, optimizer="sgd", batchnorm=False, steps=STEPS, spe=1,
             jit=False):
    """A plain fit on the batches of steps 1..`steps` but `skipped` (compiled
    alike: XLA and the steps loop may fuse the last bits otherwise)."""
    model = _model(strategy_name, spe, jit, optimizer=optimizer, batchnorm=batchnorm)
    index = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH)
                            for s in range(1, steps + 1) if s not in skipped])
    _fit(model, Y[index], [], x=X[index])
    return model


def _local(variable, strategy):
    return [v.numpy() for v in strategy.experimental_local_results(variable.value)]


def _assert_same_state(model, reference, exact):
    """Weights (moving statistics included) and optimizer variables alike."""
    check = np.testing.assert_array_equal if exact else (
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7))
    for mine, plain in zip(model.weights, reference.weights):
        for a, b in zip(_local(mine, model.distribute_strategy),
                        _local(plain, reference.distribute_strategy)):
            check(a, b)
    for mine, plain in zip(model.optimizer.variables, reference.optimizer.variables):
        assert mine.path.partition("/")[2] == plain.path.partition("/")[2]
        check(np.asarray(mine.numpy()), np.asarray(plain.numpy()))


@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_a_planted_spike_is_skipped_as_if_its_batch_had_not_come(strategy_name, spe, jit):
    model = _model(strategy_name, spe, jit)
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    with only_upstream_failure(strategy_name, jit):
        history = _fit(model, _spiked(SPIKE), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("LossSpike", SPIKE)]
    assert stop.skipped_steps == [SPIKE]
    assert history.history["skipped_steps"] == [1]
    # Keras's step count does not count the skipped step.
    assert int(model.optimizer.iterations.numpy()) == STEPS - 1
    reference = _without(strategy_name, {SPIKE}, spe=spe, jit=jit)
    # Bitwise on one device; across replicas the all-reduce may order sums differently.
    _assert_same_state(model, reference, exact=strategy_name != "mirrored")


@pytest.mark.parametrize("strategy_name, spe", [("default", 4), ("mirrored", 1)])
def test_batch_normalizations_moving_statistics_are_put_back_at_a_skipped_step(
        strategy_name, spe):
    model = _model(strategy_name, spe, batchnorm=True)
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [SPIKE]
    reference = _without(strategy_name, {SPIKE}, batchnorm=True, spe=spe)
    # Not bitwise: with a fault test armed, TensorFlow's graph optimizer may
    # compute BatchNormalization's gamma gradient in another order than in
    # plain Keras (a last-bit difference, with or without a skip).
    _assert_same_state(model, reference, exact=False)
    moving = model.get_layer("bn").moving_variance.numpy()
    assert np.all(moving < 100), "the spiked batch's statistics were not put back"


@pytest.mark.parametrize("strategy_name, spe, jit", [
    ("default", 1, False), ("default", 4, True), ("one_device", 4, False), ("mirrored", 4, False)])
def test_with_adam_the_slots_and_bias_correction_are_those_without_the_batch(
        strategy_name, spe, jit):
    model = _model(strategy_name, spe, jit, optimizer="adam")
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [SPIKE]
    reference = _without(strategy_name, {SPIKE}, optimizer="adam", spe=spe, jit=jit)
    _assert_same_state(model, reference, exact=strategy_name != "mirrored")


def test_the_verdict_gives_the_windows_statistics_computed_independently(capsys):
    model = _model()
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", log_dir=None)
    _fit(model, _spiked(SPIKE), [stop])
    # The losses of the steps before the spike, replayed with a plain model
    # on the same batches: the window is the WINDOW steps before it.
    reference = _model()
    losses = []
    for step in range(1, SPIKE):
        batch = slice((step - 1) * BATCH, step * BATCH)
        losses.append(float(reference.train_on_batch(X[batch], Y[batch])))
    window = np.array(losses[-WINDOW:], np.float64)
    verdict = stop.verdicts[0]
    said = re.search(r"\(mean ([\d.e+-]+), standard deviation ([\d.e+-]+), largest ([\d.e+-]+)\)",
                     verdict.reason)
    assert said, verdict.reason
    np.testing.assert_allclose([float(v) for v in said.groups()],
                               [window.mean(), window.std(), window.max()], rtol=2e-3)
    assert verdict.values["step/loss"] > 1e6
    printed = capsys.readouterr().out
    assert f"kerasdbg: LossSpike at step {SPIKE}:" in printed and "the step was skipped" in printed


def test_a_non_finite_batch_is_skipped_like_the_loss_scaler_does_for_any_optimizer():
    model = _model(spe=4)
    y = Y.copy()
    y[(SPIKE - 1) * BATCH] = np.nan
    stop = StopOnRule(NonFiniteLoss(), action="skip", verbose=False)
    _fit(model, y, [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("NonFiniteLoss", SPIKE),
                                                         ("NaNSource", SPIKE)]
    assert stop.skipped_steps == [SPIKE]
    _assert_same_state(model, _without("default", {SPIKE}, spe=4), exact=True)
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
    # Frozen from the third spike on (the rest of its execution too), then stopped.
    assert model.stop_training
    reference = _without("default", {SPIKE, SPIKE + 2}, steps=SPIKE + 3, spe=4)
    _assert_same_state_weights(model, reference)
    assert len(history.history["loss"]) == 1


def _assert_same_state_weights(model, reference):
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_online_and_offline_verdicts_agree_and_the_records_say_skipped(tmp_path):
    model = _model(spe=4, tap=True)
    rules = [LossSpike(window=WINDOW), GradientNormSpike(window=WINDOW)]
    stop = StopOnRule(rules, action="skip", log_dir=str(tmp_path), verbose=False)
    weights = WeightStatistics(log_dir=str(tmp_path), every_n_steps=1)
    _fit(model, _spiked(SPIKE), [stop, ActivationStatistics(log_dir=str(tmp_path)), weights])
    # A skipped step updated nothing: no update ratio of 0 recorded there.
    assert SPIKE not in set(weights.history.step)
    assert set(weights.history.step) == set(range(1, STEPS + 1)) - {SPIKE}
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
    # Why: both spike tests found it (the loss and the gradient norm).
    reasons = run.scalar_table("faults/skip/.*", run="train")
    assert list(reasons.index) == [SPIKE]
    assert sorted(reasons.columns) == ["faults/skip/gradient_norm_spike", "faults/skip/loss_spike"]
    norms = run.scalar_table("step/gradient_norm", run="train")["step/gradient_norm"]
    assert norms[SPIKE] > 100 * norms.drop(SPIKE).max()
    # The taps number the steps after the skip on (no step twice, none missing).
    taps = run.scalar_table("activations/tap/mean", run="train")
    assert list(taps.index) == list(range(1, STEPS + 1))


def test_a_rules_own_skip_action_skips_under_a_stopping_stop_on_rule():
    model = _model()
    stop = StopOnRule([NonFiniteLoss(), LossSpike(window=WINDOW, action="skip")], verbose=False)
    history = _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [SPIKE] and not model.stop_training
    assert len(history.history["loss"]) == 1 and int(model.optimizer.iterations) == STEPS - 1


def test_a_rules_own_stop_action_freezes_under_a_skipping_stop_on_rule():
    model = _model()
    stop = StopOnRule([LossSpike(window=WINDOW, action="stop")], action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert stop.skipped_steps == [] and model.stop_training
    assert int(model.optimizer.iterations) == SPIKE - 1  # a frozen step does not count
    _assert_same_state_weights(model, _without("default", set(), steps=SPIKE - 1))


def test_a_rule_decided_after_the_step_falls_back_to_stop(capsys):
    model = _model()
    stop = StopOnRule([LossNotDecreasing(num_steps=2, min_decrease=0.99)], action="skip")
    _fit(model, Y, [stop])
    assert model.stop_training and stop.verdicts[0].rule == "LossNotDecreasing"
    assert "cannot be skipped any more: training stops (the fallback of action='skip')" in \
        capsys.readouterr().out


def test_the_megatron_form_fires_on_ten_times_the_largest_norm():
    model = _model()
    rule = GradientNormSpike(window=WINDOW, sigmas=None, factor=10.0)
    stop = StopOnRule(rule, action="skip", verbose=False)
    _fit(model, _spiked(SPIKE), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("GradientNormSpike", SPIKE)]
    assert "more than 10 x the largest value of the last 16 steps" in stop.verdicts[0].reason


def test_a_healthy_run_is_quiet_with_the_default_window():
    # 200 steps, window 128: the test runs over the last 72 and finds nothing.
    x = np.tile(X, (5, 1))
    y = np.tile(Y, (5, 1))
    model = _model(spe=8)
    stop = StopOnRule([LossSpike(), GradientNormSpike()], action="skip", verbose=False)
    _fit(model, y, [stop], x=x)
    assert stop.verdicts == [] and stop.skipped_steps == []
    # The same run with one batch spiked: found at its step with the defaults.
    y[(150 - 1) * BATCH:150 * BATCH] *= 1e4
    model = _model(spe=8)
    stop = StopOnRule([LossSpike(), GradientNormSpike()], action="skip", verbose=False)
    _fit(model, y, [stop], x=x)
    assert [(v.rule, v.step) for v in stop.verdicts] == [
        ("LossSpike", 150), ("GradientNormSpike", 150)]


class _TwoOptimizers(keras.Model):
    """Two sub-models, each trained by its own optimizer on its own loss (a GAN's shape)."""

    def __init__(self):
        super().__init__()
        self.first = keras.Sequential([keras.layers.Dense(1, name="f")], name="first")
        self.second = keras.Sequential([keras.layers.Dense(1, name="s")], name="second")

    def compile(self, first_optimizer, second_optimizer):
        super().compile()
        self.first_optimizer = first_optimizer
        self.second_optimizer = second_optimizer

    def call(self, x):
        return self.first(x) + self.second(x)

    def train_step(self, data):
        x, y = data
        returned = {}
        for name, part, optimizer, target in (
                ("first_loss", self.first, self.first_optimizer, y[:, :1]),
                ("second_loss", self.second, self.second_optimizer, y[:, 1:])):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(part(x) - target))
            grads = tape.gradient(loss, part.trainable_weights)
            optimizer.apply_gradients(zip(grads, part.trainable_weights))
            returned[name] = loss
        return returned


def test_with_two_optimizers_only_the_one_whose_norm_spiked_skips():
    keras.utils.set_random_seed(4)
    model = _TwoOptimizers()
    model.compile(keras.optimizers.SGD(0.02), keras.optimizers.SGD(0.02))
    y = np.concatenate([Y, Y], axis=1)
    y[(SPIKE - 1) * BATCH:SPIKE * BATCH, 0] *= 1e4  # the first part's targets only
    stop = StopOnRule(GradientNormSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, y, [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("GradientNormSpike", SPIKE)]
    assert "the gradient norm of first_optimizer" in stop.verdicts[0].reason
    assert int(model.first_optimizer.iterations) == STEPS - 1
    assert int(model.second_optimizer.iterations) == STEPS


def test_mixed_precision_skip_leaves_the_loss_scale_as_without_the_batch(mixed_precision):
    model = _model(batchnorm=False)
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.02)), "mse")
    stop = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, _spiked(SPIKE, scale=30.0), [stop])
    # The loss scaler skips overflowing steps at first, which share their
    # number with the next (Keras does not count them): the batch is SPIKE's.
    assert len(stop.skipped_steps) == 1 and stop.verdicts[0].values["step/loss"] > 100
    reference = _model(batchnorm=False)
    reference.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.02)), "mse")
    index = np.concatenate([np.arange((s - 1) * BATCH, s * BATCH)
                            for s in range(1, STEPS + 1) if s != SPIKE])
    _fit(reference, Y[index], [], x=X[index])
    _assert_same_state(model, reference, exact=True)


def test_the_configuration_round_trips_and_bad_arguments_are_refused():
    stop = StopOnRule([LossSpike(window=64, sigmas=5.0, factor=10.0, action="skip"),
                       GradientNormSpike()], action="skip", max_skips=3, skip_window=50)
    again = StopOnRule.from_config(stop.get_config())
    assert again.get_config() == stop.get_config()
    assert (again.max_skips, again.skip_window) == (3, 50)
    assert repr(again.rules[0]) == "LossSpike(window=64, sigmas=5.0, factor=10.0, action='skip')"
    with pytest.raises(ValueError, match=r"needs freeze_on_fault=True or None\. Received: "
                                         r"freeze_on_fault=False"):
        StopOnRule(LossSpike(), action="skip", freeze_on_fault=False)
    with pytest.raises(ValueError, match=r"`max_skips` must be at most `skip_window`"):
        StopOnRule(LossSpike(), action="skip", max_skips=10, skip_window=5)
    with pytest.raises(ValueError, match=r"`action` must be one of 'stop', 'raise', 'warn', "
                                         r"'skip', 'rollback' or a callable\. "
                                         r"Received: action='rollbak'"):
        StopOnRule(LossSpike(), action="rollbak")
    with pytest.raises(ValueError, match=r"LossSpike: `window` must be at least 2"):
        LossSpike(window=1)
    with pytest.raises(ValueError, match=r"give `sigmas`, `factor` or both"):
        GradientNormSpike(sigmas=None)
    with pytest.raises(ValueError, match=r"LossSpike: `action` must be one of"):
        LossSpike(action="warn")
    with pytest.raises(ValueError, match=r"`factor` must be"):
        LossSpike(factor=0.5)


def test_steps_trained_without_the_guard_empty_its_windows():
    """A fit with the guard, a fit without it on targets x 30 (a new regime),
    then a fit with it again on those targets: the windows of the first fit
    would call the third's losses spikes (without emptying them: steps 81-90
    skipped, then max_skips); emptied, they refill first."""
    model = _model(optimizer="adam")
    first = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, Y, [first])
    _fit(model, 30 * Y, [])
    third = StopOnRule(LossSpike(window=WINDOW), action="skip", verbose=False)
    _fit(model, 30 * Y, [third])
    assert first.verdicts == [] and third.verdicts == [] and third.skipped_steps == []
    # The same loop of fits, all with the guard, keeps its windows: the third
    # fit's first steps are tested against the second's.
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

    check_two_stop_on_rules(
        _model(), _fit, _spiked(SPIKE), SPIKE, WINDOW, lambda: _without("default", {SPIKE}),
        lambda model, reference: _assert_same_state(model, reference, exact=True),
        skipping_first)
