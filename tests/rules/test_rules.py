"""Built-in rules: on records, and on broken trainings that make them fire at a known step."""

import math
import re

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, WeightStatistics
from kerasdbg.layers import TapLayer
from kerasdbg.rules import (
    AllZero, DeadReLU, ExplodingTensor, LossNotDecreasing, Rule, SaturatedActivation,
    TensorVariance,
    UnchangedTensor, VanishingGradient, WeightUpdateRatio,
)
from tests.conftest import make_strategy, matrix, only_upstream_failure

RULES = [VanishingGradient(), ExplodingTensor(), DeadReLU(), SaturatedActivation(),
         WeightUpdateRatio(), AllZero(), UnchangedTensor(),
         TensorVariance(max_threshold=1e6)]

BATCH, STEPS = 8, 10
RNG = np.random.default_rng(7)
X = np.abs(RNG.normal(size=(BATCH * STEPS, 6))).astype("float32") + 0.1
Y = RNG.normal(size=(BATCH * STEPS, 1)).astype("float32")


def _batch(x, step, value):
    """`x` with the batch of optimizer step `step` (1-based) replaced."""
    x = x.copy()
    x[(step - 1) * BATCH: step * BATCH] = value
    return x


def _train(tmp_path, x, activation="relu", strategy_name="default", spe=1,
           min_examples=BATCH // 2, jit=False):
    """A tapped MLP trained for STEPS steps with every recorder; returns the log dir.

    The taps judge a unit dead (or saturated) on one batch (`min_examples=BATCH // 2`,
    a replica's share under MirroredStrategy): the broken trainings below plant one bad
    batch. With the default (100 examples) one
    batch of 8 is no evidence, see `test_one_small_bad_batch_is_not_dead_units`."""
    log_dir = str(tmp_path / "logs")
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((6,), name="x"),
            keras.layers.Dense(32, activation=activation, kernel_initializer=keras.initializers
                               .RandomUniform(0.0, 0.2), name="hidden"),
            keras.layers.Dense(1, name="out"),
        ], name="mlp")
        model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=spe,
                      jit_compile=jit)
        tapped = kerasdbg.insert_taps(model, layers=["hidden"],
                                      tap=TapLayer(min_examples=min_examples))
    callbacks = [GradientStatistics(log_dir), WeightStatistics(log_dir),
                 ActivationStatistics(log_dir)]
    with only_upstream_failure(strategy_name, jit):
        tapped.fit(x, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=callbacks)
    return log_dir


def _first(log_dir, rule):
    verdicts = kerasdbg.check_run(log_dir, [rule])
    return verdicts[0].step if verdicts else None


# ------------------------------------------------------------ trainings
MATRIX = [
    pytest.param(s, spe, id=f"{s}-spe{spe}") for s in ("default", "mirrored") for spe in (1, 4)
]


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_healthy_training_keeps_every_rule_quiet(tmp_path, strategy_name, spe):
    log_dir = _train(tmp_path, X, strategy_name=strategy_name, spe=spe)
    relu_rules = [rule for rule in RULES if not isinstance(rule, SaturatedActivation)]
    assert kerasdbg.check_run(log_dir, relu_rules) == []


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_exploding_tensor_fires_at_the_step_with_a_nan_input(tmp_path, strategy_name, spe):
    log_dir = _train(tmp_path, _batch(X, 6, np.nan), strategy_name=strategy_name, spe=spe)
    verdicts = kerasdbg.check_run(log_dir, [ExplodingTensor()])
    assert [v.step for v in verdicts] == [6]
    # The first kernel's gradient (NaN inputs times the back-propagated error) is
    # NaN on every CPU. Whether the others are depends on the kernels: oneDNN's fused
    # MatMul+BiasAdd+Relu turns NaN into 0, Eigen's keeps it.
    assert "mlp/hidden/kernel" in verdicts[0].tensors
    assert verdicts[0].reason.startswith("ExplodingTensor at step 6: non-finite values in "
                                         "gradients: ")
    assert re.search(r"mlp/hidden/kernel=\d+", verdicts[0].reason)


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_dead_relu_fires_when_every_unit_is_zero(tmp_path, strategy_name, spe):
    # All inputs negative at step 4: the hidden pre-activations (kernel >= 0 at
    # the start, small learning rate) are all negative, so every unit is dead.
    log_dir = _train(tmp_path, _batch(X, 4, -100.0), strategy_name=strategy_name, spe=spe)
    verdicts = kerasdbg.check_run(log_dir, [DeadReLU()])
    assert [(v.step, v.values) for v in verdicts] == [(4, {"hidden_tap": 1.0})]
    # At that step no gradient reaches the hidden layer, so those rules fire too.
    assert _first(log_dir, VanishingGradient()) == 4
    assert _first(log_dir, AllZero(collections=["gradients"])) == 4


