"""TensorBoard's custom-scalars layout of a run: a few charts of many lines.

TensorBoard's Scalars tab draws one chart per tag: thousands of them for a
ResNet50-sized model. The callbacks that write to `<log_dir>/train` each say
which lines their tags draw (`Line`: a chart and a regular expression of
tags); the custom-scalars plugin ("Custom Scalars" tab) draws every tag a
line's expression matches in that line's chart.

A chart a person can read draws a few lines: the open categories draw, per
group of variables or taps (`tags.groups`: at most `MAX_LINES`, named after
the layers, `conv2`..`conv5` for a ResNet50), the largest gradient norm,
update ratio, weight norm and dead fraction, written beside the records by
the callbacks as `views/...` scalars (`views`); the loss and the global
norm on charts of their own, each also as log10 (the plugin's log axis
is a button per chart, off at first). The per-variable and per-tap charts come last, in a closed category,
and only where they draw at most `MAX_LINES` lines.

The plugin reads one layout per run: of the points of its tag
(`custom_scalars__config__`) it asks the data provider for one
(`downsample=1`), which is the last one read (both TensorBoard's Python
loader and its Rust data server keep the last point of a time series). So
the callbacks of a run, which share one writer (`_events.writer_for`), add
their lines to that writer's set here, and the merged layout is written
again, at step 0, whenever a callback adds a line: the last layout of the
run holds the charts of all of them. (Across runs, the plugin merges the
layouts by category title.)
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from tensorboard.compat.proto import summary_pb2, tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2, types_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata

from kerasdbg.sinks import events as _events
from kerasdbg.records import tags as _tags
from kerasdbg import stats as stats_lib


class Chart(NamedTuple):
    """A multi-line chart of the layout, in its (collapsible) category."""

    category: str
    title: str


MAX_LINES = 10
"""The most lines a chart of the open categories draws: per-variable and
per-tap series are drawn as `MAX_LINES` groups or fewer (`tags.groups`)."""
UPDATE_RATIO_ABOVE = 0.01
"""The update ratio above which a variable counts in the chart of the
fraction of variables moving fast (a rule of thumb puts healthy ratios near
0.001)."""
EVERY = "every variable and tap"
"""The category of the per-variable and per-tap charts: closed at first, and
written only where a chart would draw at most `MAX_LINES` lines or the count
is not known when the layout is written (the Scalars tab keeps every tag)."""

LOSS = Chart("loss", "loss")
LOG_LOSS = Chart("loss", "log10 loss")
GLOBAL_NORM = Chart("gradients", "global norm")
LOG_GLOBAL_NORM = Chart("gradients", "log10 global norm")
GRADIENT_GROUPS = Chart("gradients", "log10 largest l2 norm in each group of variables")
GRADIENT_GROUPS_RAW = Chart("gradients", "largest l2 norm in each group of variables")
GRADIENT_EXTREMES = Chart("gradients", "log10 largest and smallest l2 norm of all variables")
GRADIENT_HOLDERS = Chart(
    "gradients", "log10 largest and smallest l2 norm, by the variable holding it")
UPDATE_RATIO_GROUPS = Chart("weights", "log10 largest update ratio in each group of variables")
UPDATE_RATIO_FRACTION = Chart(
    "weights", f"fraction of variables with update ratio above {UPDATE_RATIO_ABOVE:g}")
WEIGHT_GROUPS = Chart("weights", "largest weight l2 norm in each group of variables")
HEALTH_GROUPS = Chart("activations", "largest dead / saturated fraction in each group of taps")
SKIPS = Chart("stability", "skipped steps (1 where skipped) and fraction of spiky steps")
STEP_GRADIENT_NORM = Chart("stability", "global gradient norm of each step")
ATTENTION_LOGITS = Chart("stability", "largest attention logit of each step")
SECONDS = Chart("timing", "seconds per execution and per step: input, compute")
INPUT_FRACTION = Chart("timing", "input fraction")
THROUGHPUT = Chart("timing", "examples per second")
GRADIENT_NORMS = Chart(EVERY, "gradient l2 norm of every variable")
UPDATE_RATIOS = Chart(EVERY, "weight update ratio of every variable")
WEIGHT_NORMS = Chart(EVERY, "weight l2 norm of every variable")
HEALTH = Chart(EVERY, "dead / saturated fraction of every tap")
CHARTS = (LOSS, LOG_LOSS, GLOBAL_NORM, LOG_GLOBAL_NORM, GRADIENT_GROUPS, GRADIENT_GROUPS_RAW,
          GRADIENT_EXTREMES, GRADIENT_HOLDERS, UPDATE_RATIO_GROUPS, UPDATE_RATIO_FRACTION,
          WEIGHT_GROUPS, HEALTH_GROUPS, SKIPS, STEP_GRADIENT_NORM, ATTENTION_LOGITS, SECONDS,
          INPUT_FRACTION, THROUGHPUT, GRADIENT_NORMS, UPDATE_RATIOS, WEIGHT_NORMS, HEALTH)
"""Every chart, in the order the dashboard shows them."""
CLOSED = (EVERY,)
"""The categories shown closed (a click opens them)."""

TIMED_SECONDS = ("execution_seconds", "step_seconds", "input_seconds", "compute_seconds")
"""`StepTimer`'s `time/` tags in seconds (under XLA only the first two)."""


