"""PoorWeightInitialization: on records, and on trainings started badly on purpose."""

import warnings

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.rules import PoorWeightInitialization, RuleWarning
from tests.conftest import RULE_MATRIX, make_strategy, repeated_batch

BATCH, STEPS = 16, 12
X, Y = repeated_batch(5, BATCH, STEPS, 8)
MATRIX = RULE_MATRIX


# ---------------------------------------------------------------- records
def test_activation_variances_compare_the_widest_and_narrowest_tap():
    rule = PoorWeightInitialization(gradients=None, patience=None)
    healthy = {"activations/a/std": 1.0, "activations/b/std": 3.0}  # ratio 9
    assert rule.check(1, healthy) is None
    verdict = rule.check(2, {**healthy, "activations/c/std": 0.0})
    assert verdict.tensors == ("b", "c") and verdict.values == {"b": 9.0, "c": 0.0}
    assert "is inf times that of c" in verdict.reason
    assert rule.check(3, {"activations/a/std": 1.0}) is None  # one tap: nothing to compare


def test_activation_pattern_selects_the_taps():
    rule = PoorWeightInitialization(activations="^block", gradients=None, patience=None)
    record = {"activations/block1/std": 1.0, "activations/block2/std": 2.0,
              "activations/logits/std": 100.0}
    assert rule.check(1, record) is None


def test_gradient_spread_reads_the_quantiles_of_matched_variables_only():
    rule = PoorWeightInitialization(activations=None, patience=None)
    record = {"gradients/m/d/kernel/p05": -0.01, "gradients/m/d/kernel/p95": 0.02,
              "gradients/m/d/bias/p05": 0.3, "gradients/m/d/bias/p95": 0.3}
    assert rule.check(1, record) is None  # a one-element bias has no spread
    record["gradients/m/e/kernel/p05"] = 1e-5
    record["gradients/m/e/kernel/p95"] = 5e-4
    verdict = rule.check(2, record)
    assert verdict.tensors == ("m/e/kernel",)
    assert verdict.values["m/e/kernel"] == pytest.approx(4.9e-4)


def test_loss_fires_after_patience_steps_without_a_new_lowest_loss():
    rule = PoorWeightInitialization(activations=None, gradients=None, patience=3)
    losses = [1.0, 0.8, 0.9, 0.85, 0.7, 0.75, 0.8, 0.71]
    steps = [s for s, v in enumerate(losses, 1) if rule.check(s, {"step/loss": v})]
    assert steps == [8]  # lowest at step 5, then 6, 7, 8 are not lower


def test_only_the_first_steps_are_checked():
    rule = PoorWeightInitialization(steps=2, gradients=None, patience=None)
    record = {"activations/a/std": 1.0, "activations/b/std": 100.0}
    assert rule.check(3, record) is None
    assert rule.check(2, record).step == 2
    assert rule.last_step == 2


def test_requires_follows_the_checks_that_are_on():
    assert PoorWeightInitialization().requires == (
        ("activations", "std"), ("gradients", "p05"), ("gradients", "p95"), ("step", "loss"))
    assert PoorWeightInitialization(activations=None, gradients=None).requires == (
        ("step", "loss"),)


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match=r"`threshold`.*Received: threshold=0.5"):
        PoorWeightInitialization(threshold=0.5)
    with pytest.raises(ValueError, match="nothing to check"):
        PoorWeightInitialization(activations=None, gradients=None, patience=None)
    with pytest.raises(ValueError, match="`gradients` is not a valid regular expression"):
        PoorWeightInitialization(gradients="(")
    with pytest.raises(ValueError, match="`steps`"):
        PoorWeightInitialization(steps=0)


def test_config_round_trips():
    rule = PoorWeightInitialization(threshold=4.0, patience=None, activations="dense")
    again = PoorWeightInitialization.from_config(rule.get_config())
    assert again.get_config() == rule.get_config()


# -------------------------------------------------------------- trainings
def _model(initializer, learning_rate, spe):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((8,), name="x"),
        keras.layers.Dense(32, activation="relu", kernel_initializer=initializer, name="h1"),
        keras.layers.Dense(32, activation="relu", kernel_initializer=initializer, name="h2"),
        keras.layers.Dense(1, kernel_initializer=initializer, name="out"),
    ], name="net")
    model.compile(keras.optimizers.SGD(learning_rate), "mse", steps_per_execution=spe)
    return model


