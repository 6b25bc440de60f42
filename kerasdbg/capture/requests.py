"""What the callbacks ask the capture engine for: requests and schedules.

A `Request` says which quantities of which variables one consumer (a
callback) wants recorded, at which steps (a `kerasdbg.schedule.Schedule`),
and where the records go; `Freeze` says which in-graph faults stop the
weights from changing. The schedule predicates (`_every`, `_scheduled`,
`_or`, `_and`) evaluate a schedule in the graph (with the backend's array
functions, `kerasdbg.quantities.ops`), folding what is constant into a
Python bool so that no condition is built for it.
"""

from __future__ import annotations

import re
from typing import (
    Callable, Dict, FrozenSet, Hashable, List, NamedTuple, Optional, Sequence, Tuple,
)

import numpy as np

from kerasdbg.records.capture_record import CaptureRecord, records_of
from kerasdbg import stats as stats_lib
from kerasdbg.quantities import ops as B
from kerasdbg.quantities.spikes import MIN_RELATIVE_STD, SPIKE_QUANTITIES, Spike  # noqa: F401
from kerasdbg.schedule import Schedule


Record = CaptureRecord
"""What one step recorded for one request (see `kerasdbg.records.CaptureRecord`)."""


WEIGHT_EXTRA_STATISTICS = stats_lib.UPDATE_STATISTICS
"""What a "weights" request records besides `stats.ALL_STATISTICS`: the update ratio and the
distance from the fit's start."""
RECORDABLE = ("loss", "learning_rate", "gradients", "weights", "layer_outputs")
"""What `StepRecorder` can record of a step."""
MAX_CLASSES = 1000
"""Classes a "classes" request can count (its buffer is sized before the trace)."""
MAX_STEP_SCALARS = 32
"""Scalars of what `train_step` returns that a "step" request records."""
CLASS_COLUMNS = ("seen", "mispredicted")
"""The columns of a "classes" request, per class: labels seen and mispredicted."""
STEP_COLUMNS = ("loss", "frozen", "fault")
"""Columns of a "step" request: the step's loss (from `compute_loss`, summed
over replicas, as the applied gradient sees it; else the `loss` the train
step returns; absent when neither exists), whether the weights were frozen
at that step, and whether the step had an in-graph fault (absent when no
fault is watched). Then `step/<name>` for every other scalar the train step
returns, averaged over replicas as Keras does."""
_STEP_FIXED = 7  # train id, step, loss, loss captured, frozen, fault, faulty apply
class Freeze(NamedTuple):
    """In-graph faults after which the weights stop changing, or which skip
    their step.

    Attributes:
        nonfinite_loss: a NaN or infinite loss.
        nonfinite_gradients: a NaN or infinite gradient (ignored under a
            `LossScaleOptimizer`, whose scaler already skips those steps).
        max_gradient_norm: a global gradient norm above this, or None.
        spikes: the spike tests (`Spike`), each a fault.
        skip: the faults that skip their step instead of freezing the
            weights: any of "nonfinite", "max_gradient_norm", "loss_spike",
            "gradient_norm_spike".
        max_skips: at most this many skipped steps among the last
            `skip_window` steps of an optimizer; a fault beyond them freezes.
        skip_window: see `max_skips`.
        rollback: whether the host may ask to skip the next batches after a
            rollback (`StopOnRule(action="rollback")`), whatever their faults.
    """

    nonfinite_loss: bool = True
    nonfinite_gradients: bool = True
    max_gradient_norm: Optional[float] = None
    spikes: Tuple[Spike, ...] = ()
    skip: FrozenSet[str] = frozenset()
    max_skips: int = 10
    skip_window: int = 128
    rollback: bool = False


def _watched(spec: Freeze) -> set:
    """The fault kinds a request's `Freeze` watches."""
    kinds = {f"{spike.quantity}_spike" for spike in spec.spikes}
    if spec.nonfinite_loss or spec.nonfinite_gradients:
        kinds.add("nonfinite")
    if spec.max_gradient_norm is not None:
        kinds.add("max_gradient_norm")
    return kinds


def _skipped_kinds(specs) -> frozenset:
    """The fault kinds that skip their step when several requests arm
    faults: those a request skips and every request that watches them skips
    too (a `StopOnRule` that stops on NaN/Inf beside one that skips spikes
    keeps its freeze on NaN/Inf)."""
    skipped = frozenset().union(*(s.skip for s in specs))
    return frozenset(kind for kind in skipped
                     if all(kind in s.skip for s in specs if kind in _watched(s)))


