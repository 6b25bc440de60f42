"""TensorBoard tags of kerasdbg's records: built and parsed here, and the
record of one step that rules read (`StepRecord`). Plain Python.

- `gradients/<variable path>/<stat>`: the gradient the model produced for a
  variable (before clipping; with gradient accumulation, each batch's);
- `gradients/global_norm`: the norm of all the gradients one optimizer step
  applies; with several optimizers, `gradients/<optimizer>/global_norm`;
- `applied_gradients/<variable path>/<stat>` and
  `applied_gradients/global_norm`: what the optimizer applied, recorded only
  when it differs from the model's gradient by construction (clipping,
  gradient accumulation);
- `gradients/clipped` (`gradients/<optimizer>/clipped`): 1 at the steps where
  clipping changed the gradient, else 0;
- `weights/<variable path>/<stat>`;
- `step/<name>`: one value per train step (`step/loss`, `step/frozen`, and
  every scalar the train step returns).

`<optimizer>` is where the model keeps the optimizer (`d_optimizer`,
`discriminator.optimizer`); a model trained by one optimizer keeps the
shorter tags.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

APPLIED_GRADIENTS = "applied_gradients"
STEP = "step"


def statistic(kind: str, path: str, stat: str) -> str:
    """`<kind>/<variable path>/<stat>`."""
    return f"{kind}/{path}/{stat}"


def per_optimizer(kind: str, name: str, optimizer: Optional[str]) -> str:
    """`<kind>/<name>`, or `<kind>/<optimizer>/<name>` when several
    optimizers train the model."""
    return f"{kind}/{name}" if optimizer is None else f"{kind}/{optimizer}/{name}"


def step_scalar(name: str) -> str:
    """`step/<name>`."""
    return f"{STEP}/{name}"


def per_optimizer_values(record: Mapping[str, float], kind: str, name: str) -> List[float]:
    """The values of `<kind>/<name>` and of every `<kind>/<optimizer>/<name>`
    (see `per_optimizer`) in `record`."""
    whole, prefix, suffix = f"{kind}/{name}", f"{kind}/", f"/{name}"
    return [float(value) for tag, value in record.items()
            if tag == whole or (tag.startswith(prefix) and tag.endswith(suffix))]


_LOSS_NAME = re.compile(r"(?:^|[^a-z])loss(?:$|[^a-z])", re.IGNORECASE)


def is_loss_name(name: str) -> bool:
    """Whether a scalar's name says it is a loss: `loss`, `d_loss`,
    `g_loss`, `total_loss`, `kl_loss`, `loss_real` (not `glossary`)."""
    return bool(_LOSS_NAME.search(name))


def step_losses(record: Mapping[str, float]) -> Dict[str, float]:
    """`{name: value}` of the tags `step/<name>` whose name says it is a loss."""
    start = f"{STEP}/"
    return {tag[len(start):]: float(value) for tag, value in record.items()
            if tag.startswith(start) and is_loss_name(tag[len(start):])}


def column(tag: str, kind: str) -> str:
    """The `history` column of `tag` in a callback recording `kind`: the tag
    without its `<kind>/` prefix (other tags keep theirs)."""
    prefix = f"{kind}/"
    return tag[len(prefix):] if tag.startswith(prefix) else tag


# ------------------------------------------------------------ patterns
# Regular expressions of groups of tags, for TensorBoard's custom-scalars
# layout (`kerasdbg.sinks.layout`), whose plugin applies them with `re.match`;
# anchored at both ends, so that they also select exactly these tags where
# they are searched for (the Scalars tab's tag filter).
ACTIVATIONS = "activations"
"""`activations/<tap>/<stat>`: the statistics of `TapLayer`s."""
TIME = "time"
"""`time/<name>`: `StepTimer`'s timings of each execution (`time/step_seconds`, ...)."""


def statistic_pattern(kind: str, stat: str) -> str:
    """The tags `<kind>/<tensor>/<stat>` of every tensor (variable or tap)."""
    return f"^{re.escape(kind)}/.+/{re.escape(stat)}$"


def per_optimizer_pattern(kind: str, name: str) -> str:
    """The tag `<kind>/<name>` and every `<kind>/<optimizer>/<name>`."""
    return f"^{re.escape(kind)}/(.+/)?{re.escape(name)}$"


def scalar_pattern(collection: str, names: Sequence[str]) -> str:
    """The tags `<collection>/<name>` of `names` (`step/loss`, `time/step_seconds`)."""
    names = "|".join(re.escape(n) for n in names)
    return f"^{re.escape(collection)}/{names}$" if "|" not in names else \
        f"^{re.escape(collection)}/({names})$"