class Line(NamedTuple):
    """The tags matching `pattern` (`re.match`), drawn in `chart`."""

    chart: Chart
    pattern: str


# ------------------------------------------------------ what each callback draws
def _few(count: Optional[int]) -> bool:
    """Whether a chart of `count` lines (None: not known yet) is drawn."""
    return count is None or count <= MAX_LINES


def statistics_lines(kind: str, stats: Sequence[str], count: Optional[int] = None) -> List[Line]:
    """The lines of `GradientStatistics` (`kind="gradients"`) or
    `WeightStatistics` (`"weights"`) recording `stats` of `count` variables
    (None: not known yet): the views of `views` and, for a few variables,
    the per-variable charts."""
    lines = []
    norm = "l2_norm"
    if kind == _tags.GRADIENTS:
        # Recorded whatever `stats` are; several optimizers: one norm each.
        lines.append(Line(GLOBAL_NORM, _tags.per_optimizer_pattern(kind, _tags.GLOBAL_NORM)))
        # `.../log10/<optimizer>` with several optimizers.
        lines.append(Line(LOG_GLOBAL_NORM, _tags.any_pattern([
            _tags.view_pattern(kind, _tags.GLOBAL_NORM, "log10"),
            _tags.view_pattern(kind, _tags.GLOBAL_NORM, "log10", grouped=True)])))
        if norm in stats:
            lines += [Line(GRADIENT_GROUPS, _tags.view_pattern(kind, norm, "log10_max", True)),
                      Line(GRADIENT_GROUPS_RAW, _tags.view_pattern(kind, norm, "max", True)),
                      Line(GRADIENT_EXTREMES, _tags.view_pattern(kind, norm, "log10_max")),
                      Line(GRADIENT_EXTREMES, _tags.view_pattern(kind, norm, "log10_min")),
                      Line(GRADIENT_HOLDERS, _tags.view_pattern(kind, norm, "log10_largest", True)),
                      Line(GRADIENT_HOLDERS,
                           _tags.view_pattern(kind, norm, "log10_smallest", True))]
            if _few(count):
                lines.append(Line(GRADIENT_NORMS, _tags.statistic_pattern(kind, norm)))
    elif kind == _tags.WEIGHTS:
        if "update_ratio" in stats:
            lines += [
                Line(UPDATE_RATIO_GROUPS,
                     _tags.view_pattern(kind, "update_ratio", "log10_max", True)),
                Line(UPDATE_RATIO_FRACTION,
                     _tags.view_pattern(kind, "update_ratio", _fraction_view()))]
            if _few(count):
                lines.append(Line(UPDATE_RATIOS, _tags.statistic_pattern(kind, "update_ratio")))
        if norm in stats:
            lines.append(Line(WEIGHT_GROUPS, _tags.view_pattern(kind, norm, "max", True)))
            if _few(count):
                lines.append(Line(WEIGHT_NORMS, _tags.statistic_pattern(kind, norm)))
    return lines


def activation_lines(health: Iterable[str], count: Optional[int] = None) -> List[Line]:
    """The lines of `ActivationStatistics` whose `count` taps (None: not
    known) record these health fractions (`TapLayer.health`)."""
    recorded = set(health)
    health = [name for name in stats_lib.HEALTH_STATISTICS if name in recorded]
    if not health:
        return []
    lines = [Line(HEALTH_GROUPS, _tags.view_pattern(_tags.ACTIVATIONS, health, "max", True))]
    if _few(count):
        lines.append(Line(HEALTH, _tags.statistic_pattern(_tags.ACTIVATIONS, health)))
    return lines


