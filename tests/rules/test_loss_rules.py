"""Loss rules on trainings broken on purpose: the exact firing step, online and offline."""

import warnings

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import LossNotDecreasing, NonFiniteLoss, Overfit, Overtraining, RuleWarning
from tests.conftest import RULE_MATRIX, make_strategy, repeated_batch

BATCH, STEPS = 8, 6
X, Y = repeated_batch(2, BATCH, STEPS, 4)
MATRIX = RULE_MATRIX


def _run(tmp_path, rule_factory, strategy_name, spe, learning_rate, epochs=1,
         x=X, validation=None):
    """Fits with StopOnRule(action="warn"); returns (online steps, offline steps)."""
    log_dir = str(tmp_path / "logs")
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)], name="net")
        model.compile(keras.optimizers.SGD(learning_rate), "mse", steps_per_execution=spe)
    stop = StopOnRule(rule_factory(), action="warn", log_dir=log_dir, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        model.fit(x, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                  validation_data=validation, callbacks=[stop])
    offline = kerasdbg.check_run(log_dir, rule_factory())
    # NaNSource (where a NaN came from) is reported online only.
    online = [v.step for v in stop.verdicts if v.rule != "NaNSource"]
    return online, [v.step for v in offline]


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_non_finite_loss_fires_at_the_step_of_the_nan_batch(tmp_path, strategy_name, spe):
    x = X.copy()
    x[4 * BATCH] = np.inf
    online, offline = _run(tmp_path, lambda: [NonFiniteLoss()], strategy_name, spe, 0.05, x=x)
    assert online == offline == [5]


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_loss_not_decreasing_fires_when_nothing_learns(tmp_path, strategy_name, spe):
    def rules():
        return [LossNotDecreasing(num_steps=4)]

    online, offline = _run(tmp_path, rules, strategy_name, spe, 0.0, epochs=2)
    assert online == offline == [8]  # the first comparison: steps 5-8 against 1-4
    quiet, quiet_offline = _run(tmp_path / "ok", rules, strategy_name, spe, 0.05, epochs=2)
    assert quiet == quiet_offline == []


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_overfit_fires_at_the_first_epoch_whose_validation_is_worse(tmp_path, strategy_name, spe):
    def rules():
        return [Overfit(patience=2)]

    shifted = (X, Y + 3.0)  # the validation labels are off by 3
    online, offline = _run(tmp_path, rules, strategy_name, spe, 0.05, epochs=3,
                           validation=shifted)
    assert online == offline == [2 * STEPS]  # the second evaluation
    quiet, quiet_offline = _run(tmp_path / "ok", rules, strategy_name, spe, 0.05, epochs=3,
                                validation=(X, Y))
    assert quiet == quiet_offline == []


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_overtraining_fires_when_no_loss_improves(tmp_path, strategy_name, spe):
    def rules():
        return [Overtraining(patience_train=2, patience_validation=2, delta=0.01)]

    online, offline = _run(tmp_path, rules, strategy_name, spe, 0.0, epochs=4,
                           validation=(X, Y))
    assert online == offline == [3 * STEPS]  # best at epoch 1, two epochs without
    quiet, quiet_offline = _run(tmp_path / "ok", rules, strategy_name, spe, 0.05, epochs=4,
                                validation=(X, Y))
    assert quiet == quiet_offline == []


def test_loss_rules_refuse_bad_arguments():
    with pytest.raises(ValueError, match="`split` must be one of 'train', 'val'. Received: split='test'"):
        LossNotDecreasing(split="test")
    with pytest.raises(ValueError, match=r"`min_decrease` must be a finite number >= 0 and <= 1"):
        LossNotDecreasing(min_decrease=1.5)
    with pytest.raises(TypeError, match="`patience` must be a positive int"):
        Overfit(patience=1.5)
    with pytest.raises(ValueError, match="`delta` must be a finite number >= 0 and <= 1"):
        Overtraining(delta=2.0)


def test_loss_rules_round_trip_their_config():
    for rule in (LossNotDecreasing(3, min_decrease=0.015, split="val"), Overfit(2, 0.3), Overtraining(1, 2, 0.05),
                 NonFiniteLoss()):
        assert type(rule).from_config(rule.get_config()).get_config() == rule.get_config()


def test_a_val_loss_rule_reads_the_epoch_logs():
    rule = LossNotDecreasing(num_steps=1, split="val")
    assert rule.requires == (("epoch", "val_loss"),)
    assert rule.check(10, {"epoch/val_loss": 1.0}) is None
    assert rule.check(10, {"step/loss": 5.0}) is None  # a step record: not read
    assert rule.check(20, {"epoch/val_loss": 1.0}).step == 20
