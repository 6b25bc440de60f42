"""TensorBoard tags of kerasdbg's records: every tag kerasdbg writes or reads
is built, parsed or matched here, and nowhere else. Plain Python.

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
- `<kind>/<variable path>` (`gradients/...`, `weights/...`) and
  `activations/<tap>`: the histograms;
- `activations/<tap>/<stat>`: the statistics of `TapLayer`s;
- `step/<name>`: one value per train step (`step/loss`, `step/frozen`, and
  every scalar the train step returns);
- `epoch/<log>`: Keras's epoch logs (`epoch/loss`, `epoch/val_loss`);
- `classes/<k>/seen`, `classes/<k>/mispredicted`, `replicas/<variable
  path>/spread`, `faults/...`: what `StopOnRule` records for its rules;
- `time/<name>`: `StepTimer`'s timings;
- `rules/verdicts`: `StopOnRule`'s verdict text (`kerasdbg.records.verdicts`).

`<optimizer>` is where the model keeps the optimizer (`d_optimizer`,
`discriminator.optimizer`); a model trained by one optimizer keeps the
shorter tags.

Examples:
    >>> from kerasdbg.records import tags
    >>> tag = tags.statistic(tags.GRADIENTS, "m/dense/kernel", "l2_norm")
    >>> tag, tags.tag_parts(tag)
    ('gradients/m/dense/kernel/l2_norm', ('gradients', 'm/dense/kernel', 'l2_norm'))
"""

from __future__ import annotations

import functools
import re
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

# ---------------------------------------------------------- collections
# The first part of every tag.
GRADIENTS = "gradients"
"""`gradients/<variable path>/<stat>`, `gradients/global_norm`, `gradients/clipped`."""
APPLIED_GRADIENTS = "applied_gradients"
"""`applied_gradients/<variable path>/<stat>`, `applied_gradients/global_norm`."""
WEIGHTS = "weights"
"""`weights/<variable path>/<stat>`."""
ACTIVATIONS = "activations"
"""`activations/<tap>/<stat>`: the statistics of `TapLayer`s."""
STEP = "step"
"""`step/<name>`: one value per train step."""
EPOCH = "epoch"
"""`epoch/<log>`: Keras's epoch logs, at the step that ended the epoch."""
TIME = "time"
"""`time/<name>`: `StepTimer`'s timings of each execution (`time/step_seconds`, ...)."""
FAULTS = "faults"
"""`faults/<group>/<kind>[/<name>]`: what the capture found at a fault (below)."""
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

COLLECTIONS = (GRADIENTS, WEIGHTS, ACTIVATIONS)
"""Collections of per-tensor tags: `<collection>/<tensor>/<statistic>`."""
SCALAR_COLLECTIONS = (STEP, EPOCH)
"""Collections of two-part tags: `step/loss`, `step/frozen` (each optimizer
step, from `StopOnRule`), `epoch/<log>` (Keras's epoch logs: `epoch/loss`,
`epoch/val_loss`, ...)."""

VIEWS = "views"
"""Tags `views/<collection>/<statistic>/<view>` and
`views/<collection>/<statistic>/<view>/<group>` (`view`): scalars derived
from a step's records for TensorBoard's charts (`kerasdbg.sinks.layout`):
`views/step/loss/log10`, `views/gradients/l2_norm/log10_max/<group>`, ...
Written to the event file only: they are not records (the reader, the
rules and the report never read them)."""

VERDICTS = "rules/verdicts"
"""The text tag of `StopOnRule`'s verdicts (`kerasdbg.records.verdicts`)."""

GLOBAL_NORM = "global_norm"
"""`<kind>/global_norm` (`<kind>/<optimizer>/global_norm`)."""
CLIPPED = "clipped"
"""`gradients/clipped` (`gradients/<optimizer>/clipped`)."""
LOSS = f"{STEP}/loss"
"""The loss of each optimizer step."""


# ------------------------------------------------------------- building
def statistic(kind: str, path: str, stat: str) -> str:
    """`<kind>/<variable path>/<stat>`."""
    return f"{kind}/{path}/{stat}"


def tensor(kind: str, path: str) -> str:
    """`<kind>/<variable path>` (or `activations/<tap>`): a histogram's tag,
    and the name under which `Run.tensor` reads the statistics of a tensor."""
    return f"{kind}/{path}"


def per_optimizer(kind: str, name: str, optimizer: Optional[str]) -> str:
    """`<kind>/<name>`, or `<kind>/<optimizer>/<name>` when several
    optimizers train the model."""
    return f"{kind}/{name}" if optimizer is None else f"{kind}/{optimizer}/{name}"


def scalar(collection: str, name: str) -> str:
    """`<collection>/<name>`: a two-part tag (`step/loss`, `epoch/val_loss`,
    `time/step_seconds`)."""
    return f"{collection}/{name}"


