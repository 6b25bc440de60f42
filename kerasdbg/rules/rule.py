"""`Rule` and `Verdict`: the pure part of kerasdbg's rules."""

from __future__ import annotations

import weakref
from typing import Collection, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from kerasdbg.records.step_record import Record, StepRecord, values_of  # noqa: F401
from kerasdbg.records.tags import CLASSES, COLLECTIONS, SCALAR_COLLECTIONS  # noqa: F401
from kerasdbg.records.tags import tag_parts, tag_pattern  # noqa: F401


class Verdict(NamedTuple):
    """A rule that fired: where, when, and the values that made it fire.

    `severity` is "fault", or "info" for what a rule reports once and does
    not act on: tensors that are zero by construction in a healthy network
    (see `VanishingGradient`). `StopOnRule` prints and records both, and
    acts on faults only.

    Examples:
        >>> from kerasdbg.rules import AllZero
        >>> verdict = AllZero().check(4, {"weights/m/d/bias/zero_fraction": 1.0})
        >>> verdict.rule, verdict.step, verdict.tensors, verdict.values
        ('AllZero', 4, ('m/d/bias',), {'m/d/bias': 1.0})
    """

    rule: str
    step: int
    reason: str
    tensors: Tuple[str, ...]
    values: Dict[str, float]
    severity: str = "fault"


def make_verdict(rule: str, step: int, reason: str, values: Mapping[str, float],
                 severity: str = "fault") -> Verdict:
    """A `Verdict` whose reason reads `<rule> at step <step>: <reason>` and
    whose tensors are the keys of `values`.

    Examples:
        >>> from kerasdbg.rules.rule import make_verdict
        >>> make_verdict("FreezeOnFault", 7, "the weights were frozen", {"step/loss": 1.5}).reason
        'FreezeOnFault at step 7: the weights were frozen'
    """
    return Verdict(
        rule=rule, step=int(step), reason=f"{rule} at step {int(step)}: {reason}",
        tensors=tuple(values), values={k: float(v) for k, v in values.items()},
        severity=severity,
    )


class RuleFired(RuntimeError):
    """Raised by `StopOnRule(action="raise")`; `verdicts` says what fired.

    Examples:
        >>> from kerasdbg.rules import AllZero, RuleFired
        >>> error = RuleFired([AllZero().check(3, {"weights/m/d/bias/zero_fraction": 1.0})])
        >>> str(error)
        'AllZero at step 3: zero_fraction at or above 1 in weights: m/d/bias=1'
        >>> error.verdicts[0].step
        3
    """

    def __init__(self, verdicts):
        self.verdicts = list(verdicts)
        super().__init__("\n".join(v.reason for v in self.verdicts))

    def __reduce__(self):
        # Pickled with its verdicts (an error raised in a worker process
        # reaches the parent pickled), not with its message as `args`.
        return type(self), (self.verdicts,)


class DiagnosisWarning(UserWarning):
    """What kerasdbg found about the training: a diagnosis, never a failure.

    kerasdbg's own failures (an instrument that could not record, a callback
    that could not read) are `RuntimeWarning`s; what it diagnoses in the
    training (a rule's verdict with `StopOnRule(action="warn")`, `StepTimer`'s
    "training is input-bound") is a `DiagnosisWarning`, so a test or a
    sweep that treats kerasdbg's failures as errors is not failed by a
    finding about the model or the machine.

    Examples:
        >>> import warnings
        >>> from kerasdbg.rules import DiagnosisWarning, RuleWarning
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", RuntimeWarning)  # kerasdbg's failures
        ...     warnings.simplefilter("ignore", DiagnosisWarning)  # its findings
        ...     warnings.warn("StepTimer: training is input-bound", DiagnosisWarning)
        >>> issubclass(RuleWarning, DiagnosisWarning), issubclass(DiagnosisWarning, RuntimeWarning)
        (True, False)
    """


class RuleWarning(DiagnosisWarning):
    """Issued by `StopOnRule(action="warn")` for each verdict; its message is
    the verdict's reason. A `DiagnosisWarning`, not a `RuntimeWarning` (which
    is kerasdbg failing).

    Examples:
        >>> import warnings
        >>> from kerasdbg.rules import RuleWarning
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", RuleWarning)  # e.g. in a sweep
        ...     warnings.warn("NonFiniteLoss at step 5: the loss is nan", RuleWarning)
        >>> issubclass(RuleWarning, RuntimeWarning)
        False
    """


_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def caches(rule) -> dict:
    """What a rule works out once and reads again (`Rule._of_block`, a
    layout's columns): kept beside the rule, not in its attributes, so that
    a copy of the rule (a snapshot of its memory, a tuner's) copies none."""
    try:
        found = _CACHES.get(rule)
        if found is None:
            found = _CACHES[rule] = {}
    except TypeError:  # a rule that takes no weak reference (`__slots__`): none kept
        return {}
    return found


