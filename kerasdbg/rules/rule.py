"""`Rule` and `Verdict`: the pure part of kerasdbg's rules."""

from __future__ import annotations

from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

COLLECTIONS = ("gradients", "weights", "activations")
"""Collections of per-tensor tags: `<collection>/<tensor>/<statistic>`."""
SCALAR_COLLECTIONS = ("step", "epoch")
"""Collections of two-part tags: `step/loss`, `step/frozen` (each optimizer
step, from `StopOnRule`), `epoch/<log>` (Keras's epoch logs: `epoch/loss`,
`epoch/val_loss`, ...)."""

Record = Mapping[str, float]
"""The scalars of one step, by TensorBoard tag: `gradients/<variable>/<stat>`,
`weights/<variable>/<stat>`, `activations/<tap>/<stat>`, `gradients/global_norm`,
`step/loss`, `step/frozen`; or of one epoch: `epoch/loss`, `epoch/val_loss`, ..."""


class Verdict(NamedTuple):
    """A rule that fired: where, when, and the values that made it fire.

    `severity` is "fault", or "info" for what a rule reports once and does
    not act on: tensors that are zero by construction in a healthy network
    (see `VanishingGradient`). `StopOnRule` prints and records both, and
    acts on faults only.

    Example:

    >>> from kerasdbg.rules import AllZero
    >>> verdict = AllZero().check(4, {"weights/m/d/bias/zero_fraction": 1.0})
    >>> verdict.rule, verdict.step, verdict.tensors, verdict.values
    ('AllZero', 4, ('m/d/bias',), {'m/d/bias': 100.0})
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

    Example:

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

    Example:

    >>> from kerasdbg.rules import AllZero, RuleFired
    >>> error = RuleFired([AllZero().check(3, {"weights/m/d/bias/zero_fraction": 1.0})])
    >>> str(error)
    'AllZero at step 3: at least 100% zeros in weights: m/d/bias=100'
    >>> error.verdicts[0].step
    3
    """

    def __init__(self, verdicts):
        self.verdicts = list(verdicts)
        super().__init__("\n".join(v.reason for v in self.verdicts))


class RuleWarning(RuntimeWarning):
    """Issued by `StopOnRule(action="warn")` for each verdict; its message is
    the verdict's reason.

    Example:

    >>> import warnings
    >>> from kerasdbg.rules import RuleWarning
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", RuleWarning)  # e.g. in a sweep
    ...     warnings.warn("NonFiniteLoss at step 5: the loss is nan", RuleWarning)
    >>> issubclass(RuleWarning, RuntimeWarning)
    True
    """


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

    Example:

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

    @property
    def name(self) -> str:
        return type(self).__name__

    def check(self, step: int, record: Record) -> Optional[Verdict]:
        """The verdict on step `step`, or None when the rule does not fire."""
        raise NotImplementedError(f"{self.name} must implement check(step, record)")

    def reset(self) -> None:
        """Forgets the steps seen so far (called before a run is checked)."""

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


CLASSES = "classes"
"""Tags `classes/<k>/seen` and `classes/<k>/mispredicted`: labels of class `k`
seen in training so far and how many of them were predicted wrong (from
`StopOnRule` when a rule reads them)."""


def tag_parts(tag: str) -> Optional[Tuple[str, str, str]]:
    """`(collection, tensor, statistic)` of a per-tensor (or per-class) tag, else None."""
    collection, _, rest = tag.partition("/")
    tensor, _, statistic = rest.rpartition("/")
    if collection not in COLLECTIONS + (CLASSES,) or not tensor:
        return None
    return collection, tensor, statistic


def tag_pattern(collection: str, statistic: str) -> str:
    """How the tags of a `requires` pair look, for messages."""
    if collection in SCALAR_COLLECTIONS or statistic == "global_norm":
        return f"{collection}/{statistic}"
    return f"{collection}/<name>/{statistic}"


def values_of(record: Record, collection: str, statistic: str) -> Iterator[Tuple[str, float]]:
    """`(tensor, value)` for each finite or non-finite value of one statistic."""
    for tag, value in record.items():
        parts = tag_parts(tag)
        if parts and parts[0] == collection and parts[2] == statistic:
            yield parts[1], float(value)


def listing(values: Mapping[str, float], limit: int = 5) -> str:
    """`a=1.2e-08, b=3e-09 and 4 more` for a reason."""
    items = [f"{name}={value:.4g}" for name, value in values.items()]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
