"""Rules on what the capture found at an in-graph fault: `FreezeOnFault`, `NaNSource`.

They read the scalars `StopOnRule` records at each step (`step/frozen`,
`step/fault`) and, at a fault's step, the `faults/...` scalars of what the
capture found there (see below), so that the same verdicts come online and
offline (`kerasdbg.check_run` on `StopOnRule`'s `log_dir`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kerasdbg.records import tags as _tags
from kerasdbg import _validation as check
from kerasdbg.rules.rule import Rule, make_verdict

_LOCATED = {
    _tags.NAN_SOURCE_LOSS: "every layer output was finite (the loss or its gradient was not)",
    _tags.NAN_SOURCE_TRAIN_STEP: (
        "every layer output of the model's forward pass was finite; the train step "
        "computes more than it (its own loss or sub-models)"),
    # On JAX when the replay could not run (it says why) or had no inputs.
    _tags.NAN_SOURCE_GRADIENTS: "the layer outputs were not examined",
}


class FreezeOnFault(Rule):
    """Reports the step from which an in-graph fault froze the weights.

    With `StopOnRule(freeze_on_fault=True)` (on by default when a rule
    watches NaN/Inf), the steps at and after a non-finite loss or gradient
    (or a global gradient norm above `max_gradient_norm`) do not change the
    weights. This rule fires at the first frozen step (`step/frozen` = 1)
    when no other rule fired at that step; when one did (e.g.
    `NonFiniteLoss`), its verdict says it all and this rule says nothing,
    unless a freeze could not undo an update: with several optimizers, those
    that applied their update of the faulty train step before the apply that
    found the fault are listed in an "info" verdict. Having this rule in
    `StopOnRule`'s rules turns the freeze on.

    Args:
        max_gradient_norm: the limit the freeze also acted on, for the
            verdict's text, or None for the one the run recorded
            (`faults/freeze/max_gradient_norm`). Defaults to `None`.

    Examples:
        >>> from kerasdbg.rules import FreezeOnFault
        >>> rule = FreezeOnFault()
        >>> rule.check(3, {"step/frozen": 0.0, "step/loss": 0.5}) is None
        True
        >>> rule.check(4, {"step/frozen": 1.0, "step/loss": 0.5}).reason
        'FreezeOnFault at step 4: the weights were frozen from this step on (in-graph fault: a non-finite loss or gradient); loss=0.5'
    """

    requires = (("step", "frozen"),)
    watches_nonfinite = True
    follows = True

    def __init__(self, max_gradient_norm: Optional[float] = None):
        self.max_gradient_norm = None if max_gradient_norm is None else check.number(
            "FreezeOnFault", "max_gradient_norm", max_gradient_norm, minimum=0.0,
            exclusive_minimum=True)
        self._seen = False

    def get_config(self) -> dict:
        return {"max_gradient_norm": self.max_gradient_norm}

    def reset(self) -> None:
        self._seen = False

    def screen(self, block):
        return _set(block, _tags.step_scalar("frozen"))

    def advance(self, block):
        pass  # a step that did not freeze changes nothing

    def check(self, step, record):
        if self._seen or not record.get(_tags.step_scalar("frozen")):
            return None
        self._seen = True
        earlier = _tags.names_under(record, _tags.fault("freeze", "applied_before"))
        found = _tags.names_under(record, _tags.fault("freeze", "found_by"))
        kept = ""
        if earlier and found:
            faulty = found[0]
            finder = f"a later apply of {faulty}" if faulty in earlier else f"{faulty}'s apply"
            names = ", ".join(earlier)
            kept = (f"{names} had applied this train step's update before {finder} found "
                    "the fault; a freeze acts from the apply that finds the fault on and "
                    f"cannot undo an earlier one, so {names}'s weights include step {step}'s "
                    "update")
        if self.others:
            if kept:
                self.__dict__.setdefault("_notes", []).append(make_verdict(
                    self.name, step, kept, {name: 1.0 for name in earlier}, severity="info"))
            return None
        loss = record.get(_tags.step_scalar("loss"))  # absent when the model gives none
        limit = self.max_gradient_norm
        if limit is None:  # the limit the run froze on, as recorded
            limit = record.get(_tags.fault("freeze", "max_gradient_norm"))
        norm = "" if limit is None else f", or a global gradient norm above {limit:g}"
        return self.verdict(
            step, "the weights were frozen from this step on (in-graph fault: a non-finite "
            f"loss or gradient{norm})" + ("" if loss is None else f"; loss={loss:.4g}")
            + (f"; {kept}" if kept else ""),
            {} if loss is None else {_tags.step_scalar("loss"): loss})


class NaNSource(Rule):
    """Says where the first non-finite loss or gradient of a run came from.

    With `StopOnRule(locate_nan=True)` (on by default when a rule watches
    NaN/Inf), the first step with a non-finite loss or gradient replays its
    forward pass layer by layer (on TensorFlow inside a `tf.cond` taken only
    then, on JAX by the host) and records the first layer whose output held NaN/Inf and the variables
    whose gradient did. This rule reports them at that step. Having it in
    `StopOnRule`'s rules turns the localisation on.

    Examples:
        >>> from kerasdbg.rules import NaNSource
        >>> NaNSource().check(3, {"step/fault": 1.0, "faults/nan_source/located": 1.0,
        ...                       "faults/nan_source/layer/x": 1.0,
        ...                       "faults/nan_source/gradient/m/d/kernel": 1.0}).reason
        "NaNSource at step 3: the first layer whose output held NaN/Inf is 'x'; non-finite gradients: m/d/kernel"
    """

    requires = (("step", "fault"),)
    watches_nonfinite = True
    follows = True

    def screen(self, block):
        return _set(block, _tags.step_scalar("fault"))

    def advance(self, block):
        pass  # no memory

    def check(self, step, record):
        located = record.get(_tags.fault("nan_source", "located"))
        if not record.get(_tags.step_scalar("fault")) or located is None:
            return None
        layers = _tags.names_under(record, _tags.fault("nan_source", "layer"))
        variables = _tags.names_under(record, _tags.fault("nan_source", "gradient"))
        optimizers = _tags.names_under(record, _tags.fault("nan_source", "optimizer"))
        layer = layers[0] if layers else None
        if layer is not None:
            where = f"the first layer whose output held NaN/Inf is '{layer}'"
        elif int(located) == _tags.NAN_SOURCE_HIDDEN:
            models = _tags.names_under(record, _tags.fault("nan_source", "model"))
            name = f" '{models[0]}'" if models else ""
            where = (f"the layers of the subclassed model{name} are not visible; insert "
                     "TapLayers in its call() to see them")
        else:
            where = _LOCATED.get(int(located), "no layer output was found non-finite")
        grads = ", ".join(variables[:8]) + (f" and {len(variables) - 8} more"
                                             if len(variables) > 8 else "")
        by = f" (applied by {optimizers[0]})" if optimizers else ""
        tensors = ([layer] if layer else []) + variables
        return self.verdict(step, f"{where}; non-finite gradients{by}: {grads or 'none'}",
                            {t: 1.0 for t in tensors})


def _set(block, tag: str):
    """The steps of `block` whose value of `tag` is set (not 0: NaN is, as
    in Python's truth), none where the block has no such tag."""
    values = block.tag(tag)
    return np.zeros(len(block), bool) if values is None else values != 0
