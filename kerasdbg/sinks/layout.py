"""TensorBoard's custom-scalars layout of a run: a few charts of many lines.

TensorBoard's Scalars tab draws one chart per tag: thousands of them for a
ResNet50-sized model. The callbacks that write to `<log_dir>/train` each say
which lines their tags draw (`Line`: a chart and a regular expression of
tags); the custom-scalars plugin ("Custom Scalars" tab) draws every tag a
line's expression matches in that line's chart.

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

import warnings
import weakref
from typing import Iterable, List, NamedTuple, Optional, Sequence

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


LOSS = Chart("loss and gradient norm", "loss and global norm(s)")
GRADIENT_NORMS = Chart("gradients", "gradient l2 norm of every variable")
UPDATE_RATIOS = Chart("weights", "weight update ratios")
WEIGHT_NORMS = Chart("weights", "weight norms")
HEALTH = Chart("activations", "dead / saturated fractions")
SECONDS = Chart("timing", "seconds per execution and per step: input, compute")
INPUT_FRACTION = Chart("timing", "input fraction")
THROUGHPUT = Chart("timing", "examples per second")
CHARTS = (LOSS, GRADIENT_NORMS, UPDATE_RATIOS, WEIGHT_NORMS, HEALTH, SECONDS,
          INPUT_FRACTION, THROUGHPUT)
"""Every chart, in the order the dashboard shows them."""

TIMED_SECONDS = ("execution_seconds", "step_seconds", "input_seconds", "compute_seconds")
"""`StepTimer`'s `time/` tags in seconds (under XLA only the first two)."""


class Line(NamedTuple):
    """The tags matching `pattern` (`re.match`), drawn in `chart`."""

    chart: Chart
    pattern: str


# ------------------------------------------------------ what each callback draws
def statistics_lines(kind: str, stats: Sequence[str]) -> List[Line]:
    """The lines of `GradientStatistics` (`kind="gradients"`) or
    `WeightStatistics` (`"weights"`) recording `stats`."""
    lines = []
    if kind == "gradients":
        # Recorded whatever `stats` are; several optimizers: one norm each.
        lines.append(Line(LOSS, _tags.per_optimizer_pattern(kind, "global_norm")))
        if "l2_norm" in stats:
            lines.append(Line(GRADIENT_NORMS, _tags.statistic_pattern(kind, "l2_norm")))
    elif kind == "weights":
        if "update_ratio" in stats:
            lines.append(Line(UPDATE_RATIOS, _tags.statistic_pattern(kind, "update_ratio")))
        if "l2_norm" in stats:
            lines.append(Line(WEIGHT_NORMS, _tags.statistic_pattern(kind, "l2_norm")))
    return lines


def activation_lines(health: Iterable[str]) -> List[Line]:
    """The lines of `ActivationStatistics` whose taps record these health
    fractions (`TapLayer.health`)."""
    health = set(health)
    return [Line(HEALTH, _tags.statistic_pattern(_tags.ACTIVATIONS, name))
            for name in stats_lib.HEALTH_STATISTICS if name in health]


def timing_lines(timed: bool) -> List[Line]:
    """The lines of `StepTimer`; `timed`: whether it splits input and compute
    (not under XLA)."""
    if not timed:
        return [Line(SECONDS, _tags.scalar_pattern(_tags.TIME, TIMED_SECONDS[:2]))]
    return [Line(SECONDS, _tags.scalar_pattern(_tags.TIME, TIMED_SECONDS)),
            Line(INPUT_FRACTION, _tags.scalar_pattern(_tags.TIME, ["input_fraction"])),
            Line(THROUGHPUT, _tags.scalar_pattern(_tags.TIME, ["examples_per_second"]))]


def loss_lines() -> List[Line]:
    """The line of `StopOnRule`: the loss of each step."""
    return [Line(LOSS, _tags.scalar_pattern(_tags.STEP, ["loss"]))]


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
            categories[chart.category] = proto.category.add(title=chart.category)
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
