"""Runs rules over step records: one loop for online and offline checks."""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from kerasdbg import _qualified
from kerasdbg.records import tags as _tags
from kerasdbg.records.step_block import StepBlock, blocks_of
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


def screens(rule: Rule) -> bool:
    """Whether `rule`'s screen is its own check's: a subclass that overrides
    `check` but not `screen` (a custom rule built on a built-in one) is
    judged at every step."""
    kind = type(rule)
    found = _SCREENS.get(kind)
    if found is None:
        mro = kind.__mro__
        checking = next(c for c in mro if "check" in vars(c))
        screening = next(c for c in mro if "screen" in vars(c))
        found = _SCREENS[kind] = mro.index(screening) <= mro.index(checking)
    return found


_SCREENS: Dict[type, bool] = {}

BLOCK_VALUES = 1 << 18
"""`check_records` holds at most this many values (steps x tags) before it
judges them, and `BLOCK_STEPS` steps."""
BLOCK_STEPS = 4096


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
        self.judged = 0  # the rules' judgements of one step that `check_block` made
        for rule in self.rules:
            rule.reset()

    def check(self, step: int, record: Mapping[str, float],
              only: Optional[set] = None) -> List[Verdict]:
        """The verdicts on one record, in the order of the rules; a rule's
        "info" verdicts (notes) come before its fault. With `only`, the rules
        at those positions only (the others found the step quiet)."""
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
            if only is not None and index not in only:
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

    def check_block(self, block: StepBlock) -> Iterator[Tuple[int, List[Verdict]]]:
        """The verdicts on the steps of `block`, the same as `check` gives
        step by step: each rule judges one by one only the steps its screen
        keeps (`Rule.screen`; every step for a rule without one), and
        `advance`s over the others. Yields `(index in the block, verdicts)`
        for each step some rule judged, in order. A caller that stops iterating leaves the screened
        rules short of their quiet steps since each one's last judgement:
        `StopOnRule` stops only for a rollback, which gives the rules their
        memory of the snapshot's step anew (`resume`)."""
        count = len(block)
        if not count:
            return
        masks: Dict[int, Optional[np.ndarray]] = {}
        union = np.zeros(count, bool)
        for index, rule in enumerate(self.rules):
            if not self._done(index):
                mask = rule.screen(block) if screens(rule) else None
                masks[index] = None if mask is None else np.asarray(mask, bool)
                union |= True if mask is None else masks[index]
        quiet_from = {index: 0 for index, mask in masks.items() if mask is not None}
        for position in np.flatnonzero(union).tolist():
            judging = {index for index, mask in masks.items()
                       if mask is None or mask[position]}
            for index in judging & quiet_from.keys():
                self._advance(index, block, quiet_from[index], position)
                quiet_from[index] = position + 1
            self.judged += sum(not self._done(index) for index in judging)
            yield position, self.check(int(block.steps[position]), block.record(position),
                                       only=judging)
        for index, start in quiet_from.items():
            self._advance(index, block, start, count)

    def _done(self, index: int) -> bool:
        """Whether rule `index` is no longer checked (it fired, once is enough)."""
        return self.first_only and index in self.fired and not self.rules[index].repeats

    def _advance(self, index: int, block: StepBlock, start: int, end: int) -> None:
        """Rule `index` advances over the quiet steps `start:end` (unless done)."""
        if end > start and not self._done(index):
            self.rules[index].advance(block.rows(start, end))

    def check_records(self, rows: Iterable[Tuple[int, Mapping[str, float]]]
                      ) -> List[Verdict]:
        """The verdicts on `(step, record)` pairs in step order (each record's
        step part, then its epoch part, as `check_step`), the steps of one
        tag layout screened as a block (`check_block`), at most `BLOCK_VALUES`
        values held at a time."""
        verdicts: List[Verdict] = []
        pending: List[Tuple[int, Dict[str, float]]] = []
        held = [0]

        def flush():
            for block in blocks_of(pending):
                for _, found in self.check_block(block):
                    verdicts.extend(found)
            pending.clear()
            held[0] = 0

        for step, record in rows:
            steps, epochs = split_epoch(record)
            if steps:
                pending.append((step, steps))
                held[0] += len(steps)
            if epochs or held[0] >= BLOCK_VALUES or len(pending) >= BLOCK_STEPS:
                flush()
                verdicts.extend(self.check(step, epochs))
        flush()
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