# --------------------------------------------------------------- faults
# What the capture found at an in-graph fault, as scalars of the fault's
# step (1 unless said), so that the rules that report it (`FreezeOnFault`,
# `NaNSource`) read it online and offline alike:
#
# - `faults/nan_source/layer/<layer>`: the first layer whose output held
#   NaN/Inf in the replayed forward pass;
# - `faults/nan_source/gradient/<variable path>`: a variable whose gradient did;
# - `faults/nan_source/optimizer/<name>`: the optimizer applying them (with
#   several optimizers);
# - `faults/nan_source/located`: how the replay went (`NAN_SOURCE_*`);
# - `faults/nan_source/model/<name>`: the subclassed model whose layers the
#   replay cannot see;
# - `faults/freeze/applied_before/<optimizer>`: an optimizer that had applied
#   this train step's update before the apply that found the fault;
# - `faults/freeze/found_by/<optimizer>`: the optimizer whose apply found it;
# - `faults/freeze/max_gradient_norm`: the gradient-norm limit that was armed.
FAULTS = "faults"
NAN_SOURCE = f"{FAULTS}/nan_source"
FREEZE = f"{FAULTS}/freeze"
NAN_SOURCE_LAYER = 1
"""`faults/nan_source/located`: a layer output held NaN/Inf."""
NAN_SOURCE_LOSS = 2
"""Every layer output was finite and the train step's loss is `compute_loss`'s."""
NAN_SOURCE_TRAIN_STEP = 3
"""Every layer output of the forward pass was finite; the train step computes more."""
NAN_SOURCE_HIDDEN = 4
"""The model is subclassed: its layers are not visible to the replay."""


def fault(group: str, kind: str, name: Optional[str] = None) -> str:
    """`faults/<group>/<kind>` or `faults/<group>/<kind>/<name>`."""
    return f"{FAULTS}/{group}/{kind}" if name is None else f"{FAULTS}/{group}/{kind}/{name}"


def names_under(record, prefix: str) -> list:
    """The `<name>`s of the tags `<prefix>/<name>` in `record` whose value is
    non-zero, in the record's order."""
    start = prefix + "/"
    return [tag[len(start):] for tag, value in record.items()
            if tag.startswith(start) and value]


# ------------------------------------------------------------- parsing
COLLECTIONS = ("gradients", "weights", "activations")
"""Collections of per-tensor tags: `<collection>/<tensor>/<statistic>`."""
SCALAR_COLLECTIONS = ("step", "epoch")
"""Collections of two-part tags: `step/loss`, `step/frozen` (each optimizer
step, from `StopOnRule`), `epoch/<log>` (Keras's epoch logs: `epoch/loss`,
`epoch/val_loss`, ...)."""
REPLICAS = "replicas"
"""Tags `replicas/<variable path>/spread`: how far the replicas' copies of a
trainable variable are apart (from `StopOnRule` when a rule reads them, every
few steps): the largest relative difference between a replica's checksums
(sum, sum of squares) and replica 0's; 0 when every replica holds the same
values."""
CLASSES = "classes"
"""Tags `classes/<k>/seen` and `classes/<k>/mispredicted`: labels of class `k`
seen in training so far and how many of them were predicted wrong (from
`StopOnRule` when a rule reads them)."""

Record = Mapping[str, float]
"""The scalars of one step, by TensorBoard tag: `gradients/<variable>/<stat>`,
`weights/<variable>/<stat>`, `activations/<tap>/<stat>`, `gradients/global_norm`,
`step/loss`, `step/frozen`; or of one epoch: `epoch/loss`, `epoch/val_loss`, ..."""


@functools.lru_cache(maxsize=1 << 16)
def tag_parts(tag: str) -> Optional[Tuple[str, str, str]]:
    """`(collection, tensor, statistic)` of a per-tensor (or per-class) tag,
    else None. Each tag is parsed once (the answer is kept)."""
    collection, _, rest = tag.partition("/")
    tensor, _, statistic = rest.rpartition("/")
    if collection not in COLLECTIONS + (CLASSES, REPLICAS) or not tensor:
        return None
    return collection, tensor, statistic


def tag_pattern(collection: str, statistic: str) -> str:
    """How the tags of a `requires` pair look, for messages."""
    if collection in SCALAR_COLLECTIONS or statistic == "global_norm":
        return f"{collection}/{statistic}"
    return f"{collection}/<name>/{statistic}"


class StepRecord(dict):
    """The scalars of one step, by tag (a `dict`), indexed once by
    `(collection, statistic)` for the rules: `values_of` then reads the
    values of one statistic without looking at the other tags.

    Examples:
        >>> from kerasdbg.records.tags import StepRecord, values_of
        >>> record = StepRecord({"gradients/d/kernel/l2_norm": 2.0, "step/loss": 0.5})
        >>> list(values_of(record, "gradients", "l2_norm"))
        [('d/kernel', 2.0)]
    """

    __slots__ = ("_index",)

    def by_statistic(self, collection: str, statistic: str) -> List[Tuple[str, float]]:
        """`(tensor, value)` of every tag `<collection>/<tensor>/<statistic>`."""
        index = getattr(self, "_index", None)
        if index is None:
            index = {}
            for tag, value in self.items():
                parts = tag_parts(tag)
                if parts:
                    index.setdefault((parts[0], parts[2]), []).append((parts[1], float(value)))
            self._index = index
        return index.get((collection, statistic), [])


