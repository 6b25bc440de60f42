"""`default_rules`: the one default rule set, online and offline.

`StopOnRule()` watches these rules when given none, and `kerasdbg check`
evaluates them on a recorded run when given no `--rule`, so a run gets one
verdict whichever way it is asked for (the report and TensorBoard show what
`StopOnRule` recorded).
"""

from __future__ import annotations

from typing import Iterable, List

from kerasdbg.rules.all_zero import AllZero
from kerasdbg.rules.dead_relu import DeadReLU, SaturatedActivation
from kerasdbg.rules.exploding_tensor import ExplodingTensor
from kerasdbg.rules.faults import FreezeOnFault, NaNSource
from kerasdbg.rules.loss_rules import NonFiniteLoss
from kerasdbg.rules.replica_consistency import ReplicaConsistency
from kerasdbg.rules.rule import COLLECTIONS, Rule
from kerasdbg.rules.unchanged_tensor import UnchangedTensor
from kerasdbg.rules.vanishing_gradient import VanishingGradient
from kerasdbg.rules.weight_update_ratio import WeightUpdateRatio


def reads_any(rule: Rule, collections: Iterable[str]) -> bool:
    """Whether `rule` reads a tag of one of `collections` (`"activations"`,
    `"replicas"`, ...).

    Examples:
        >>> from kerasdbg.rules import DeadReLU
        >>> from kerasdbg.rules.defaults import reads_any
        >>> reads_any(DeadReLU(), ["activations"]), reads_any(DeadReLU(), ["replicas"])
        (True, False)
    """
    collections = set(collections)
    return any(collection in collections for collection, _ in rule.requires)


def default_rules(without: Iterable[str] = ()) -> List[Rule]:
    """New instances of the rules meant for any model, with their defaults.

    `NonFiniteLoss`, `ExplodingTensor`, `VanishingGradient`, `AllZero` (on
    the collections not in `without`), `UnchangedTensor`,
    `WeightUpdateRatio`, for models with `TapLayer`s
    `DeadReLU` and `SaturatedActivation`, for models with several replicas
    `ReplicaConsistency`, and the reports of an in-graph
    fault, `FreezeOnFault` and `NaNSource`. None of them fires on
    a healthy run of the standard models kerasdbg is tested on (Keras
    applications with their default initializers, the keras.io examples);
    the rules with thresholds a model must choose (`TensorVariance`,
    `ClassImbalance`, `PoorWeightInitialization`, the loss-trend rules) are
    left out.

    The same set, whichever way it is asked for: `StopOnRule()` (which
    leaves out the rules that read what its model cannot give, as
    `without`), `kerasdbg check` without `--rule` (which leaves out the rules
    the run holds nothing for).

    Args:
        without: leave out the rules that read one of these collections:
            `"activations"` for a model without `TapLayer`s, `"replicas"` for
            one replica. Defaults to `()`.

    Examples:
        >>> from kerasdbg.rules import default_rules
        >>> [rule.name for rule in default_rules()]
        ['NonFiniteLoss', 'ExplodingTensor', 'VanishingGradient', 'AllZero', 'UnchangedTensor', 'WeightUpdateRatio', 'DeadReLU', 'SaturatedActivation', 'ReplicaConsistency', 'FreezeOnFault', 'NaNSource']
        >>> [rule.name for rule in default_rules(without=["activations", "replicas"])][3:]
        ['AllZero', 'UnchangedTensor', 'WeightUpdateRatio', 'FreezeOnFault', 'NaNSource']
        >>> default_rules(without=["activations"])[3]
        AllZero(zero_fraction=1.0, collections=['gradients', 'weights'])
    """
    without = tuple(without)
    # AllZero watches the collections there are (gradients and weights without
    # taps): left out, it would be silent online where `check` fires offline.
    kept = [c for c in COLLECTIONS if c not in without]
    rules = [NonFiniteLoss(), ExplodingTensor(), VanishingGradient(),
             AllZero(collections=kept or COLLECTIONS),
             UnchangedTensor(), WeightUpdateRatio(), DeadReLU(), SaturatedActivation(),
             ReplicaConsistency(), FreezeOnFault(), NaNSource()]
    return [rule for rule in rules if not reads_any(rule, without)]