def merged_freeze(requests: Sequence["Request"]) -> Optional[Freeze]:
    """The faults that several requests arm, as one `Freeze` that each
    backend's guard takes: any fault a request watches (the lowest gradient
    norm limit, every spike test), skipped where every request watching it
    skips it, else frozen; None when none arms one.

    Examples:
        >>> from kerasdbg.capture.requests import Freeze, Request, merged_freeze
        >>> a = Request("step", freeze=Freeze(max_gradient_norm=10.0, skip={"max_gradient_norm"}))
        >>> b = Request("step", freeze=Freeze(max_gradient_norm=5.0))
        >>> merged = merged_freeze([a, b])
        >>> merged.max_gradient_norm, sorted(merged.skip)
        (5.0, [])
        >>> sorted(merged_freeze([a]).skip), merged_freeze([Request("step")])
        (['max_gradient_norm'], None)
    """
    specs = [r.freeze for r in requests if r.freeze is not None]
    if not specs:
        return None
    if len(specs) == 1:
        return specs[0]
    norms = [s.max_gradient_norm for s in specs if s.max_gradient_norm is not None]
    skipping = [s for s in specs if s.skip]
    return Freeze(
        nonfinite_loss=any(s.nonfinite_loss for s in specs),
        nonfinite_gradients=any(s.nonfinite_gradients for s in specs),
        max_gradient_norm=min(norms) if norms else None,
        spikes=tuple(dict.fromkeys(spike for s in specs for spike in s.spikes)),
        skip=_skipped_kinds(specs),
        max_skips=min([s.max_skips for s in skipping] or [specs[0].max_skips]),
        skip_window=max([s.skip_window for s in skipping] or [specs[0].skip_window]),
        rollback=any(s.rollback for s in specs),
    )


