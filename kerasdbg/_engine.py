"""The capture engine: gets per-step data out of the compiled train function.

One engine per model, shared by every kerasdbg callback on it. During a `fit`
it wraps the model's `train_step` (an instance attribute, for the duration
of the `fit`). While that step is traced, every optimizer's `apply` is
routed through the engine (`_keras_internals.optimizer_routes`), so each
optimizer step of the train step, of any optimizer wherever the model keeps
it, computes the requested statistics in-graph and stores them in ring
buffers with one row per train step of an execution. After each execution
the host reads the buffers once and hands the new rows to the callbacks.

Life cycle, driven by the callbacks:

- `attach(request)` in `on_train_begin`: the first one wraps `train_step`
  (and `compute_loss`) and forces a retrace; later ones only add their
  request, since nothing is traced before the first batch.
- `prepare()` in `on_train_batch_begin`: creates the buffers it can before
  the trace (for the optimizers that are built: creating variables inside
  the first trace makes `tf.function` trace twice).
- in the trace: a *channel* per optimizer and per apply of it in the train
  step (WGAN-GP's discriminator: three), created when first seen unless
  `prepare` predicted it, with a *slot* per request: the variables it
  selects among those the optimizer applies, and its buffers.
- `collect()` in `on_train_batch_end` (and at the end): reads new rows.
- `detach(request)` in `on_train_end`: the last one restores the model and
  forces a retrace, so a later `fit` without the callbacks runs the plain
  train step again. A `fit` that ends by an exception has no
  `on_train_end`; the engine then restores the model from the `fit`
  wrapper (`_keras_internals.wrap_fit`) as that `fit` unwinds.

Buffers are `ON_READ` / `ONLY_FIRST_REPLICA` variables: under a
`tf.distribute` strategy each replica writes its own copy without any
communication, and the host reads replica 0 (or all, for values a replica
holds alone). Rows are addressed by a train-step id (`row = (id - 1) %
steps_per_execution`), so consecutive train steps of one execution never
share a row and the host needs no reset between executions.
"""

from __future__ import annotations

import re
import threading
import warnings
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from kerasdbg import _buffers
from kerasdbg import _events
from kerasdbg import _replay
from kerasdbg import _tags
from kerasdbg import _keras_internals as internals
from kerasdbg import stats as stats_lib
from kerasdbg.schedule import Schedule


Record = _tags.CaptureRecord
"""What one step recorded for one request (see `_tags.CaptureRecord`)."""


WEIGHT_EXTRA_STATISTICS = ("update_ratio", "distance_from_start")
MAX_FLAGGED = 4096
"""Variables of one optimizer whose non-finite gradient NaN localisation can name."""
MAX_CLASSES = 1000
"""Classes a "classes" request can count (its buffer is sized before the trace)."""
MAX_STEP_SCALARS = 32
"""Scalars of what `train_step` returns that a "step" request records."""
CLASS_COLUMNS = ("seen", "mispredicted")
STEP_COLUMNS = ("loss", "frozen", "fault")
"""Columns of a "step" request: the step's loss (from `compute_loss`, summed
over replicas, as the applied gradient sees it; else the `loss` the train
step returns; absent when neither exists), whether the weights were frozen
at that step, and whether the step had an in-graph fault (absent when no
fault is watched). Then `step/<name>` for every other scalar the train step
returns, averaged over replicas as Keras does."""
_STEP_FIXED = 7  # train id, step, loss, loss captured, frozen, fault, faulty apply


class Freeze(NamedTuple):
    """In-graph faults after which the weights stop changing.

    Attributes:
        nonfinite_loss: a NaN or infinite loss.
        nonfinite_gradients: a NaN or infinite gradient (ignored under a
            `LossScaleOptimizer`, whose scaler already skips those steps).
        max_gradient_norm: a global gradient norm above this, or None.
    """

    nonfinite_loss: bool = True
    nonfinite_gradients: bool = True
    max_gradient_norm: Optional[float] = None


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
        include, exclude: regular expressions on variable paths.
        bins: histogram bins.
        strict: a failure of the instrumentation raises instead of warning.
        freeze: for a "step" request, the faults that freeze the weights.
        localize: for a "step" request, find at the first non-finite loss or
            gradient the first layer whose output was non-finite and the
            variables whose gradient was (see `Engine.nan_source`).
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
        last_step: Optional[int] = None,
        owner: str = "kerasdbg",
        wrapper: Optional[Callable] = None,
        for_rules: bool = False,
        schedule: Optional[Schedule] = None,
        frequent: Sequence[str] = (),
    ):
        self.kind = kind
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
        self.totals: Optional[tf.Variable] = None
        self.present = [False] * MAX_CLASSES
        # For a "classes" request: whether the traced train step gave labels and
        # class predictions (None until it was traced).
        self.labelled: Optional[bool] = None

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
        return tf.less_equal(step, tf.cast(self.schedule.last_step, step.dtype))

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
    def bind(self, channel: "Channel", variables, paths) -> None:
        """Called when the request is given its variables in a channel."""


def _every(step, n: int):
    if n == 1:
        return True
    return tf.equal(tf.math.floormod(step, n), 0)


def _scheduled(schedule: Schedule, step):
    """In the graph: `schedule.at(step)` (a Python bool when it is constant)."""
    every = _every(step, schedule.every_n_steps)
    if schedule.first_steps and every is not True:
        every = tf.logical_or(every, tf.less_equal(
            step, tf.cast(schedule.first_steps, step.dtype)))
    if schedule.last_step is None:
        return every
    return _and(every, tf.less_equal(step, tf.cast(schedule.last_step, step.dtype)))


def _or(a, b):
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return tf.logical_or(a, b)


def _and(a, b):
    if a is True:
        return b
    if b is True:
        return a
    if a is False or b is False:
        return False
    return tf.logical_and(a, b)


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


def _zeros_like(variable) -> tf.Tensor:
    return tf.zeros(variable.shape, internals.read_handle(variable).dtype.base_dtype)


def _dense(gradient) -> tf.Tensor:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def _all_finite(tensors) -> tf.Tensor:
    """Whether every element of `tensors` is finite, in one read of each.

    The sum of a tensor is finite when its elements are (one reduction, no
    tensor-sized temporary); only when a sum is not (a NaN/Inf, or a sum of
    finite values that overflowed) is each element tested, in a `tf.cond`
    taken then.
    """
    if not tensors:
        return tf.constant(True)
    dense = [_dense(t) for t in tensors]
    sums = tf.stack([tf.cast(tf.reduce_sum(t), tf.float32) for t in dense])
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(sums)), lambda: tf.constant(True),
        lambda: tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in dense])))


def _several_replicas():
    """The replica context when there are several replicas, else None."""
    replicas = tf.distribute.get_replica_context()
    if replicas is not None and replicas.num_replicas_in_sync > 1:
        return replicas
    return None


class Hook:
    """One optimizer the train step applies."""

    def __init__(self, name: str, optimizer, index: int):
        self.name = name
        self.optimizer = optimizer
        self.inner = internals.inner_optimizer(optimizer)
        self.index = index
        self.channels: List["Channel"] = []
        self.clipping = internals.clipping(optimizer)
        self.accumulation = internals.accumulation_steps(optimizer)
        self.scaled = self.inner is not optimizer
        # One copy of each variable before each update (update ratios) and one
        # at the start of the fit (distances), by variable key, shared by the
        # channels and requests of this optimizer.
        self.previous: Dict[int, tf.Variable] = {}
        self.initial: Dict[int, tf.Variable] = {}
        self.started: Optional[tf.Variable] = None

    @property
    def separate(self) -> bool:
        """Whether the applied gradient differs from the model's by construction."""
        return self.clipping is not None or self.accumulation is not None

    def updates_at(self, step):
        """Whether the optimizer's step `step` updates the weights."""
        if not self.accumulation:
            return True
        return tf.equal(tf.math.floormod(step, self.accumulation), 0)


