"""get_config / from_config round trips of every public callback and rule, through JSON."""

import json

import keras
import pytest

from kerasdbg import callbacks as callbacks_lib
from kerasdbg import rules as rules_lib
from kerasdbg.callbacks import (
    ActivationStatistics, GradientStatistics, StepRecorder, StepTimer, StopOnRule,
    WeightStatistics,
)
from kerasdbg.rules import (
    AllZero, ClassImbalance, DeadReLU, ExplodingTensor, FreezeOnFault, GradientNormSpike,
    LearnedRange, LogitGrowth, LossNotDecreasing, LossSpike, SkippedStep,
    NaNSource, NonFiniteLoss, Overfit, Overtraining, PoorWeightInitialization, ReplicaConsistency, Rule,
    SaturatedActivation, TensorVariance, UnchangedTensor, VanishingGradient, WeightUpdateRatio,
)


def on_fault(verdicts, model):
    """A module-level action: what a config can name."""


def hidden_layers(layer):
    """A module-level layer selection."""
    return layer.name == "hidden"


class LargeLoss(Rule):
    """A custom rule, found again by its module."""

    requires = (("step", "loss"),)

    def __init__(self, limit=10.0):
        self.limit = limit

    def check(self, step, record):
        return None

    def get_config(self):
        return {"limit": self.limit}


# Each with arguments other than its defaults.
RULES = [
    AllZero(zero_fraction=0.9, collections=["weights"]),
    ClassImbalance(threshold_imbalance=5.0, threshold_misprediction=0.5),
    DeadReLU(layer_fraction=0.3),
    ExplodingTensor(collections=["weights"], threshold=1e3, only_nan=True),
    FreezeOnFault(max_gradient_norm=5.0),
    LossNotDecreasing(num_steps=4, min_decrease=0.01, split="val"),
    NaNSource(),
    NonFiniteLoss(),
    Overfit(patience=2, ratio_threshold=0.2),
    Overtraining(patience_train=3, patience_validation=4, delta=0.05),
    PoorWeightInitialization(threshold=5.0, distribution_range=0.01),
    ReplicaConsistency(tolerance=1e-4, every_n_steps=7),
    SaturatedActivation(layer_fraction=0.7),
    TensorVariance(min_threshold=1e-6, max_threshold=1e6),
    UnchangedTensor(num_steps=5, rtol=1e-4, atol=1e-7),
    VanishingGradient(threshold=1e-5, require="all"),
    WeightUpdateRatio(large_threshold=5.0, small_threshold=1e-6),
    LossSpike(window=64, sigmas=5.0, factor=10.0, action="skip"),
    GradientNormSpike(window=100, sigmas=None, factor=10.0, action="stop"),
    SkippedStep(),
    LogitGrowth(max_logit=30.0, factor=None, window=20, min_logit=2.0, max_output_logit=1e3),
    LearnedRange("weights", "update_ratio", {"m/d/kernel": (1e-4, 0.5), "m/d/bias": (None, 2.0)},
                 first_ranges={"m/d/kernel": (None, 3.0), "m/d/bias": (None, None)},
                 first_steps=3, margin=4.0, every_step=False),
]


def test_every_public_rule_is_covered():
    rules = {name for name in rules_lib.__all__
             if isinstance(getattr(rules_lib, name), type)
             and issubclass(getattr(rules_lib, name), Rule) and name != "Rule"}
    assert rules == {type(r).__name__ for r in RULES}


@pytest.mark.parametrize("rule", RULES, ids=[type(r).__name__ for r in RULES])
def test_a_rule_round_trips_through_json(rule):
    config = json.loads(json.dumps(rule.get_config()))
    again = type(rule).from_config(config)
    assert again.get_config() == rule.get_config() and repr(again) == repr(rule)
    # Nothing the constructor was given is left out of the config.
    assert vars(again).keys() >= config.keys()
    for name, value in config.items():
        got = getattr(again, name)
        assert (list(got) if isinstance(got, tuple) else got) == value, name


def _callbacks(tmp_path):
    log_dir = str(tmp_path / "logs")
    return [
        GradientStatistics(log_dir, every_n_steps=3, histogram_every_n_steps=6, include="kernel",
                           exclude="bias", stats=["l2_norm", "max"], histogram_bins=12,
                           history_size=10, strict=True, first_steps=2),
        WeightStatistics(log_dir, every_n_steps=2, stats=["l2_norm", "update_ratio"],
                         first_steps=0),
        ActivationStatistics(log_dir, include="dense", exclude="out", history_size=5,
                             strict=True),
        StepRecorder(str(tmp_path / "t.npz"), steps=[0, 4], record=["loss", "weights"],
                     include="kernel", exclude="out", layers=hidden_layers, strict=True),
        StepTimer(log_dir, input_bound_threshold=0.3, warmup=1, strict=True),
        StopOnRule([VanishingGradient(threshold=1e-5), LargeLoss(3.0)], action=on_fault,
                   start_step=2, freeze_on_fault=True, max_gradient_norm=100.0,
                   locate_nan=False, log_dir=log_dir,
                   suspend=[keras.callbacks.EarlyStopping], verbose=False, strict=True,
                   loss="total", every_n_steps=5, first_steps=3),
    ]


def test_every_public_callback_is_covered(tmp_path):
    assert {type(c).__name__ for c in _callbacks(tmp_path)} == set(callbacks_lib.__all__)


@pytest.mark.parametrize("index", range(6), ids=[
    "GradientStatistics", "WeightStatistics", "ActivationStatistics", "StepRecorder",
    "StepTimer", "StopOnRule"])
def test_a_callback_round_trips_through_json(tmp_path, index):
    callback = _callbacks(tmp_path)[index]
    config = json.loads(json.dumps(callback.get_config()))
    again = type(callback).from_config(config)
    assert again.get_config() == callback.get_config()
    for name, value in config.items():
        got = getattr(again, name)
        if name == "rules":
            assert [type(r) for r in got] == [type(r) for r in callback.rules]
            assert [r.get_config() for r in got] == [r.get_config() for r in callback.rules]
        elif name == "action" and isinstance(value, dict):
            assert got is on_fault
        elif name == "layers" and isinstance(value, dict):
            assert got is hidden_layers
        elif name == "suspend":
            assert got == (keras.callbacks.EarlyStopping,)
        else:
            assert (list(got) if isinstance(got, tuple) else got) == value, name


def test_stop_on_rule_defaults_round_trip_and_a_lambda_cannot_be_saved():
    default = StopOnRule()
    config = json.loads(json.dumps(default.get_config()))
    assert config["rules"] is None and config["action"] == "stop"
    again = StopOnRule.from_config(config)
    assert [r.name for r in again.rules] == [r.name for r in default.rules]
    assert again.suspend == default.suspend
    with pytest.raises(TypeError, match="StopOnRule: get_config cannot write `action`="):
        StopOnRule(action=lambda verdicts, model: None).get_config()