def test_one_small_bad_batch_is_not_dead_units(tmp_path):
    # The taps' default: inactive on the last 100 examples or more, in a row. One batch
    # of 8 that activates no unit (a healthy small layer has such batches) is not that.
    log_dir = _train(tmp_path, _batch(X, 4, -100.0), min_examples=100)
    assert kerasdbg.check_run(log_dir, [DeadReLU()]) == []
    assert kerasdbg.check_run(log_dir, [VanishingGradient()])[0].step == 4


@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_units_are_dead_after_min_examples_in_a_row(tmp_path, strategy_name, spe, jit):
    # Bad batches from step 4 to 10 (7 batches). Each replica counts its own share.
    x = X.copy()
    x[3 * BATCH:] = -100.0
    per_replica = BATCH // (2 if strategy_name == "mirrored" else 1)
    kwargs = dict(strategy_name=strategy_name, spe=spe, jit=jit)
    assert kerasdbg.check_run(_train(tmp_path / "short", x, min_examples=7 * per_replica + 1,
                                     **kwargs), [DeadReLU()]) == []
    verdict = kerasdbg.check_run(_train(tmp_path / "enough", x, min_examples=7 * per_replica,
                                        **kwargs), [DeadReLU()])[0]
    assert (verdict.step, verdict.values) == (4 + 7 - 1, {"hidden_tap": 1.0})


def test_vanishing_gradient_and_all_zero_on_zero_inputs(tmp_path):
    log_dir = _train(tmp_path, _batch(X, 7, 0.0))
    verdict = kerasdbg.check_run(log_dir, [VanishingGradient()])[0]
    assert (verdict.step, verdict.tensors) == (7, ("mlp/hidden/kernel",))
    assert verdict.values == {"mlp/hidden/kernel": 0.0}
    assert _first(log_dir, VanishingGradient(require="all")) is None  # biases still learn
    zero = kerasdbg.check_run(log_dir, [AllZero(collections=["gradients"])])[0]
    assert (zero.step, zero.tensors) == (7, ("mlp/hidden/kernel",))


def test_weight_update_ratio_fires_on_a_huge_update(tmp_path):
    log_dir = _train(tmp_path, _batch(X, 5, 1e5))
    verdict = kerasdbg.check_run(log_dir, [WeightUpdateRatio()])[0]
    assert verdict.step == 5
    assert all(ratio > 10 for ratio in verdict.values.values())
    # The first update of each variable out of range is not enough; the second is.
    assert _first(log_dir, WeightUpdateRatio(large_threshold=1e30, small_threshold=0.5)) == 2


def test_saturated_activation_fires_on_saturated_tanh(tmp_path):
    log_dir = _train(tmp_path, _batch(X, 3, 1e3), activation="tanh")
    verdict = kerasdbg.check_run(log_dir, [SaturatedActivation()])[0]
    assert verdict.step == 3 and verdict.values["hidden_tap"] >= 0.5
    with pytest.raises(ValueError, match="DeadReLU reads activations/<name>/dead_fraction"):
        kerasdbg.check_run(log_dir, [DeadReLU()])  # tanh taps record no dead units
    assert kerasdbg.check_run(_train(tmp_path / "healthy", X, activation="tanh"),
                              [SaturatedActivation()]) == []


