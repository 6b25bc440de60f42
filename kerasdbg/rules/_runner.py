"""Runs rules over step records: one loop for online and offline checks."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from kerasdbg import _qualified
from kerasdbg.records import tags as _tags
from kerasdbg.records.step_record import StepRecord
from kerasdbg.rules.rule import Rule, Verdict

EPOCH_PREFIX = _tags.prefix(_tags.EPOCH)
"""Tags recorded once per epoch (`epoch/loss`, `epoch/val_loss`, ...), at the
step that ended the epoch. Rules see them as a record of their own, after the
step's record, online and offline alike."""


def rule_config(owner: str, rule: Rule) -> Dict[str, Any]:
    """`{"class_name", "module", "config"}`: a rule in a JSON config."""
    name = _qualified.name_of(owner, "rules", type(rule))
    return {"class_name": type(rule).__name__, "module": name.rpartition(".")[0],
            "config": rule.get_config()}


def rule_from_config(entry: Mapping[str, Any]) -> Rule:
    """The rule `rule_config` wrote (a built-in rule by its name alone too)."""
    module = entry.get("module", "kerasdbg.rules")
    cls = _qualified.resolve(f"{module}.{entry['class_name']}")
    return cls.from_config(dict(entry.get("config", {})))


def check_rules(owner: str, rules) -> List[Rule]:
    """`rules` (one `Rule` or a sequence) as a non-empty list, else raises."""
    if isinstance(rules, Rule):
        return [rules]
    if isinstance(rules, (str, bytes)) or not hasattr(rules, "__iter__"):
        raise TypeError(
            f"{owner}: `rules` must be a kerasdbg.rules.Rule or a sequence of them. "
            f"Received: rules={rules!r} of type {type(rules).__name__}"
        )
    rules = list(rules)
    for rule in rules:
        if not isinstance(rule, Rule):
            raise TypeError(
                f"{owner}: `rules` must hold kerasdbg.rules.Rule objects. "
                f"Received: {rule!r} of type {type(rule).__name__}"
            )
    if not rules:
        raise ValueError(f"{owner}: `rules` must hold at least one rule. Received: rules=[]")
    return rules


def split_epoch(record: Mapping[str, float]) -> Tuple[Dict[str, float], Dict[str, float]]:
    """`(step part, epoch part)` of a step's record."""
    steps, epochs = {}, {}
    for tag, value in record.items():
        (epochs if tag.startswith(EPOCH_PREFIX) else steps)[tag] = value
    return steps, epochs


_NOT_STATE = ("others", "_notes")
"""A rule's attributes that are not its memory of the steps."""


def _memory(rule) -> set:
    """The names of a rule's attributes that its `reset()` assigns: its memory
    of the steps, never its configuration (a rule whose configuration is not
    in `get_config` would otherwise take another's thresholds). Found on a
    copy, which `reset()` may change in place; a copy that fails raises (the
    caller says the memory could not be kept)."""
    probe = copy.deepcopy(rule)
    before = dict(vars(probe))
    probe.reset()
    return {k for k, v in vars(probe).items() if k not in before or v is not before[k]}


class RuleRunner:
    """Feeds records to rules in step order; remembers which fired.

    Args:
        rules: the rules (each is `reset()` here).
        first_only: once a rule fired, stop evaluating it.
    """

    def __init__(self, rules: Sequence[Rule], first_only: bool = True):
        self.rules = list(rules)
        self.first_only = first_only
        self.fired: set = set()
        for rule in self.rules:
            rule.reset()

    def check(self, step: int, record: Mapping[str, float]) -> List[Verdict]:
        """The verdicts on one record, in the order of the rules; a rule's
        "info" verdicts (notes) come before its fault."""
        verdicts = []
        if not record:
            return verdicts
        if not isinstance(record, StepRecord):
            record = StepRecord(record)  # indexed once for all the rules
        order, first_following = self._order()
        others: tuple = ()
        for index in order:
            rule = self.rules[index]
            if index == first_following:
                others = tuple(verdicts)
            if self.first_only and index in self.fired and not rule.repeats:
                continue
            rule.others = others if rule.follows else ()
            try:
                verdict = rule.check(int(step), record)
            finally:
                rule.others = ()
            verdicts += rule.take_notes()
            if verdict is not None:
                self.fired.add(index)
                verdicts.append(verdict)
        return verdicts

    def _order(self) -> Tuple[List[int], Optional[int]]:
        """The rules' positions in the order they check (the rules that follow
        the others, and see their verdicts at the step, last), and the first
        of those that follow; worked out once for the rules there are."""
        key = tuple(map(id, self.rules))  # `follows` is a rule's class's
        if getattr(self, "_ordered", (None,))[0] != key:
            leading = [i for i, r in enumerate(self.rules) if not r.follows]
            following = [i for i, r in enumerate(self.rules) if r.follows]
            self._ordered = (key, leading + following, (following or [None])[0])
        return self._ordered[1], self._ordered[2]

    def key(self) -> Tuple[str, ...]:
        """The rules, by class and configuration: a runner of the same key
        can take this runner's `state`."""
        return tuple(f"{type(r).__module__}.{type(r).__qualname__}:{r!r}" for r in self.rules)

    def state(self) -> List[Optional[dict]]:
        """A copy of what each rule remembers of the steps it saw (None for
        the rules that watch NaN/Inf: each fit reports its own fault).
        Which rules fired is not part of it."""
        kept: List[Optional[dict]] = []
        for rule in self.rules:
            memory = set() if rule.watches_nonfinite else _memory(rule)
            kept.append(None if rule.watches_nonfinite else copy.deepcopy(
                {k: v for k, v in vars(rule).items() if k in memory and k not in _NOT_STATE}))
        return kept

    def resume(self, state: Sequence[Optional[dict]]) -> None:
        """Gives each rule the memory a runner of the same `key` kept (its
        `state`): the rules go on as if they had seen those steps."""
        for rule, kept in zip(self.rules, state):
            if kept is not None:
                vars(rule).update(copy.deepcopy(kept))

    def check_step(self, step: int, record: Mapping[str, float]) -> List[Verdict]:
        """The step part of a record, then its epoch part."""
        steps, epochs = split_epoch(record)
        return self.check(step, steps) + self.check(step, epochs)