class Slot:
    """One request's part of one channel: its variables and its buffers."""

    def __init__(self, request: Request, channel: "Channel", positions: List[int]):
        self.request = request
        self.channel = channel
        self.positions = positions  # indices into the channel's variables
        self.variables = [channel.variables[i] for i in positions]
        self.paths = [channel.paths[i] for i in positions]
        self.present = [True] * len(positions)
        self._tags: Dict[tuple, Tuple[Optional[str], ...]] = {}  # built once per kind of row
        self.values = None  # [row, (train id, values...)]
        self.applied_values = None
        self.hist_counts = self.hist_ranges = self.hist_ids = None

    def build(self, steps_per_execution: int) -> None:
        request, n = self.request, steps_per_execution
        kind = request.kind
        width = len(self.positions) * len(request.stats)
        if kind == "gradients":
            width += 2  # global norm, clipped
        nan = tf.constant(np.nan, tf.float64)
        # Column 0: the train-step id that wrote the row (exact in float64),
        # so that one write per step says both what and when.
        self.values = _buffers.on_read_variable(tf.fill([n, 1 + width], nan), f"kerasdbg_{kind}")
        if kind == "gradients" and self.channel.hook.separate:
            self.applied_values = _buffers.on_read_variable(
                tf.fill([n, width], nan), "kerasdbg_applied_gradients")
        if request.histogram_every_n_steps:
            v = len(self.positions)
            self.hist_counts = _buffers.on_read_variable(
                tf.zeros([n, v, request.bins], tf.float64), f"kerasdbg_{kind}_hist")
            self.hist_ranges = _buffers.on_read_variable(
                tf.zeros([n, v, 2], tf.float64), f"kerasdbg_{kind}_hist_ranges")
            self.hist_ids = _buffers.on_read_variable(tf.zeros([n], tf.int64),
                                                      f"kerasdbg_{kind}_hist_ids")

    def tags(self, several: bool, columns: Optional[Sequence[str]] = None
             ) -> Tuple[Optional[str], ...]:
        """The tag of each value column; None for variables without a
        gradient and for statistics not in `columns` (None: all)."""
        key = ("values", several, columns, tuple(self.present))
        if key not in self._tags:
            self._tags[key] = self._make_tags(several, columns)
        return self._tags[key]

    def _make_tags(self, several: bool, columns) -> Tuple[Optional[str], ...]:
        request, kind = self.request, self.request.kind
        optimizer = self.channel.hook.name if several else None
        wanted = [columns is None or s in columns for s in request.stats]
        tags = []
        for path, present in zip(self.paths, self.present):
            tags += [_tags.statistic(kind, path, s) if present and w else None
                     for s, w in zip(request.stats, wanted)]
        if kind == "gradients":
            tags.append(_tags.per_optimizer(kind, "global_norm", optimizer))
            tags.append(_tags.per_optimizer(kind, "clipped", optimizer)
                        if self.channel.hook.clipping else None)
        return tuple(tags)

    def applied_tags(self, several: bool, columns: Optional[Sequence[str]] = None
                     ) -> Tuple[Optional[str], ...]:
        key = ("applied", several, columns, tuple(self.present))
        if key not in self._tags:
            self._tags[key] = self._make_applied_tags(several, columns)
        return self._tags[key]

    def _make_applied_tags(self, several: bool, columns) -> Tuple[Optional[str], ...]:
        optimizer = self.channel.hook.name if several else None
        kind = _tags.APPLIED_GRADIENTS
        wanted = [columns is None or s in columns for s in self.request.stats]
        tags = []
        for path, present in zip(self.paths, self.present):
            tags += [_tags.statistic(kind, path, s) if present and w else None
                     for s, w in zip(self.request.stats, wanted)]
        tags.append(_tags.per_optimizer(kind, "global_norm", optimizer))
        return tuple(tags)

    def histogram_tags(self, kind: Optional[str] = None) -> Tuple[Optional[str], ...]:
        kind = kind or self.request.kind
        return tuple(f"{kind}/{p}" if present else None
                     for p, present in zip(self.paths, self.present))


class Channel:
    """One apply of one optimizer in the train step (the `index`-th)."""

    def __init__(self, hook: Hook, index: int, variables, paths: List[str]):
        self.hook = hook
        self.index = index
        self.variables = list(variables)
        self.paths = paths
        self.keys = [internals.variable_key(hook.optimizer, v) for v in self.variables]
        self.meta: Optional[tf.Variable] = None
        self.slots: Dict[int, Slot] = {}
        self.considered: set = set()  # the requests `build` has given their slots
        self.number = -1  # its index in `Engine.channels`

    @property
    def previous(self) -> List[tf.Variable]:
        """The hook's copies of this channel's variables before the update."""
        copies = self.hook.previous
        return [copies[k] for k in self.keys] if all(k in copies for k in self.keys) else []

    @property
    def initial(self) -> List[tf.Variable]:
        """The hook's copies of this channel's variables at the fit's start."""
        copies = self.hook.initial
        return [copies[k] for k in self.keys] if all(k in copies for k in self.keys) else []

    def build(self, requests, steps_per_execution: int) -> None:
        if self.meta is None:
            # [row, (train id, step, skipped, updated)]
            self.meta = _buffers.on_read_variable(
                tf.zeros([steps_per_execution, 4], tf.int64), "kerasdbg_meta")
        for request in requests:
            if id(request) in self.considered or not request.per_variable:
                continue
            self.considered.add(id(request))
            positions = [i for i, (v, p) in enumerate(zip(self.variables, self.paths))
                         if internals.is_float(v) and request.selects(p)]
            if request.kind == "tensors":
                if request.channel is not None:
                    continue
                request.bind(self, [self.variables[i] for i in positions],
                             [self.paths[i] for i in positions])
                request.channel = self
                request.positions = positions
                continue
            if not positions:
                continue
            slot = Slot(request, self, positions)
            slot.build(steps_per_execution)
            self.slots[id(request)] = slot
            # Zeros, filled in the graph: a variable created in this trace has
            # no value to read yet.
            hook = self.hook
            if request.kind == "weights" and "update_ratio" in request.stats:
                for key, v in zip(self.keys, self.variables):
                    if key not in hook.previous:
                        hook.previous[key] = _buffers.on_read_variable(
                            _zeros_like(v), "kerasdbg_previous")
            if request.kind == "weights" and "distance_from_start" in request.stats:
                for key, v in zip(self.keys, self.variables):
                    if key not in hook.initial:
                        hook.initial[key] = _buffers.on_read_variable(
                            _zeros_like(v), "kerasdbg_initial")
                if hook.started is None:
                    # Whether `initial` holds the weights at the start of the fit.
                    hook.started = _buffers.on_read_variable(tf.zeros([], tf.int64),
                                                             "kerasdbg_started")

    def slots_of(self, kind: str) -> List[Slot]:
        return [s for s in self.slots.values() if s.request.kind == kind]


class _StepState:
    """What the engine keeps about the train step being traced (per replica)."""

    def __init__(self, engine: "Engine", train_id, x):
        self.engine = engine
        self.train_id = train_id
        self.x = x
        self.applies: Dict[int, int] = {}
        self.in_apply = False
        self.loss = None  # compute_loss's, this replica's
        self.loss_sum = None  # summed over replicas
        self.y = self.y_pred = None
        self.fault = None
        self.first_step = None  # the step of the first optimizer apply
        # The applies traced so far, in order, and the index among them of the
        # first whose own fault test failed (-1: none), in-graph.
        self.order: List["Channel"] = []
        self.first_fault = None


class _ApplyContext:
    """One apply being traced: its channel and what `_before_apply` found."""

    def __init__(self, state: _StepState, channel: Channel):
        self.state = state
        self.channel = channel
        self.step = None
        self.frozen = None
        self.loss = None
        self.step_slots = None
        self.clipped = None
        self.applied = None


_ABSENT = object()
_TLS = threading.local()
# (replica id, id(inner optimizer)) -> the apply being traced: the reduction
# may run in another thread than `apply` (a merge_call under Mirrored).
_CONTEXTS: Dict[Tuple[Optional[int], int], _ApplyContext] = {}


def _route_apply(optimizer, original, grads, trainable_variables=None):
    state = getattr(_TLS, "state", None)
    if state is None or state.in_apply:
        return original(grads, trainable_variables)
    state.in_apply = True
    try:
        return state.engine._apply(state, optimizer, original, grads, trainable_variables)
    finally:
        state.in_apply = False


def _route_reduce(optimizer, original, grads_and_vars):
    reduced = original(grads_and_vars)
    context = _CONTEXTS.get((internals.replica_id(), id(optimizer)))
    if context is not None:
        engine = context.state.engine
        engine._guard(lambda: engine._record_applied(context, reduced))
    return reduced


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CLEANUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model) -> "Engine":
    """The model's engine, created on first use (not stored on the model)."""
    engine = _ENGINES.get(model)
    if engine is None:
        engine = Engine(model)
        _ENGINES[model] = engine
    return engine


def on_fit_end(model, key, cleanup: Callable[[], None]) -> None:
    """Runs `cleanup()` when the running `fit` of `model` ends, however it
    ends, unless `cancel_fit_end(model, key)` came first."""
    _CLEANUPS.setdefault(model, {})[key] = cleanup


def cancel_fit_end(model, key) -> None:
    cleanups = _CLEANUPS.get(model)
    if cleanups is not None:
        cleanups.pop(key, None)


def _after_fit(model) -> None:
    cleanups = _CLEANUPS.pop(model, None) if model in _CLEANUPS else None
    if cleanups is None:
        return
    for key, cleanup in cleanups.items():
        try:
            cleanup()
        except Exception as error:  # noqa: BLE001 - the fit's own outcome comes first
            warnings.warn(f"kerasdbg could not restore the model after fit ({key}): "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)


# Before any callback of kerasdbg exists: the `fit` that first uses one has
# resolved `Model.fit` before its callbacks run.
internals.wrap_fit(_after_fit)