# ------------------------------------------------------------ records
def test_rules_on_records_edge_cases():
    nan = math.nan
    assert VanishingGradient().check(1, {"gradients/v/mean_abs": nan}) is None
    assert VanishingGradient().check(1, {}) is None
    every = VanishingGradient(require="all")  # (a first step alone is not enough)
    still = {"gradients/a/mean_abs": 0.0, "gradients/b/mean_abs": 0.0,
             "weights/a/update_ratio": 0.0, "weights/b/update_ratio": 0.0}
    assert every.check(1, still) is None
    assert every.check(2, still).tensors == ("a", "b")
    assert ExplodingTensor(only_nan=True).check(
        1, {"gradients/a/nan_count": 0.0, "gradients/a/inf_count": 2.0}) is None
    assert ExplodingTensor().check(
        1, {"gradients/a/nan_count": 0.0, "gradients/a/inf_count": 2.0}).values == {"a": 2.0}
    big = ExplodingTensor(threshold=100.0).check(
        1, {"gradients/a/min": -500.0, "gradients/a/max": 3.0, "gradients/a/nan_count": 0.0})
    assert big.values == {"a": 500.0}
    assert ExplodingTensor(collections=["weights"]).check(1, {"gradients/a/nan_count": 1}) is None
    # Variables with a norm below epsilon are left out of WeightUpdateRatio.
    record = {"weights/a/update_ratio": 1e6, "weights/a/l2_norm": 0.0}
    assert WeightUpdateRatio().check(1, record) is None
    # A variable's first update out of range is not enough (healthy networks
    # have them at their initial weights); the next one out of range fires.
    tiny = WeightUpdateRatio()
    assert tiny.check(1, {"weights/a/update_ratio": 1e-12}) is None
    assert tiny.check(2, {"weights/a/update_ratio": 1e-12}).values == {"a": 1e-12}
    mostly_zero = AllZero(zero_fraction=0.9)
    assert mostly_zero.check(1, {"activations/t/zero_fraction": 0.95}) is None  # the first
    assert mostly_zero.check(2, {"activations/t/zero_fraction": 0.95}) is not None
    assert DeadReLU(layer_fraction=0.8).check(1, {"activations/t/dead_fraction": 0.75}) is None
    # Tags that are not per tensor are ignored.
    assert AllZero().check(1, {"gradients/global_norm": 0.0}) is None



@pytest.mark.parametrize("rule", [ExplodingTensor(), ExplodingTensor(only_nan=True),
                                  ExplodingTensor(collections=["gradients", "weights"]),
                                  ExplodingTensor(threshold=10.0)], ids=repr)
def test_exploding_tensor_judges_a_step_record_as_the_plain_record(rule):
    """A `StepRecord` is judged through its arrays (the counts all 0: no dict of
    tensors built); the same verdict as on the same values in a plain dict."""
    from kerasdbg.records import StepRecord
    rng = np.random.default_rng(3)
    for trial in range(200):
        record = {}
        for collection in ("gradients", "weights"):
            for name in ("m/a/kernel", "m/a/bias", "m/b/kernel"):
                record[f"{collection}/{name}/nan_count"] = float(rng.choice([0, 0, 0, 1, 7, math.nan]))
                if rng.random() < 0.8:
                    record[f"{collection}/{name}/inf_count"] = float(rng.choice([0, 0, 0, 2]))
                record[f"{collection}/{name}/max"] = float(rng.normal() * 10)
                record[f"{collection}/{name}/min"] = -float(rng.normal() * 10)
        record["step/loss"] = 1.0
        assert rule.check(trial, StepRecord(record)) == rule.check(trial, dict(record)), record

def test_reasons_list_at_most_five_tensors():
    record = {f"gradients/v{i}/mean_abs": 0.0 for i in range(8)}
    record.update({f"weights/v{i}/update_ratio": 0.0 for i in range(8)})
    rule = VanishingGradient()
    assert rule.check(1, record) is None  # a first step alone is not enough
    reason = rule.check(2, record).reason
    assert reason.endswith("v4=0 and 3 more") and "8 of 8 variables" in reason


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_config_round_trip(rule):
    again = type(rule).from_config(rule.get_config())
    assert again.get_config() == rule.get_config()
    assert repr(again) == repr(rule)


