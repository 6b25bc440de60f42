"""`DeadReLU` and `SaturatedActivation`: unhealthy activation layers, from taps."""

from __future__ import annotations

import math

from kerasdbg import _validation as check
from kerasdbg.rules.rule import Rule, values_of


class _ActivationHealth(Rule):
    statistic = ""
    what = ""

    def __init__(self, *, layer_fraction: float = 0.5, **deprecated):
        # Keyword-only: a positional value meant `threshold_inactivity` before.
        owner = type(self).__name__
        renamed = check.deprecated(owner, deprecated, {
            "threshold_layer": ("layer_fraction", check.from_percent,
                                "a fraction 0-1, not a percent"),
            "threshold_inactivity": (None, None, "it never changed what the rule reads; "
                                     "the taps decide when a unit counts, with "
                                     "`TapLayer(active_fraction=...)`"),
        }, {"layer_fraction": (layer_fraction, 0.5)})
        check.no_other_arguments(owner, deprecated)
        layer_fraction = renamed.get("layer_fraction", layer_fraction)
        self.layer_fraction = check.number(
            owner, "layer_fraction", layer_fraction, minimum=0.0, maximum=1.0)

    @property
    def requires(self):
        return (("activations", self.statistic),)

    def check(self, step, record):
        bad = {
            tap: value for tap, value in values_of(record, "activations", self.statistic)
            if not math.isnan(value) and value >= self.layer_fraction
        }
        return self.verdict_on(
            step, f"{self.statistic} at or above {self.layer_fraction:g}", bad)

    def get_config(self):
        return {"layer_fraction": self.layer_fraction}


class DeadReLU(_ActivationHealth):
    """Fires when a ReLU layer's fraction of dead units is at least `layer_fraction`.

    Reads `activations/<tap>/dead_fraction` (0-1) of `TapLayer(activation=
    "relu")` taps (`kerasdbg.insert_taps` sets the activation). The taps
    decide when a unit is dead: active (non-zero) for at most their
    `active_fraction` (0.01, SageMaker Debugger's 1%) of each batch, in a row
    of recorded batches of at least their `min_examples` examples (100): one
    small batch that happens to activate a healthy unit nowhere does not make
    it dead.

    Args:
        layer_fraction: the fraction (0-1) of dead units of a layer that
            fires. Defaults to `0.5`. (`threshold_layer`, a percent, is its
            deprecated name; `threshold_inactivity` is deprecated and ignored.)

    Examples:
        >>> from kerasdbg.rules import DeadReLU
        >>> DeadReLU().check(40, {"activations/dense_tap/dead_fraction": 0.75}).reason
        'DeadReLU at step 40: dead_fraction at or above 0.5: dense_tap=0.75'
    """

    statistic = "dead_fraction"
    what = "dead"


class SaturatedActivation(_ActivationHealth):
    """Fires when a tanh or sigmoid layer's fraction of saturated units is at least `layer_fraction`.

    Reads `activations/<tap>/saturated_fraction` (0-1) of `TapLayer(activation=
    "tanh" or "sigmoid")` taps, which compare the activation's output with the
    images of SageMaker Debugger's input bounds (|x| > 9.4999 for tanh,
    outside (-23, 16.99999) for sigmoid); a unit counts when it is
    unsaturated for at most the taps' `active_fraction` of each batch.

    Args:
        layer_fraction: the fraction (0-1) of saturated units of a layer
            that fires. Defaults to `0.5`. (`threshold_layer`, a percent, is
            its deprecated name; `threshold_inactivity` is deprecated and
            ignored.)

    Examples:
        >>> from kerasdbg.rules import SaturatedActivation
        >>> SaturatedActivation().check(5, {"activations/gate_tap/saturated_fraction": 0.1}) is None
        True
    """

    statistic = "saturated_fraction"
    what = "saturated"