class Engine:
    """The capture engine of one model. See the module docstring."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.requests: List[Request] = []
        self.trace_count = 0
        self.installed = False
        self._prepared = False
        self._failed = False
        self._calls: Optional[tf.Variable] = None
        self._last_call = 0
        self._first_call = 0
        self._step_base = 0
        self._steps_per_execution = None
        self.hooks: Dict[int, Hook] = {}
        self.channels: List[Channel] = []
        self._shadowed: Dict[str, object] = {}
        self._lock = threading.Lock()
        self._several: Optional[bool] = None
        # The "step" buffer: [row, train id, loss, loss captured, frozen,
        # fault, MAX_STEP_SCALARS returned scalars].
        self._step_values: Optional[tf.Variable] = None
        self._step_names: List[str] = []
        # The optimizers of the train step's applies, in order (from the trace),
        # and, by step, those a fault found after the first apply had reached.
        self._apply_order: List[str] = []
        self._late_faults: Dict[int, List[str]] = {}
        self._step_warned = False
        self._frozen: Optional[tf.Variable] = None
        # Non-trainable state the forward pass updates (BatchNormalization's
        # moving statistics) and its copy after the last unfrozen step.
        self._state: List[tuple] = []
        self._state_saved: Optional[tf.Variable] = None
        # NaN localisation: [step, first layer index, channel, one flag per variable].
        self._nan_row: Optional[tf.Variable] = None
        self.nan_layers: List[str] = []
        self._diagnosed = False
        self._saw_steps = False
        self._steps_done = 0  # the last step collected, over the fits
        # Whether the traced train step called `compute_loss`.
        self.loss_captured = False

    # ----------------------------------------------------------- lifecycle
    def attach(self, request: Request) -> None:
        """Adds a request; the first one instruments the train step (retrace)."""
        model = self._model()
        if self._prepared:
            # The last fit ended without on_train_end and without the fit
            # wrapper (a Keras loop of its own): start over.
            self._reset()
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "kerasdbg: the model has no optimizer; call `model.compile()` "
                "before `fit`."
            )
        if not self.installed:
            internals.check_supported(model.optimizer)
            self._install(model)
        self.requests.append(request)

    def prepare(self) -> None:
        """Creates the buffers it can before the first trace of this fit."""
        if self._prepared or not self.requests:
            return
        model = self._model()
        if internals.uses_standard_train_step(model):
            internals.build_optimizer_before_trace(model)
        n = int(model.steps_per_execution)
        strategy = model.distribute_strategy
        if self._steps_per_execution != n:
            self.channels, self.hooks = [], {}
            self._step_values = None
        self._steps_per_execution = n
        found = internals.find_optimizers(model)
        with strategy.scope():
            if self._calls is None:
                self._calls = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_calls")
            if self._step_values is None and self._wants("step", "classes", "wrap"):
                self._step_values = _buffers.on_read_variable(
                    tf.fill([n, _STEP_FIXED + MAX_STEP_SCALARS], tf.constant(np.nan, tf.float64)),
                    "kerasdbg_step")
            if self._freeze() is not None and self._frozen is None:
                self._frozen = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_frozen")
            if self._freeze() is not None:
                self._prepare_state(model, strategy)
            if self._localizes() and self._nan_row is None:
                self._nan_row = _buffers.on_read_variable(
                    tf.zeros([3 + MAX_FLAGGED], tf.int64), "kerasdbg_nan_source")
            for request in self.requests:
                if request.kind == "classes":
                    request.totals = _buffers.on_read_variable(
                        tf.zeros([MAX_CLASSES, len(CLASS_COLUMNS)], tf.float64),
                        "kerasdbg_class_totals")
                if request.kind == "tensors":
                    request.jit = getattr(model, "jit_compile", False) is True
                    request.channel = None
            # The optimizers that are built: their channel is known now. With
            # several, which one applies first is known only in the trace.
            built = [(name, o) for name, o in found
                     if internals.inner_optimizer(o).built
                     and getattr(internals.inner_optimizer(o), "_trainable_variables", None)]
            for name, optimizer in built:
                hook = self._hook(optimizer, name)
                self._channel_now(hook, 0,
                                  internals.optimizer_variables(internals.inner_optimizer(optimizer)),
                                  bind_tensors=len(built) == 1)
        for hook in self.hooks.values():
            if hook.started is not None:  # distances count from this fit's start
                hook.started.assign(tf.zeros([], tf.int64))
        iterations = [int(internals.read(internals.raw_iterations(o)).numpy()) for _, o in found]
        # Without an optimizer that ever stepped (nothing trainable), the
        # steps continue from the last fit's, not from 1 again.
        self._step_base = min([i for i in iterations if i > 0], default=self._steps_done)
        self._last_call = self._first_call = int(self._calls.numpy())
        if self._frozen is not None:
            self.unfreeze()
        if self._nan_row is not None:
            self._nan_row.assign(tf.zeros_like(self._nan_row))
        self._diagnosed = False
        self._saw_steps = False
        self._step_warned = False
        self._late_faults = {}
        self._prepared = True

    def _wants(self, *kinds) -> bool:
        return any(r.kind in kinds for r in self.requests)

    def _prepare_state(self, model, strategy) -> None:
        """Copies of the forward pass's state variables, for frozen steps.

        The moving statistics of a BatchNormalization are updated by the
        forward pass, before the update knows the step is faulty; a frozen
        step puts back their values after the last unfrozen step. Under a
        strategy each replica keeps its own (Keras updates them per replica).
        Layers built only inside `fit` get theirs in the trace.
        """
        self._make_state(model)
        if self._state:
            def save():
                for variable, copy in self._state:
                    copy.assign(internals.read(variable))
                self._state_saved.assign(tf.ones([], tf.int64))

            strategy.run(tf.function(save))

    @staticmethod
    def _state_variables(model) -> list:
        return [v for v in model.non_trainable_variables
                if internals.is_float(v) and not internals.on_read(v)]

    def _state_matches(self, variables) -> bool:
        known = [s[0] for s in self._state]
        return len(known) == len(variables) and all(a is b for a, b in zip(known, variables))

    def _make_state(self, model) -> None:
        variables = self._state_variables(model)
        if not self._state_matches(variables):
            # Zeros: the first unfrozen step saves the values (a variable
            # created in the trace has none to read yet); until then a frozen
            # step restores nothing.
            self._state = [(v, _buffers.on_read_variable(_zeros_like(v), "kerasdbg_state"))
                           for v in variables]
            self._state_saved = _buffers.on_read_variable(tf.zeros([], tf.int64),
                                                          "kerasdbg_state_saved")

    def _freeze(self) -> Optional[Freeze]:
        """The faults that freeze the weights: the union over the requests."""
        specs = [r.freeze for r in self.requests if r.freeze is not None]
        if not specs:
            return None
        norms = [s.max_gradient_norm for s in specs if s.max_gradient_norm is not None]
        return Freeze(
            nonfinite_loss=any(s.nonfinite_loss for s in specs),
            nonfinite_gradients=any(s.nonfinite_gradients for s in specs),
            max_gradient_norm=min(norms) if norms else None,
        )

    def _localizes(self) -> bool:
        return any(r.localize for r in self.requests)

    def nan_source(self) -> Optional[dict]:
        """Where the first non-finite loss or gradient of this fit came from.

        Returns None until one occurred, else `{"step", "layer", "variables",
        "optimizer"}`: the first layer (qualified name, in graph order, inputs
        first) whose output held NaN/Inf on any replica, or None if none did
        (or the model is subclassed), the paths of the variables whose
        gradient did, and the optimizer that was applying them.
        """
        if self._nan_row is None:
            return None
        rows = _buffers.read_replicas(self._nan_row)
        hits = [r for r in rows if r[0] > 0]
        if not hits:
            return None
        indices = [int(r[1]) for r in hits if r[1] >= 0]
        layer = None
        if indices and min(indices) < len(self.nan_layers):
            layer = self.nan_layers[min(indices)]
        number = int(hits[0][2])
        channel = self.channels[number] if 0 <= number < len(self.channels) else None
        flags = np.any([r[3:] for r in hits], axis=0)
        paths = channel.paths if channel is not None else []
        variables = [p for p, bad in zip(paths, flags) if bad]
        return {"step": int(hits[0][0]), "layer": layer, "variables": variables,
                "optimizer": channel.hook.name if channel is not None else None}

    def applied_before_fault(self, step: int) -> Optional[Tuple[List[str], str]]:
        """`(earlier, faulty)` when the fault of the train step at `step` was
        found by an apply that was not its first: the optimizers that had
        applied their update of that train step before it (a freeze cannot
        undo those), and the one that found the fault. None otherwise."""
        applies = self._late_faults.get(step)
        if not applies:
            return None
        earlier = list(dict.fromkeys(name for name in applies[:-1]))
        return earlier, applies[-1]

    def unfreeze(self) -> None:
        """Lets the weights change again after a fault froze them (host side)."""
        if self._frozen is not None:
            self._frozen.assign(tf.zeros([], tf.int64))

    @property
    def frozen(self) -> bool:
        """Whether a fault has frozen the weights (replica 0's flag)."""
        return self._frozen is not None and bool(_buffers.read(self._frozen))

    @property
    def several_optimizers(self) -> bool:
        """Whether more than one optimizer applied gradients in the train step."""
        return bool(self._several)

    def detach(self, request: Request) -> None:
        """Removes a request; the last one restores the model (retrace)."""
        self.collect()
        if request in self.requests:
            self.requests.remove(request)
        if not self.requests:
            self._reset()

    def abort(self) -> None:
        """Hands out what is recorded and restores the model, at once.

        For a callback that ends `fit` with an exception, after which no
        `on_train_end` runs.
        """
        try:
            self.collect()
        finally:
            self._reset()

    def _after_failed_fit(self) -> None:
        """`abort` for a `fit` that ended by an exception: the records are
        handed out if they can be, and the fit's own exception is what
        propagates (a consumer failing again here is left alone)."""
        try:
            try:
                self.collect()
            except Exception:  # noqa: BLE001 - the fit already raised
                pass
            # What the callbacks wrote of the failed fit is on disk for a look
            # at it (no on_train_end flushes their writers).
            try:
                _events.flush_all()
            except Exception:  # noqa: BLE001 - the fit already raised
                pass
        finally:
            self._reset()

    def _reset(self) -> None:
        model = self._model()
        self.requests = []
        self._prepared = False
        self._failed = False
        for channel in self.channels:
            channel.slots = {}
            channel.considered = set()
        if self.installed:
            self._uninstall(model)

    def _install(self, model) -> None:
        original_step = model.train_step
        original_loss = model.compute_loss

        def train_step(data):
            return self._train_step(original_step, data)

        def compute_loss(*args, **kwargs):
            loss = original_loss(*args, **kwargs)
            state = getattr(_TLS, "state", None)
            if state is not None and state.engine is self:
                state.loss = loss
                state.y = args[1] if len(args) > 1 else kwargs.get("y")
                state.y_pred = args[2] if len(args) > 2 else kwargs.get("y_pred")
                x = args[0] if args else kwargs.get("x")
                if x is not None:
                    state.x = x
            return loss

        # What the instance itself held (a user's own `model.train_step = ...`)
        # is wrapped here and put back afterwards.
        self._shadowed = {name: vars(model).get(name, _ABSENT)
                          for name in ("train_step", "compute_loss")}
        object.__setattr__(model, "train_step", train_step)
        object.__setattr__(model, "compute_loss", compute_loss)
        self.installed = True
        self._several = None
        on_fit_end(model, self, self._after_failed_fit)
        model.make_train_function(force=True)

    def _uninstall(self, model) -> None:
        self.installed = False
        if model is None:
            return
        cancel_fit_end(model, self)
        for name, value in self._shadowed.items():
            if value is _ABSENT:
                internals.unpatch(model, name)
            else:
                object.__setattr__(model, name, value)
        model.make_train_function(force=True)

    # ------------------------------------------------------- in the graph
    def _guard(self, function: Callable[[], object]):
        """Runs trace-time instrumentation; a failure warns unless strict."""
        if self._failed or not self._prepared:
            return None
        try:
            return function()
        except Exception as error:  # noqa: BLE001 - any failure of ours
            if any(r.strict for r in self.requests):
                raise
            self._failed = True
            warnings.warn(
                "kerasdbg could not instrument the train step and records "
                f"nothing this fit; training goes on. Cause: {type(error).__name__}: "
                f"{error}",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def _row(self, train_id):
        return tf.math.floormod(train_id - 1, self._steps_per_execution)

    def _train_step(self, original, data):
        if not self._prepared or self._failed:
            return original(data)
        state = self._guard(lambda: self._begin_step(data))
        if state is None:
            return original(data)
        step_function = original
        for request in [r for r in self.requests if r.kind == "wrap" and r.wrapper]:
            step_function = _wrapped(request.wrapper, step_function, self._row(state.train_id))
        previous = getattr(_TLS, "state", None)
        _TLS.state = state
        try:
            with internals.optimizer_routes(_route_apply, _route_reduce):
                logs = step_function(data)
        finally:
            _TLS.state = previous
        self._guard(lambda: self._end_step(state, logs))
        return logs

    def _begin_step(self, data) -> _StepState:
        self.trace_count += 1
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data) if isinstance(
            data, (tuple, list)) else (data, None, None)
        return _StepState(self, self._calls.read_value() + 1, x)

    def _hook(self, optimizer, name: Optional[str] = None) -> Hook:
        # Under a lock: the replicas of a MirroredStrategy trace at once.
        with self._lock:
            hook = self.hooks.get(id(optimizer))
            if hook is None:
                if name is None:
                    names = dict((id(o), n) for n, o in internals.find_optimizers(self._model()))
                    name = names.get(id(optimizer), optimizer.name)
                hook = Hook(name, optimizer, len(self.hooks))
                self.hooks[id(optimizer)] = hook
            return hook

    def _paths(self, variables) -> List[str]:
        """Display paths: unique over the model's variables, stable across channels."""
        model = self._model()
        every = list(model.variables) if model is not None else []
        known = dict(zip((id(internals.read_handle(v)) for v in every), unique_paths(every)))
        return [known.get(id(internals.read_handle(v))) or getattr(v, "path", None) or v.name
                for v in variables]

    def _channel_now(self, hook: Hook, index: int, variables, bind_tensors: bool = True) -> Channel:
        """The channel of the `index`-th apply of `hook` on `variables`,
        created now (eagerly, or in a cross-replica context) if needed;
        `bind_tensors=False` leaves a `StepRecorder` to the first apply."""
        keys = [internals.variable_key(hook.optimizer, v) for v in variables]
        requests = [r for r in self.requests if bind_tensors or r.kind != "tensors"]
        with self._lock:
            for channel in hook.channels:
                if channel.index == index and channel.keys == keys:
                    channel.build(requests, self._steps_per_execution)
                    return channel
            hook.channels = [c for c in hook.channels if c.index != index]
            channel = Channel(hook, index, variables, self._paths(variables))
            channel.build(requests, self._steps_per_execution)
            channel.number = len(self.channels)
            self.channels.append(channel)
            hook.channels.append(channel)
            return channel

    def _channel(self, hook: Hook, index: int, variables) -> Channel:
        """`_channel_now` from the trace: buffers are created outside it."""
        keys = [internals.variable_key(hook.optimizer, v) for v in variables]

        def ready():
            for channel in hook.channels:
                if channel.index == index and channel.keys == keys and all(
                        id(r) in channel.considered for r in self.requests if r.per_variable):
                    return channel
            return None

        channel = ready()
        if channel is not None:
            return channel
        model = self._model()

        def create():
            with tf.init_scope(), model.distribute_strategy.scope():
                self._channel_now(hook, index, variables)

        # Every replica calls this (merge_call runs `create` once, for all).
        internals.merge_call(create)
        channel = ready()
        if channel is None:
            raise RuntimeError(f"kerasdbg: no channel for apply {index} of {hook.name}")
        return channel

    def _apply(self, state: _StepState, optimizer, original, grads, trainable_variables):
        inner = internals.inner_optimizer(optimizer)
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif inner.built:
            variables = internals.optimizer_variables(inner)
        else:
            variables = None
        if not grads or variables is None or len(variables) != len(grads):
            return original(grads, trainable_variables)
        hook = self._hook(optimizer)
        index = state.applies.get(id(hook), 0)
        state.applies[id(hook)] = index + 1
        channel = self._guard(lambda: self._channel(hook, index, variables))
        if channel is None:
            return original(grads, trainable_variables)
        context = _ApplyContext(state, channel)
        before = self._guard(lambda: self._before_apply(context, optimizer, grads))
        key = (internals.replica_id(), id(inner))
        _CONTEXTS[key] = context
        try:
            applied = None
            if before is not None and context.frozen is not None:
                applied = self._guard(lambda: self._apply_unless_frozen(
                    original, optimizer, grads, trainable_variables, context.frozen))
            result = None
            if applied is None:
                result = original(grads, trainable_variables)
        finally:
            _CONTEXTS.pop(key, None)
        if before is not None:
            self._guard(lambda: self._after_apply(context, optimizer))
        return result

    def _before_apply(self, context: _ApplyContext, optimizer, grads) -> bool:
        channel, state = context.channel, context.state
        hook = channel.hook
        step = internals.read(internals.raw_iterations(optimizer)) + 1
        context.step = step
        if state.first_step is None:
            state.first_step = step
        loss, nonfinite, fault, frozen = self._step_loss_and_fault(context, optimizer, grads)
        context.loss, context.frozen = loss, frozen
        position = tf.constant(len(state.order), tf.int64)
        state.order.append(channel)
        if fault is not None:
            state.fault = fault if state.fault is None else tf.logical_or(state.fault, fault)
            earlier = tf.constant(-1, tf.int64) if state.first_fault is None else state.first_fault
            state.first_fault = tf.where(tf.logical_and(fault, earlier < 0), position, earlier)
        if nonfinite is not None and self._localizes():
            self._localize(context, step, nonfinite, grads)
        if hook.separate:
            self._record_model_gradients(context, optimizer, grads)
        weight_slots = channel.slots_of("weights")
        if channel.initial and weight_slots:

            def start():
                for copy, variable in zip(channel.initial, channel.variables):
                    copy.assign(internals.read(variable))
                hook.started.assign(tf.ones([], tf.int64))

            _buffers.run_if(tf.equal(hook.started.read_value(), 0), start)
        ratios = [s for s in weight_slots if "update_ratio" in s.request.stats]
        if channel.previous and ratios:

            def snapshot():
                for copy, variable in zip(channel.previous, channel.variables):
                    copy.assign(internals.read(variable))

            _buffers.run_if(_and(_any([s.request.needs_at("update_ratio", step) for s in ratios]),
                                 hook.updates_at(step)), snapshot)
        tensors = self._tensor_request(channel)
        if tensors is not None:
            context.step_slots = tensors.record_before(self._model(), optimizer, step, loss,
                                                       state.x)
        return True

    def _tensor_request(self, channel: Channel):
        for request in self.requests:
            if request.kind == "tensors" and request.channel is channel:
                return request
        return None

    def _step_loss_and_fault(self, context: _ApplyContext, optimizer, grads):
        """`(loss, nonfinite, fault, frozen)` of the apply, each None if unused.

        `loss` is `compute_loss`'s, summed over replicas; `nonfinite` says
        the loss or a gradient held NaN/Inf, `fault` adds a gradient norm
        above the limit, `frozen` is the sticky flag that skips the update.
        One all-reduce of a small vector gives every replica the same loss
        and the same fault, hence the same decision.
        """
        state = context.state
        freeze = self._freeze()
        # The faults are tested to freeze, or only to localise a NaN.
        watched = freeze or (Freeze() if self._localizes() else None)
        wants_loss = self._wants("step", "tensors")
        local = None if state.loss is None else tf.reduce_sum(tf.cast(state.loss, tf.float64))
        if watched is None:
            if local is not None and wants_loss and state.loss_sum is None:
                replicas = _several_replicas()
                state.loss_sum = local if replicas is None else replicas.all_reduce(
                    tf.distribute.ReduceOp.SUM, local)
            return state.loss_sum, None, None, None
        parts = [tf.constant(0.0, tf.float64) if local is None else local]
        present = [g for g in grads if g is not None]
        scaled = context.channel.hook.scaled
        check_grads = watched.nonfinite_gradients and not scaled
        if check_grads:
            parts.append(tf.cast(tf.logical_not(_all_finite(present)), tf.float64))
        vector = tf.stack(parts)
        replicas = _several_replicas()
        if replicas is not None:
            vector = replicas.all_reduce(tf.distribute.ReduceOp.SUM, vector)
        loss = None if local is None else vector[0]
        if loss is not None:
            state.loss_sum = loss
        nonfinite = tf.constant(False)
        if watched.nonfinite_loss and loss is not None:
            nonfinite = tf.logical_or(nonfinite, tf.logical_not(tf.math.is_finite(loss)))
        if check_grads:
            nonfinite = tf.logical_or(nonfinite, vector[1] > 0)
        fault = nonfinite
        if watched.max_gradient_norm is not None:
            if replicas is not None:
                # The norm of the summed gradient, as the optimizer applies it.
                present = replicas.all_reduce(
                    tf.distribute.ReduceOp.SUM, [_dense(g) for g in present])
            norms = stats_lib.tensor_statistics(present, ["l2_norm"])[:, 0] if present else \
                tf.zeros([0], tf.float64)
            squares = tf.reduce_sum(tf.square(norms))
            norm = tf.sqrt(squares)
            over = norm > watched.max_gradient_norm
            if scaled:
                norm = norm / tf.cast(optimizer.dynamic_scale, tf.float64)
                # An overflow of the scaled gradients is the loss scaler's to skip.
                over = tf.logical_and(tf.math.is_finite(norm), norm > watched.max_gradient_norm)
            fault = tf.logical_or(fault, over)
        if freeze is None:
            return loss, nonfinite, fault, None
        frozen = tf.logical_or(self._frozen.read_value() > 0, fault)
        self._frozen.assign(tf.cast(frozen, tf.int64))
        return loss, nonfinite, fault, frozen

    def _localize(self, context: _ApplyContext, step, nonfinite, grads) -> None:
        """On the first fault of the fit, replays the forward pass layer by
        layer and records where non-finite values first appear.

        Costs nothing on healthy steps but the fault test itself: the replay
        sits in a `tf.cond` taken once.
        """
        model = self._model()
        row = self._nan_row
        x = context.state.x
        number = context.channel.number

        def replay():
            names, flags = [], []

            def on_output(name, outputs):
                for tensor in keras.tree.flatten(outputs):
                    if tf.is_tensor(tensor) and tensor.dtype.is_floating:
                        names.append(name)
                        flags.append(tf.logical_not(tf.reduce_all(tf.math.is_finite(tensor))))

            if x is not None and _replay.is_graph_model(model):
                _replay.call_layer_by_layer(model, x, True, on_output)
            self.nan_layers = names
            if flags:
                bad = tf.stack(flags)
                first = tf.where(tf.reduce_any(bad),
                                 tf.cast(tf.argmax(tf.cast(bad, tf.int32)), tf.int64),
                                 tf.constant(-1, tf.int64))
            else:
                first = tf.constant(-1, tf.int64)
            variable_flags = [
                tf.constant(0, tf.int64) if g is None else tf.cast(
                    tf.logical_not(tf.reduce_all(tf.math.is_finite(_dense(g)))), tf.int64)
                for g in list(grads)[:MAX_FLAGGED]
            ]
            head = tf.stack([tf.cast(step, tf.int64), first, tf.constant(number, tf.int64)]
                            + variable_flags)
            # One zeros op, not thousands of stacked scalars (XLA compiles each).
            padding = tf.zeros([MAX_FLAGGED - len(variable_flags)], tf.int64)
            row.assign(tf.concat([head, padding], 0))
            return tf.constant(True)

        first_time = tf.logical_and(nonfinite, tf.equal(row.read_value()[0], 0))
        tf.cond(first_time, replay, lambda: tf.constant(False))

    def _keep_state_unless_frozen(self, frozen) -> None:
        """A frozen step restores the state variables; any other saves them.

        In replica context: each replica restores its own copy (no
        communication), as the forward pass updated it.
        """
        if not self._state:
            return

        def restore():
            for variable, copy in self._state:
                variable.assign(tf.cast(copy.read_value(), variable.dtype))
            return tf.constant(True)

        def save():
            for variable, copy in self._state:
                copy.assign(tf.cast(internals.read(variable), copy.dtype))
            self._state_saved.assign(tf.ones([], tf.int64))
            return tf.constant(False)

        saved = self._state_saved.read_value() > 0
        _buffers.run_if(tf.logical_and(frozen, saved), restore)
        _buffers.run_if(tf.logical_not(frozen), save)

    def _apply_unless_frozen(self, original_apply, optimizer, grads, trainable_variables, frozen):
        """Applies the update unless `frozen`; a frozen step only counts itself.

        Strategies that need `merge_call` (Mirrored, OneDevice) get the
        `tf.cond` in cross-replica context, as `LossScaleOptimizer` does.
        """

        inner = internals.inner_optimizer(optimizer)
        scaled = inner is not optimizer
        # Built here, not inside a branch (a LossScaleOptimizer builds in apply).
        internals.ensure_built(optimizer, trainable_variables)

        def count_step(grads, trainable_variables):
            # The gradient statistics of a frozen step are recorded too: the
            # (routed) reduction records them, and nothing is applied.
            if scaled:
                scale = optimizer.dynamic_scale
                grads = [g if g is None else g / tf.cast(scale, g.dtype) for g in grads]
            if trainable_variables is None:
                trainable_variables = internals.optimizer_variables(inner)
            variables = [internals.read_handle(v) for v in trainable_variables]
            getattr(inner, internals.REDUCE_METHOD)(list(zip(grads, variables)))
            internals.raw_iterations(optimizer).assign_add(1)

        def branch(function):
            def run():
                function()
                return tf.constant(True)

            return run

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(
                frozen, branch(lambda: count_step(grads, trainable_variables)),
                branch(lambda: original_apply(grads, trainable_variables)),
            )
            return True

        def cross_replica(distribution, frozen, grads, trainable_variables):
            flag = distribution.experimental_local_results(frozen)[0]
            tf.cond(
                flag,
                branch(lambda: distribution.extended.call_for_each_replica(
                    count_step, args=(grads, trainable_variables))),
                branch(lambda: distribution.extended.call_for_each_replica(
                    original_apply, args=(grads, trainable_variables))),
            )

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(frozen, grads, trainable_variables)
        )
        return True

    def _record_model_gradients(self, context: _ApplyContext, optimizer, grads) -> None:
        """The gradients the model produced and, separately, the ones the
        optimizer applies, when those differ by construction (clipping,
        gradient accumulation): both from `apply`'s arguments, unscaled,
        summed over replicas (one more all-reduce).

        The applied gradient is computed here as Keras does (the averaged
        sum of the accumulated gradients, clipped), not read from Keras's
        own tensors: a second reader of those changes how TensorFlow's graph
        optimizer rewrites the update, and so its last bit."""
        channel, hook = context.channel, context.channel.hook
        slots = channel.slots_of("gradients")
        tensors = self._tensor_request(channel)
        if not slots and tensors is None:
            return
        step = context.step
        if hook.scaled:
            scale = tf.cast(optimizer.dynamic_scale, tf.float32)
            grads = [g if g is None else _dense(g) / tf.cast(scale, g.dtype) for g in grads]
        grads = [None if g is None else _dense(g) for g in grads]
        applied, clipped = self._applied_gradients(context, optimizer, grads)
        replicas = _several_replicas()
        present = [i for i, g in enumerate(grads) if g is not None]
        if replicas is not None and present:
            parts = [grads[i] for i in present] + [applied[i] for i in present]
            parts += [tf.cast(clipped, tf.float32)] if clipped is not None else []
            reduced = replicas.all_reduce(tf.distribute.ReduceOp.SUM, parts)
            for k, i in enumerate(present):
                grads[i], applied[i] = reduced[k], reduced[len(present) + k]
            if clipped is not None:
                clipped = reduced[-1] > 0
        context.clipped = clipped
        context.applied = applied
        row, train_id = self._row(context.state.train_id), context.state.train_id
        if slots:
            self._write_gradients(slots, grads, step, row, train_id, clipped, applied=False)
            self._write_gradients(slots, applied, step, row, train_id, None, applied=True)

    def _applied_gradients(self, context: _ApplyContext, optimizer, grads):
        """`(applied, clipped)`: what Keras applies for this replica's `grads`
        (with gradient accumulation the sum of the accumulated batches over
        their number, then clipped: `BaseOptimizer._backend_apply_gradients`),
        and whether its clipping changed it, by Keras's own test (None
        without clipping; with accumulation, False at the batches that do
        not update)."""
        hook = context.channel.hook
        applied = list(grads)
        if hook.accumulation:
            variables = [v for v, g in zip(context.channel.variables, grads) if g is not None]
            accumulated = iter(internals.accumulators(optimizer, variables))
            applied = [None if g is None else
                       (g + tf.cast(internals.read(next(accumulated)), g.dtype)) / hook.accumulation
                       for g in applied]
        if not hook.clipping:
            return applied, None
        kind, value = hook.clipping
        present = [g for g in applied if g is not None]
        if not present:
            return applied, tf.constant(False)
        if kind == "clipvalue":
            clipped = tf.reduce_any(tf.stack([tf.reduce_max(tf.abs(g)) > value for g in present]))
            applied = [None if g is None else tf.clip_by_value(g, -value, value) for g in applied]
        elif kind == "clipnorm":
            norms = [tf.norm(g) for g in present]
            clipped = tf.reduce_any(tf.stack([n > value for n in norms]))
            applied = [None if g is None else tf.clip_by_norm(g, value) for g in applied]
        else:
            norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in present]))
            clipped = norm > value
            scale = value * tf.minimum(1.0 / norm, 1.0 / value)
            applied = [None if g is None else g * tf.cast(scale, g.dtype) for g in applied]
        if hook.accumulation:
            clipped = tf.logical_and(clipped, hook.updates_at(context.step))
        return applied, clipped

    def _record_applied(self, context: _ApplyContext, reduced) -> None:
        """The gradient the optimizer applies (after clipping, summed over
        replicas), from the routed reduction, when it is the model's; with
        clipping or accumulation `_record_model_gradients` did it all."""
        channel = context.channel
        inner = channel.hook.inner
        if channel.hook.separate:
            grads = context.applied
        else:
            by_key = {internals.variable_key(inner, v): g for g, v in reduced if g is not None}
            grads = [by_key.get(k) for k in channel.keys]
        step = context.step
        row, train_id = self._row(context.state.train_id), context.state.train_id
        tensors = self._tensor_request(channel)
        if tensors is not None and grads is not None:
            tensors.record_gradients(step, [grads[i] for i in tensors.positions])
        if channel.hook.separate:
            return
        slots = channel.slots_of("gradients")
        if slots:
            self._write_gradients(slots, grads, step, row, train_id, None, applied=False)

    def _write_gradients(self, slots: List[Slot], grads, step, row, train_id, clipped,
                         applied: bool) -> None:
        """Statistics of `grads` (the channel's, in its order) into the slots:
        the model's gradient (`applied=False`), else the applied one. Each
        statistic of each gradient is computed once per step, whatever the
        number of slots asking for it (`_scheduled_table`)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        for slot in slots:
            slot.present = [grads[i] is not None for i in slot.positions]
        wanted = sorted({i for m in slots for i in m.positions if grads[i] is not None})
        others = [i for i in present if i not in set(wanted)]
        gate = slots[0].channel.hook.updates_at(step) if applied else True

        def compute(stats):
            table = stats_lib.tensor_statistics([grads[i] for i in wanted], stats) \
                if wanted else tf.zeros([0, len(stats)], tf.float64)
            squares = tf.reduce_sum(tf.square(table[:, stats.index("l2_norm")]))
            if others:
                other_l2 = stats_lib.tensor_statistics([grads[i] for i in others],
                                                       ["l2_norm"])[:, 0]
                squares += tf.reduce_sum(tf.square(other_l2))
            return table, tf.sqrt(squares)

        plan = _scheduled_table(slots, step, gate, compute, len(wanted))
        if plan is not None:
            table, columns, global_norm = plan
            tail = [global_norm]
            if not applied:
                tail.append(tf.constant(np.nan, tf.float64) if clipped is None
                            else tf.cast(clipped, tf.float64))
            tail = [tf.stack(tail)]
            for slot in slots:
                def write(slot=slot):
                    values = _slot_rows(table, wanted, slot.positions, slot.present,
                                        [columns.index(s) for s in slot.request.stats])
                    buffer = slot.applied_values if applied else slot.values
                    _buffers.write_row(buffer, row, tf.concat(
                        [tf.cast(train_id, tf.float64)[None], values] + tail, 0))

                _buffers.run_if(_and(gate, slot.request.writes_at(step)), write)
        if not applied:
            for slot in slots:
                mine = [grads[i] for i in slot.positions]
                _buffers.run_if(slot.request.histograms_at(step),
                                lambda slot=slot, mine=mine: self._record_histograms(
                                    slot, mine, row, train_id))

    def _after_apply(self, context: _ApplyContext, optimizer) -> None:
        channel, hook = context.channel, context.channel.hook
        step = context.step
        after = internals.read(internals.raw_iterations(optimizer))
        skipped = tf.equal(after, step - 1)
        train_id = context.state.train_id
        row = self._row(train_id)
        # The weights describe updates that happened: not the batches gradient
        # accumulation only adds up, not the steps a fault froze.
        updates = hook.updates_at(step)
        if context.frozen is not None:
            updates = _and(updates, tf.logical_not(context.frozen))
        weight_slots = channel.slots_of("weights")
        if weight_slots:
            self._record_weights(weight_slots, step, updates, row, train_id)
        for slot in channel.slots_of("weights"):
            _buffers.run_if(
                _and(slot.request.histograms_at(step), updates),
                lambda slot=slot: self._record_histograms(
                    slot, [internals.read(v) for v in slot.variables], row, train_id),
            )
        tensors = self._tensor_request(channel)
        if tensors is not None and context.step_slots is not None:
            tensors.record_after(step, context.step_slots)
        updated = tf.constant(1, tf.int64) if updates is True else tf.cast(updates, tf.int64)
        meta = tf.stack([train_id, step, tf.cast(skipped, tf.int64), updated])
        _buffers.write_row(channel.meta, row, meta)

    def _end_step(self, state: _StepState, logs) -> None:
        """The train step's own row (loss, frozen, returned scalars), the
        class counts, the state kept for frozen steps; then counts the step."""
        model = self._model()
        if self._several is None and state.applies:
            self._several = len(state.applies) > 1
        freeze = self._freeze()
        frozen = None
        if freeze is not None:
            frozen = self._frozen.read_value() > 0
            if not self._state_matches(self._state_variables(model)):
                internals.merge_call(lambda: self._make_state_now(model))
            self._keep_state_unless_frozen(frozen)
        row = self._row(state.train_id)
        if self._step_values is not None:
            self._write_step(state, logs, frozen, row)
        classes = [r for r in self.requests if r.kind == "classes"]
        if classes:
            counts = self._class_counts(state, classes)
            for request in classes:
                request.labelled = counts is not None
            if counts is not None:
                for request in classes:
                    totals = request.totals.read_value() + counts
                    request.totals.assign(totals)
        self._calls.assign_add(1)

    def _make_state_now(self, model) -> None:
        with tf.init_scope(), model.distribute_strategy.scope():
            self._make_state(model)

    def _write_step(self, state: _StepState, logs, frozen, row) -> None:
        self.loss_captured = state.loss is not None
        loss = state.loss_sum
        if loss is None and state.loss is not None:
            local = tf.reduce_sum(tf.cast(state.loss, tf.float64))
            replicas = _several_replicas()
            loss = local if replicas is None else replicas.all_reduce(
                tf.distribute.ReduceOp.SUM, local)
        scalars, names = [], []
        for name, value in (logs.items() if isinstance(logs, dict) else ()):
            if tf.is_tensor(value) and value.shape.rank == 0 and (
                    value.dtype.is_floating or value.dtype.is_integer):
                names.append(str(name))
                scalars.append(tf.cast(value, tf.float64))
        if len(names) > MAX_STEP_SCALARS and not self._step_warned:
            self._step_warned = True
            warnings.warn(f"kerasdbg records the first {MAX_STEP_SCALARS} of the "
                          f"{len(names)} scalars the train step returns, per step: "
                          f"{', '.join(names[MAX_STEP_SCALARS:])} are left out.",
                          RuntimeWarning, stacklevel=3)
        names, scalars = names[:MAX_STEP_SCALARS], scalars[:MAX_STEP_SCALARS]
        self._step_names = names
        self._apply_order = [channel.hook.name for channel in state.order]
        nan = tf.constant(np.nan, tf.float64)
        fault = nan if state.fault is None else tf.cast(state.fault, tf.float64)
        fixed = [tf.cast(state.train_id, tf.float64),
                 nan if state.first_step is None else tf.cast(state.first_step, tf.float64),
                 nan if loss is None else loss,
                 tf.constant(0.0 if loss is None else 1.0, tf.float64),
                 nan if frozen is None else tf.cast(frozen, tf.float64),
                 fault,
                 nan if state.first_fault is None else tf.cast(state.first_fault, tf.float64)]
        padding = [nan] * (MAX_STEP_SCALARS - len(scalars))
        _buffers.write_row(self._step_values, row, tf.stack(fixed + scalars + padding))

    def _class_counts(self, state: _StepState, requests):
        """`[MAX_CLASSES, 2]` labels seen and mispredicted in this step (all
        replicas), from the first output; None when there are no labels."""
        y, y_pred = state.y, state.y_pred
        if y is None or y_pred is None:
            return None
        y, y_pred = keras.tree.flatten(y)[0], keras.tree.flatten(y_pred)[0]
        classes = y_pred.shape[-1] if y_pred.shape.rank else None
        if classes is None or classes > MAX_CLASSES:
            return None
        if classes == 1:  # one sigmoid unit: class 1 above 0.5
            predicted = tf.cast(tf.reshape(y_pred, [-1]) > 0.5, tf.int64)
            labels = tf.cast(tf.reshape(y, [-1]) > 0.5, tf.int64)
            classes = 2
        else:
            predicted = tf.reshape(tf.argmax(y_pred, axis=-1), [-1])
            if y.shape.rank == y_pred.shape.rank and y.shape[-1] == y_pred.shape[-1]:
                labels = tf.reshape(tf.argmax(y, axis=-1), [-1])  # one-hot
            else:
                labels = tf.reshape(tf.cast(y, tf.int64), [-1])
        for request in requests:
            request.present = [k < classes for k in range(MAX_CLASSES)]
        valid = tf.logical_and(labels >= 0, labels < classes)
        ids = tf.where(valid, labels, classes)  # out-of-range labels are dropped
        wrong = tf.cast(tf.not_equal(predicted, labels), tf.float64)
        counts = tf.stack([
            tf.math.unsorted_segment_sum(tf.ones_like(wrong), ids, classes + 1)[:classes],
            tf.math.unsorted_segment_sum(wrong, ids, classes + 1)[:classes],
        ], axis=1)
        replicas = _several_replicas()
        if replicas is not None:
            counts = replicas.all_reduce(tf.distribute.ReduceOp.SUM, counts)
        return tf.pad(counts, [[0, MAX_CLASSES - classes], [0, 0]])

    def _record_weights(self, slots: List[Slot], step, updates, row, train_id) -> None:
        """Statistics of the weights after the update, each computed once per
        step for all `slots` (`_scheduled_table`)."""
        channel = slots[0].channel
        wanted = sorted({i for s in slots for i in s.positions})

        def compute(stats):
            weights = [internals.read(channel.variables[i]) for i in wanted]
            base_names = tuple(s for s in stats if s in stats_lib.ALL_STATISTICS)
            base = stats_lib.tensor_statistics(weights, base_names)
            columns = {s: base[:, i] for i, s in enumerate(base_names)}
            # The norms of the update, of the weights before it and of the drift
            # from the start: one call, so one fault test and one finishing step.
            ratio = "update_ratio" in stats
            distance = "distance_from_start" in stats
            extras = []
            if ratio:
                copies = channel.previous
                previous = [copies[i].read_value() for i in wanted]
                extras += [w - tf.cast(p, w.dtype) for w, p in zip(weights, previous)] + previous
            if distance:
                initial = channel.initial
                extras += [w - tf.cast(initial[i].read_value(), w.dtype)
                           for w, i in zip(weights, wanted)]
            norms = tf.unstack(
                tf.reshape(stats_lib.tensor_statistics(extras, ["l2_norm"]), [-1, len(weights)])
            ) if extras else []
            if ratio:
                update, before = norms[0], norms[1]
                # 0/0 (a zero tensor that did not move) is no update at all.
                columns["update_ratio"] = tf.where(
                    tf.equal(update, 0), tf.zeros_like(update), update / before
                )
            if distance:
                columns["distance_from_start"] = norms[-1]
            return tf.stack([columns[s] for s in stats], axis=1), tf.constant(0.0, tf.float64)

        plan = _scheduled_table(slots, step, updates, compute, len(wanted))
        if plan is None:
            return
        table, columns, _ = plan
        for slot in slots:
            def write(slot=slot):
                values = _slot_rows(table, wanted, slot.positions, [True] * len(slot.positions),
                                    [columns.index(s) for s in slot.request.stats])
                _buffers.write_row(slot.values, row, tf.concat(
                    [tf.cast(train_id, tf.float64)[None], values], 0))

            _buffers.run_if(_and(updates, slot.request.writes_at(step)), write)

    def _record_histograms(self, slot: Slot, tensors, row, train_id) -> None:
        present = [t for t in tensors if t is not None]
        counts, ranges = stats_lib.histograms(present, slot.request.bins)
        empty_counts = tf.zeros([slot.request.bins], tf.float64)
        empty_range = tf.constant([np.nan, np.nan], tf.float64)
        all_counts, all_ranges, i = [], [], 0
        for t in tensors:
            all_counts.append(empty_counts if t is None else counts[i])
            all_ranges.append(empty_range if t is None else ranges[i])
            i += t is not None
        _buffers.write_row(slot.hist_counts, row, tf.stack(all_counts))
        _buffers.write_row(slot.hist_ranges, row, tf.stack(all_ranges))
        _buffers.write_row(slot.hist_ids, row, train_id)

    # ----------------------------------------------------------- on host
    def step_of(self, train_id: int) -> int:
        """The step of a train step that ran (host read of the step buffer)."""
        if self._step_values is None:
            return self.fit_step(train_id)
        row = _buffers.read(self._step_values)[(train_id - 1) % self._steps_per_execution]
        return self.fit_step(train_id, row[1] if int(row[0]) == train_id else np.nan)

    def fit_step(self, train_id: int, step: float = np.nan) -> int:
        """The step of a train step: that of the first optimizer apply in it
        (so that a model trained by one optimizer numbers its train steps as
        the optimizer does, and a fault found by that apply and the train
        step's loss share a step), else counted from `_step_base`."""
        if not np.isnan(step):
            number = int(step)
        else:
            number = self._step_base + train_id - self._first_call
        self._steps_done = max(self._steps_done, number)
        return number

    def train_steps(self) -> int:
        """The train-step id of the last train step run (host read)."""
        return int(_buffers.read(self._calls)) if self._calls is not None else 0

    def collect(self) -> None:
        """Reads the rows written since the last call and hands them out."""
        if not self._prepared:
            return
        if self._failed and self.installed:
            # Instrumenting the trace failed part-way (a warning said so): the
            # rest of this fit runs the plain train step, no half-armed freeze.
            self._uninstall(self._model())
        for request in self.requests:
            if request.kind == "tensors" and request.channel is not None:
                request.collect()
        # Each callback collects at each batch end; the first read tells the
        # later ones there is nothing new (a read costs 10-30 us).
        calls = int(_buffers.read(self._calls))
        if calls <= self._last_call:
            return
        n = self._steps_per_execution
        first = max(self._last_call + 1, calls - n + 1)
        if first > self._last_call + 1 and self._wants("gradients", "weights", "step", "classes"):
            warnings.warn(
                f"kerasdbg lost {first - self._last_call - 1} step records: the "
                "train function ran more than steps_per_execution steps between "
                "two callback events.",
                RuntimeWarning,
                stacklevel=2,
            )
        ids = list(range(first, calls + 1))
        records: Dict[int, List[Record]] = {id(r): [] for r in self.requests}
        self._collect_steps(ids, records)
        several = self.several_optimizers
        ordered: Dict[int, list] = {id(r): [] for r in self.requests}
        for channel in self.channels:
            if channel.slots:
                self._collect_channel(channel, ids, ordered, several)
        for key, entries in ordered.items():
            # In the order the steps ran: train step, then apply in it.
            records[key] += [record for _, _, record in sorted(entries, key=lambda e: e[:2])]
        self._last_call = calls
        self._saw_steps = True
        for request in self.requests:
            if records[id(request)]:
                request.consumer(records[id(request)])
        if not self._diagnosed:
            self._diagnosed = True
            self._diagnose()

    def _collect_steps(self, ids, records) -> None:
        requests = [r for r in self.requests if r.kind in ("step", "classes")]
        if not requests or self._step_values is None:
            return
        n = self._steps_per_execution
        replicas = _buffers.read_replicas(self._step_values)
        table = replicas[0]
        names = self._step_names
        for train_id in ids:
            row = table[(train_id - 1) % n]
            if int(row[0]) != train_id:
                continue
            step = self.fit_step(train_id, row[1])
            if row[6] > 0:  # a fault found after other applies of this train step
                self._late_faults[step] = self._apply_order[:int(row[6]) + 1]
            scalars = np.mean([r[(train_id - 1) % n][_STEP_FIXED:_STEP_FIXED + len(names)]
                               for r in replicas], axis=0) if names else np.zeros(0)
            for request in requests:
                if request.kind == "classes":
                    continue
                captured = row[3] > 0
                tags = [_tags.step_scalar("loss") if captured else None,
                        _tags.step_scalar("frozen") if not np.isnan(row[4]) else None,
                        _tags.step_scalar("fault") if not np.isnan(row[5]) else None]
                values = [row[2], row[4], row[5]]
                for name, value in zip(names, scalars):
                    if name == "loss" and captured:
                        continue  # compute_loss's loss of the step comes first
                    tags.append(_tags.step_scalar(name))
                    values.append(value)
                for tag, value in self._fault_scalars(step, row).items():
                    tags.append(tag)
                    values.append(value)
                records[id(request)].append(Record(
                    step=step, skipped=False, values=np.asarray(values, np.float64),
                    histograms=None, tags=tuple(tags)))
        for request in requests:
            if request.kind == "classes":
                totals = _buffers.read(request.totals)
                tags = tuple(f"classes/{k}/{c}" if request.present[k] else None
                             for k in range(MAX_CLASSES) for c in CLASS_COLUMNS)
                last = [table[(i - 1) % n] for i in ids if int(table[(i - 1) % n][0]) == i]
                if last:
                    records[id(request)].append(Record(
                        step=self.fit_step(int(last[-1][0]), last[-1][1]), skipped=False,
                        values=totals.reshape(-1), histograms=None, tags=tags))

    def _fault_scalars(self, step: int, row) -> Dict[str, float]:
        """The `faults/...` scalars of a train step's row (see `_tags`): where
        the first non-finite value of the fit came from, at its step, and
        which optimizers had applied their update before the apply that found
        a fault."""
        scalars: Dict[str, float] = {}
        if not row[5] > 0:  # no fault (or none watched) at this step
            return scalars
        freeze = self._freeze()
        if freeze is not None and freeze.max_gradient_norm is not None:
            scalars[_tags.fault("freeze", "max_gradient_norm")] = float(freeze.max_gradient_norm)
        late = self.applied_before_fault(step)
        if late is not None:
            earlier, faulty = late
            for name in earlier:
                scalars[_tags.fault("freeze", "applied_before", name)] = 1.0
            scalars[_tags.fault("freeze", "found_by", faulty)] = 1.0
        source = self.nan_source() if self._localizes() else None
        if source is None or source["step"] != step:
            return scalars
        model = self._model()
        layer = source["layer"]
        if layer is not None:
            located = _tags.NAN_SOURCE_LAYER
            scalars[_tags.fault("nan_source", "layer", layer)] = 1.0
        elif _replay.is_graph_model(model):
            located = _tags.NAN_SOURCE_LOSS if self.loss_captured else _tags.NAN_SOURCE_TRAIN_STEP
        else:
            located = _tags.NAN_SOURCE_HIDDEN
            scalars[_tags.fault("nan_source", "model", model.name)] = 1.0
        scalars[_tags.fault("nan_source", "located")] = float(located)
        for path in source["variables"]:
            scalars[_tags.fault("nan_source", "gradient", path)] = 1.0
        if self.several_optimizers and source.get("optimizer"):
            scalars[_tags.fault("nan_source", "optimizer", source["optimizer"])] = 1.0
        return scalars

    def _collect_channel(self, channel: Channel, ids, records, several: bool) -> None:
        n = self._steps_per_execution
        meta = _buffers.read(channel.meta)
        rows = [((i - 1) % n, i) for i in ids if meta[(i - 1) % n, 0] == i]
        if not rows:
            return
        steps = [int(meta[row, 1]) for row, _ in rows]
        name = channel.hook.name
        for slot in channel.slots.values():
            request = slot.request
            # A buffer no step of these wrote is not read (10-30 us each).
            has_values, has_histograms = request.written_at(steps)
            values = ids_ = applied = applied_ids = hist = None
            if has_values:
                table = _buffers.read(slot.values)
                ids_, values = table[:, 0], table[:, 1:]
                if slot.applied_values is not None:
                    table = _buffers.read(slot.applied_values)
                    applied_ids, applied = table[:, 0], table[:, 1:]
            if has_histograms:
                hist = [_buffers.read(b) for b in (slot.hist_ids, slot.hist_counts,
                                                   slot.hist_ranges)]
            histogram_tags = slot.histogram_tags()
            for (row, train_id), step in zip(rows, steps):
                histograms = None
                if hist is not None and hist[0][row] == train_id:
                    histograms = (hist[1][row], hist[2][row])
                columns = request.columns_at(step)
                row_values, row_tags = None, slot.tags(several, columns)
                if values is not None and ids_[row] == train_id:
                    row_values = values[row].copy()
                    if applied is not None and applied_ids[row] == train_id:
                        row_values = np.concatenate([row_values, applied[row]])
                        row_tags = row_tags + slot.applied_tags(several, columns)
                records[id(request)].append((train_id, channel.number, Record(
                    step=step, skipped=bool(meta[row, 2]), values=row_values,
                    histograms=histograms, tags=row_tags, histogram_tags=histogram_tags,
                    optimizer=name, applied=bool(meta[row, 3]))))

    def _diagnose(self) -> None:
        """After the first execution with steps: says once, for each request
        that recorded nothing by construction, why."""
        model = self._model()
        applied = [h for h in self.hooks.values() if h.channels]
        found = [name for name, _ in internals.find_optimizers(model)]
        silent: Dict[tuple, List[Request]] = {}
        for request in self.requests:
            if not request.per_variable:
                continue
            if request.kind == "tensors" and request.channel is not None and (
                    request.variables or not {"gradients", "weights"} & set(request.record)):
                continue
            if any(id(request) in c.slots for c in self.channels):
                continue
            if not self.channels:
                if not model.trainable_variables:
                    why = (f"the model {model.name!r} has no trainable variables, so no "
                           "optimizer applied gradients")
                else:
                    why = ("no optimizer applied gradients in the train step (kerasdbg sees "
                           "every Keras optimizer's `apply`/`apply_gradients` called inside "
                           f"`train_step`; the model holds: {', '.join(found) or 'none'}). "
                           "If the train step updates the weights another way (assign, a "
                           "non-Keras optimizer), there is nothing to record")
            else:
                names = ", ".join(h.name for h in applied)
                paths = sorted({p for c in self.channels for p in c.paths})
                listing = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more"
                                                  if len(paths) > 8 else "")
                why = (f"none of the variables that {names} applied matches "
                       f"include={request.include!r}, exclude={request.exclude!r}: "
                       f"{listing}")
            silent.setdefault((request.owner, why), []).append(request)
        # One message per callback and cause, whatever its number of requests.
        for (owner, why), requests in silent.items():
            if any(r.for_rules for r in requests):
                kinds = " or ".join(dict.fromkeys(r.kind for r in requests))
                message = (f"{owner} records no {kinds} this fit: {why}; the rules that read "
                           "them have nothing to read and will not fire.")
            else:
                message = f"{owner} records nothing this fit: {why}."
            if any(r.strict for r in requests):
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def _scheduled_table(slots: List[Slot], step, gate, compute, rows: int):
    """The statistics the slots record at `step`, each computed once.

    Slots are grouped by schedule. In the graph, the first group (largest
    set of statistics first) whose schedule holds at `step` computes its
    statistics and those of every later group and every slot's `frequent`
    ones; when none holds, only the `frequent` ones are computed. So each
    (tensor, statistic) is computed at most once per step, whatever the
    number of slots (consumers) asking for it, and nothing when none does.

    `compute(stats)` returns `(table [rows, len(stats)], scalar)`. Returns
    `(table [rows, len(columns)], columns, scalar)`, NaN where a statistic
    was not computed at this step, or None when no slot ever records.
    """
    groups: Dict[Schedule, List[Slot]] = {}
    for slot in slots:
        groups.setdefault(slot.request.schedule, []).append(slot)

    def ordered(names):
        names = set(names)
        return tuple(s for s in stats_lib.ALL_STATISTICS + WEIGHT_EXTRA_STATISTICS if s in names)

    full = [ordered(s for m in members for s in m.request.base_stats) for members in groups.values()]
    frequent = ordered(s for m in slots for s in m.request.base_frequent)
    predicates = [_and(gate, _scheduled(schedule, step)) for schedule in groups]
    if frequent:
        last = [m.request.schedule.last_step for m in slots if m.request.frequent]
        frequent_gate = gate if None in last else _and(
            gate, tf.less_equal(step, tf.cast(max(last), step.dtype)))
    else:
        frequent_gate = False
    chain = sorted(range(len(full)), key=lambda k: -len(full[k]))
    columns = ordered(s for names in full for s in names)
    if not columns:
        return None
    nan = tf.constant(np.nan, tf.float64)

    def widened(stats):
        table, scalar = compute(stats)
        parts = tf.unstack(table, num=len(stats), axis=1) if stats else []
        by_name = dict(zip(stats, parts))
        fill = tf.fill([rows], nan)
        return tf.stack([by_name.get(s, fill) for s in columns], axis=1), tf.cast(
            scalar, tf.float64)

    def idle():
        return tf.fill([rows, len(columns)], nan), nan

    def branch(k):
        if k == len(chain):
            if frequent_gate is False:
                return idle()
            if frequent_gate is True:
                return widened(frequent)
            return tf.cond(frequent_gate, lambda: widened(frequent), idle)
        stats = ordered([s for j in chain[k:] for s in full[j]] + list(frequent))
        predicate = predicates[chain[k]]
        if predicate is True:
            return widened(stats)
        if predicate is False:
            return branch(k + 1)
        return tf.cond(predicate, lambda: widened(stats), lambda: branch(k + 1))

    table, scalar = branch(0)
    return table, columns, scalar


def _any(predicates):
    """The logical or of `records_at` predicates (Python bools or tensors)."""
    if any(p is True for p in predicates):
        return True
    tensors = [p for p in predicates if p is not False]
    if not tensors:
        return False
    return tensors[0] if len(tensors) == 1 else tf.reduce_any(tf.stack(tensors))


def _slot_rows(table, wanted: List[int], positions: List[int], present: List[bool],
               columns: List[int]) -> tf.Tensor:
    """A slot's flat values from a group's `table` (one row per `wanted`
    position): its positions, its columns, NaN for variables without one."""
    if not wanted:
        return tf.fill([len(positions) * len(columns)], tf.constant(np.nan, tf.float64))
    index = {p: k for k, p in enumerate(wanted)}
    rows = tf.gather(table, [index.get(p, 0) for p in positions])
    rows = tf.gather(rows, columns, axis=1)
    if not all(present):
        mask = tf.constant(present)[:, None]
        rows = tf.where(mask, rows, tf.constant(np.nan, tf.float64))
    return tf.reshape(rows, [-1])


def _wrapped(wrapper, step_function, row):
    def step(data):
        return wrapper(step_function, data, row)

    return step