@pytest.mark.parametrize("make, old, new", [
    (lambda: DeadReLU(threshold_layer=80.0), "threshold_layer=80.0", "layer_fraction=0.8"),
    (lambda: SaturatedActivation(threshold_layer=30), "threshold_layer=30", "layer_fraction=0.3"),
    (lambda: AllZero(threshold=90.0), "threshold=90.0", "zero_fraction=0.9"),
    (lambda: LossNotDecreasing(diff_percent=5.0), "diff_percent=5.0", "min_decrease=0.05"),
    (lambda: LossNotDecreasing(mode="val"), "mode='val'", "split='val'"),
], ids=["dead-relu", "saturated", "all-zero", "diff-percent", "mode"])
def test_a_renamed_argument_warns_with_its_new_name_and_keeps_working(make, old, new):
    with pytest.warns(FutureWarning, match=re.escape(f"is deprecated; use `{new.split('=')[0]}`")) \
            as caught:
        rule = make()
    assert f"{old} is {new}." in str(caught[0].message)
    name, value = new.split("=")
    assert rule.get_config()[name] == pytest.approx(eval(value))  # noqa: S307 - test literal
    assert old.split("=")[0] not in rule.get_config()


def test_the_unused_threshold_inactivity_is_gone_with_a_warning():
    with pytest.warns(FutureWarning, match=re.escape(
            "DeadReLU: `threshold_inactivity` is deprecated and ignored: it never changed what "
            "the rule reads; the taps decide when a unit counts, with "
            "`TapLayer(active_fraction=...)`.")):
        rule = DeadReLU(threshold_inactivity=5.0)
    assert rule.get_config() == {"layer_fraction": 0.5}


@pytest.mark.parametrize("make, error, message", [
    (lambda: VanishingGradient(threshold=-1), ValueError,
     "VanishingGradient: `threshold` must be a finite number >= 0. Received: threshold=-1.0"),
    (lambda: VanishingGradient(require="most"), ValueError,
     "VanishingGradient: `require` must be one of 'any', 'all'. Received: require='most'"),
    (lambda: ExplodingTensor(collections=["losses"]), ValueError,
     "ExplodingTensor: `collections` must be a non-empty list of names from gradients, "
     "weights, activations"),
    (lambda: ExplodingTensor(threshold=0), ValueError, "`threshold` must be a finite number > 0"),
    (lambda: ExplodingTensor(only_nan=1), TypeError, "`only_nan` must be a bool"),
    (lambda: DeadReLU(layer_fraction=1.5), ValueError,
     "DeadReLU: `layer_fraction` must be a finite number >= 0 and <= 1. "
     "Received: layer_fraction=1.5"),
    (lambda: WeightUpdateRatio(small_threshold=20.0), ValueError,
     "WeightUpdateRatio: `small_threshold` must be a finite number >= 0 and <= 10"),
    (lambda: AllZero(zero_fraction="all"), TypeError,
     "AllZero: `zero_fraction` must be a number. Received: zero_fraction='all' of type str"),
    (lambda: AllZero(zero_fraction=math.nan), ValueError, "`zero_fraction` must be a finite number"),
    (lambda: AllZero(zero_fraction=0.5, threshold=50), ValueError,
     "AllZero: give `zero_fraction` or its deprecated name `threshold`, not both. "
     "Received: zero_fraction=0.5, threshold=50"),
    (lambda: AllZero(limit=3), TypeError,
     "AllZero: unexpected keyword argument `limit`. Received: limit=3"),
    # A positional value meant another argument, in another unit, before the renames.
    (lambda: DeadReLU(1.0), TypeError, "takes 1 positional argument but 2 were given"),
    (lambda: AllZero(100.0), TypeError, "takes 1 positional argument but 2 were given"),
    (lambda: LossNotDecreasing(10, 5.0), TypeError, "positional argument"),
], ids=["negative", "require", "collection", "zero-threshold", "only-nan-type", "fraction",
        "small-above-large", "type", "nan", "old-and-new", "unknown", "positional-dead-relu",
        "positional-all-zero", "positional-loss"])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_check_run_refuses_rules_it_cannot_evaluate(tmp_path):
    log_dir = str(tmp_path / "logs")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1, name="d")], name="m")
    model.compile("sgd", "mse")
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[GradientStatistics(log_dir, stats=["l2_norm"])])
    with pytest.raises(ValueError, match=re.escape(
        "check_run: VanishingGradient reads gradients/<name>/mean_abs, "
        "gradients/<name>/zero_fraction, weights/<name>/update_ratio, which run 'train'"
    )):
        kerasdbg.check_run(log_dir, [VanishingGradient()])
    with pytest.raises(TypeError, match="`rules` must hold kerasdbg.rules.Rule objects"):
        kerasdbg.check_run(log_dir, ["VanishingGradient"])
    # All firing steps on request, not only the first.
    everything = kerasdbg.check_run(log_dir, [_Always()], first_only=False)
    assert [v.step for v in everything] == list(range(1, STEPS + 1))