def values_of(record: Record, collection: str, statistic: str) -> Iterator[Tuple[str, float]]:
    """`(tensor, value)` for each finite or non-finite value of one statistic."""
    if isinstance(record, StepRecord):
        yield from record.by_statistic(collection, statistic)
        return
    for tag, value in record.items():
        parts = tag_parts(tag)
        if parts and parts[0] == collection and parts[2] == statistic:
            yield parts[1], float(value)


# ------------------------------------------------------------- verdicts
VERDICT_TENSORS = 5
"""Tensors listed per verdict in the `rules/verdicts` text; the others are counted."""
_VERDICT_ROW = re.compile(
    r"^\|\s*(?P<rule>[^|]*?)\s*\|\s*(?P<step>-?\d+)\s*\|\s*(?P<tensors>[^|]*?)\s*\|"
    r"\s?(?P<reason>.*?)\s*\|\s*$")
_VERDICT_HEAD = re.compile(r"^\|\s*rule\s*\|\s*step\s*\||^\|[-:| ]*\|\s*$")
_MORE = re.compile(r"\s*\.\.\.(?: and (?P<count>\d+) more)?$")


def verdict_markdown(verdicts: Sequence[Any]) -> str:
    """The `rules/verdicts` text of `StopOnRule`: a Markdown table `| rule |
    step | tensors | reason |` (TensorBoard's Text dashboard renders it);
    `verdict_rows` reads it back.

    Examples:
        >>> from kerasdbg.records.tags import verdict_markdown, verdict_rows
        >>> from kerasdbg.rules import AllZero
        >>> text = verdict_markdown([AllZero().check(3, {"weights/m/d/bias/zero_fraction": 1.0})])
        >>> print(text)
        | rule | step | tensors | reason |
        |---|---|---|---|
        | AllZero | 3 | m/d/bias | AllZero at step 3: zero_fraction at or above 1 in weights: m/d/bias=1 |
        >>> verdict_rows(text)[0]["tensors"]
        ['m/d/bias']
    """
    rows = ["| rule | step | tensors | reason |", "|---|---|---|---|"]
    for v in verdicts:
        hidden = len(v.tensors) - VERDICT_TENSORS
        tensors = ", ".join(v.tensors[:VERDICT_TENSORS]) + (
            f" ... and {hidden} more" if hidden > 0 else "")
        rows.append(f"| {v.rule} | {v.step} | {tensors} | {v.reason} |")
    return "\n".join(rows)


def verdict_rows(text: str) -> List[Dict[str, Any]]:
    """The rows of a `verdict_markdown` text, in order: dicts of `rule`,
    `step` (None for a line that is not a row, kept as a `reason`),
    `tensors` (a list), `hidden` (tensors left out of the list; -1 when a
    run written before this count says only " ...") and `reason`. The
    reason is the last cell, so it may itself hold a "|"."""
    rows = []
    for line in str(text).splitlines():
        line = line.strip()
        if not line or _VERDICT_HEAD.match(line):
            continue
        match = _VERDICT_ROW.match(line)
        if match is None:
            rows.append({"rule": "", "step": None, "tensors": [], "hidden": 0, "reason": line})
            continue
        tensors, hidden = match["tensors"], 0
        more = _MORE.search(tensors)
        if more is not None:
            hidden = int(more["count"]) if more["count"] else -1
            tensors = tensors[:more.start()]
        rows.append({"rule": match["rule"], "step": int(match["step"]),
                     "tensors": [t.strip() for t in tensors.split(",") if t.strip()],
                     "hidden": hidden, "reason": match["reason"]})
    return rows


# ------------------------------------------------------------- records
class CaptureRecord(NamedTuple):
    """What one step recorded for one request.

    Attributes:
        step: the step: for gradients and weights, the applying optimizer's
            step (its `iterations` after the update, 1-based; with gradient
            accumulation, the batch it accumulated); for "step" requests the
            step of the first optimizer apply in that train step (counted on
            from the last fit when nothing is applied). A step the loss scaler
            skipped carries the number the update would have had.
        skipped: whether the loss scaler skipped the update.
        values: the request's values for this step, or None if the step was
            not recorded (`every_n_steps`, or no update to describe).
        histograms: `(counts [V, bins], ranges [V, 2])`, or None.
        tags: the TensorBoard tag of each value; None for a value left out
            (a variable without a gradient, a loss that was not captured).
        histogram_tags: the tag of each histogram row, None likewise.
        optimizer: the name of the optimizer that applied the step, or None
            for a "step" request.
        applied: whether the step updated the weights (False: a batch whose
            gradient the optimizer only accumulated).
    """

    step: int
    skipped: bool
    values: Optional[Any]
    histograms: Optional[tuple]
    tags: Tuple[Optional[str], ...] = ()
    histogram_tags: Tuple[Optional[str], ...] = ()
    optimizer: Optional[str] = None
    applied: bool = True