def step_scalar(name: str) -> str:
    """`step/<name>`."""
    return scalar(STEP, name)


def epoch_scalar(name: str) -> str:
    """`epoch/<name>`: Keras's epoch log `name`."""
    return scalar(EPOCH, name)


def prefix(collection: str) -> str:
    """`<collection>/`: what every tag of `collection` starts with."""
    return f"{collection}/"


def prefixes(collections: Iterable[str]) -> Tuple[str, ...]:
    """`prefix` of each collection, for `str.startswith`."""
    return tuple(prefix(c) for c in collections)


KERASDBG_PREFIXES = prefixes(COLLECTIONS + SCALAR_COLLECTIONS + (CLASSES,))
"""The tags of a run that kerasdbg can read back start with one of these."""


# -------------------------------------------------------------- parsing
def scalar_name(tag: str) -> str:
    """What follows the collection: `loss` of `step/loss`, `nan_source/located`
    of `faults/nan_source/located`."""
    return tag.partition("/")[2]


def scalar_parts(tag: str) -> Optional[Tuple[str, str]]:
    """`(collection, name)` of a two-part tag (`step/loss`,
    `gradients/global_norm`), else None."""
    if tag.count("/") != 1:
        return None
    collection, _, name = tag.partition("/")
    return collection, name


def is_per_optimizer(tag: str, kind: str, name: str) -> bool:
    """Whether `tag` is `<kind>/<name>` or a `<kind>/<optimizer>/<name>`
    (see `per_optimizer`)."""
    return tag == f"{kind}/{name}" or (tag.startswith(f"{kind}/") and tag.endswith(f"/{name}"))


_LOSS_NAME = re.compile(r"(?:^|[^a-z])loss(?:$|[^a-z])", re.IGNORECASE)


def is_loss_name(name: str) -> bool:
    """Whether a scalar's name says it is a loss: `loss`, `d_loss`,
    `g_loss`, `total_loss`, `kl_loss`, `loss_real` (not `glossary`)."""
    return bool(_LOSS_NAME.search(name))


def step_losses(record: Mapping[str, float]) -> Dict[str, float]:
    """`{name: value}` of the tags `step/<name>` whose name says it is a loss."""
    start = prefix(STEP)
    return {tag[len(start):]: float(value) for tag, value in record.items()
            if tag.startswith(start) and is_loss_name(tag[len(start):])}


def column(tag: str, kind: str) -> str:
    """The `history` column of `tag` in a callback recording `kind`: the tag
    without its `<kind>/` prefix (other tags keep theirs)."""
    start = prefix(kind)
    return tag[len(start):] if tag.startswith(start) else tag


@functools.lru_cache(maxsize=1 << 16)
def tag_parts(tag: str) -> Optional[Tuple[str, str, str]]:
    """`(collection, tensor, statistic)` of a per-tensor (or per-class, or
    per-replica) tag, else None. Each tag is parsed once (the answer is kept)."""
    collection, _, rest = tag.partition("/")
    tensor_path, _, stat = rest.rpartition("/")
    if collection not in COLLECTIONS + (CLASSES, REPLICAS) or not tensor_path:
        return None
    return collection, tensor_path, stat


def tensor_of(tag: str) -> str:
    """The tensor of a per-tensor tag (`m/d/kernel` of
    `gradients/m/d/kernel/l2_norm`); a tag of another shape as it is."""
    parts = tag_parts(tag)
    return tag if parts is None else parts[1]


def tensor_name(tag: str) -> str:
    """The name `Run.tensor` reads a tag under: `<collection>/<tensor>` of a
    per-tensor statistic of `gradients`, `weights` or `activations`, else
    the tag itself."""
    parts = tag_parts(tag)
    return tensor(parts[0], parts[1]) if parts and parts[0] in COLLECTIONS else tag


def statistic_of(name: str, tag: str) -> Optional[str]:
    """The statistic of `tag` when it is `<name>/<statistic>` (`name` from
    `tensor_name`), else None."""
    start = name + "/"
    if not tag.startswith(start) or "/" in tag[len(start):]:
        return None
    return tag[len(start):]


def names_under(record, start: str) -> list:
    """The `<name>`s of the tags `<start>/<name>` in `record` whose value is
    non-zero, in the record's order."""
    start = start + "/"
    return [tag[len(start):] for tag, value in record.items()
            if tag.startswith(start) and value]


# ------------------------------------------------------------ patterns
# Regular expressions of groups of tags, for TensorBoard's custom-scalars
# layout (`kerasdbg.sinks.layout`), whose plugin applies them with `re.match`,
# and for `Run.scalar_table` (`re.fullmatch`); anchored at both ends, so
# that they also select exactly these tags where they are searched for (the
# Scalars tab's tag filter).
def _alternatives(names: Sequence[str]) -> str:
    names = "|".join(re.escape(n) for n in names)
    return names if "|" not in names else f"({names})"