class _Always(Rule):
    def check(self, step, record):
        return self.verdict(step, "always", {})


# ------------------------------------------------------------ command line
def test_cli_check_agrees_with_check_run_and_sets_the_exit_status(tmp_path, capsys):
    from kerasdbg import cli

    broken = _train(tmp_path / "broken", _batch(X, 4, -100.0))
    healthy = _train(tmp_path / "healthy", X)
    assert cli.main(["check", broken, "--rule", "DeadReLU:layer_fraction=0.9"]) == 1
    out = capsys.readouterr().out.strip()
    assert out == kerasdbg.check_run(broken, [DeadReLU(layer_fraction=0.9)])[0].reason
    assert out.startswith("DeadReLU at step 4: dead_fraction at or above 0.9")
    # Without --rule: the default rules of StopOnRule() that the run can feed (not
    # SaturatedActivation here, nor ReplicaConsistency, nor the fault reports).
    assert cli.main(["check", healthy]) == 0
    assert capsys.readouterr().err.strip() == "kerasdbg check: 0 of 6 rules fired"
    assert cli.main(["check", broken, "--rule", "AllZero:collections=gradients|weights",
                     "--all-steps"]) == 1
    assert capsys.readouterr().out.splitlines()[0].startswith("AllZero at step 4")


@pytest.mark.parametrize("rule, message", [
    ("Nope", "unknown rule 'Nope'. Rules: AllZero, ClassImbalance, DeadReLU"),
    ("DeadReLU:layer_fraction", "rule parameters are written param=value"),
    ("DeadReLU:limit=3", "DeadReLU has no parameter 'limit'. Parameters: layer_fraction"),
    ("DeadReLU:layer_fraction=2", "`layer_fraction` must be a finite number >= 0 and <= 1"),
], ids=["unknown", "no-value", "unknown-param", "bad-value"])
def test_cli_check_bad_rules(tmp_path, capsys, rule, message):
    from kerasdbg import cli

    assert cli.main(["check", str(tmp_path), "--rule", rule]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------ UnchangedTensor, TensorVariance
def test_unchanged_tensor_trusts_the_update_ratio_where_recorded():
    """Statistics that barely change (Adam moving a kernel by 1e-5 of itself per
    step, within rtol) are not unchanged weights when the update ratio says they
    moved; a ratio of 0 still fires. A ratio of the weight decay (lr x wd) cannot
    prove the weights still (the decay hides what the gradient did): no verdict."""
    def record(ratio, **more):
        return {"weights/m/d/kernel/l2_norm": 1.5, "weights/m/d/kernel/mean": 0.1,
                "weights/m/d/kernel/update_ratio": ratio, **more}

    moving = UnchangedTensor(num_steps=3)
    assert [moving.check(s, record(1e-5)) for s in (1, 2, 3, 4)] == [None] * 4
    rule = UnchangedTensor(num_steps=3)
    assert rule.check(1, record(0.0)) is None
    assert rule.check(2, record(0.0)) is None
    assert rule.check(3, record(0.0)).tensors == ("m/d/kernel",)
    decayed = UnchangedTensor(num_steps=3)
    assert [decayed.check(s, record(4e-6, **{"step/weight_decay_fraction": 4e-6}))
            for s in (1, 2, 3, 4)] == [None] * 4
    # Without a ratio recorded, the statistics decide, as before.
    rule = UnchangedTensor(num_steps=2)
    assert rule.check(1, {"weights/m/d/kernel/l2_norm": 1.5}) is None
    assert rule.check(2, {"weights/m/d/kernel/l2_norm": 1.5}).tensors == ("m/d/kernel",)


def test_unchanged_tensor_fires_when_the_weights_stop_moving(tmp_path):
    log_dir = str(tmp_path / "logs")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="d")], name="m")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    frozen = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch == 4 and model.optimizer.learning_rate.assign(0.0))
    model.fit(X, np.zeros((len(X), 4), "float32"), batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[frozen, WeightStatistics(log_dir)])
    # Weights are recorded after each update: those of step 5 are the last to
    # move, and steps 5, 6 and 7 record the same weights.
    verdict = kerasdbg.check_run(log_dir, [UnchangedTensor(num_steps=3)])[0]
    assert (verdict.step, set(verdict.tensors)) == (7, {"m/d/kernel", "m/d/bias"})
    assert kerasdbg.check_run(_train(tmp_path / "healthy", X), [UnchangedTensor()]) == []