def timing_lines(timed: bool) -> List[Line]:
    """The lines of `StepTimer`; `timed`: whether it splits input and compute
    (not under XLA)."""
    if not timed:
        return [Line(SECONDS, _tags.scalar_pattern(_tags.TIME, TIMED_SECONDS[:2]))]
    return [Line(SECONDS, _tags.scalar_pattern(_tags.TIME, TIMED_SECONDS)),
            Line(INPUT_FRACTION, _tags.scalar_pattern(_tags.TIME, ["input_fraction"])),
            Line(THROUGHPUT, _tags.scalar_pattern(_tags.TIME, ["examples_per_second"]))]


def loss_lines() -> List[Line]:
    """The lines of `StopOnRule`: the loss of each step, and its log10."""
    return [Line(LOSS, _tags.scalar_pattern(_tags.STEP, ["loss"])),
            Line(LOG_LOSS, _tags.view_pattern(_tags.STEP, "loss", "log10"))]


def guard_lines() -> List[Line]:
    """The lines of `StopOnRule`'s in-graph guard (spike tests, skips) and of
    the largest logits: each where recorded."""
    per = _tags.per_optimizer_pattern
    return [Line(SKIPS, per(_tags.STEP, "skipped")),
            Line(SKIPS, per(_tags.STEP, "spike_fraction")),
            Line(STEP_GRADIENT_NORM, per(_tags.STEP, "gradient_norm")),
            Line(ATTENTION_LOGITS, per(_tags.STEP, "max_attention_logit"))]


# ------------------------------------------------------------------ views
def _fraction_view() -> str:
    return f"fraction_above_{UPDATE_RATIO_ABOVE:g}"


def _log10(value: float) -> Optional[float]:
    """log10 of `value` for a chart of log10 values: None (the point left
    out) where there is none, at a value <= 0 (a negative loss, a zero norm)
    or NaN; +inf at +inf (an exploded value still shows)."""
    if not value > 0:  # NaN too
        return None
    return float(np.log10(value))


def _put_log10(out: Dict[str, float], tag: str, value: float) -> None:
    """`out[tag] = log10(value)`, unless `_log10` leaves it out."""
    logged = _log10(value)
    if logged is not None:
        out[tag] = logged


def loss_views(scalars: Mapping[str, float]) -> Dict[str, float]:
    """`views/step/<loss>/log10` of each loss `step/<loss>` in `scalars`;
    absent at a loss <= 0 (a cosine-similarity or ELBO-style loss) or NaN,
    +inf at an infinite loss.

    Examples:
        >>> from kerasdbg.sinks import layout
        >>> layout.loss_views({"step/loss": 100.0, "step/kl_loss": -0.5})
        {'views/step/loss/log10': 2.0}
    """
    out: Dict[str, float] = {}
    for tag, view in _loss_plan(tuple(scalars)):
        _put_log10(out, view, float(scalars[tag]))
    return out


def loss_view_groups(tags: Tuple[str, ...], values: np.ndarray) -> list:
    """`loss_views` of steps of the same tags (`values [n, len(tags)]`), as
    `view_groups` gives views: `(view tags, positions of the steps, their
    values)`, the steps with the same views together.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.sinks import layout
        >>> [(t, rows.tolist(), v.tolist()) for t, rows, v in layout.loss_view_groups(
        ...     ("step/loss",), np.array([[100.0], [-1.0], [10.0]]))]
        [(('views/step/loss/log10',), [0, 2], [[2.0], [1.0]]), ((), [1], [[]])]
    """
    plan = _loss_plan(tuple(tags))
    values = np.asarray(values, np.float64)
    if not plan or not len(values):
        return [((), np.arange(len(values)), np.empty((len(values), 0)))]
    chosen = values[:, [tags.index(tag) for tag, _ in plan]]
    present = chosen > 0  # (NaN: absent; +inf: +inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.log10(np.where(present, chosen, 1.0))
    out = []
    for signature, rows in _same_rows(present.astype(np.int64)):
        kept = np.flatnonzero(signature)
        out.append((tuple(plan[k][1] for k in kept.tolist()), rows, logged[np.ix_(rows, kept)]))
    return out


loss_views.of_block = loss_view_groups  # (what `EventWriter.write_block` derives with)