class Request:
    """What one consumer (a callback) wants recorded at each step.

    Args:
        kind: "gradients", "weights", "tensors" (full tensors at a few
            steps: `_step_tensors.TensorRequest`), "step" (the loss and
            returned scalars of each train step and whether it was frozen),
            "classes" (labels seen and mispredicted per class, summed over
            the fit) or "wrap" (a function around each train step, for
            `StepTimer`: `wrapper(step_function, data, row)`).
        stats: statistic names (`stats.ALL_STATISTICS`, plus for weights
            `WEIGHT_EXTRA_STATISTICS`).
        every_n_steps: record scalars at steps divisible by this (when no
            `schedule` is given).
        histogram_every_n_steps: record histograms at steps divisible by
            this, or None for no histograms.
        consumer: called as `consumer(records)` with a list of `Record`.
        include: a regular expression: only the variables whose path it
            matches (None: all).
        exclude: a regular expression: not the variables whose path it
            matches (None: none).
        bins: histogram bins.
        strict: a failure of the instrumentation raises instead of warning.
        freeze: for a "step" request, the faults that freeze the weights.
        localize: for a "step" request, find at the first non-finite loss or
            gradient the first layer whose output was non-finite and the
            variables whose gradient was (see `Faults.nan_source`).
        last_step: record scalars only up to this step (for what a rule
            reads at the start of training only), or None (when no
            `schedule` is given).
        schedule: the steps at which `stats` are recorded (a
            `kerasdbg.schedule.Schedule`); overrides `every_n_steps` and
            `last_step`.
        frequent: those of `stats` recorded at every step (up to the
            schedule's `last_step`) besides the scheduled ones.
        owner: the callback, for messages.
        wrapper: for a "wrap" request.
        for_rules: what it records is what rules read (messages say so).
        deferred: its consumer may get the records of a step at the next
            read (`kerasdbg.capture.reads`: once per interval, at the latest
            at the epoch's end), not after the execution that ran it.
        blocks: its consumer takes `CaptureBlock`s among the records (the
            steps of one optimizer with the same tags and no histogram, as
            arrays); otherwise each is handed as one record per step.
    """

    def __init__(
        self,
        kind: str,
        stats: Sequence[str] = (),
        every_n_steps: int = 1,
        histogram_every_n_steps: Optional[int] = None,
        consumer: Callable[[List[Record]], None] = lambda records: None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        bins: int = stats_lib.DEFAULT_HISTOGRAM_BINS,
        strict: bool = False,
        freeze: Optional[Freeze] = None,
        localize: bool = False,
        logits: bool = False,
        last_step: Optional[int] = None,
        owner: str = "kerasdbg",
        wrapper: Optional[Callable] = None,
        for_rules: bool = False,
        schedule: Optional[Schedule] = None,
        frequent: Sequence[str] = (),
        deferred: bool = False,
        blocks: bool = False,
    ):
        self.kind = kind
        self.deferred = deferred
        self.blocks = blocks
        self.stats = tuple(stats)
        self.schedule = schedule or Schedule(every_n_steps=every_n_steps, last_step=last_step)
        every_n_steps, last_step = self.schedule.every_n_steps, self.schedule.last_step
        self.every_n_steps = every_n_steps
        self.histogram_every_n_steps = histogram_every_n_steps
        self.consumer = consumer
        self.include = include
        self.exclude = exclude
        self.bins = bins
        self.strict = strict
        self.freeze = freeze
        self.logits = logits
        self.localize = localize
        self.last_step = last_step
        self.owner = owner
        self.wrapper = wrapper
        self.for_rules = for_rules
        self.frequent = () if self.schedule.every_step else tuple(
            s for s in self.stats if s in frequent)
        # The columns of the statistics table: `tensor_statistics`'s, then the
        # weights' derived ones (update ratio, distance from start).
        self.base_stats = tuple(s for s in self.stats
                                if s in stats_lib.ALL_STATISTICS + WEIGHT_EXTRA_STATISTICS)
        self.base_frequent = tuple(s for s in self.base_stats if s in self.frequent)
        if kind == "gradients":
            # The global norm is derived from the per-variable norms.
            if "l2_norm" not in self.base_stats:
                self.base_stats += ("l2_norm",)
            if self.frequent and "l2_norm" not in self.base_frequent:
                self.base_frequent += ("l2_norm",)
        self.totals: Optional[object] = None
        self.present = [False] * MAX_CLASSES
        # For a "classes" request: whether the traced train step gave labels and
        # class predictions (None until it was traced).
        self.labelled: Optional[bool] = None
        # Variables of the consumer's own that the traced step writes (a
        # `StepTimer`'s timestamps), by name: a later fit that reuses the
        # traced function hands them to its equivalent request (`adopt`).
        self.buffers: Dict[str, object] = {}

    def graph_key(self) -> Optional[Hashable]:
        """What the traced train step depends on in this request: two
        requests with equal keys build the same graph, so a later `fit` can
        run the function traced for the other (`adopt`). None: never reused."""
        return (type(self).__qualname__, self.kind, self.stats, self.schedule,
                self.histogram_every_n_steps, self.include, self.exclude, self.bins,
                self.freeze, self.localize, self.frequent, self.deferred, self.owner,
                self.wrapper is None)

    def trace_state(self) -> dict:
        """What the traced train step writes to and what its trace found, for
        an equivalent request of a later fit that runs the same function
        (`adopt`)."""
        return {"totals": self.totals, "labelled": self.labelled,
                "present": list(self.present), "buffers": dict(self.buffers)}

    def adopt(self, state: dict) -> None:
        """Takes over the `trace_state` of an equivalent request (`graph_key`)
        of an earlier fit, whose traced function this fit runs."""
        self.totals = state["totals"]
        self.labelled = state["labelled"]
        self.present = list(state["present"])
        self.buffers = dict(state["buffers"])

    @property
    def per_variable(self) -> bool:
        return self.kind in ("gradients", "weights", "tensors")

    def selects(self, path: str) -> bool:
        return (self.include is None or re.search(self.include, path) is not None) and (
            self.exclude is None or re.search(self.exclude, path) is None)

    def records_at(self, step) -> object:
        """In the graph: whether `stats` are recorded at `step` (the schedule)."""
        return _scheduled(self.schedule, step)

    def frequent_at(self, step) -> object:
        """In the graph: whether the `frequent` statistics are recorded at `step`."""
        if not self.frequent:
            return False
        if self.schedule.last_step is None:
            return True
        return B.less_equal(step, B.cast(self.schedule.last_step, step.dtype))

    def writes_at(self, step) -> object:
        """In the graph: whether the request writes values at `step`."""
        return _or(self.records_at(step), self.frequent_at(step))

    def needs_at(self, statistic: str, step) -> object:
        """In the graph: whether `statistic` is recorded at `step`."""
        if statistic in self.frequent:
            return self.frequent_at(step)
        return self.records_at(step) if statistic in self.stats else False

    def columns_at(self, step: int) -> Optional[Tuple[str, ...]]:
        """On the host: the statistics recorded at `step`, or None."""
        if self.schedule.at(step):
            return self.stats
        if self.frequent and (self.schedule.last_step is None
                              or step <= self.schedule.last_step):
            return self.frequent
        return None

    def column_sets(self, steps) -> "np.ndarray":
        """`columns_at` of each of `steps` (an array), as a code: 0 None,
        1 `stats`, 2 `frequent`."""
        steps = np.asarray(steps, np.int64)
        schedule = self.schedule
        within = np.ones(steps.shape, bool) if schedule.last_step is None else \
            steps <= schedule.last_step
        scheduled = within & ((steps <= schedule.first_steps)
                              | (steps % schedule.every_n_steps == 0))
        frequent = within if self.frequent else np.zeros(steps.shape, bool)
        return np.where(scheduled, 1, np.where(frequent, 2, 0)).astype(np.int8)

    def columns_of(self, code: int) -> Optional[Tuple[str, ...]]:
        """The statistics of a `column_sets` code."""
        return (None, self.stats, self.frequent)[int(code)]

    def deliver(self, items: list) -> None:
        """Hands `items` (records and `CaptureBlock`s, in step order) to the
        consumer: the blocks as they are where it takes blocks, else as a
        record per step."""
        if not items:
            return
        self.consumer(items if self.blocks else records_of(items))

    def histograms_at(self, step) -> object:
        if not self.histogram_every_n_steps:
            return False
        return _every(step, self.histogram_every_n_steps)

    def written_at(self, steps: Sequence[int]) -> Tuple[bool, bool]:
        """On the host: whether any of these steps wrote values, histograms
        (as `records_at` and `histograms_at` decided in the graph), so that
        `collect` reads only the buffers that hold something new."""
        values = any(self.columns_at(step) is not None for step in steps)
        histograms = bool(self.histogram_every_n_steps) and any(
            step % self.histogram_every_n_steps == 0 for step in steps
        )
        return values, histograms

    # Hooks of the "tensors" request (`_step_tensors.TensorRequest`).
    def bind(self, channel, variables, paths) -> None:
        """Called when the request is given its variables in a channel."""