class Rule:
    """Base class of the rules: the records of a step in, a verdict out.

    A rule never touches the model: `check(step, record)` reads the scalars of
    one step (see `Record`) and returns a `Verdict` when it fires, else None.
    Rules that look at several steps keep their window in Python state, which
    `reset()` clears. The same rule objects run online (a callback, step by
    step) and offline (`kerasdbg.check_run` on a log directory).

    A custom rule subclasses `Rule`, sets `requires` to the `(collection,
    statistic)` pairs it reads (so a run that lacks them is refused with a
    clear message), implements `check`, and `get_config` if it has arguments.

    Examples:
        >>> from kerasdbg.rules import Rule
        >>> class LargeGlobalNorm(Rule):
        ...     requires = (("gradients", "global_norm"),)
        ...     def __init__(self, limit=100.0):
        ...         self.limit = limit
        ...     def check(self, step, record):
        ...         norm = record.get("gradients/global_norm")
        ...         if norm is not None and norm > self.limit:
        ...             return self.verdict(step, f"global norm {norm:g} > {self.limit:g}",
        ...                                 {"global_norm": norm})
        ...     def get_config(self):
        ...         return {"limit": self.limit}
        >>> LargeGlobalNorm().check(7, {"gradients/global_norm": 250.0}).reason
        'LargeGlobalNorm at step 7: global norm 250 > 100'
    """

    requires: Sequence[Tuple[str, str]] = ()
    watches_nonfinite = False
    """Whether the rule reacts to NaN/Inf; `StopOnRule` then freezes the
    weights at an in-graph fault by default."""
    last_step: Optional[int] = None
    """The last optimizer step the rule reads, or None for all; `StopOnRule`
    stops recording what only this rule needs after it."""

    repeats = False
    """Whether the rule may fire again at a later step (a spike rule: every
    spike is said, and with `StopOnRule(action="skip")` skipped); the others
    fire at most once per `fit`."""
    action: Optional[str] = None
    """What the rule itself asks `StopOnRule` to do where it fires ("skip",
    "stop"), or None for `StopOnRule`'s action (only rules whose test runs in
    the graph can ask to skip)."""

    follows = False
    """Whether the rule is checked after the others at each step, seeing the
    verdicts of the rules that do not follow in `others` (`FreezeOnFault`
    says nothing when another rule already said why the step is bad)."""
    others: Sequence["Verdict"] = ()

    @property
    def every_step(self) -> bool:
        """Whether the rule reads its gradient and weight statistics at every
        step. On its default schedule `StopOnRule` records those of the
        other rules at steps 1-10 and every 50th step only (a condition
        such as vanishing gradients lasts); this is True for the rules that
        watch NaN/Inf, and a custom rule can say True too."""
        return bool(self.watches_nonfinite)

    @property
    def name(self) -> str:
        return type(self).__name__

    def can_check(self, present: Collection[Tuple[str, str]]) -> bool:
        """Whether a run that records the `(collection, statistic)` pairs
        `present` (`("step", "<name>")` for a tag `step/<name>`) gives this
        rule something to read: any pair of `requires` by default, online and
        offline alike."""
        needed = tuple(self.requires)
        return not needed or any(need in present for need in needed)

    def check(self, step: int, record: Record) -> Optional[Verdict]:
        """The verdict on step `step`, or None when the rule does not fire."""
        raise NotImplementedError(f"{self.name} must implement check(step, record)")

    def reset(self) -> None:
        """Forgets the steps seen so far (called before a run is checked)."""

    def screen(self, block) -> Optional["np.ndarray"]:
        """The steps of `block` (a `kerasdbg.records.step_block.StepBlock`)
        that `check` must judge, as a boolean mask, or None for every step.

        A screen reads the whole block in a few array operations, with what
        the rule remembers of the steps before it, and never leaves out a
        step at which `check` would return a verdict or a note; a step it
        leaves out is "quiet", and `advance` then updates the rule's memory
        over it (the rule's `check` may judge some of the block's steps in
        between: its memory then is what `advance` would have made it).
        The default (None) judges every step one by one: the slow path, and
        what a custom rule that implements `check` only gets.
        """
        return None

    def advance(self, block) -> None:
        """Updates what the rule remembers as `check` would over the steps of
        `block`, which `screen` found quiet (called only where `screen`
        returns a mask)."""

    def _of_block(self, block, compute, screening: bool):
        """`compute(block)`, worked out once for a `screen` (`screening`) and
        the `advance` over the same steps that follows it when the screen
        found them all quiet (`StepBlock.rows` of the whole block is the
        block): a rule whose screen and advance read the same arrays of a
        block computes them once a read. `compute` may read what the rule
        remembers: between the two nothing changed it (its `check` judged no
        step of the block, or the advance would be over fewer steps)."""
        cache = caches(self)
        if not screening:
            kept = cache.pop("block", None)
            if kept is not None and kept[0] is block:
                return kept[1]
            return compute(block)
        value = compute(block)
        cache["block"] = (block, value)
        return value

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config: dict) -> "Rule":
        return cls(**config)

    def verdict_on(self, step: int, what: str, values: Dict[str, float]) -> Optional[Verdict]:
        """`verdict(step, "<what>: <values listed>", values)`, or None when
        `values` (the tensors that make the rule fire) is empty."""
        if not values:
            return None
        return self.verdict(step, f"{what}: {listing(values)}", values)

    def verdict(self, step: int, reason: str, values: Dict[str, float]) -> Verdict:
        """A `Verdict` of this rule; `reason` is prefixed with the rule and step."""
        return make_verdict(self.name, step, reason, values)

    def note(self, step: int, what: str, values: Dict[str, float]) -> None:
        """Keeps an "info" verdict for `take_notes` (nothing when `values`
        is empty): something worth saying once that is not a fault."""
        if values:
            notes = self.__dict__.setdefault("_notes", [])
            notes.append(make_verdict(self.name, step, f"{what}: {listing(values)}", values,
                                      severity="info"))

    def take_notes(self) -> List[Verdict]:
        """The "info" verdicts kept since the last call (the runner asks
        after each `check`)."""
        return self.__dict__.pop("_notes", [])

    def __repr__(self) -> str:
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{self.name}({arguments})"


def listing(values: Mapping[str, float], limit: int = 5) -> str:
    """`a=1.2e-08, b=3e-09 and 4 more` for a reason."""
    items = [f"{name}={value:.4g}" for name, value in values.items()]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