@functools.lru_cache(maxsize=64)
def _loss_plan(tags: Tuple[str, ...]) -> Tuple[Tuple[str, str], ...]:
    """(tag, view tag) of each loss among `tags` (a callback writes the same
    tags at every step: worked out once per tuple)."""
    start = _tags.prefix(_tags.STEP)
    return tuple((start + name, _tags.view(_tags.STEP, name, "log10"))
                 for name in _tags.step_losses(dict.fromkeys(tags, 0.0)))


class _Plan(NamedTuple):
    """Where the views of one tuple of tags take their values."""

    groups: Tuple[str, ...]
    # statistic -> (indices of its per-tensor tags in the tuple, group of each as an
    # index into `groups`, the tensor of each, the columns of each group among them)
    statistics: Dict[str, Tuple[np.ndarray, np.ndarray, Tuple[str, ...],
                                Tuple[np.ndarray, ...]]]
    # (index, view tag) of each per-optimizer global norm
    global_norms: Tuple[Tuple[int, str], ...]


_VIEWED = {_tags.GRADIENTS: ("l2_norm",), _tags.WEIGHTS: ("l2_norm", "update_ratio"),
           _tags.ACTIVATIONS: stats_lib.HEALTH_STATISTICS}


@functools.lru_cache(maxsize=64)
def _plan(kind: str, tags: Tuple[Optional[str], ...], names: Tuple[str, ...] = ()) -> _Plan:
    wanted = _VIEWED.get(kind, ())
    tensors: Dict[str, None] = dict.fromkeys(names)
    found = []
    global_norms = []
    for i, tag in enumerate(tags):
        if tag is None:
            continue
        if kind == _tags.GRADIENTS and _tags.is_per_optimizer(tag, kind, _tags.GLOBAL_NORM):
            optimizer = tag[len(kind) + 1:-len(_tags.GLOBAL_NORM) - 1] or None
            global_norms.append((i, _tags.view(kind, _tags.GLOBAL_NORM, "log10", optimizer)))
            continue
        parts = _tags.tag_parts(tag)
        if parts is None or parts[0] != kind or parts[2] not in wanted:
            continue
        tensors.setdefault(parts[1], None)
        found.append((i, parts[1], parts[2]))
    names = list(tensors)
    group_of = dict(zip(names, _tags.groups(names, MAX_LINES)))
    groups = tuple(dict.fromkeys(group_of[t] for _, t, _ in found))
    number = {g: k for k, g in enumerate(groups)}
    statistics = {}
    for stat in wanted:
        chosen = [(i, number[group_of[t]], t) for i, t, s in found if s == stat]
        if chosen:
            index, group = (np.array(c, np.int64) for c in list(zip(*chosen))[:2])
            members = tuple(np.flatnonzero(group == g) for g in range(len(groups)))
            statistics[stat] = (index, group, tuple(t for _, _, t in chosen), members)
    return _Plan(groups, statistics, tuple(global_norms))


def _group_max(values: np.ndarray, members: Tuple[np.ndarray, ...]) -> np.ndarray:
    """Of each row of `values` (steps x tensors), the largest value in each
    group (`members[g]`: the columns of group g), NaN left out: a (steps x
    groups) array, NaN where a group holds only NaN or nothing."""
    out = np.full((values.shape[0], len(members)), np.nan)
    for g, columns in enumerate(members):
        if columns.size:
            out[:, g] = np.fmax.reduce(values[:, columns], axis=1)
    return out


_view = functools.lru_cache(maxsize=8192)(_tags.view)
"""`tags.view`, each tag worked out once (the views' tags, at every read)."""