def statistic_pattern(kind: str, stat) -> str:
    """The tags `<kind>/<tensor>/<stat>` of every tensor (variable or tap);
    `stat` a name or a sequence of names."""
    stats = [stat] if isinstance(stat, str) else list(stat)
    return f"^{re.escape(kind)}/.+/{_alternatives(stats)}$"


def per_optimizer_pattern(kind: str, name: str) -> str:
    """The tag `<kind>/<name>` and every `<kind>/<optimizer>/<name>`."""
    return f"^{re.escape(kind)}/(.+/)?{re.escape(name)}$"


def scalar_pattern(collection: str, names: Sequence[str]) -> str:
    """The tags `<collection>/<name>` of `names` (`step/loss`, `time/step_seconds`)."""
    return f"^{re.escape(collection)}/{_alternatives(names)}$"


def any_pattern(patterns: Sequence[str]) -> str:
    """The tags any of `patterns` matches."""
    return "|".join(patterns)


def view_pattern(collection: str, statistic, view: str, grouped: bool = False) -> str:
    """The tags `view(collection, statistic, view)` (`grouped`: of every
    group, `view(collection, statistic, view, <group>)`); `statistic` a
    name, a sequence of names, or None for any."""
    if statistic is None:
        stats = "[^/]+"
    else:
        stats = _alternatives([statistic] if isinstance(statistic, str) else list(statistic))
    group = "/.+" if grouped else ""
    return f"^{re.escape(VIEWS)}/{re.escape(collection)}/{stats}/{re.escape(view)}{group}$"


def tag_pattern(collection: str, statistic: str, name: str = "<name>") -> str:
    """How the tags of a `requires` pair look, for messages: `step/loss`,
    `gradients/global_norm`, `<collection>/<name>/<statistic>`."""
    if collection in SCALAR_COLLECTIONS or statistic == GLOBAL_NORM:
        return f"{collection}/{statistic}"
    return f"{collection}/{name}/{statistic}"


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
# - `faults/skip/<kind>` (`faults/skip/<kind>/<optimizer>` with several): why
#   a step was skipped in the graph (`StopOnRule(action="skip")`): "nonfinite",
#   "max_gradient_norm", "loss_spike" or "gradient_norm_spike".
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
NAN_SOURCE_GRADIENTS = 5
"""Only the gradients were examined (on JAX, when the replay of the layers
could not run or had no inputs): which of them held NaN/Inf."""


def fault(group: str, kind: str, name: Optional[str] = None) -> str:
    """`faults/<group>/<kind>` or `faults/<group>/<kind>/<name>`."""
    return f"{FAULTS}/{group}/{kind}" if name is None else f"{FAULTS}/{group}/{kind}/{name}"


# ---------------------------------------------------------------- views
def view(collection: str, statistic: str, view: str, group: Optional[str] = None) -> str:
    """`views/<collection>/<statistic>/<view>[/<group>]` (see `VIEWS`): e.g.
    `view("gradients", "l2_norm", "log10_max", "conv2")`."""
    tag = f"{VIEWS}/{collection}/{statistic}/{view}"
    return tag if group is None else f"{tag}/{group}"


_SEPARATORS = re.compile(r"[/_.\-]")


def _prefix(name: str, depth: int) -> str:
    """`name` up to its `depth`-th separator (`/`, `_`, `.`, `-`), or whole."""
    cuts = [m.start() for m in _SEPARATORS.finditer(name)]
    return name if depth > len(cuts) else name[:cuts[depth - 1]]


