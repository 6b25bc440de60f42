"""What rules read, turned into what the capture records (`plan`).

A rule says what it reads (`Rule.requires`: collection and statistic
pairs), until which step (`Rule.last_step`) and whether at every step
(`Rule.every_step`). `plan` makes the requests that record exactly that,
each statistic once whatever the number of rules reading it, and says what
cannot be recorded (`Refusal`), for the callback to report. It runs on the
host, with no framework.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence

from kerasdbg import stats as stats_lib
from kerasdbg.capture.requests import CLASS_COLUMNS, WEIGHT_EXTRA_STATISTICS, Freeze, Request
from kerasdbg.records import tags as _tags
from kerasdbg.schedule import Schedule

VARIABLE_EXTRAS = (_tags.GLOBAL_NORM, _tags.CLIPPED)
LOGITS = ("max_attention_logit", "max_output_logit")
"""The `step/` scalars of the largest logits, recorded when a rule reads them."""
"""What a rule may read of gradients or weights beyond their statistics."""


class Refusal(NamedTuple):
    """A quantity rules read that cannot be recorded for this model."""

    collection: str
    statistic: str
    allowed: str
    """What can be recorded instead, for the message."""


class Plan(NamedTuple):
    """The requests that record what the rules read, and what they cannot.

    Attributes:
        requests: the requests, the step's own last (loss, faults, freeze).
        refusals: what rules read that cannot be recorded.
        reads_activations: whether a rule reads `activations/` (taps).
        replica_every: every how many steps a rule compares replicas, or None.
    """

    requests: List[Request]
    refusals: List[Refusal]
    reads_activations: bool
    replica_every: Optional[int]


def needs(rules: Sequence) -> Dict[str, Dict[str, tuple]]:
    """What the rules read, by collection: statistic -> `(last, every)`, the
    last step a rule reads it at (None: every step) and whether a rule reads
    it at every step (`Rule.every_step`)."""
    wanted_by: Dict[str, Dict[str, tuple]] = {}
    for rule in rules:
        for collection, statistic in rule.requires:
            wanted = wanted_by.setdefault(collection, {})
            last, every = wanted.get(statistic, (rule.last_step, False))
            last = None if None in (last, rule.last_step) else max(last, rule.last_step)
            wanted[statistic] = (last, every or rule.every_step)
    return wanted_by


def variable_requests(kind: str, statistics: Dict[str, tuple], schedule: Schedule,
                      default_schedule: bool, strict: bool, owner: str,
                      refusals: List[Refusal]) -> List[Request]:
    """One request per last step: what is read at the first steps only (e.g.
    quantiles) is not computed after them. On the default schedule, what a
    rule reads at every step is recorded at every step."""
    allowed = stats_lib.ALL_STATISTICS + (WEIGHT_EXTRA_STATISTICS if kind == _tags.WEIGHTS else ())
    unknown = sorted(set(statistics) - set(allowed) - set(VARIABLE_EXTRAS))
    if unknown:
        refusals.append(Refusal(kind, unknown[0], f"statistics of {kind}: {', '.join(allowed)}"))
    groups: Dict[Optional[int], List[str]] = {}
    for statistic, (last, _) in statistics.items():
        groups.setdefault(last, []).append(statistic)
    requests = []
    for last, wanted in sorted(groups.items(), key=lambda item: item[0] or 0):
        stats = [s for s in allowed if s in wanted] or ["l2_norm"]
        frequent = [s for s in stats if statistics.get(s, (None, False))[1]]
        if _tags.GLOBAL_NORM in wanted and statistics[_tags.GLOBAL_NORM][1]:
            frequent.append("l2_norm")
        requests.append(Request(
            kind=kind, stats=stats, schedule=schedule._replace(last_step=last),
            frequent=frequent if default_schedule else (), strict=strict, owner=owner,
            for_rules=True,
        ))
    return requests


def plan(rules: Sequence, *, schedule: Schedule, default_schedule: bool, strict: bool,
         owner: str, replicas: int, has_taps: bool, freeze: Optional[Freeze],
         localize: bool, recordable: Optional[Sequence[str]] = None) -> Plan:
    """The requests that record what `rules` read for a model with
    `replicas` replicas (and taps, or not), and the step's own request (the
    loss, the fault test, the `freeze`, NaN localisation with `localize`).
    `recordable`: the request kinds the backend's capture records (None:
    every kind); what needs another is refused."""
    refusals: List[Refusal] = []
    requests: List[Request] = []
    reads_activations = False
    replica_every = None
    for collection, statistics in needs(rules).items():
        if collection in (_tags.GRADIENTS, _tags.WEIGHTS):
            requests.extend(variable_requests(collection, statistics, schedule,
                                              default_schedule, strict, owner, refusals))
        elif collection == _tags.CLASSES and recordable is not None \
                and "classes" not in recordable:
            refusals.extend(Refusal(collection, statistic, f"{_tags.prefix(_tags.CLASSES)} tags "
                                    "are recorded on the TensorFlow backend only so far")
                            for statistic in sorted(statistics))
        elif collection == _tags.CLASSES:
            unknown = sorted(set(statistics) - set(CLASS_COLUMNS))
            if unknown:
                refusals.append(Refusal(collection, unknown[0], ", ".join(
                    _tags.tag_pattern(_tags.CLASSES, c, "<k>") for c in CLASS_COLUMNS)))
            requests.append(Request(kind="classes", strict=strict, owner=owner))
        elif collection == _tags.ACTIVATIONS:
            reads_activations = True
            if not has_taps:
                refusals.extend(Refusal(collection, statistic,
                                        "activations need TapLayers (kerasdbg.insert_taps)")
                                for statistic in sorted(statistics))
        elif collection == _tags.REPLICAS:
            unknown = sorted(set(statistics) - {"spread"})
            if unknown:
                refusals.append(Refusal(collection, unknown[0],
                                        _tags.tag_pattern(_tags.REPLICAS, "spread", "<variable>")))
            elif replicas < 2:
                refusals.append(Refusal(collection, "spread", f"{_tags.prefix(_tags.REPLICAS)} "
                                        "tags need a strategy with several replicas"))
            else:
                replica_every = min(getattr(r, "every_n_steps", 1) for r in rules
                                    if any(c == _tags.REPLICAS for c, _ in r.requires))
        elif collection in _tags.SCALAR_COLLECTIONS:
            pass  # step/loss, step/frozen, every scalar the train step returns, the
            # largest logits (below); epoch logs
        else:
            refusals.extend(Refusal(collection, statistic, ", ".join(_tags.prefixes(
                _tags.COLLECTIONS + (_tags.REPLICAS,) + _tags.SCALAR_COLLECTIONS)) + " tags")
                            for statistic in sorted(statistics))
    logits = any(name in LOGITS for name in needs(rules).get(_tags.STEP, {}))
    if logits and recordable is not None and "logits" not in recordable:
        refusals.extend(Refusal(_tags.STEP, name, "the largest logits are recorded on the "
                                "TensorFlow backend only so far")
                        for name in sorted(set(needs(rules)[_tags.STEP]) & set(LOGITS)))
        logits = False
    requests.append(Request(kind="step", strict=strict, freeze=freeze, localize=localize,
                            owner=owner, logits=logits))
    return Plan(requests, refusals, reads_activations, replica_every)