def views(kind: str, tags: Sequence[Optional[str]], values: Sequence[float],
          names: Sequence[str] = ()) -> Dict[str, float]:
    """The scalars of TensorBoard's readable charts derived from one step's
    records of `kind` (`tags[i]` holding `values[i]`; a None tag is left
    out): per group of variables or taps (`tags.groups`, at most
    `MAX_LINES`), the largest value of a statistic (`max`; `log10_max` of
    gradient norms and update ratios); across all variables the log10 of the largest
    and the smallest gradient norm and the fraction of variables whose
    update ratio is above `UPDATE_RATIO_ABOVE`, and those largest and
    smallest norms again under the name of the variable holding them
    (`log10_largest/<variable>`, `log10_smallest/<variable>`: one line per
    variable that ever held them); log10 of the global norm (of each
    optimizer's, with several). Tags: `tags.view`.

    A NaN value is left out of a largest or smallest (a `max` is NaN when
    all are). A log10 view is absent where its input is <= 0 or NaN and
    +inf where it is +inf (an exploded norm still shows); the smallest
    norm is the smallest nonzero one (a bias whose gradient is zero by
    construction does not pin it). An infinite update ratio (a weight that
    was 0, as a zero-initialised bias at its first step) is left out of its
    group's `log10_max` and of the fraction, which counts the variables
    whose ratio is finite; both are absent where none is.

    Args:
        kind: "gradients", "weights" or "activations".
        tags: the tag of each value; None for a value left out.
        values: the step's values.
        names: the names of every variable or tap the groups are made of, so
            that the same names make the same groups at every step (the
            variables of every optimizer of the model, whose records
            `tags` joins). Defaults to `()`: those in `tags`.

    Returns:
        `{view tag: value}`.

    Examples:
        >>> from kerasdbg.sinks import layout
        >>> views = layout.views("gradients", ["gradients/global_norm",
        ...     "gradients/m/a/kernel/l2_norm", "gradients/m/b/kernel/l2_norm"], [5.0, 3.0, 4.0])
        >>> round(views["views/gradients/global_norm/log10"], 4)
        0.699
        >>> views["views/gradients/l2_norm/max/b/kernel"], views["views/gradients/l2_norm/log10_min"]
        (4.0, 0.47712125471966244)
    """
    return views_of_steps(kind, tags, np.asarray(values, np.float64)[None], names)[0]


def views_of_steps(kind: str, tags: Sequence[Optional[str]], values: np.ndarray,
                   names: Sequence[str] = ()) -> List[Dict[str, float]]:
    """`views` of several steps of the same tags at once (`values[s]`: the
    values of step s), computed over the steps as arrays: one dict per step,
    each the `views` of its row.

    Examples:
        >>> from kerasdbg.sinks import layout
        >>> tags = ["gradients/global_norm", "gradients/m/a/kernel/l2_norm"]
        >>> [round(v["views/gradients/global_norm/log10"], 3)
        ...  for v in layout.views_of_steps("gradients", tags, [[10.0, 1.0], [100.0, 2.0]])]
        [1.0, 2.0]
    """
    values = np.asarray(values, np.float64)
    out: List[Dict[str, float]] = [{} for _ in range(values.shape[0])]
    for view_tags, rows, found in view_groups(kind, tags, values, names):
        for s, row in zip(rows.tolist(), found.tolist()):
            out[s] = dict(zip(view_tags, row))
    return out