def _run(tmp_path, initializer, learning_rate, strategy_name="default", spe=1):
    """Fits a tapped MLP with the rule online and the recorders for offline;
    returns (online verdicts, offline verdicts, the untrained model's weights)."""
    log_dir = str(tmp_path / "logs")
    with make_strategy(strategy_name).scope():
        model = _model(initializer, learning_rate, spe)
        tapped = kerasdbg.insert_taps(model, layers=["h1", "h2"])
    weights = [w.copy() for w in model.get_weights()]
    stop = StopOnRule([PoorWeightInitialization()], action="warn", log_dir=log_dir,
                      verbose=False)
    callbacks = [GradientStatistics(log_dir, stats=["p05", "p95"]),
                 ActivationStatistics(log_dir), stop]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        tapped.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    offline = kerasdbg.check_run(log_dir, [PoorWeightInitialization()])
    return stop.verdicts, offline, weights


def _reasons(verdicts):
    return [(v.step, v.reason) for v in verdicts]


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_a_healthy_start_stays_quiet(tmp_path, strategy_name, spe):
    online, offline, _ = _run(tmp_path, "he_normal", 0.01, strategy_name, spe)
    assert online == offline == []


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_too_wide_weights_fire_on_activation_variances_at_step_1(tmp_path, strategy_name, spe):
    online, offline, weights = _run(
        tmp_path, keras.initializers.RandomNormal(stddev=3.0), 1e-6, strategy_name, spe)
    assert _reasons(online) == _reasons(offline)
    [verdict] = online
    assert verdict.step == 1 and verdict.tensors == ("h2_tap", "h1_tap")
    if strategy_name == "default":  # (under Mirrored the taps see the first replica)
        k1, b1, k2, b2 = weights[:4]
        h1 = np.maximum(X[:BATCH].astype(np.float64) @ k1 + b1, 0)
        h2 = np.maximum(h1 @ k2 + b2, 0)
        assert verdict.values["h1_tap"] == pytest.approx(h1.var(), rel=1e-5)
        assert verdict.values["h2_tap"] == pytest.approx(h2.var(), rel=1e-5)
        assert h2.var() > 10 * h1.var()


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_zero_weights_fire_on_gradient_spread_at_step_1(tmp_path, strategy_name, spe):
    online, offline, _ = _run(tmp_path, "zeros", 0.01, strategy_name, spe)
    assert _reasons(online) == _reasons(offline)
    [verdict] = online
    assert verdict.step == 1
    # Every kernel gets an all-zero gradient: no signal reaches them.
    assert verdict.values == {"net/h1/kernel": 0.0, "net/h2/kernel": 0.0, "net/out/kernel": 0.0}


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_a_loss_that_never_falls_fires_after_patience_steps(tmp_path, strategy_name, spe):
    online, offline, weights = _run(tmp_path, "he_normal", 0.0, strategy_name, spe)
    assert _reasons(online) == _reasons(offline)
    [verdict] = online
    assert verdict.step == 6  # lowest at step 1, then five equal losses
    k1, b1, k2, b2, k3, b3 = [w.astype(np.float64) for w in weights]
    h = np.maximum(np.maximum(X[:BATCH] @ k1 + b1, 0) @ k2 + b2, 0)
    assert verdict.values["step/loss"] == pytest.approx(np.mean((h @ k3 + b3 - Y[:BATCH]) ** 2),
                                                        rel=1e-5)


class _Spy(kerasdbg.rules.Rule):
    """Notes which statistics each step's record holds."""

    def __init__(self, requires, last_step=None):
        self.requires, self.last_step, self.seen = requires, last_step, {}

    def check(self, step, record):
        statistics = {tag.rsplit("/", 1)[1] for tag in record
                      if tag.startswith("gradients/") and tag.count("/") > 1}
        if statistics:  # (the epoch logs come as a record of their own)
            self.seen[step] = sorted(statistics)


@pytest.mark.parametrize("spe", [1, 4])
def test_what_a_rule_reads_at_the_first_steps_only_is_recorded_for_those_only(spe):
    model = _model("he_normal", 0.01, spe)
    early = _Spy((("gradients", "p05"), ("gradients", "p95")), last_step=3)
    always = _Spy((("gradients", "mean_abs"),))
    stop = StopOnRule([early, always], action="warn", verbose=False)
    model.fit(X[:6 * BATCH], Y[:6 * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[stop])
    quantiles = ["mean_abs", "p05", "p95"]
    assert always.seen == {1: quantiles, 2: quantiles, 3: quantiles,
                           4: ["mean_abs"], 5: ["mean_abs"], 6: ["mean_abs"]}
