"""Rules: records of a step in, a verdict out; online and offline alike."""

from kerasdbg.rules.all_zero import AllZero
from kerasdbg.rules.class_imbalance import ClassImbalance
from kerasdbg.rules.dead_relu import DeadReLU
from kerasdbg.rules.dead_relu import SaturatedActivation
from kerasdbg.rules.defaults import default_rules
from kerasdbg.rules.exploding_tensor import ExplodingTensor
from kerasdbg.rules.faults import FreezeOnFault
from kerasdbg.rules.faults import NaNSource
from kerasdbg.rules.learned_range import LearnedRange
from kerasdbg.rules.logit_growth import LogitGrowth
from kerasdbg.rules.loss_rules import LossNotDecreasing
from kerasdbg.rules.loss_rules import NonFiniteLoss
from kerasdbg.rules.loss_rules import Overfit
from kerasdbg.rules.loss_rules import Overtraining
from kerasdbg.rules.poor_weight_initialization import PoorWeightInitialization
from kerasdbg.rules.replica_consistency import ReplicaConsistency
from kerasdbg.rules.rule import DiagnosisWarning
from kerasdbg.rules.rule import Rule
from kerasdbg.rules.rule import RuleFired
from kerasdbg.rules.rule import RuleWarning
from kerasdbg.rules.rule import Verdict
from kerasdbg.rules.spike_rules import GradientNormSpike
from kerasdbg.rules.spike_rules import LossSpike
from kerasdbg.rules.spike_rules import SkippedStep
from kerasdbg.rules.tensor_variance import TensorVariance
from kerasdbg.rules.unchanged_tensor import UnchangedTensor
from kerasdbg.rules.vanishing_gradient import VanishingGradient
from kerasdbg.rules.weight_update_ratio import WeightUpdateRatio

__all__ = (
    "AllZero",
    "ClassImbalance",
    "DeadReLU",
    "DiagnosisWarning",
    "ExplodingTensor",
    "GradientNormSpike",
    "FreezeOnFault",
    "LearnedRange",
    "LogitGrowth",
    "LossNotDecreasing",
    "LossSpike",
    "NaNSource",
    "NonFiniteLoss",
    "Overfit",
    "Overtraining",
    "PoorWeightInitialization",
    "ReplicaConsistency",
    "Rule",
    "RuleFired",
    "RuleWarning",
    "SaturatedActivation",
    "SkippedStep",
    "TensorVariance",
    "UnchangedTensor",
    "VanishingGradient",
    "Verdict",
    "WeightUpdateRatio",
    "default_rules",
)