def view_groups(kind: str, tags: Sequence[Optional[str]], values: np.ndarray,
                names: Sequence[str] = ()) -> List[Tuple[Tuple[str, ...], np.ndarray, np.ndarray]]:
    """`views_of_steps` as blocks: the steps that have the same view tags
    (most steps of a read share them), each group as `(its view tags, its
    steps' positions in values, their views [steps, tags])`, computed as
    arrays with no object per step.

    Examples:
        >>> from kerasdbg.sinks import layout
        >>> tags = ["gradients/global_norm", "gradients/m/a/kernel/l2_norm"]
        >>> [(len(t), rows.tolist()) for t, rows, _ in layout.view_groups(
        ...     "gradients", tags, [[10.0, 1.0], [0.0, 0.0], [100.0, 2.0]])]
        [(7, [0, 2]), (1, [1])]
    """
    plan = _plan(kind, tuple(tags), tuple(names))
    values = np.asarray(values, np.float64)
    steps = values.shape[0]
    if not steps:
        return []
    # (tag, or (tags, which of them at each step); values; log10 of them; the
    # steps that have one), in the order of a step's views.
    entries: List[tuple] = []
    for index, tag in plan.global_norms:
        entries.append((tag, values[:, index], True, None))
    count = len(plan.groups)
    for stat, (index, group, tensors, members) in plan.statistics.items():
        chosen = values[:, index]
        if stat != "update_ratio":
            # The groups holding a tensor of this statistic (a tap records
            # either its dead or its saturated fraction).
            held = [g for g, columns in enumerate(members) if columns.size]
            largest = _group_max(chosen, members)
            for g in held:
                entries.append((_view(kind, stat, "max", plan.groups[g]),
                                largest[:, g], False, None))
            if kind == _tags.GRADIENTS and stat == "l2_norm":
                for g in held:
                    entries.append((_view(kind, stat, "log10_max", plan.groups[g]),
                                    largest[:, g], True, None))
                entries.extend(_extremes(kind, stat, chosen, tensors))
        else:
            finite = np.isfinite(chosen)
            largest = _group_max(np.where(finite, chosen, np.nan), members)
            for g in range(count):
                entries.append((_view(kind, stat, "log10_max", plan.groups[g]),
                                largest[:, g], True, None))
            counted = finite.sum(axis=1)
            above = (np.where(finite, chosen, -np.inf) > UPDATE_RATIO_ABOVE).sum(axis=1)
            entries.append((_view(kind, stat, _fraction_view()),
                            above / np.maximum(counted, 1), False, counted > 0))
    if not entries:
        return []
    # Per step and entry: the value, and 0 where it has no view, else 1 + which tag.
    columns = np.stack([entry[1] for entry in entries], axis=1).astype(np.float64)
    present = np.stack([np.ones(steps, bool) if entry[3] is None else entry[3]
                        for entry in entries], axis=1)
    logged = np.asarray([entry[2] for entry in entries], bool)
    # Absent at a value <= 0 or NaN, +inf at +inf (an exploded value still shows).
    present &= ~logged | (columns > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        columns = np.where(logged, np.log10(np.where(present, columns, 1.0)), columns)
    which = np.stack([np.zeros(steps, np.int64) if isinstance(entry[0], str) else entry[0][1]
                      for entry in entries], axis=1) + 1
    which *= present
    groups = _same_rows(which)
    known = _SIGNATURES.setdefault((kind, tuple(tags), tuple(names)), {})
    if len(known) > 4096:  # (views that never repeat)
        known.clear()
    out = []
    for signature, rows in groups:
        key = signature.tobytes()
        chosen = known.get(key)
        if chosen is None:
            chosen = known[key] = _chosen(entries, signature.tolist())
        view_tags, kept = chosen
        out.append((view_tags, rows, columns[rows[:, None], kept]))
    return out


def _same_rows(which: np.ndarray) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The rows of `which` (small non-negative ints) that are equal, as
    `(the row, the positions of the rows equal to it)`, in the order each
    first occurs."""
    varying = np.flatnonzero((which != which[0]).any(axis=0))
    if not varying.size:  # (most reads: every step alike)
        return [(which[0], np.arange(which.shape[0]))]
    part = which[:, varying]
    radix = part.max(axis=0) + 1
    if float(np.prod(radix.astype(np.float64))) < 2.0 ** 62:
        # Each row as one number (mixed radix): unique ints, not rows.
        places = np.concatenate([[1], np.cumprod(radix[:-1])]).astype(np.int64)
        keys = part @ places
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(part, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    parts = np.split(order, np.cumsum(np.bincount(inverse))[:-1])
    return [(which[first[g]], parts[g]) for g in np.argsort(first).tolist()]


_SIGNATURES: Dict[tuple, Dict[bytes, tuple]] = {}
"""Per layout of tags: the view tags and entries of each signature of views
(`view_groups`) seen, worked out once."""


def _chosen(entries: List[tuple], signature: List[int]) -> tuple:
    """The view tags of the steps of one signature (per entry, 0 for no
    view, else 1 + which tag), and the entries that give their values."""
    kept = [k for k, w in enumerate(signature) if w]
    view_tags = [entries[k][0] if isinstance(entries[k][0], str)
                 else entries[k][0][0][signature[k] - 1] for k in kept]
    if len(set(view_tags)) < len(view_tags):
        # A tag twice at a step: where it came first, the last value (as a dict).
        last = {tag: k for k, tag in zip(kept, view_tags)}
        view_tags = list(dict.fromkeys(view_tags))
        kept = [last[tag] for tag in view_tags]
    return tuple(view_tags), np.asarray(kept, np.int64)


def _extremes(kind: str, stat: str, chosen: np.ndarray, tensors: Tuple[str, ...]) -> List[tuple]:
    """The entries (as `views_of_steps`'s) of the log10 of the largest and of
    the smallest nonzero of each row of `chosen` (NaN left out), also under
    the name of the tensor holding it: a line per variable that was ever the
    largest (smallest)."""
    if not chosen.shape[1]:
        return []
    known = np.where(np.isnan(chosen), -np.inf, chosen)
    rows = np.arange(chosen.shape[0])
    has = known.max(axis=1) > 0
    i = np.argmax(known, axis=1)
    largest = chosen[rows, i]
    positive = known > 0
    smallest_of = np.where(positive, known, np.inf)
    j = np.argmin(smallest_of, axis=1)
    # Every positive value infinite: the first of them (argmin takes the first inf).
    j = np.where(np.isinf(smallest_of[rows, j]), np.argmax(positive, axis=1), j)
    smallest = chosen[rows, j]
    largest_tags, smallest_tags = _named(kind, stat, tensors)
    return [(_view(kind, stat, "log10_max"), largest, True, has),
            ((largest_tags, i), largest, True, has),
            (_view(kind, stat, "log10_min"), smallest, True, has),
            ((smallest_tags, j), smallest, True, has)]


@functools.lru_cache(maxsize=256)
def _named(kind: str, stat: str, tensors: Tuple[str, ...]) -> Tuple[tuple, tuple]:
    """The tags of `_extremes`'s views named after their tensor."""
    return (tuple(_tags.view(kind, stat, "log10_largest", t) for t in tensors),
            tuple(_tags.view(kind, stat, "log10_smallest", t) for t in tensors))


# ----------------------------------------------------------------- layout
def layout(lines: Iterable[Line]) -> layout_pb2.Layout:
    """The layout drawing `lines`: the charts in `CHARTS` order, each
    category once, the expressions of a chart sorted."""
    patterns = {}
    for line in set(lines):
        patterns.setdefault(line.chart, []).append(line.pattern)
    proto = layout_pb2.Layout()
    categories = {}
    for chart in CHARTS:
        if chart not in patterns:
            continue
        if chart.category not in categories:
            categories[chart.category] = proto.category.add(
                title=chart.category, closed=chart.category in CLOSED)
        categories[chart.category].chart.add(
            title=chart.title,
            multiline=layout_pb2.MultilineChartContent(tag=sorted(patterns[chart])))
    return proto


def summary(proto: layout_pb2.Layout) -> summary_pb2.Summary:
    """The plugin's summary of `proto`: what
    `tensorboard.plugins.custom_scalar.summary.pb` makes, without TF's
    compat.v1 protos."""
    value = summary_pb2.Summary.Value(
        tag=metadata.CONFIG_SUMMARY_TAG,
        tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
            string_val=[proto.SerializeToString()]))
    value.metadata.CopyFrom(metadata.create_summary_metadata())
    return summary_pb2.Summary(value=[value])


class _Run:
    """The lines written so far to one writer, and whether writing failed."""

    def __init__(self):
        self.lines = frozenset()
        self.failed = False


# A new writer of a directory (removed, then written again) starts anew.
_RUNS: "weakref.WeakKeyDictionary[_events.EventWriter, _Run]" = weakref.WeakKeyDictionary()


def add(owner: str, writer: Optional[_events.EventWriter], lines: Iterable[Line],
        strict: bool = False) -> None:
    """Adds `owner`'s lines to the layout of `writer`'s run and, when that
    adds any, writes the merged layout. A failure warns once per run and
    training goes on (`strict` raises); the layout is tried again at the
    next addition.

    Args:
        owner: the callback adding them, for the warning.
        writer: the run's shared writer; None (no log directory) adds nothing.
        lines: the lines of `owner`'s tags.
        strict: raise instead of warning. Defaults to `False`.
    """
    if writer is None:
        return
    lines = list(lines)
    if any(line.chart == LOG_LOSS for line in lines):
        writer.derive(loss_views)  # the loss's writer (`StopOnRule`) writes its log10 too
    run = _RUNS.setdefault(writer, _Run())
    merged = run.lines | frozenset(lines)
    if merged == run.lines:
        return
    try:
        writer.write_summary(0, summary(layout(merged)))
    except _events.RecordingError:
        raise
    except Exception as error:  # noqa: BLE001 - a layout must not stop fit
        if strict:
            raise _events.RecordingError(
                [owner], "the TensorBoard custom-scalars layout to", writer.log_dir,
                error) from error
        if not run.failed:
            run.failed = True
            # Worded as the callbacks' other failures to record (`_guarded`).
            warnings.warn(
                f"{owner} could not record: it could not write the TensorBoard custom-scalars "
                f"layout to {writer.log_dir!r}; the Scalars tab still shows every tag, and "
                f"training goes on. Cause: {type(error).__name__}: {error}",
                RuntimeWarning, stacklevel=3)
        return
    run.lines = merged
