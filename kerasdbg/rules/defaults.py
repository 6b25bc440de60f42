"""`default_rules`: the rules `StopOnRule()` watches when given none."""

from __future__ import annotations

from typing import List

from kerasdbg.rules.all_zero import AllZero
from kerasdbg.rules.dead_relu import DeadReLU, SaturatedActivation
from kerasdbg.rules.exploding_tensor import ExplodingTensor
from kerasdbg.rules.faults import FreezeOnFault, NaNSource
from kerasdbg.rules.loss_rules import NonFiniteLoss
from kerasdbg.rules.replica_consistency import ReplicaConsistency
from kerasdbg.rules.rule import Rule
from kerasdbg.rules.unchanged_tensor import UnchangedTensor
from kerasdbg.rules.vanishing_gradient import VanishingGradient
from kerasdbg.rules.weight_update_ratio import WeightUpdateRatio


def default_rules() -> List[Rule]:
    """New instances of the rules meant for any model, with their defaults.

    `NonFiniteLoss`, `ExplodingTensor`, `VanishingGradient`, `AllZero`,
    `UnchangedTensor`, `WeightUpdateRatio`, for models with `TapLayer`s
    `DeadReLU` and `SaturatedActivation`, for models with several replicas
    `ReplicaConsistency`, and the reports of an in-graph
    fault, `FreezeOnFault` and `NaNSource`. None of them fires on
    a healthy run of the standard models kerasdbg is tested on (see the
    README); the rules with thresholds a model must choose (`TensorVariance`,
    `ClassImbalance`, the loss-trend rules) are left out.

    Examples:
        >>> from kerasdbg.rules import default_rules
        >>> [rule.name for rule in default_rules()]
        ['NonFiniteLoss', 'ExplodingTensor', 'VanishingGradient', 'AllZero', 'UnchangedTensor', 'WeightUpdateRatio', 'DeadReLU', 'SaturatedActivation', 'ReplicaConsistency', 'FreezeOnFault', 'NaNSource']
    """
    return [NonFiniteLoss(), ExplodingTensor(), VanishingGradient(), AllZero(),
            UnchangedTensor(), WeightUpdateRatio(), DeadReLU(), SaturatedActivation(),
            ReplicaConsistency(), FreezeOnFault(), NaNSource()]
