"""`ReplicaConsistency`: replicas whose copies of a trainable weight differ."""

from __future__ import annotations

from kerasdbg import _validation as check
from kerasdbg.records.tags import REPLICAS
from kerasdbg.rules.rule import Rule, values_of


class ReplicaConsistency(Rule):
    """Fires when the replicas of a distributed model no longer hold the
    same trainable weights.

    Under `MirroredStrategy` and `MultiWorkerMirroredStrategy` every
    replica applies the same all-reduced update to its copy of each weight,
    so the copies stay equal. A train step that updates a weight with its
    own replica's gradient (an `assign_sub` in a custom `train_step`, a
    variable written in replica context) lets them drift apart without any
    error: each replica then trains another model.

    Reads `replicas/<variable>/spread`, which `StopOnRule` records every
    `every_n_steps` steps (and at the first step) when the model has more
    than one replica: for each trainable variable, each replica's checksums
    (the sum and the sum of squares of its copy, in float64, computed where
    the copy lives) against replica 0's, as the largest relative difference.
    Only two numbers per variable and replica leave the devices; under
    several workers they are gathered across workers in one collective.
    Non-trainable state that Keras keeps per replica by design
    (`BatchNormalization`'s moving statistics) is not read. With one
    replica the rule has nothing to read and `StopOnRule` leaves it out.

    Args:
        tolerance: the relative spread above which the replicas disagree.
            Copies updated alike are equal to the bit on the devices tested
            (CPU); the default leaves room for updates that are not
            bit-reproducible (atomic scatters of sparse gradients on a GPU,
            a last bit of float16), while a replica trained on its own
            gradient is off by 1e-3 to 1 from its first step. Defaults to
            `1e-4`.
        every_n_steps: how often the replicas are compared (a comparison
            reads two numbers per variable and replica). Defaults to `100`.

    Examples:
        >>> from kerasdbg.rules import ReplicaConsistency
        >>> rule = ReplicaConsistency()
        >>> rule.check(100, {"replicas/d/kernel/spread": 0.0}) is None
        True
        >>> rule.check(200, {"replicas/d/kernel/spread": 0.31}).reason
        'ReplicaConsistency at step 200: replicas hold different values (equal at the previous comparison, step 100; relative spread of their checksums) of: d/kernel=0.31'
    """

    def __init__(self, tolerance: float = 1e-4, every_n_steps: int = 100):
        owner = type(self).__name__
        self.tolerance = check.number(owner, "tolerance", tolerance, minimum=0.0)
        self.every_n_steps = check.positive_int(owner, "every_n_steps", every_n_steps)
        self.reset()

    def reset(self) -> None:
        self._agreed = None  # the last step at which every replica agreed

    def get_config(self) -> dict:
        return {"tolerance": self.tolerance, "every_n_steps": self.every_n_steps}

    @property
    def requires(self):
        return ((REPLICAS, "spread"),)

    def check(self, step, record):
        values = list(values_of(record, REPLICAS, "spread"))
        if not values:
            return None
        spread = {name: value for name, value in values
                  if not value <= self.tolerance}  # inf: only some copies are not finite
        if not spread:
            self._agreed = step
            return None
        since = ("at the first comparison" if self._agreed is None
                 else f"equal at the previous comparison, step {self._agreed}")
        return self.verdict_on(
            step, f"replicas hold different values ({since}; relative spread of their "
            "checksums) of", spread)