def _every(step, n: int):
    if n == 1:
        return True
    return B.equal(B.floormod(step, n), 0)


def _scheduled(schedule: Schedule, step):
    """In the graph: `schedule.at(step)` (a Python bool when it is constant)."""
    every = _every(step, schedule.every_n_steps)
    if schedule.first_steps and every is not True:
        every = B.logical_or(every, B.less_equal(
            step, B.cast(schedule.first_steps, step.dtype)))
    if schedule.last_step is None:
        return every
    return _and(every, B.less_equal(step, B.cast(schedule.last_step, step.dtype)))


def sometimes_recorded(requests: Sequence["Request"]) -> List["Request"]:
    """The gradient and weight requests that take some statistics or their
    histograms at some steps only: what a second, full variant of the step
    records (the every-step variant leaves it out)."""
    return [r for r in requests if r.kind in ("gradients", "weights") and (
        set(r.stats) - set(r.frequent) and not r.schedule.every_step
        or r.histogram_every_n_steps)]


def scheduled_between(requests: Sequence["Request"], low: int, high: int) -> bool:
    """On the host: whether one of `requests` takes its scheduled statistics
    or its histograms at a step in `[low, high]`."""
    for request in requests:
        schedule = request.schedule
        if not schedule.every_step:
            top = high if schedule.last_step is None else min(high, schedule.last_step)
            if low <= top and (low <= schedule.first_steps or
                               top // schedule.every_n_steps * schedule.every_n_steps >= low):
                return True
        every = request.histogram_every_n_steps
        if every and high // every * every >= low:
            return True
    return False


def scheduled_in(requests: Sequence["Request"], low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """`scheduled_between` of each pair `(low[i], high[i])`, as an array of
    bools (the host's choice for many calls at once)."""
    low = np.asarray(low, np.int64)
    high = np.asarray(high, np.int64)
    out = np.zeros(np.broadcast(low, high).shape, bool)
    for request in requests:
        schedule = request.schedule
        if not schedule.every_step:
            top = high if schedule.last_step is None else np.minimum(high, schedule.last_step)
            every = schedule.every_n_steps
            out |= (low <= top) & ((low <= schedule.first_steps) | (top // every * every >= low))
        every = request.histogram_every_n_steps
        if every:
            out |= high // every * every >= low
    return out


def _or(a, b):
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return B.logical_or(a, b)


def _and(a, b):
    if a is True:
        return b
    if b is True:
        return a
    if a is False or b is False:
        return False
    return B.logical_and(a, b)


def unique_paths(variables) -> List[str]:
    """Variable paths, made unique with a `_<n>` suffix where they repeat."""
    seen: Dict[str, int] = {}
    paths = []
    for v in variables:
        path = getattr(v, "path", None) or v.name
        count = seen.get(path, 0)
        seen[path] = count + 1
        paths.append(path if count == 0 else f"{path}_{count}")
    return paths
