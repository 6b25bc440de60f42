"""`DeadReLU` and `SaturatedActivation`: unhealthy activation layers, from taps."""

from __future__ import annotations

import math

from kerasdbg import _validation as check
from kerasdbg.rules.rule import Rule, values_of


class _ActivationHealth(Rule):
    statistic = ""
    what = ""

    def __init__(self, threshold_inactivity: float = 1.0, threshold_layer: float = 50.0):
        owner = type(self).__name__
        self.threshold_inactivity = check.number(
            owner, "threshold_inactivity", threshold_inactivity, minimum=0.0, maximum=100.0)
        self.threshold_layer = check.number(
            owner, "threshold_layer", threshold_layer, minimum=0.0, maximum=100.0)

    @property
    def requires(self):
        return (("activations", self.statistic),)

    def check(self, step, record):
        bad = {
            tap: 100.0 * value for tap, value in values_of(record, "activations", self.statistic)
            if not math.isnan(value) and 100.0 * value >= self.threshold_layer
        }
        return self.verdict_on(
            step, f"{self.what} units (percent) at or above {self.threshold_layer:g}%", bad)

    def get_config(self):
        return {"threshold_inactivity": self.threshold_inactivity,
                "threshold_layer": self.threshold_layer}


class DeadReLU(_ActivationHealth):
    """Fires when a ReLU layer has at least `threshold_layer` percent dead units.

    Reads `activations/<tap>/dead_fraction` of `TapLayer(activation="relu")`
    taps (`kerasdbg.insert_taps` sets the activation). A unit is dead when it
    is zero for at least `100 - inactivity_threshold` percent of each batch,
    in a row of recorded batches of at least the taps' `min_examples`
    examples (100):
    one small batch that happens to activate a healthy unit nowhere does not
    make it dead. The taps' `inactivity_threshold` decides that, and
    `threshold_inactivity` here is the value to give them (SageMaker
    Debugger's default, 1%).

    Args:
        threshold_inactivity: percent of the batch, see above. Defaults to `1.0`.
        threshold_layer: percent of dead units that fires. Defaults to `50.0`.

    Example:

    >>> from kerasdbg.rules import DeadReLU
    >>> DeadReLU().check(40, {"activations/dense_tap/dead_fraction": 0.75}).reason
    'DeadReLU at step 40: dead units (percent) at or above 50%: dense_tap=75'
    """

    statistic = "dead_fraction"
    what = "dead"


class SaturatedActivation(_ActivationHealth):
    """Fires when a tanh or sigmoid layer has at least `threshold_layer` percent saturated units.

    Reads `activations/<tap>/saturated_fraction` of `TapLayer(activation="tanh"
    or "sigmoid")` taps, which compare the activation's output with the images
    of SageMaker Debugger's input bounds (|x| > 9.4999 for tanh, outside
    (-23, 16.99999) for sigmoid).

    Args:
        threshold_inactivity: percent of the batch for which a unit must be
            saturated; the taps' `inactivity_threshold`. Defaults to `1.0`.
        threshold_layer: percent of saturated units that fires. Defaults to `50.0`.

    Example:

    >>> from kerasdbg.rules import SaturatedActivation
    >>> SaturatedActivation().check(5, {"activations/gate_tap/saturated_fraction": 0.1}) is None
    True
    """

    statistic = "saturated_fraction"
    what = "saturated"