def groups(names: Sequence[str], limit: int = 10) -> List[str]:
    """The group of each of `names` (variable paths, tap names), for charts
    of at most `limit` lines: the names' longest common prefix of whole
    `/`-parts left out, the deepest prefix (cut at `/`, `_`, `.` or `-`)
    that gives at most `limit` groups. When even the first cut gives one
    group (or the first gives more than `limit`), the names of the first
    cut that gives more than `limit` are split, in order, into at most
    `limit` runs named `<first>..<last>`. Groups keep the order of the names.

    Examples:
        >>> from kerasdbg.records import tags
        >>> tags.groups(["m/conv2_block1_1_conv/kernel", "m/conv2_block2_1_bn/beta",
        ...              "m/conv3_block1_1_conv/kernel", "m/predictions/bias"], limit=3)
        ['conv2', 'conv2', 'conv3', 'predictions']
        >>> tags.groups(["cnn/conv1/kernel", "cnn/conv1/bias", "cnn/dense/kernel"])
        ['conv1/kernel', 'conv1/bias', 'dense/kernel']
    """
    names = list(names)
    if not names:
        return []
    parts = [n.split("/") for n in names]
    common = 0
    while (len(names) > 1 and all(len(p) > common + 1 for p in parts)
           and len({p[common] for p in parts}) == 1):
        common += 1
    rest = ["/".join(p[common:]) for p in parts]
    deepest = max(len(_SEPARATORS.findall(n)) for n in rest) + 1
    chosen = None
    for depth in range(1, deepest + 1):
        keys = [_prefix(n, depth) for n in rest]
        if len(set(keys)) > limit:
            break
        chosen = keys
    else:
        return chosen
    if chosen is not None and len(set(chosen)) > 1:
        return chosen
    # One group, or more than `limit` at the first cut: the names of the
    # first cut that gives more than `limit`, in order, split into runs.
    order = list(dict.fromkeys(keys))
    size = -(-len(order) // limit)
    runs = [order[i:i + size] for i in range(0, len(order), size)]
    name_of = {key: run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}"
               for run in runs for key in run}
    return [name_of[key] for key in keys]


# ------------------------------------------------------- whole tags
PER_OPTIMIZER_NAMES = (GLOBAL_NORM, CLIPPED)
"""The last parts of `gradients/` and `applied_gradients/` tags that are one
per optimizer (`per_optimizer`), not one per variable (`statistic`)."""
PLUGINS = ("scalars", "histograms", "text")
"""The TensorBoard plugins whose data kerasdbg writes."""


class ParsedTag(NamedTuple):
    """A tag taken apart: `form`, the name of the function of this module
    that builds it (`statistic`, `per_optimizer`, `scalar`, `fault`,
    `tensor`, `view`; `VERDICTS` for the constant), and `parts`, its arguments.
    `build` puts it back together."""

    form: str
    parts: Tuple[Optional[str], ...]


_PER_TENSOR = (GRADIENTS, APPLIED_GRADIENTS, WEIGHTS, ACTIVATIONS, CLASSES, REPLICAS)
_HISTOGRAMS = (GRADIENTS, APPLIED_GRADIENTS, WEIGHTS, ACTIVATIONS)


def parse(tag: str, plugin: str = "scalars") -> Optional[ParsedTag]:
    """Takes apart any tag kerasdbg writes, of one of the `PLUGINS`; None for
    a tag that is not kerasdbg's. `build(parse(tag, plugin)) == tag`.

    Examples:
        >>> from kerasdbg.records import tags
        >>> tags.parse("gradients/d_optimizer/global_norm")
        ParsedTag(form='per_optimizer', parts=('gradients', 'global_norm', 'd_optimizer'))
        >>> tags.parse("faults/nan_source/gradient/m/d/kernel")
        ParsedTag(form='fault', parts=('nan_source', 'gradient', 'm/d/kernel'))
        >>> tags.build(tags.parse("weights/m/d/kernel", "histograms"))
        'weights/m/d/kernel'
    """
    if plugin == "text":
        return ParsedTag("VERDICTS", ()) if tag == VERDICTS else None
    collection, _, rest = tag.partition("/")
    if not rest:
        return None
    if plugin == "histograms":
        return ParsedTag("tensor", (collection, rest)) if collection in _HISTOGRAMS else None
    head, _, last = rest.rpartition("/")
    if collection in (GRADIENTS, APPLIED_GRADIENTS) and last in PER_OPTIMIZER_NAMES:
        return ParsedTag("per_optimizer", (collection, last, head or None))
    if collection == STEP and head:  # `step/<optimizer>/weight_decay_fraction`
        return ParsedTag("per_optimizer", (collection, last, head))
    if collection in SCALAR_COLLECTIONS + (TIME,):
        return ParsedTag("scalar", (collection, rest))
    if collection == VIEWS:
        parts = rest.split("/", 3)
        if len(parts) < 3 or not all(parts):
            return None
        return ParsedTag("view", (parts[0], parts[1], parts[2],
                                  parts[3] if len(parts) == 4 else None))
    if collection == FAULTS:
        group, _, more = rest.partition("/")
        kind, _, name = more.partition("/")
        return ParsedTag("fault", (group, kind, name or None)) if group and kind else None
    if collection in _PER_TENSOR and head and last:
        return ParsedTag("statistic", (collection, head, last))
    return None


def build(parsed: ParsedTag) -> str:
    """The tag `parse` took apart."""
    if parsed.form == "VERDICTS":
        return VERDICTS
    return _BUILDERS[parsed.form](*parsed.parts)


_BUILDERS = {"statistic": statistic, "per_optimizer": per_optimizer, "scalar": scalar,
             "fault": fault, "tensor": tensor, "view": view}