def test_tensor_variance_fires_on_dead_and_on_huge_activations(tmp_path):
    dead = _train(tmp_path / "dead", _batch(X, 4, -100.0))
    verdict = kerasdbg.check_run(dead, [TensorVariance(min_threshold=1e-12,
                                                       collections=["activations"])])[0]
    assert (verdict.step, verdict.values) == (4, {"hidden_tap": 0.0})
    huge = _train(tmp_path / "huge", _batch(X, 5, 1e5))
    assert _first(huge, TensorVariance(max_threshold=1e6, collections=["activations"])) == 5
    with pytest.raises(ValueError, match="TensorVariance: give `min_threshold`, `max_threshold`"):
        TensorVariance()
    with pytest.raises(ValueError, match="UnchangedTensor: `num_steps` must be at least 2"):
        UnchangedTensor(num_steps=1)


def test_the_verdict_text_reads_back_with_its_tensor_count_and_a_bar_in_the_reason():
    from kerasdbg.records import verdict_markdown, verdict_rows

    values = {f"gradients/v{i}/min": -1e9 for i in range(12)}
    values.update({f"gradients/v{i}/max": 1.0 for i in range(12)})
    values.update({f"gradients/v{i}/nan_count": 0.0 for i in range(12)})
    verdict = ExplodingTensor(threshold=10.0).check(7, values)
    assert "|values| above 10" in verdict.reason and len(verdict.tensors) == 12
    (row,) = verdict_rows(verdict_markdown([verdict]))
    assert row == {"rule": "ExplodingTensor", "step": 7, "tensors": [f"v{i}" for i in range(5)],
                   "hidden": 7, "reason": verdict.reason, "severity": "fault"}
    # A text written before the count: " ..." alone.
    old = "| rule | step | tensors | reason |\n|---|---|---|---|\n| R | 2 | a, b ... | why |"
    assert verdict_rows(old)[0]["hidden"] == -1


def test_the_verdict_text_heading_names_one_step_or_the_steps_in_order():
    """Verdicts at one step: "(step 11)"; at several: their steps, the newest last
    (on the commit before, "(steps 11; the newest last)" for one step)."""
    from kerasdbg.records import verdict_markdown, verdict_rows
    from kerasdbg.rules import AllZero

    at = [AllZero().check(s, {"weights/m/d/bias/zero_fraction": 1.0}) for s in (11, 11, 12, 14)]
    one = verdict_markdown(at[:2])
    assert one.splitlines()[0] == "**Verdicts, in step order** (step 11)"
    several = verdict_markdown(at)
    assert several.splitlines()[0] == \
        "**Verdicts, in step order** (steps 11-12, 14; the newest last)"
    assert [r["step"] for r in verdict_rows(several)] == [11, 11, 12, 14]
