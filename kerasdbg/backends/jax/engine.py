"""JAX's capture: per-step records out of Keras's JAX trainer.

Keras's JAX trainer runs a stateless step, `train_step(state, data)`, jitted
when `jit_compile` is on, as a Python loop of `steps_per_execution` calls
per execution; the gradients are made by `jax.value_and_grad` inside it and
go straight to each optimizer's `stateless_apply`, and only the logs and the
new state leave the step. So the quantities are computed inside the step
and leave it as outputs:

- `attach` (the first request) puts kerasdbg's train function in place of
  the one Keras made for this `fit` (made before `on_train_begin`): the
  same loop, over kerasdbg's step `step(state, carry, data) -> (logs, state,
  carry, records)`, jitted as Keras jits its own (state donated, the
  state's shardings kept under a `keras.distribution`), which calls the
  model's own `train_step` (Keras's, or the user's).
- While that step is traced, each optimizer the model holds has its
  `stateless_apply` shadowed (an instance attribute, removed at the end of
  the fit): it computes the requested statistics of the gradients it is
  given and of the weights before and after its update, and hands them to
  the step through a trace-time context; the step returns them. With
  `StopOnRule` it also tests the gradients' finiteness.
- The step with a freeze: a step whose gradients or loss are not finite (or
  whose gradient norm exceeds the freeze's limit), or any step after one,
  returns the state it was given (weights, the forward pass's state such as
  BatchNormalization's moving statistics, and the optimizer's variables,
  its step counter included): no update of a faulty step reaches the
  model. `carry` holds whether the weights are frozen, the train-step
  count and the weights at the fit's start (for `distance_from_start`).
- With the in-graph spike tests or `action="skip"` (`guard`): the spike
  windows and skip flags ride in the carry too, and a skipped step returns
  the state it was given for its optimizer, its step counter included (not
  counted, as Keras's loss scaler does for an overflow), while the debug
  layers' counters and buffers record it as for a freeze. The steps
  kerasdbg skipped or froze, per optimizer (with any freeze armed), ride in
  the carry (`skipped`) and number the steps (`iterations` + those + 1),
  the taps' too; the host keeps
  each optimizer's count (`keras_objects.uncounted_steps`) for later fits.
- With `action="rollback"` (`faults.snapshot` / `faults.put_back`): a
  snapshot is a host copy of the loop's state (`model._jax_state` after an
  execution: weights, the forward pass's state, every optimizer's
  variables, a second optimizer's in the non-trainable state too; not the
  debug layers' counters and buffers) and of the carry's spike windows,
  skip flags and skipped counts. The put-back hands the state to Keras's
  loop as a callback may (`jax_state_sync`: the loop's next execution
  starts from the model's variables) and the carry parts to the next
  execution; the next `rollback_skip` train steps are skipped in the step
  (`forced` in the carry), numbered on from the snapshot's step.
- The host keeps each step's outputs (device arrays) and reads them once
  per execution (`collect`, one `jax.device_get`), then hands each request
  its records, with the same tags as TensorFlow's capture.
- Only what a fit asks for is traced: the class counts of a "classes"
  request (`classes`, totals in the carry), the host timing of a "wrap"
  request (`_timed_execution`, nothing in the step), and for a "tensors"
  request (`StepRecorder`) a second variant of the step, called at the
  recorded steps only (`step_tensors`).

Under `keras.distribution` (`DataParallel`, `ModelParallel`) the step is
one jitted program over the global arrays: the gradients are the global
ones and a sharded variable is described whole, once per step.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import math
import threading
import time
import warnings
import weakref
from typing import Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kerasdbg import _replay
from kerasdbg import stats as stats_lib
from kerasdbg.backends.jax import classes as _classes
from kerasdbg.backends.jax import guard as _guard
from kerasdbg.backends.jax import layer_record as _layer_record
from kerasdbg.backends.jax import nan_source as _nan_source
from kerasdbg.backends.jax import ops as _ops
from kerasdbg.backends.jax import packing as _packing
from kerasdbg.backends.jax import step_tensors as _tensors
from kerasdbg.capture import blocks as _blocks
from kerasdbg.capture import fit_end
from kerasdbg.capture import keras_objects
from kerasdbg.capture import progress as _progress
from kerasdbg.capture import reads
from kerasdbg.capture.interface import (
    LOSS_FROM_COMPUTE_LOSS, LOSS_FROM_METRIC, Capture, FaultState, supported,
)
from kerasdbg.capture.requests import (
    CLASS_COLUMNS, MAX_CLASSES, Record, Request, merged_freeze, scheduled_between, scheduled_in,
    sometimes_recorded, unique_paths,
)
from kerasdbg.quantities import reductions
from kerasdbg.records import tags as _tags
from kerasdbg.records.capture_record import CaptureBlock

KINDS = ("gradients", "weights", "step", "classes", "wrap", "tensors")
"""The request kinds JAX's capture records (`kerasdbg.capture.interface.RECORDS`)."""

# The keys of the step's records that hold its step scalars: their tags.
_CALLS = _tags.step_scalar("calls")
_FIRST = _tags.step_scalar("first")
_FROZEN = _tags.step_scalar("frozen")
_FAULT = _tags.step_scalar("fault")
_NONFINITE = "fault/nonfinite"  # the step's fault is a NaN/Inf (not a norm above the limit)
_GUARD = "guard/"  # + "<optimizer number>/<name>": the guard's values of the step
_SKIPPED = "skipped"  # the carry's key of the steps no optimizer counted (skipped, frozen), per number
_FORCED = "forced"  # the carry's key of the batches left to skip after a rollback
_LOSS = _tags.LOSS

# The keys of what `_timed_execution` adds to an execution's last records:
# its train steps, the host's seconds in `next(iterator)`, the examples.
_TIMING = ("wrap/steps", "wrap/input_seconds", "wrap/examples")
TIMING = ("steps", "input_seconds", "examples")
"""What a "wrap" request's record holds per execution (its `tags`)."""
# What the host adds to a step's records (a read finds them in `Steps.extras`).
_HOST_KEYS = (_tensors.PREFIX + "guess",) + _TIMING

_LOCAL = threading.local()

LOCATE_BYTES = 64 << 20
"""With NaN location each step's batch is kept (a reference) until its step
is read, for the replay of a first fault; past this many bytes of them the
host reads at the next execution's end (at most one execution's batches
then: a large batch on an accelerator is not held for a whole interval)."""


def _context() -> Optional["_StepContext"]:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def skipped_offset(model, counter):
    """The steps kerasdbg kept from counting (skipped or frozen) of the
    optimizer of `model` whose step counter is `counter`, for a debug layer
    that numbers a step while it is
    traced (`layer_record`): in kerasdbg's step, the carry's count (as the
    applies number their steps); in another step (Keras's own, in a fit
    without kerasdbg's capture), the host's count when it is traced, fixed
    in that trace; 0 when kerasdbg never skipped a step of it."""
    context = _context()
    if context is not None and context.engine._model() is model:
        skipped = context.carry.get(_SKIPPED, {})
        for hook in context.engine.hooks.values():
            if keras_objects.raw_iterations(hook.optimizer) is counter \
                    and str(hook.number) in skipped:
                return skipped[str(hook.number)]
        return 0
    for _, optimizer in keras_objects.find_optimizers(model):
        if keras_objects.raw_iterations(optimizer) is counter:
            holder = keras_objects.uncounted_steps(optimizer)
            return 0 if holder is None else int(np.asarray(holder.value))
    return 0


class _StepContext:
    """What one trace of kerasdbg's step collects from the applies in it."""

    def __init__(self, engine: "Engine", carry):
        self.engine = engine
        self.carry = carry
        self.records: Dict[str, object] = {}
        self.oks: List[object] = []
        self.finites: List[object] = []  # whether each apply's gradients were finite
        self.guard: List[_guard.Apply] = []  # each apply's fault test, for the guard
        self.applies: Dict[int, int] = {}
        self.loss = None
        self.first_step = None
        # The labels and predictions Keras's train step hands its metrics.
        self.y = self.y_pred = None
        # A `StepRecorder`'s request, in the step variant that records its
        # tensors (else None), and whether an apply recorded them already.
        self.tensors: Optional[_tensors.TensorRequest] = None
        self.tensors_taken = False
        # Which variant of the step this trace makes (`_Variants`): True, the
        # one that computes the scheduled statistics and histograms (kept at
        # the steps the schedules name, by a select); False, the every-step
        # one that leaves them out; None, one step that picks between them
        # with a condition (unjitted, where the condition is a Python branch).
        self.full: Optional[bool] = None


class _Hook:
    """One optimizer of the model: what it applies and how it is named."""

    def __init__(self, name: str, optimizer, number: int):
        self.name = name
        self.optimizer = optimizer
        self.number = number
        self.variables = list(keras_objects.optimizer_variables(optimizer))
        self.paths = unique_paths(self.variables)
        index = [i for i, v in enumerate(optimizer.variables)
                 if v is keras_objects.raw_iterations(optimizer)]
        self.iterations_index = index[0] if index else None
        self.clipping = keras_objects.clipping(optimizer)
        self.accumulation = keras_objects.accumulation_steps(optimizer)
        # With gradient accumulation: where each variable's accumulator is in
        # the optimizer's variables (what `stateless_apply` is given).
        self.accumulators = _accumulator_positions(optimizer, self.variables) \
            if self.accumulation else None
        self.applies = 0  # the most applies of it seen in one train step
        self._positions: Dict[int, tuple] = {}  # id(request) -> (request, positions)
        # (id(request), columns, several, updated) -> (request, tags)
        self.tags: Dict[tuple, tuple] = {}
        # Mixed precision: the gradients come scaled by the loss scale (a
        # variable of the optimizer), and an overflow is the scaler's to skip.
        scale = getattr(optimizer, "dynamic_scale", None)
        self.scale_index = next((i for i, v in enumerate(optimizer.variables) if v is scale),
                                None) if scale is not None else None

    @property
    def records_applied(self) -> bool:
        """Whether what the optimizer applies differs from the gradients
        (clipping, or the average of the accumulated batches): recorded
        under `applied_gradients/...`."""
        return bool(self.clipping) or self.accumulators is not None

    def positions(self, request: Request) -> List[int]:
        # Asked for every record the host decodes: worked out once per request.
        found = self._positions.get(id(request))
        if found is None or found[0] is not request:
            found = (request, [i for i, (v, p) in enumerate(zip(self.variables, self.paths))
                               if request.selects(p) and keras_objects.is_float(v)])
            self._positions[id(request)] = found
        return found[1]


class _Same:
    """Equal to another `_Same` of the same object while that object lives,
    held weakly where it can be (a kept key must not keep a train function,
    an optimizer or a distribution alive)."""

    def __init__(self, value):
        self._id = id(value)
        self._strong = False
        try:
            self._ref = weakref.ref(value)
        except TypeError:  # None, or an object without weak references
            self._ref = lambda value=value: value
            self._strong = True

    def __eq__(self, other):
        if not isinstance(other, _Same):
            return NotImplemented
        return self._id == other._id and self._ref() is other._ref()

    def __hash__(self):
        return self._id

    @property
    def alive(self) -> bool:
        """Whether the object lives (one held strongly always does)."""
        return self._strong or self._ref() is not None


def _alive(key) -> bool:
    """Whether every object a `_graph_key` names by identity (`_Same`) lives."""
    if isinstance(key, _Same):
        return key.alive
    if isinstance(key, tuple):
        return all(_alive(part) for part in key)
    return True


class _UncountedSteps:
    """The steps kerasdbg kept one optimizer from counting (skipped or
    frozen), on the host
    (`keras_objects.uncounted_steps`): `value`, a NumPy integer, kept up to
    date at each collect from the step's carry, where the count runs."""

    def __init__(self):
        self.value = np.int64(0)


class _Snapshot(NamedTuple):
    """What a rollback puts back (`_Faults.snapshot`), on the host."""

    positions: Tuple[int, ...]
    """The positions in Keras's state (trainable, non-trainable, optimizer
    variables, flattened) that a rollback puts back."""
    values: List[np.ndarray]
    """Their values, in that order."""
    carry: dict
    """The carry's spike windows, skip flags and skipped counts (`guard`,
    `skipped`) that it has."""


_ROLLED_BACK = ("guard", _SKIPPED)
"""The parts of the carry a rollback puts back."""


class _Faults(FaultState):
    """The freeze's host side: whether the weights are frozen now, and
    what `StopOnRule(action="rollback")` asks of the step."""

    def __init__(self, engine: "Engine"):
        self._engine = weakref.proxy(engine)
        self.frozen = False

    def unfreeze(self) -> None:
        self.frozen = False
        carry = self._engine._carry
        # The fit's class counts, spike windows, skipped steps and a
        # rollback's skips to come go on (only the freeze starts over).
        # The train-step count goes on from the carry's (the host's may be
        # behind it: a read takes only the steps the device finished).
        kept = {key: carry[key] for key in (_classes.CARRY, "guard", _SKIPPED, _FORCED)
                if carry is not None and key in carry}
        if carry is not None:
            self._engine._carry = dict(self._engine._first_carry_of(carry), **kept)

    def snapshot(self) -> _Snapshot:
        """A host copy of what a rollback puts back, taken between two
        executions of the fit: the state Keras's loop holds (on JAX the
        model's variables are written back only at an epoch's end), but the
        debug layers' counters and buffers (their records go on), and the
        carry's spike windows, skip flags and skipped counts."""
        return self._engine._snapshot()

    def put_back(self, snapshot: _Snapshot) -> None:
        """Puts `snapshot` back: the next execution starts from its state and
        its carry parts (the debug layers' counters and buffers and the
        metrics as they are now)."""
        self._engine._put_back(snapshot)

    def keep_state(self) -> None:
        """Nothing to do on JAX: a frozen or skipped step puts back the
        state it was given, which after `put_back` is the snapshot's."""

    def skip_next(self, batches: int) -> None:
        """Skips the next `batches` train steps whatever they hold (after a
        rollback; counted in the carry, from the next execution on)."""
        carry = self._engine._carry
        if carry is None or _FORCED not in carry:
            raise RuntimeError("kerasdbg's step of this fit does not skip the batches after a "
                               "rollback (no rollback armed, or no step ran yet)")
        left = np.asarray(batches, np.int32)
        sharding = getattr(carry[_FORCED], "sharding", None)
        self._engine._carry = dict(carry, **{_FORCED: jnp.asarray(left) if sharding is None
                                             else jax.device_put(left, sharding)})


class Engine(Capture):
    """JAX's capture of one model. See the module docstring."""

    reads_at_batch_begin = True
    """Keras's JAX loop calls the batch ends on a worker thread when every
    callback is `async_safe`: the callbacks read at the next batch's begin."""

    times_on_host = True
    """A "wrap" request (`StepTimer`) gets one record per execution, timed
    on the host (`_timed_execution`), not a function around each step."""

    def replica_checker(self):
        """None: under a `keras.distribution` a weight is one array, its
        copies on the devices replicated by its sharding, with no replica's
        own copy to drift from the others."""
        return None

    def tensor_request(self, steps, record, layers, consumer, *, include=None, exclude=None,
                       strict: bool = False, initial: bool = False,
                       start: int = 0) -> _tensors.TensorRequest:
        """The request of a `StepRecorder` (`step_tensors.TensorRequest`)."""
        return _tensors.TensorRequest(steps, record, layers, consumer, include=include,
                                      exclude=exclude, strict=strict, initial=initial,
                                      start=start)

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.requests: List[Request] = []
        self.hooks: Dict[int, _Hook] = {}
        self.installed = False
        self.loss_captured = False
        self.faults = _Faults(self)
        self.trace_count = 0
        self._several = False
        self._plain = None
        self._pending: list = []
        # With NaN location: each pending step's batch (else None), read with its records.
        self._pending_data: list = []
        self._carry = None
        self._calls = 0
        self._step_base = 0
        self._warned = False
        self._out_shardings = None
        self._patched_metrics = False
        self._loss_trackers: list = []
        # Where the traced step's loss came from (set while it is traced).
        self.loss_origin = LOSS_FROM_COMPUTE_LOSS
        self._read_once = False
        self._hold = False  # the next execution runs no step (`hold_next_execution`)
        self._data_bytes = 0  # of the batches kept for NaN location
        self._last_logs = None
        self.clock = reads.ReadClock()  # when the host reads the records
        self.transfers = 0  # reads of the records (device to host), for tests
        self._initial: Dict[str, list] = {}
        self._located = False  # whether this fit's first fault was located
        # The step of this fit, and the one kept for a later fit of the same graph.
        self._step_function = None  # {variant: the jitted step} of this fit (`_Variants`)
        self._recording_function = None  # the step variant of a StepRecorder's steps
        self._variants: Optional["_Variants"] = None
        # The steps of the last fits' graphs, for later fits (`KEPT_GRAPHS`,
        # the least recently used first): {key: {"step": {variant: step},
        # "applies": {optimizer: applies a step}, "classes": what its trace found}}.
        self._kept: "collections.OrderedDict[tuple, dict]" = collections.OrderedDict()
        self._kept_key: Optional[tuple] = None  # this fit's, when it may be kept
        self._kept_applies: Dict[int, int] = {}
        self._kept_classes: Optional[tuple] = None  # what this fit's step's trace found
        # The guard's carry of the last fit, per optimizer (`_Same` of it), for
        # the next fit: the spike windows and skip flags go on, as on TensorFlow.
        self._guard_kept: Dict[object, dict] = {}
        self._guard_seen: Dict[int, int] = {}  # optimizer number -> the last step collected

    # ----------------------------------------------------------- lifecycle
    def attach(self, request: Request) -> None:
        supported(request.owner, request.kind)
        model = self._model()
        if getattr(model, "optimizer", None) is None:
            raise ValueError("kerasdbg: the model has no optimizer; call `model.compile()` "
                             "before `fit`.")
        if request.kind == "step" and request.localize and request.freeze is None:
            # The faulty step's weights are those the freeze keeps: without it
            # they are gone when the host reads the step.
            message = (f"{request.owner}: on the JAX backend NaNSource needs the NaN guard "
                       "(freeze_on_fault=True): without it this fit's faulty step is not "
                       "looked into and NaNSource will not fire.")
            if request.strict:
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        if not self.installed:
            self._install(model)
        self.requests.append(request)
        _progress.of(self).arm()
        if request.kind == "weights" and "distance_from_start" in request.stats \
                and not self._initial:
            # The weights at the fit's start: the model holds them until
            # Keras's loop moves them into its state, at the first batch.
            self._initial = {str(h.number): [_copied(v.value) for v in h.variables]
                             for h in self.hooks.values()}

    def prepare(self) -> None:
        """Nothing to do before a batch but the progress line: the step is
        traced at its first call."""
        _progress.of(self).begin(self._model())

    def _ring(self) -> tuple:
        """`(steps_per_execution, rows of a ring)` of the model now."""
        steps = int(getattr(self._model(), "steps_per_execution", 1) or 1)
        known = self.__dict__.get("_ring_of")
        if known is None or known[0] != (steps, reads.RING_STEPS):
            known = self._ring_of = ((steps, reads.RING_STEPS), (steps, reads.ring_rows(steps)))
        return known[1]

    def hold_next_execution(self) -> None:
        if self._last_logs is not None:  # an execution ran: its logs stand for this one
            self._hold = True

    @property
    def several_optimizers(self) -> bool:
        return self._several

    def detach(self, request: Request) -> None:
        # A variant compiled ahead is traced with this fit's requests: before one goes.
        self._wait_ahead()
        self.collect()
        if request in self.requests:
            self.requests.remove(request)
        if not self.requests:
            self._uninstall()

    def _wait_ahead(self) -> None:
        """Waits for the variants compiled ahead on a thread (`_Jitted.prepare`)."""
        for function in (self._step_function or {}).values():
            if isinstance(function, _Jitted):
                function.wait()

    def abort(self) -> None:
        self._wait_ahead()
        self._forget_kept()
        try:
            self.collect()
        finally:
            self.requests = []
            self._uninstall()

    # --------------------------------------------------------- instrument
    def _install(self, model) -> None:
        found = keras_objects.find_optimizers(model)
        self.hooks = {}
        for number, (name, optimizer) in enumerate(found):
            if not optimizer.built:
                continue  # never applied in this fit: Keras builds what it applies
            hook = _Hook(name, optimizer, number)
            self.hooks[id(optimizer)] = hook
            keras_objects.patch(optimizer, "stateless_apply",
                                self._routed_apply(hook, type(optimizer).stateless_apply))
        self._patched_metrics = "_update_metrics_variables" not in vars(model)
        if self._patched_metrics:
            original = type(model)._update_metrics_variables

            def update_metrics(metrics_variables, unscaled_loss, *args, **kwargs):
                context = _context()
                if context is not None:
                    context.loss = unscaled_loss
                    self.loss_origin = LOSS_FROM_COMPUTE_LOSS
                    if len(args) >= 3:  # x, y, y_pred, sample_weight
                        context.y, context.y_pred = args[1], args[2]
                return original(model, metrics_variables, unscaled_loss, *args, **kwargs)

            keras_objects.patch(model, "_update_metrics_variables", update_metrics)
        self._loss_trackers = keras_objects.watch_loss_metrics(
            model, "stateless_update_state", self._metric_loss)
        self._plain = model.train_function
        self._initial = {}
        self._located = False
        # This fit's kept entry, once `_jitted` found or made it: until then
        # nothing of a trace (a StepRecorder's variant first) writes into an
        # earlier fit's, and a failure drops none of them.
        self._kept_key = None
        self._kept_applies = {}
        self._step_function = None
        self._recording_function = None
        self._several = False
        self.loss_captured = False
        self._read_once = False
        self._hold = False
        self._last_logs = None
        self._data_bytes = 0
        self.clock.begin_fit()
        self._pending = []
        self._pending_data = []
        self._carry = None
        self._calls = 0
        iterations = [keras_objects.step_number(h.optimizer) for h in self.hooks.values()]
        self._step_base = min([i for i in iterations if i > 0], default=0)
        # Where each optimizer starts this fit (read while the model holds its
        # variables; Keras's loop takes them at the first batch).
        self._fit_start = {h.number: n for h, n in zip(self.hooks.values(), iterations)}
        self._variants = _UNDECIDED  # at the first call, when every request is attached
        # The state's shardings under a keras.distribution, read while the
        # model still holds its variables (Keras's loop moves them into its
        # state at the first batch).
        from keras.src.distribution import distribution_lib

        self._out_shardings = None
        if distribution_lib.distribution() is not None and model.jit_compile:
            self._out_shardings = (None, model._get_state_sharding_spec(), None, None)
        model.train_function = self._train_function(model)
        self.faults.frozen = False
        self.installed = True
        fit_end.on_fit_end(model, self, self._after_failed_fit)

    def _metric_loss(self, value) -> None:
        """The step's loss where the train step does not give it to Keras's
        `_update_metrics_variables` (a train step written for JAX, as the
        keras.io guide writes it, updates the metric named "loss" itself
        with `stateless_update_state(variables, loss)`): the value it gives
        that metric (`keras_objects.watch_loss_metrics`), when it is the
        step's own (not one inside `jax.value_and_grad`)."""
        context = _context()
        if context is not None and context.loss is None and _of_the_step(value):
            context.loss = value
            self.loss_origin = LOSS_FROM_METRIC

    def _uninstall(self) -> None:
        _progress.of(self).end(finished=False)
        model = self._model()
        keras_objects.unwatch_loss_metrics(self._loss_trackers, "stateless_update_state")
        self._loss_trackers = []
        for hook in self.hooks.values():
            keras_objects.unpatch(hook.optimizer, "stateless_apply")
        if model is not None:
            if self._patched_metrics:
                keras_objects.unpatch(model, "_update_metrics_variables")
                self._patched_metrics = False
            if self.installed:
                model.train_function = self._plain
                fit_end.cancel_fit_end(model, self)
        self._plain = None
        self.installed = False
        self._keep_guard()
        self._wait_ahead()  # no thread left behind
        # Nothing of this fit kept but the step for a later one (which holds
        # the model only weakly): the state and the optimizers go with the fit.
        self._step_function = None
        self._recording_function = None
        self._variants = None
        self._carry = None
        self._initial = {}
        self._pending = []
        self._pending_data = []
        self._data_bytes = 0
        self.hooks = {}

    def _forget_kept(self) -> None:
        """Drops this fit's step from the kept ones (a fit that raised or was
        aborted: its step may be half traced)."""
        if self._kept_key is not None:
            self._kept.pop(self._kept_key, None)
        self._kept_key = None

    def _after_failed_fit(self) -> None:
        self._wait_ahead()
        self._forget_kept()  # a fit that raised leaves nothing to reuse
        _progress.of(self).end(finished=False)  # it may have raised in its first step
        try:
            self.collect()
        except Exception:  # noqa: BLE001 - the fit already raised
            pass
        self.requests = []
        self._uninstall()

    @staticmethod
    def _uncount(keep, uncounted: dict, applies: Dict[int, int]) -> dict:
        """`uncounted` (the carry's steps each optimizer did not count, by
        number) plus, for each optimizer the step applied (`applies`: number
        -> its applies in the step) and puts back (`keep(number)` false),
        those applies: a frozen or skipped step counts in no optimizer's
        `iterations` (its counter is put back with its other variables), and
        the steps keep their numbers (as on TensorFlow, where each such apply
        counts here instead, also one a loss scaler would have skipped)."""
        uncounted = dict(uncounted)
        for number, count in applies.items():
            key = str(number)
            if key in uncounted:
                uncounted[key] = uncounted[key] + jnp.where(keep(number), 0, count)
        return uncounted

    def _freeze(self):
        """The faults the requests arm, merged as on every backend (`merged_freeze`)."""
        return merged_freeze(self.requests)

    def _guards(self) -> bool:
        """Whether the freeze arms a spike test or a skip (`guard`)."""
        return _guard.armed(self._freeze())

    def _state_roles(self, model) -> List[tuple]:
        """With the guard, what a step keeps of each position of Keras's
        state (trainable, non-trainable, then the model's optimizer's
        variables, flattened; a second optimizer of a train step written for
        JAX keeps its variables in the non-trainable state): `("debug",)` the debug
        layers' counters and buffers, always the step's; `("counter", n)`
        optimizer n's step counter, the step's unless n skipped it or the
        weights are frozen (then `_uncount` counts the step); `("owned", n)`
        the variables optimizer n updates and its own, the step's unless the
        weights are frozen or n skipped;
        `("other",)` the rest (the forward pass's state, such as
        BatchNormalization's moving statistics), the step's unless the
        weights are frozen or an optimizer skipped."""
        hooks = sorted(self.hooks.values(), key=lambda h: h.number)
        counters = {id(keras_objects.raw_iterations(h.optimizer)): h.number for h in hooks}
        owned: Dict[int, int] = {}
        for hook in hooks:
            for variable in list(hook.variables) + list(hook.optimizer.variables):
                owned.setdefault(id(variable), hook.number)
        variables = (list(model.trainable_variables) + list(model.non_trainable_variables) +
                     (list(model.optimizer.variables) if model.optimizer is not None else []))
        roles = []
        for variable in variables:
            if _layer_record.is_debug_variable(variable):
                roles.append(("debug",))
            elif id(variable) in counters:
                roles.append(("counter", counters[id(variable)]))
            elif id(variable) in owned:
                roles.append(("owned", owned[id(variable)]))
            else:
                roles.append(("other",))
        return roles

    def _guard_carry(self, carry: dict) -> None:
        """Adds to a fit's first carry the steps kerasdbg kept each optimizer
        from counting (skipped or frozen), for each that has a count
        (registered here for the host when a fault is armed) and, with the
        guard, its spike windows and skip flags (those of the last fit, else
        empty)."""
        freeze = self._freeze()
        skipped = {}
        for hook in self.hooks.values():
            holder = keras_objects.uncounted_steps(hook.optimizer)
            if holder is None and freeze is not None:
                holder = _UncountedSteps()
                keras_objects.keep_uncounted_steps(hook.optimizer, holder)
            if holder is not None:
                skipped[str(hook.number)] = _on_device(int(np.asarray(holder.value)), np.int32)
        if skipped:
            carry[_SKIPPED] = skipped
        if self._guards():
            kept = {h.number: self._kept_guard_of(h) for h in self.hooks.values()}
            carry["guard"] = _guard.init(freeze, kept)
            if freeze.rollback:
                # Always in the carry (its structure is the jitted step's):
                # the batches left to skip after a rollback, none until one.
                carry[_FORCED] = _on_device(0, np.int32)

    def _kept_guard_of(self, hook) -> dict:
        """The spike windows and skip flags an earlier fit left for `hook`'s
        optimizer, unless it trained steps since that the guard did not see
        (a fit without it in between): then none, the windows refill."""
        kept = self._guard_kept.get(_Same(keras_objects.inner_optimizer(hook.optimizer)), {})
        now = getattr(self, "_fit_start", {}).get(hook.number)
        if kept.get("step") is not None and now is not None and kept["step"] != now:
            return {}
        return kept

    def _take_skipped(self, skipped) -> None:
        """The host's count of each optimizer's skipped steps
        (`keras_objects.uncounted_steps`), from the carry's (host values)."""
        for hook in self.hooks.values():
            holder = keras_objects.uncounted_steps(hook.optimizer)
            if isinstance(holder, _UncountedSteps) and str(hook.number) in skipped:
                holder.value = np.int64(skipped[str(hook.number)])

    def _keep_guard(self) -> None:
        """At the fit's end: each optimizer's skipped steps for the host,
        and the guard's carry for the next fit (as host arrays: a later fit
        may run on other devices)."""
        carry = self._carry
        if carry is None or not (_SKIPPED in carry or "guard" in carry):
            return
        skipped, guard = jax.device_get((carry.get(_SKIPPED), carry.get("guard")))
        if skipped:
            self._take_skipped(skipped)
        if guard is not None:
            by_number = _guard.split(guard)
            for hook in self.hooks.values():
                if hook.number not in by_number:
                    continue
                key = _Same(keras_objects.inner_optimizer(hook.optimizer))
                entry = self._guard_kept.setdefault(key, {_guard.WINDOWS: {}, _guard.FLAGS: {}})
                for part in (_guard.WINDOWS, _guard.FLAGS):
                    entry[part].update(by_number[hook.number][part])
                # Where the optimizer stood: a later fit that finds it moved on
                # without the guard starts with empty windows.
                entry["step"] = self._guard_seen.get(hook.number)

    # ----------------------------------------------------------- rollback
    def _loop_state(self, model) -> List[list]:
        """The state of the fit now, `[trainable, non_trainable, optimizer
        variables]`: the one Keras's loop holds (`model._jax_state`, set
        after each execution), else, between epochs (a validation's loop
        leaves none), the one written back to the model's variables."""
        state = getattr(model, "_jax_state", None) or {}
        groups = (model.trainable_variables, model.non_trainable_variables,
                  model.optimizer.variables if model.optimizer is not None else [])
        keys = ("trainable_variables", "non_trainable_variables", "optimizer_variables")
        if all(state.get(key) is not None for key in keys):
            parts = [list(state[key]) for key in keys]
        else:
            parts = [[v.value for v in group] for group in groups]
        if [len(part) for part in parts] != [len(group) for group in groups]:
            raise RuntimeError("the state Keras's loop holds is not this model's")
        return parts

    def _snapshot(self) -> _Snapshot:
        """See `_Faults.snapshot` (one transfer)."""
        model = self._model()
        flat = [value for part in self._loop_state(model) for value in part]
        positions = tuple(i for i, role in enumerate(self._state_roles(model))
                          if role[0] != "debug")
        carry = {key: self._carry[key] for key in _ROLLED_BACK
                 if self._carry is not None and key in self._carry}
        values, carry = jax.device_get(([flat[i] for i in positions], carry))
        # Own copies: on a CPU a host value may share the buffer of an array
        # that the loop's next execution donates.
        values = [np.array(value) for value in values]
        return _Snapshot(positions, values, jax.tree_util.tree_map(np.array, carry))

    def _put_back(self, snapshot: _Snapshot) -> None:
        """See `_Faults.put_back`."""
        model = self._model()
        parts = self._loop_state(model)
        flat = [value for part in parts for value in part]
        for position, value in zip(snapshot.positions, snapshot.values):
            # A fresh copy: the runtime may alias a host array, and the loop
            # donates its state; the snapshot stays for a later rollback.
            value = np.array(value)
            sharding = getattr(flat[position], "sharding", None)
            flat[position] = jnp.asarray(value) if sharding is None \
                else jax.device_put(value, sharding)
        a, b = len(parts[0]), len(parts[0]) + len(parts[1])
        # As a callback may (Keras's JAX trainer reads `_jax_state` for it):
        # the state goes to the model's variables, and the loop's next
        # execution starts from them; a fit that ends here ends with them.
        model._jax_state = dict(getattr(model, "_jax_state", None) or {},
                                trainable_variables=flat[:a], non_trainable_variables=flat[a:b],
                                optimizer_variables=flat[b:])
        model._jax_state_synced = False
        model.jax_state_sync()
        carry = dict(self._carry if self._carry is not None else self._first_carry(model))
        for key, value in snapshot.carry.items():
            now = carry.get(key)
            if now is not None and jax.tree_util.tree_structure(now) == \
                    jax.tree_util.tree_structure(value):
                # On the devices of the carry's own values (no new compile).
                carry[key] = jax.tree_util.tree_map(
                    lambda old, new: jax.device_put(new, old.sharding), now, value)
            else:
                carry[key] = jax.tree_util.tree_map(jnp.asarray, value)
        self._carry = carry
        if _SKIPPED in snapshot.carry:
            self._take_skipped(snapshot.carry[_SKIPPED])

    # ------------------------------------------------------- in the step
    def _routed_apply(self, hook: _Hook, original):
        optimizer = hook.optimizer

        def stateless_apply(optimizer_variables, grads, trainable_variables):
            new_trainable, new_optimizer = original(
                optimizer, optimizer_variables, grads, trainable_variables)
            context = _context()
            if context is None:
                return new_trainable, new_optimizer
            index = context.applies.get(hook.number, 0)
            context.applies[hook.number] = index + 1
            hook.applies = max(hook.applies, index + 1)
            self._kept_applies[hook.number] = hook.applies
            key = f"{hook.number}/{index}"
            if hook.iterations_index is not None:
                # The counter before the apply, plus one: the step's number even
                # when the loss scaler skips it (the counter does not move then).
                step = jnp.asarray(optimizer_variables[hook.iterations_index], jnp.int32) + 1
                skipped_before = context.carry.get(_SKIPPED, {}).get(str(hook.number))
                if skipped_before is not None:
                    # kerasdbg numbers the steps it skipped too (`iterations` does not count them).
                    step = step + skipped_before
            else:
                step = context.carry["calls"] + 1
            context.records[f"apply/{key}/step"] = step
            if context.first_step is None:
                context.first_step = step
            grads = list(grads)
            floats = [i for i, v in enumerate(hook.variables) if keras_objects.is_float(v)]
            skipped = jnp.asarray(False)
            if hook.scale_index is not None:
                # What the model's gradients are: unscaled, as TensorFlow's capture records.
                scale = optimizer_variables[hook.scale_index]
                skipped = jnp.logical_not(reductions.all_finite([grads[i] for i in floats]))
                grads = [g if i not in floats else g / jnp.asarray(scale, g.dtype)
                         for i, g in enumerate(grads)]
            context.records[f"apply/{key}/skipped"] = skipped
            if hook.accumulation and hook.iterations_index is not None:
                # Keras updates at every `gradient_accumulation_steps`-th batch.
                before = jnp.asarray(optimizer_variables[hook.iterations_index], jnp.int32)
                context.records[f"apply/{key}/applied"] = (before + 1) % hook.accumulation == 0
            joint = _joint_tables(self.requests, hook, step, context.full, grads, new_trainable)
            norm = joint.norm(floats)
            if norm is None:
                norm = reductions.norm_of([grads[i] for i in floats])
            context.records[f"apply/{key}/norm"] = norm
            if context.tensors is not None and not context.tensors_taken:
                self._record_tensors(context, hook, step, optimizer_variables, grads,
                                     new_trainable, skipped)
            freeze = self._freeze()
            if freeze is not None:
                ok = joint.all_finite(floats)
                if ok is None:
                    ok = _all_finite([grads[i] for i in floats])
                context.finites.append(ok)
                if hook.scale_index is not None and freeze.max_gradient_norm is None:
                    ok = jnp.asarray(True)  # an overflow is the loss scaler's to skip
                if any(r.localize for r in self.requests):
                    # Which gradients held NaN/Inf: counted at every step, in
                    # one pass with no condition (NaN localisation reads them
                    # at a fault).
                    nonfinite = joint.nonfinite(floats)
                    if nonfinite is None:
                        counts = stats_lib.tensor_statistics([grads[i] for i in floats],
                                                             ["nan_count", "inf_count"])
                        nonfinite = jnp.sum(counts, axis=1)
                    context.records[f"apply/{key}/nonfinite"] = nonfinite > 0
                if freeze.max_gradient_norm is not None:
                    ok = jnp.logical_and(ok, norm <= freeze.max_gradient_norm)
                    if hook.scale_index is not None:
                        ok = jnp.logical_or(ok, skipped)  # the scaler skips it: no fault
                context.oks.append(ok)
                if _guard.armed(freeze):
                    context.guard.append(self._guard_apply(hook, freeze, context.finites[-1],
                                                           norm, skipped))
            for number, request in enumerate(self.requests):
                if request.kind not in ("gradients", "weights"):
                    continue
                positions = hook.positions(request)
                if not positions:
                    continue
                if request.kind == "gradients":
                    tensors = [grads[i] for i in positions]
                    table = _scheduled(request, step, lambda stats, tensors=tensors, number=number:
                                       joint.table(number, stats, lambda: stats_lib.tensor_statistics(
                                           tensors, stats)), context.full)
                    tail = [norm]
                    averaged = grads
                    if hook.accumulators is not None:
                        # What Keras applies at an update: the batches' gradients
                        # accumulated since the last one, averaged (then clipped).
                        averaged = [g + jnp.asarray(optimizer_variables[j], g.dtype)
                                    for g, j in zip(grads, hook.accumulators)]
                        averaged = [g / hook.accumulation for g in averaged]
                    if hook.clipping and hook.accumulators is not None:
                        # Judged on what an update applies; no clipping between updates.
                        tail.append(jnp.logical_and(
                            _clipped(hook.clipping, [averaged[i] for i in floats],
                                     reductions.norm_of([averaged[i] for i in floats])),
                            context.records.get(f"apply/{key}/applied", True)))
                    elif hook.clipping:
                        tail.append(_clipped(hook.clipping, [grads[i] for i in floats], norm))
                    else:
                        tail.append(jnp.asarray(np.nan, table.dtype))
                    row = jnp.concatenate([jnp.reshape(table, [-1]),
                                           jnp.stack([jnp.asarray(t, table.dtype)
                                                      for t in tail])])
                    if hook.records_applied:
                        # What the optimizer applies: its own clipping of them.
                        applied = keras_objects.clip_gradients(optimizer, averaged) \
                            if hook.clipping else averaged
                        chosen = [applied[i] for i in positions]
                        applied_table = _scheduled(
                            request, step, lambda stats, chosen=chosen:
                            stats_lib.tensor_statistics(chosen, stats), context.full)
                        applied_norm = reductions.norm_of([applied[i] for i in floats])
                        row = jnp.concatenate([row, jnp.reshape(applied_table, [-1]),
                                               jnp.reshape(jnp.asarray(applied_norm,
                                                                       row.dtype), [1])])
                else:
                    tensors = [new_trainable[i] for i in positions]
                    before = [trainable_variables[i] for i in positions]
                    initial = context.carry["initial"].get(str(hook.number))
                    start = [initial[i] for i in positions] if initial is not None else None
                    row = jnp.reshape(_scheduled(
                        request, step, lambda stats, tensors=tensors, before=before, start=start,
                        number=number: joint.table(number, stats, lambda: _weight_table(
                            stats, tensors, before, start)), context.full), [-1])
                context.records[f"apply/{key}/{number}"] = row
                if request.histogram_every_n_steps:
                    context.records[f"apply/{key}/{number}/hist"] = _histograms(
                        request, step, tensors, context.full)
            return new_trainable, new_optimizer

        return stateless_apply

    @staticmethod
    def _guard_apply(hook: _Hook, freeze, finite, norm, scaler_skipped) -> _guard.Apply:
        """The guard's fault test of one apply (`guard.Apply`), as
        TensorFlow's: under a loss scaler, non-finite gradients and their
        norm are the scaler's to skip, no fault."""
        scaled = hook.scale_index is not None
        nonfinite = jnp.asarray(False)
        if freeze.nonfinite_gradients and not scaled:
            nonfinite = jnp.logical_not(finite)
        over = None
        if freeze.max_gradient_norm is not None:
            over = norm > freeze.max_gradient_norm
            if scaled:
                over = jnp.logical_and(over, jnp.logical_not(scaler_skipped))
        return _guard.Apply(hook.number, nonfinite, over, norm)

    def _record_tensors(self, context: "_StepContext", hook: _Hook, step, optimizer_variables,
                        grads, new_trainable, skipped) -> None:
        """A `StepRecorder`'s tensors of this apply, when it is the first of
        the step that applies to the variables the request selects (the
        learning rate: of the step's first apply, until one is selected)."""
        request = context.tensors
        records, prefix = context.records, _tensors.PREFIX
        positions = hook.positions(request)
        if "learning_rate" in request.record and (
                positions or prefix + "learning_rate" not in records):
            from keras.src.backend.common.stateless_scope import StatelessScope

            # The rate the update used: the optimizer's, as the step holds
            # its variables (a schedule reads the step counter).
            mapping = list(zip(hook.optimizer.variables, optimizer_variables))
            with StatelessScope(state_mapping=mapping):
                rate = hook.optimizer.learning_rate
                rate = jnp.asarray(getattr(rate, "value", rate))
            records[prefix + "learning_rate"] = rate
        if not positions:
            return
        context.tensors_taken = True
        request.bind([hook.variables[i] for i in positions], [hook.paths[i] for i in positions])
        records[prefix + "step"] = step
        records[prefix + "skipped"] = skipped  # the loss scaler's: its step comes again
        if "gradients" in request.record:
            applied = keras_objects.clip_gradients(hook.optimizer, grads) if hook.clipping \
                else grads
            records[prefix + "gradients"] = [applied[i] for i in positions]
        if "weights" in request.record:
            records[prefix + "weights"] = [new_trainable[i] for i in positions]

    def _tensor_request(self) -> Optional[_tensors.TensorRequest]:
        for request in self.requests:
            if request.kind == "tensors" and not request.complete:
                return request
        return None

    def _stepper(self, model):
        """The step each call of this execution runs: with a `StepRecorder`,
        the variant that records its tensors at the steps it asks for; else,
        where the schedules take some statistics at some steps only, the
        full or the every-step variant, as the host counts the steps
        (`_Variants`); else the step (see `kerasdbg.backends.jax.step_tensors`)."""
        if self._variants is _UNDECIDED:
            self._variants = _Variants.of(self, model)
        variants = self._variants
        if variants is None:
            step = self._jitted(model)
        else:
            engine = self
            both: list = []  # [every-step, full] once each has run (this execution)

            def step(state, carry, data):
                full = variants.wanted()
                variants.called()
                if both:
                    return both[full](state, carry, data)
                function = engine._jitted(model, full=full)
                other = engine._jitted(model, full=not full)
                if not isinstance(other, _Jitted) or other.ready:
                    if isinstance(function, _Jitted) and isinstance(other, _Jitted):
                        both.extend((other, function) if full else (function, other))
                    return function(state, carry, data)
                # The variant not needed first, compiled for this call's shapes
                # before the loop needs it (not at a step mid-fit), beside the
                # loop, once this call traced the first (one trace at a time).
                abstract = _abstract((state, carry, data))
                out = function(state, carry, data)
                other.prepare(model, abstract)
                return out

        request = self._tensor_request()
        if request is None:
            return step
        engine = self

        def call(state, carry, data):
            if not request.initial_handed:
                request.take_initial(model, state[0])
            if not request.wanted():
                request.called()
                return step(state, carry, data)
            guessed = request.next_step
            request.called()
            if variants is not None:
                variants.called()
            logs, state, carry, records = engine._jitted(model, request)(state, carry, data)
            return logs, state, carry, dict(records, **{_tensors.PREFIX + "guess": guessed})

        return call

    def _train_function(self, model):
        """kerasdbg's train function of this fit: Keras's loop over
        kerasdbg's step (see the module docstring). The step is made at the
        first call, when every request of the fit is attached (`_jitted`)."""
        steps = model.steps_per_execution
        engine = self

        def train_function(state, iterator):
            if engine._hold:
                # A stop decided at this batch's begin: no step runs.
                engine._hold = False
                return engine._last_logs, state
            step = _Guarded(engine._stepper(model))
            carry = engine._carry if engine._carry is not None else engine._first_carry(model)
            try:
                if engine._wants("wrap"):
                    return engine._timed_execution(step, steps, state, carry, iterator)
                keep = engine._keeps_batches()
                data = next(iterator)
                logs, state, carry, records = step(state, carry, data)
                engine._add(records, data, keep)
                try:
                    for _ in range(steps - 1):
                        data = next(iterator)
                        logs, state, carry, records = step(state, carry, data)
                        engine._add(records, data, keep)
                except StopIteration:
                    pass
            except _StepFailed as failed:
                return engine._plain_from(model, failed, steps, iterator)
            engine._carry = carry
            engine._last_logs = logs
            _packing.start_transfer(engine._pending[-steps:])
            return logs, state

        return train_function

    def _plain_from(self, model, failed: "_StepFailed", steps: int, iterator):
        """kerasdbg's step failed (its trace, around a train step it cannot
        follow: never the user's fit to break): the rest of the fit runs
        Keras's own train function from the failed step's state and batch on,
        and the instruments say once that they record nothing more. Raised
        instead: with `strict=True`, or when the failed call had consumed
        the state already (an error at run time, not at trace time)."""
        _progress.of(self).cancel()
        error = failed.__cause__
        leaves = jax.tree_util.tree_leaves(failed.state)
        if any(r.strict for r in self.requests) or any(
                getattr(leaf, "is_deleted", lambda: False)() for leaf in leaves):
            raise error
        owners = ", ".join(dict.fromkeys(r.owner for r in self.requests))
        self.abort()  # hands out what earlier steps recorded; Keras's function back
        warnings.warn(
            f"kerasdbg ({owners}) could not run its step around this model's train step, so "
            f"this fit goes on as plain Keras and they record nothing more in it. Cause: "
            f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
        rest = itertools.chain([failed.data], itertools.islice(iterator, steps - failed.index - 1))
        return model.train_function(failed.state, rest)

    def _timed_execution(self, step, steps: int, state, carry, iterator):
        """One execution of Keras's loop, with the host's time spent
        waiting for each batch (`next(iterator)`) and the examples in them:
        host timing only, so the steps run as without it (no
        `block_until_ready`: the device's work on one step goes on while
        the host fetches the next batch). They ride on the execution's last
        records as host values (`_TIMING`)."""
        clock = time.perf_counter
        waited, examples, ran = 0.0, 0.0, 0
        logs = records = None
        for _ in range(steps):
            begin = clock()
            try:
                data = next(iterator)
            except StopIteration:
                if ran == 0:
                    raise
                break
            waited += clock() - begin
            examples += _examples(data)
            logs, state, carry, records = step(state, carry, data)
            ran += 1
            self._add(records, data)
        # The timing rides on the execution's last records (each step's once,
        # also when the data ends before `steps`).
        self._pending[-1] = dict(self._pending[-1], **{
            _TIMING[0]: float(ran), _TIMING[1]: waited, _TIMING[2]: examples})
        self._carry = carry
        self._last_logs = logs
        return logs, state

    def _graph_key(self, model) -> Optional[tuple]:
        """What the step traced for this fit depends on: a later fit with an
        equal key runs the step jitted for an earlier one (no new trace and
        compile). None: never reused."""
        from keras.src.distribution import distribution_lib

        keys = [request.graph_key() for request in self.requests]
        if any(key is None for key in keys):
            return None
        step = vars(model).get("train_step", type(model).train_step)
        # Keras's own train function of this fit: `compile` makes a new one
        # (another loss or metrics), so a recompiled model traces again.
        return (tuple(keys), id(step), bool(model.jit_compile), bool(model.run_eagerly),
                _Same(distribution_lib.distribution()),
                # Keras's function, also when the debug layers wrap it for a loop.
                _Same(getattr(self._plain, "__wrapped__", self._plain)),
                tuple((h.number, _Same(h.optimizer)) for h in self.hooks.values()),
                tuple(id(v) for v in model.trainable_variables),
                tuple(sorted(self._initial)))

    def _jitted(self, model, tensors: Optional[_tensors.TensorRequest] = None,
                full: Optional[bool] = None):
        """The step of this fit, in its variant `full` (`_Variants`): the
        one jitted for an earlier fit of the same graph (`_graph_key`), else
        a new one. With `tensors`: its variant that records a
        `StepRecorder`'s tensors (made once a fit, a full one)."""
        if tensors is not None:
            if self._recording_function is None:
                full = True if isinstance(self._variants, _Variants) else None
                self._recording_function = self._compiled(model, self._step(model, tensors, full))
            return self._recording_function
        if self._step_function is None:
            key = self._graph_key(model)
            kept = self._kept.pop(key, None) if key is not None else None
            self._kept_key = key
            if kept is not None:
                self._kept[key] = kept  # the most recently used
                # What its trace found: how many applies of each optimizer a step makes.
                self._kept_applies = kept["applies"]
                for hook in self.hooks.values():
                    hook.applies = self._kept_applies.get(hook.number, 0)
                self._label(kept["classes"])
                self._step_function = kept["step"]
            else:
                self._kept_applies = {}
                self._step_function = {}
                if key is not None:
                    for dead in [k for k in self._kept if not _alive(k)]:
                        del self._kept[dead]  # a graph no later fit can match
                    self._kept[key] = {"step": self._step_function,
                                       "applies": self._kept_applies, "classes": None}
                    while len(self._kept) > KEPT_GRAPHS:
                        self._kept.popitem(last=False)
        step = self._step_function.get(full)
        if step is None:
            step = self._step_function[full] = self._compiled(model, self._step(model, full=full))
            if isinstance(step, _Jitted):
                step.variant = full
                # Two variants pass each other their outputs: one program each.
                step.keeps = full is not None
        return step

    def _compiled(self, model, step):
        """`step` jitted as Keras jits its own (the state donated, its
        shardings kept), its records packed into two arrays
        (`kerasdbg.backends.jax.packing`: each output of a jitted call costs
        the host, a dozen per step on a GPU as much as a small model's step);
        as it is when the model runs without `jit_compile`."""
        if model.run_eagerly or not model.jit_compile:
            return step
        inner, call = _packing.packed(step)
        jitted = jax.jit(inner, donate_argnums=0, out_shardings=self._out_shardings)
        return _Jitted(jitted, call)

    def _first_carry(self, model):
        carry = {"frozen": _on_device(False, np.bool_),
                 "calls": _on_device(self._calls, np.int32), "initial": self._initial}
        if self._wants("classes"):
            carry[_classes.CARRY] = _classes.zeros()
        self._guard_carry(carry)
        return carry

    def _first_carry_of(self, carry) -> dict:
        """A fresh carry (not frozen) with the calls counted in `carry`."""
        return {"frozen": _on_device(False, np.bool_), "calls": carry["calls"],
                "initial": self._initial}

    def _localizes(self) -> bool:
        return any(r.localize for r in self.requests)

    def _keeps_batches(self) -> bool:
        """Whether the steps keep their batches (NaN location, until a fault
        of this fit is located): decided once an execution."""
        return not self._located and self._localizes()

    def _add(self, records, data, keep: Optional[bool] = None) -> None:
        """Keeps a step's records until they are read, and where `keep`
        (None: `_keeps_batches()`) its batch (a reference, no copy: the
        batches of one execution)."""
        self._pending.append(records)
        if keep is None:
            keep = self._keeps_batches()
        if keep:
            self._pending_data.append(data)
            # Bounded: past LOCATE_BYTES of batches kept, the host reads (`collect`).
            self._data_bytes += _nbytes(data)
        else:
            self._pending_data.append(None)

    def _wants(self, kind: str) -> bool:
        return any(r.kind == kind for r in self.requests)

    def _label(self, found: Optional[tuple]) -> None:
        """Tells the "classes" requests what the step's trace found: None (no
        labels and class predictions to count) or the number of classes."""
        self._kept_classes = found
        kept = self._kept.get(self._kept_key) if self._kept_key is not None else None
        if kept is not None:
            kept["classes"] = found
        for request in self.requests:
            if request.kind == "classes":
                request.labelled = found is not None
                classes = found[0] if found is not None else 0
                request.present = [k < classes for k in range(MAX_CLASSES)]

    def _step(self, model, tensors: Optional[_tensors.TensorRequest] = None,
              full: Optional[bool] = None):
        engine = self
        model_ref = weakref.ref(model)  # the kept step must not keep the model alive

        def step(state, carry, data):
            model = model_ref()
            engine.trace_count += 1
            context = _StepContext(engine, carry)
            context.tensors = tensors
            context.full = full
            stack = getattr(_LOCAL, "stack", None)
            if stack is None:
                stack = _LOCAL.stack = []
            stack.append(context)
            try:
                logs, new_state = model.train_step(state, data)
            finally:
                stack.pop()
            frozen = carry["frozen"]
            records = dict(context.records)
            fault = jnp.asarray(False)
            guard, skipped = carry.get("guard"), carry.get(_SKIPPED)
            forced = carry.get(_FORCED)  # the batches left to skip after a rollback
            if guard is not None and context.guard:
                fault, frozen, new_state, guard, skipped, forced = engine._guarded(
                    model, context, carry, state, new_state, records)
            elif engine._freeze() is not None:
                oks, finites = list(context.oks), list(context.finites)
                if context.loss is not None:
                    loss_finite = reductions.all_finite(context.loss)
                    oks.append(loss_finite)
                    finites.append(loss_finite)
                ok = jnp.all(jnp.stack(oks)) if oks else jnp.asarray(True)
                fault = jnp.logical_not(ok)
                if finites and engine._localizes():
                    # A fault NaNSource looks into: a NaN/Inf, not a norm above the limit.
                    records[_NONFINITE] = jnp.logical_and(
                        fault, jnp.logical_not(jnp.all(jnp.stack(finites))))
                keep = jnp.logical_and(ok, jnp.logical_not(frozen))
                trainable, non_trainable, optimizer_variables, metrics = new_state
                new = list(trainable) + list(non_trainable) + list(optimizer_variables)
                old = list(state[0]) + list(state[1]) + list(state[2])
                kept = _selected(keep, new, old)
                for position, role in enumerate(engine._state_roles(model)):
                    if role[0] == "debug":  # they record the faulty step too
                        kept[position] = new[position]
                if skipped is not None:
                    skipped = engine._uncount(lambda number: keep, skipped, context.applies)
                a, b = len(trainable), len(trainable) + len(non_trainable)
                new_state = (kept[:a], kept[a:b], kept[b:], metrics)
                frozen = jnp.logical_or(frozen, fault)
            calls = carry["calls"] + 1
            records[_CALLS] = calls
            records[_FROZEN] = frozen
            records[_FAULT] = fault
            if context.first_step is not None:
                records[_FIRST] = context.first_step
            if context.loss is not None:
                records[_LOSS] = context.loss
            if tensors is not None and not context.tensors_taken \
                    and context.first_step is not None:
                # No variable the request selects was applied: what does not
                # need the variables is recorded all the same, and it is said.
                records[_tensors.PREFIX + "step"] = context.first_step
                applied = [h for h in engine.hooks.values() if h.number in context.applies]
                tensors.unselected(", ".join(h.name for h in applied),
                                   sorted({p for h in applied for p in h.paths}))
            if tensors is not None and _tensors.PREFIX + "step" in records:
                if "loss" in tensors.record and context.loss is not None:
                    records[_tensors.PREFIX + "loss"] = context.loss
                outputs = _tensors.layer_outputs(model, tensors, state, data)
                if outputs:
                    records[_tensors.PREFIX + "layer_outputs"] = outputs
            for name, value in _flat_logs(logs).items():
                records[f"logs/{name}"] = value
            # The weights at the fit's start go in, never out: an output that
            # returns an input unchanged is a copy of it at every step (the
            # whole model's weights), so the caller hands them in again (`_Guarded`).
            new_carry = {"frozen": frozen, "calls": calls}
            if guard is not None:
                new_carry["guard"] = guard
            if skipped is not None:
                new_carry[_SKIPPED] = skipped
            if forced is not None:
                new_carry[_FORCED] = forced
            if _classes.CARRY in carry:
                counted = _classes.counts(context.y, context.y_pred)
                engine._label(None if counted is None else (counted[1],))
                new_carry[_classes.CARRY] = carry[_classes.CARRY] if counted is None \
                    else carry[_classes.CARRY] + counted[0]
            return logs, new_state, new_carry, records

        return step

    def _guarded(self, model, context: "_StepContext", carry, state, new_state, records):
        """The guard's decisions for one train step (`guard.update` on its
        applies' fault tests and its loss): the state it keeps (per
        position, `_state_roles`), its values into `records`, and the
        carry's new guard, skipped counts and batches left to skip after a
        rollback. Returns `(fault, frozen, new_state, guard, skipped,
        forced)`."""
        freeze = self._freeze()
        loss, loss_nonfinite = None, jnp.asarray(False)
        if context.loss is not None:
            # The step's loss, as `step/loss` records it (one program over
            # the global batch under a keras.distribution: the global loss).
            loss = jnp.sum(jnp.asarray(context.loss, jnp.float32))
            if freeze.nonfinite_loss:
                loss_nonfinite = jnp.logical_not(reductions.all_finite(context.loss))
        left = carry.get(_FORCED)
        # Once per train step, whatever its applies (see `Faults.skip_next`).
        forced = None if left is None else left > 0
        outcome = _guard.update(freeze, carry["guard"], carry["frozen"], loss, loss_nonfinite,
                                context.guard, forced)
        if self._localizes():
            # A fault NaNSource looks into: a NaN/Inf, not a norm above the limit.
            records[_NONFINITE] = outcome.nonfinite
        for name, number, value in outcome.values:
            records[f"{_GUARD}{number}/{name}"] = value
        skips = outcome.skips
        any_skip = functools.reduce(jnp.logical_or, skips.values())
        keep = jnp.logical_not(outcome.frozen)
        trainable, non_trainable, optimizer_variables, metrics = new_state
        new = list(trainable) + list(non_trainable) + list(optimizer_variables)
        old = list(state[0]) + list(state[1]) + list(state[2])
        only = next(iter(skips)) if len(skips) == 1 else None

        def counts(number):
            # Whether optimizer `number` counts the step: not when it skipped, nor frozen.
            return jnp.logical_and(keep, jnp.logical_not(skips[number]))

        groups: Dict[tuple, list] = {}
        for position, role in enumerate(self._state_roles(model)):
            if role[0] == "debug":
                continue  # the debug layers record the step whatever happens to it
            number = role[1] if len(role) > 1 else only
            if role[0] == "counter":
                if number not in skips:
                    continue  # not applied in this step: nothing to put back
                key = ("counter", number)
                predicate = counts(number)
            else:
                key = ("keep", number)
                predicate = jnp.logical_and(keep, jnp.logical_not(
                    any_skip if number is None else skips.get(number, jnp.asarray(False))))
            groups.setdefault(key, [predicate, []])[1].append(position)
        kept = list(new)
        for predicate, positions in groups.values():
            chosen = _selected(predicate, [new[i] for i in positions], [old[i] for i in positions])
            for position, value in zip(positions, chosen):
                kept[position] = value
        a, b = len(trainable), len(trainable) + len(non_trainable)
        new_state = (kept[:a], kept[a:b], kept[b:], metrics)
        skipped = carry.get(_SKIPPED)
        if skipped is not None:
            skipped = self._uncount(counts, skipped,
                                    {n: context.applies.get(n, 1) for n in skips})
        if forced is not None:
            left = left - forced.astype(jnp.int32)
        return outcome.fault, outcome.frozen, new_state, outcome.state, skipped, left

    # ----------------------------------------------------------- on host
    def collect(self, final: bool = True, batch: Optional[int] = None) -> None:
        """Reads what the steps since the last call recorded (one transfer)
        and hands each request its records."""
        _progress.of(self).end()
        if final:
            self.clock.final()
        elif not self.clock.first_at(batch):
            return  # another callback decided at this batch
        if not self._pending:
            return
        ready = len(self._pending)
        if not final and self._read_once:
            # Read when the clock says so (`kerasdbg.capture.reads`), and then,
            # at an interval, only the steps the device finished: the read never
            # waits for it. A request read after every execution (a rollback's,
            # a timer's) and an interval of 0 read every step run.
            requests = self.requests
            every = not requests or self._data_bytes > LOCATE_BYTES or \
                not all(r.deferred for r in requests)
            steps, rows = self._ring()
            if not self.clock.due(len(self._pending), steps, rows, every_execution=every):
                return
            if not every and reads.interval() > 0 and \
                    len(self._pending) <= 2 * reads.RING_STEPS and jax.default_backend() != "cpu":
                # (On a CPU the device is the host: a read waits at most for
                # the step in flight, and the reads stay those the clock says.)
                ready = next((i for i, records in enumerate(self._pending)
                              if not _packing.ready(records)), ready)
                if ready == 0:
                    return
        self._read_once = True
        self.clock.read()
        pending, self._pending = self._pending[:ready], self._pending[ready:]
        batches, self._pending_data = self._pending_data[:ready], self._pending_data[ready:]
        self._data_bytes = sum(_nbytes(data) for data in self._pending_data)
        totals = skipped = None
        if not self._pending and self._carry is not None:
            # The carry's totals describe the last step run: read with it.
            if self._wants("classes"):
                totals = self._carry.get(_classes.CARRY)
            skipped = self._carry.get(_SKIPPED)
            totals, skipped = jax.device_get((totals, skipped))
        self.transfers += 1
        if skipped:
            # Where the steps stand for the host (`keras_objects.step_number`).
            self._take_skipped(skipped)
        groups = _packing.fetch_columns(pending, _HOST_KEYS)
        self._several = self._several or sum(h.applies > 0 for h in self.hooks.values()) > 1
        out: Dict[int, List[Record]] = {id(r): [] for r in self.requests}
        step = None
        first = 0
        for group in groups:
            step = self._read_steps(group, batches[first:first + group.count], out)
            first += group.count
        if totals is not None and groups:
            # The totals after the last of these steps, as TensorFlow's capture records them.
            for request in self.requests:
                if request.kind == "classes" and request.labelled:
                    out[id(request)].append(self._classes_record(request, step, totals))
        for request in self.requests:
            request.deliver(out[id(request)])

    def _read_steps(self, group: "_packing.Steps", batches: list,
                    out: Dict[int, List[Record]]) -> int:
        """Adds to `out` (per request, in step order) the records of the
        steps of `group` (steps of one layout, as columns: each record's
        values of every step in one array), and returns the last step."""
        columns, count = group.columns, group.count
        if _tensors.PREFIX + "step" in columns:
            for i, extras in enumerate(group.extras):
                if _tensors.PREFIX + "guess" in extras:
                    for request in self.requests:
                        if request.kind == "tensors":
                            request.take(int(extras[_tensors.PREFIX + "guess"]), group.step(i))
        calls = np.asarray(columns[_CALLS]).astype(np.int64).reshape(count)
        self._calls = int(calls[-1])
        steps = (np.asarray(columns[_FIRST]).astype(np.int64).reshape(count) if _FIRST in columns
                 else self._step_base + calls)
        frozen = np.asarray(columns[_FROZEN]).astype(bool).reshape(count)
        self.loss_captured = self.loss_captured or _LOSS in columns
        self.faults.frozen = self.faults.frozen or bool(frozen.any())
        # Per request, per step: the records of that step, optimizers in their order.
        found: Dict[int, List[List[Record]]] = {id(r): [[] for _ in range(count)]
                                               for r in self.requests}
        no = np.zeros(count, bool)
        # A request that one apply alone records in these steps (one optimizer
        # applied once a step) takes its steps as blocks (`Request.blocks`).
        sources = {number: sum(f"apply/{h.number}/{i}/{number}" in columns
                               for h in self.hooks.values() for i in range(h.applies))
                   for number, request in enumerate(self.requests) if request.blocks}
        blocked: Dict[int, list] = {}
        for hook in sorted(self.hooks.values(), key=lambda h: h.number):
            guard_skipped = columns.get(f"{_GUARD}{hook.number}/skipped")
            dropped = frozen if guard_skipped is None else \
                frozen | np.asarray(guard_skipped).astype(bool).reshape(count)
            for index in range(hook.applies):
                key = f"apply/{hook.number}/{index}"
                if f"{key}/step" not in columns:
                    continue
                applied = np.asarray(columns[f"{key}/step"]).astype(np.int64).reshape(count)
                # Where the guard last saw this optimizer (`_kept_guard_of`).
                self._guard_seen[hook.number] = int(applied[-1])
                skipped = columns.get(f"{key}/skipped")
                if isinstance(self._variants, _Variants):
                    # A step a loss scaler skipped is made again under its number.
                    redo = skipped is not None and bool(np.asarray(skipped).reshape(count)[-1])
                    self._variants.seen(hook.number, int(calls[-1]), int(applied[-1]) - redo)
                skipped = no if skipped is None else np.asarray(skipped).astype(bool).reshape(count)
                # False at a batch that gradient accumulation only accumulated.
                updated = columns.get(f"{key}/applied")
                updated = ~no if updated is None else \
                    np.asarray(updated).astype(bool).reshape(count)
                for number, request in enumerate(self.requests):
                    rows = columns.get(f"{key}/{number}")
                    if rows is None:
                        continue
                    rows = np.asarray(rows, np.float64).reshape(count, -1)
                    hist = columns.get(f"{key}/{number}/hist")
                    weights = request.kind == "weights"
                    if sources.get(number) == 1 and not self._several:
                        blocked[id(request)] = self._blocks(
                            request, hook, applied, rows, hist, skipped, updated,
                            ~dropped if weights else ~no)
                        continue
                    into = found[id(request)]
                    for i in range(count):
                        if weights and dropped[i]:
                            continue  # weights the freeze or a skip threw away
                        into[i].append(self._record(
                            request, hook, int(applied[i]), rows[i],
                            None if hist is None else (hist[0][i], hist[1][i]),
                            bool(skipped[i]), bool(updated[i])))
        step_values = None
        for request in self.requests:
            into = found[id(request)]
            kept = out[id(request)]
            if request.kind == "step":
                # As blocks; `Request.deliver` makes a record a step of them
                # for a request that takes none.
                if step_values is None:
                    step_values = self._step_values(group)
                values, tags, own = step_values
                kept.extend(_blocks.items_of(
                    np.zeros(count, np.int8), np.ones(count, bool), ~own,
                    lambda rows, _: CaptureBlock(steps[rows], values[rows], tags),
                    lambda i: self._step_record(int(steps[i]), group.step(i),
                                                batches[i] if i < len(batches) else None)))
                continue
            if request.kind == "wrap":
                for i, extras in enumerate(group.extras):
                    if _TIMING[0] in extras:
                        into[i].append(Record(
                            step=int(steps[i]), skipped=False, histograms=None, tags=TIMING,
                            values=np.asarray([extras[k] for k in _TIMING], np.float64)))
            for records in into:
                kept.extend(records)
            kept.extend(blocked.get(id(request), ()))
        return int(steps[-1])

    def _blocks(self, request: Request, hook: _Hook, applied, rows, hist, skipped, updated,
                kept) -> list:
        """The records of `request` from `hook`'s one apply a step, as
        `CaptureBlock`s (a record of its own where a step has a histogram
        or no values), in step order."""
        codes = request.column_sets(applied)
        blockable = codes > 0
        # What an update applied is recorded at the updates only: a block's
        # steps all update, or none does.
        codes = np.where(blockable, codes * 2 + updated, codes)
        drawn = np.zeros(len(applied), bool)  # the steps with a histogram
        if hist is not None and request.histogram_every_n_steps:
            drawn = applied % request.histogram_every_n_steps == 0
        # A step that records nothing of it says nothing, but a skip, a
        # histogram or a batch that only accumulated.
        kept = kept & (blockable | skipped | drawn | ~updated)
        blockable &= ~drawn
        several = self._several

        def block(chosen, code):
            columns, update = request.columns_of(code // 2), bool(code % 2)
            key = (id(request), columns, several, update)
            tags = hook.tags.get(key)
            if tags is None or tags[0] is not request:
                tags = hook.tags[key] = (request, self._record_tags(request, hook, columns,
                                                                    update))
            return CaptureBlock(applied[chosen], rows[chosen], tags[1], skipped[chosen],
                                updated[chosen], hook.name)

        def record(i):
            return self._record(request, hook, int(applied[i]), rows[i],
                                None if hist is None else (hist[0][i], hist[1][i]),
                                bool(skipped[i]), bool(updated[i]))

        return _blocks.items_of(codes, kept, blockable, block, record)

    def _record(self, request: Request, hook: _Hook, step: int, row, hist,
                skipped: bool = False, updated: bool = True) -> Record:
        columns = request.columns_at(step)
        several = self._several
        key = (id(request), columns, several, updated)
        tags = hook.tags.get(key)
        if tags is None or tags[0] is not request:
            tags = hook.tags[key] = (request, self._record_tags(request, hook, columns, updated))
        tags = tags[1]
        values = None if columns is None else np.asarray(row, np.float64)
        histograms = histogram_tags = None
        if hist is not None and step % request.histogram_every_n_steps == 0:
            positions = hook.positions(request)
            histograms = (np.asarray(hist[0], np.float64), np.asarray(hist[1], np.float64))
            histogram_tags = tuple(_tags.tensor(request.kind, hook.paths[i]) for i in positions)
        return Record(step=step, skipped=skipped, values=values, histograms=histograms,
                      tags=tags, histogram_tags=histogram_tags or (),
                      optimizer=hook.name, applied=updated)

    def _record_tags(self, request: Request, hook: _Hook, columns, updated: bool = True) -> tuple:
        """The tags of a record of `request` from `hook` holding `columns`
        (the same at most steps: worked out once per layout); at a batch
        that gradient accumulation only accumulated (`updated` False),
        nothing was applied: no `applied_gradients/...`."""
        positions = hook.positions(request)
        several = self._several
        optimizer = hook.name if several else None
        wanted = [columns is not None and s in columns for s in request.stats]
        tags = []
        for i in positions:
            tags += [_tags.statistic(request.kind, hook.paths[i], s) if w else None
                     for s, w in zip(request.stats, wanted)]
        if request.kind == "gradients":
            tags.append(_tags.per_optimizer(request.kind, _tags.GLOBAL_NORM, optimizer)
                        if columns is not None else None)
            tags.append(_tags.per_optimizer(request.kind, _tags.CLIPPED, optimizer)
                        if hook.clipping and columns is not None else None)
            if hook.records_applied:
                # The applied gradients (averaged over the accumulated batches, after
                # the optimizer's clipping), as on TensorFlow.
                kind = _tags.APPLIED_GRADIENTS
                for i in positions:
                    tags += [_tags.statistic(kind, hook.paths[i], s) if w and updated else None
                             for s, w in zip(request.stats, wanted)]
                tags.append(_tags.per_optimizer(kind, _tags.GLOBAL_NORM, optimizer)
                            if columns is not None and updated else None)
        return tuple(tags)

    @staticmethod
    def _classes_record(request: Request, step: int, totals) -> Record:
        tags = tuple(_tags.statistic(_tags.CLASSES, str(k), c) if request.present[k] else None
                     for k in range(MAX_CLASSES) for c in CLASS_COLUMNS)
        return Record(step=step, skipped=False,
                      values=np.asarray(totals, np.float64).reshape(-1), histograms=None,
                      tags=tags)

    def _nan_source(self, batch) -> List[tuple]:
        """`(tag, value)` of the layer part of a first fault's NaNSource:
        `located` (`NAN_SOURCE_*`), then the first layer output that held
        NaN/Inf, or the subclassed model whose layers the replay cannot see.

        The faulty step's forward pass is replayed here, on the host's call,
        once per fit: on its batch (`batch`, kept with its records) and the
        weights the loop holds now, which the freeze kept at those the step
        started from (`nan_source`). Nothing of it is traced or compiled
        before a fault."""
        model = self._model()
        tag = _tags.fault("nan_source", "located")
        if model is not None and not _replay.is_graph_model(model):
            return [(tag, float(_tags.NAN_SOURCE_HIDDEN)),
                    (_tags.fault("nan_source", "model", model.name), 1.0)]
        if model is None or batch is None or not _nan_source.replayable(model, batch):
            # No batch to replay (a train step given no inputs): not examined.
            return [(tag, float(_tags.NAN_SOURCE_GRADIENTS))]
        names: List[str] = []
        try:
            index = _nan_source.replay(model, _loop_weights(model), batch, names)
        except Exception as error:  # noqa: BLE001 - the verdict says what was examined
            warnings.warn(f"kerasdbg (NaNSource) could not replay the faulty step's layers, "
                          f"so its verdict names the gradients only. Cause: "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
            return [(tag, float(_tags.NAN_SOURCE_GRADIENTS))]
        if index is not None:
            return [(tag, float(_tags.NAN_SOURCE_LAYER)),
                    (_tags.fault("nan_source", "layer", names[index]), 1.0)]
        located = _tags.NAN_SOURCE_LOSS if self.loss_captured else _tags.NAN_SOURCE_TRAIN_STEP
        return [(tag, float(located))]

    def _step_values(self, group: "_packing.Steps") -> tuple:
        """`(values [n, tags], tags, own [n])` of the step records of the
        steps of `group`: the steps of a layout share their tags; `own`: a
        step with a fault, whose record says more (`_step_record`)."""
        columns, count = group.columns, group.count

        def column(key):
            values = np.asarray(columns[key], np.float64).reshape(count, -1)
            if values.shape[1] != 1:
                raise ValueError(key)  # not a scalar a step: made on its own
            return values[:, 0]

        tags, keys = self._step_layout(columns)
        try:
            values = np.full((count, len(keys)), np.nan)
            for position, key in enumerate(keys):
                if key is not None:
                    values[:, position] = column(key)
        except (ValueError, TypeError):
            values = None
        own = np.ones(count, bool) if values is None else values[:, 2] != 0
        if _NONFINITE in columns:
            own |= np.asarray(columns[_NONFINITE]).reshape(count, -1).any(axis=1)
        return values, tuple(tags), own

    def _step_layout(self, keys) -> Tuple[List[Optional[str]], List[Optional[str]]]:
        """`(tags, keys)` of a step record whose step's records have `keys`:
        the loss (None where the step has none), frozen, fault, the train
        step's logs, the guard's values (step/skipped, step/gradient_norm,
        step/spike_fraction, per optimizer); each tag's key in the records."""
        tags = [_tags.step_scalar("loss") if _LOSS in keys else None,
                _tags.step_scalar("frozen"), _tags.step_scalar("fault")]
        found = [_LOSS if _LOSS in keys else None, _FROZEN, _FAULT]
        for key in keys:
            if key.startswith("logs/"):
                name = key[len("logs/"):]
                if name == "loss" and _LOSS in keys:
                    continue  # the step's own loss comes first
                tags.append(_tags.step_scalar(name))
                found.append(key)
        names = {str(h.number): h.name for h in self.hooks.values()}
        for key in keys:
            if key.startswith(_GUARD):
                number, _, name = key[len(_GUARD):].partition("/")
                tags.append(_tags.per_optimizer(
                    _tags.STEP, name, names.get(number, number) if self._several else None))
                found.append(key)
        return tags, found

    def _step_record(self, step: int, records: dict, batch=None) -> Record:
        tags, keys = self._step_layout(records)
        values = [np.nan if key is None else float(records[key]) for key in keys]
        freeze = self._freeze()
        if bool(records[_FAULT]) and freeze is not None \
                and freeze.max_gradient_norm is not None:
            tags.append(_tags.fault("freeze", "max_gradient_norm"))
            values.append(float(freeze.max_gradient_norm))
        if bool(records.get(_NONFINITE, False)) and not self._located and self._localizes():
            # The first fault of the fit: the first layer output and the
            # gradients that held NaN/Inf.
            self._located = True
            for tag, value in self._nan_source(batch):
                tags.append(tag)
                values.append(value)
            for hook in sorted(self.hooks.values(), key=lambda h: h.number):
                floats = [p for p, v in zip(hook.paths, hook.variables)
                          if keras_objects.is_float(v)]
                for index in range(hook.applies):
                    flags = records.get(f"apply/{hook.number}/{index}/nonfinite")
                    if flags is None or not np.any(flags):
                        continue
                    tags += [_tags.fault("nan_source", "gradient", p)
                             for p, bad in zip(floats, flags) if bad]
                    values += [1.0] * int(np.sum(flags))
                    if self._several:
                        tags.append(_tags.fault("nan_source", "optimizer", hook.name))
                        values.append(1.0)
        return Record(step=step, skipped=False, values=np.asarray(values, np.float64),
                      histograms=None, tags=tuple(tags))


def _loop_weights(model):
    """`(trainable, non_trainable)` values of `model` now: those of the
    running loop's state (Keras writes them back to the variables only at
    an epoch's end), else the variables'."""
    state = getattr(model, "_jax_state", None) or {}
    trainable = state.get("trainable_variables")
    non_trainable = state.get("non_trainable_variables")
    if trainable is None:
        trainable = [v.value for v in model.trainable_variables]
    if non_trainable is None:
        non_trainable = [v.value for v in model.non_trainable_variables]
    return trainable, non_trainable


class _StepFailed(Exception):
    """A call of kerasdbg's step raised (the error is its `__cause__`): the
    state and batch it was given, and its place in the execution."""

    def __init__(self, state, data, index: int):
        super().__init__("kerasdbg's step failed")
        self.state, self.data, self.index = state, data, index


_UNDECIDED = object()


class _Variants:
    """The host's choice, call by call, between the two variants of the
    jitted step, so that the step that runs at most calls holds no condition
    and computes no more than what is recorded at every step.

    Keras's JAX loop calls the step once per batch from Python, so the host
    knows each call before it runs. The full variant computes every scheduled
    statistic and histogram and keeps them, by a select, at the steps the
    schedules name; the every-step variant computes only the statistics
    recorded at every step (the l2 norms, the NaN/Inf counts). The host runs
    the full one at the calls whose steps a schedule names, counting each
    optimizer's steps from where it stood at the fit's start (its applies a
    call), corrected at every read by the steps the records say were made.
    A loss scaler that skips a step does not move the count, so past a read
    an optimizer with one may be up to a step behind the host's count per
    call since: for it the full variant runs from the first call that may
    make a scheduled step until the read that says which did.
    """

    def __init__(self, engine: "Engine", requests: List[Request]):
        self.engine = engine
        self.requests = requests
        self.made = 0  # calls of the step this fit
        self.anchor: Dict[int, Tuple[int, int]] = {}  # number -> (call, its last step)
        # `(first call, [wanted at each call from it])`, worked out at once for
        # the calls up to the next read (which moves the anchors).
        self._window: Optional[Tuple[int, List[bool]]] = None
        self._seen_call = 0  # the call of the last read
        self._span = 0  # the calls between the last two reads

    @classmethod
    def of(cls, engine: "Engine", model) -> Optional["_Variants"]:
        """The choice, where the fit's step is jitted and a request takes
        some of its statistics or its histograms at some steps only."""
        if model.run_eagerly or not model.jit_compile:
            return None  # unjitted: the step's conditions are Python branches
        requests = sometimes_recorded(engine.requests)
        return cls(engine, requests) if requests else None

    def wanted(self) -> bool:
        """Whether the next call runs the full variant: after the fit's first
        read (the step traced, each optimizer's applies a call known), read
        off the window of the calls until the next read."""
        call = self.made + 1
        window = self._window
        if window is not None:
            offset = call - window[0]
            if 0 <= offset < len(window[1]):
                return window[1][offset]
        if not self.anchor or self._span < WINDOW_SPAN:
            # Before the first read, or reads every few calls: call by call.
            return self.wanted_at(call)
        calls = np.arange(call, call + WINDOW_CALLS, dtype=np.int64)
        wanted = np.zeros(WINDOW_CALLS, bool)
        for hook in self.engine.hooks.values():
            applies = max(hook.applies, 1)
            since, last = self.anchor.get(hook.number,
                                          (0, self.engine._fit_start.get(hook.number, 0)))
            first = last + (calls - since - 1) * applies + 1
            low = np.full_like(first, last + 1) if hook.scale_index is not None else first
            wanted |= scheduled_in(self.requests, np.maximum(low, 1), first + applies - 1)
        self._window = (call, wanted.tolist())
        return self._window[1][0]

    def wanted_at(self, call: int) -> bool:
        """Whether call `call` runs the full variant (the anchors as they are)."""
        for hook in self.engine.hooks.values():
            applies = max(hook.applies, 1)
            since, last = self.anchor.get(hook.number,
                                          (0, self.engine._fit_start.get(hook.number, 0)))
            first = last + (call - since - 1) * applies + 1
            low = last + 1 if hook.scale_index is not None else first
            if scheduled_between(self.requests, max(low, 1), first + applies - 1):
                return True
        return False

    def called(self) -> None:
        self.made += 1

    def seen(self, number: int, call: int, step: int) -> None:
        """A read: call `call` of this fit made optimizer `number`'s step `step` last."""
        self.anchor[number] = (call, step)
        self._window = None
        if call != self._seen_call:
            self._span, self._seen_call = call - self._seen_call, call


WINDOW_CALLS = 512
"""The calls whose variant `_Variants.wanted` works out at once."""
WINDOW_SPAN = 16
"""The fewest calls between two reads for which a window pays."""


KEPT_PROGRAMS = 4
"""The compiled programs a variant keeps (one per shape of its arguments)."""
KEPT_GRAPHS = 4
"""The steps an engine keeps for later fits, one per graph (`Engine._graph_key`):
fits that alternate their instruments (a bench's configurations, a search's
trials on one model) trace and compile each once, not at every fit."""


def _abstract(arguments):
    """The shapes, dtypes and shardings of the arrays of `arguments` (what a
    program is compiled for; the arrays themselves may be donated)."""
    # An array not committed to a device has no sharding of its own: it
    # goes where the computation runs.
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if a._committed
                                       else None)
        if isinstance(a, jax.Array) else a, arguments)


class _Jitted:
    """A jitted variant of the step, with its records packed
    (`packing.packed`'s `call`): called as the jitted function, or, once
    `prepare` compiled it ahead for the arguments' shapes, as that
    compiled program (a call of other shapes, such as an epoch's last
    batch, goes to the jitted function, which traces them)."""

    def __init__(self, jitted, call):
        self.jitted = jitted
        self.call = call
        # Compiled programs, the one that ran last first: the one compiled ahead
        # (`prepare`), those kept from calls of `jitted` (`keeps`).
        self.programs: list = []
        self.ready = False  # compiled, by a call or ahead
        self.variant: Optional[bool] = None  # `_Variants`' full, every-step, or the one step
        self.keeps = False  # whether the program of the first call of `jitted` is kept (`ahead`)
        self.waited = 0.0  # seconds a caller waited for the compilation `prepare` started

    def prepare(self, model, arguments) -> None:
        """Traces and compiles the variant for the shapes of `arguments`
        (`(state, carry, data)`, or their `_abstract`) without running it, on a
        thread of its own: the loop goes on meanwhile, and waits for it
        only if it needs the variant before it is compiled (`wait`)."""
        self.ready = True
        abstract = _abstract(arguments)
        # Keras keeps its settings (the distribution, scopes) per thread: the
        # trace sees the loop thread's.
        from keras.src.backend.common import global_state

        # Its own copy of a list or dict (the name scope stack, a defaultdict
        # of names), made here: the loop thread may trace meanwhile and
        # change its own.
        settings = [{name: copy.copy(value) if isinstance(value, (list, dict)) else value
                     for name, value in vars(tracker).items()} for tracker in
                    (global_state.GLOBAL_STATE_TRACKER, global_state.GLOBAL_SETTINGS_TRACKER)]

        def compile_ahead():
            try:
                for tracker, values in zip((global_state.GLOBAL_STATE_TRACKER,
                                            global_state.GLOBAL_SETTINGS_TRACKER), settings):
                    for name, value in values.items():
                        setattr(tracker, name, value)
                self.programs.append(self.jitted.lower(*abstract).compile())
            except Exception:  # noqa: BLE001 - compiled at its first call instead
                pass

        self._thread = threading.Thread(target=compile_ahead, name="kerasdbg-compile",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Waits for the compilation `prepare` started, if any (`waited`
        adds the seconds the caller waited)."""
        thread, self._thread = getattr(self, "_thread", None), None
        if thread is not None:
            begin = time.perf_counter()
            thread.join()
            self.waited += time.perf_counter() - begin

    @property
    def ahead(self):
        """The program the next call tries first (None before any is compiled)."""
        return self.programs[0] if self.programs else None

    def __call__(self, state, carry, data):
        self.ready = True
        self.wait()
        programs = self.programs
        for index, program in enumerate(programs):
            try:
                out = self.call(program, state, carry, data)
            except TypeError:  # other shapes or structure (an epoch's last batch)
                continue
            except ValueError:  # other shardings: refused before it ran, else raised
                if any(getattr(leaf, "is_deleted", lambda: False)()
                       for leaf in jax.tree_util.tree_leaves(state)):
                    raise
                continue
            if index:
                programs.insert(0, programs.pop(index))
            return out
        if not (self.keeps or programs):
            return self.call(self.jitted, state, carry, data)
        # The variants pass each other their outputs, which the device may or
        # may not have committed, and a jitted function's signature holds
        # whether each argument is: a new mix would compile the variant again
        # (0.9 s on a small MLP, at a step mid-fit and in every later fit). So
        # the program of this call is kept and run from now on, as the one
        # compiled ahead is (lowered again for the same arguments, it comes
        # from the jitted function's cache, not compiled again); a call of
        # other shapes (a later fit's batch size) keeps its own beside it.
        abstract = _abstract((state, carry, data))
        out = self.call(self.jitted, state, carry, data)
        try:
            programs.insert(0, self.jitted.lower(*abstract).compile())
            del programs[KEPT_PROGRAMS:]
        except Exception:  # noqa: BLE001 - the jitted function goes on
            pass
        return out


class _Guarded:
    """A step whose failure carries what the plain function needs to go on."""

    def __init__(self, step):
        self._step = step
        self._calls = 0

    def __call__(self, state, carry, data):
        index = self._calls
        self._calls += 1
        try:
            logs, new_state, new_carry, records = self._step(state, carry, data)
        except Exception as error:  # noqa: BLE001 - judged in `_plain_from`
            raise _StepFailed(state, data, index) from error
        if "initial" in carry:  # an input of every step, not an output (`Engine._step`)
            new_carry = dict(new_carry, initial=carry["initial"])
        return logs, new_state, new_carry, records


def _selected(predicate, new: list, old: list) -> list:
    """`new` where `predicate` holds, else `old`, as a `lax.cond`: the one
    condition left in the step with a freeze armed. A select (`where`) would
    hold no condition, but XLA fuses it into the update that makes `new`, and
    the fused update is no longer contracted into FMAs as plain Keras's is:
    BatchNormalization's moving statistics then differ from plain Keras's in
    the last bit (measured on XLA CPU; an optimization barrier does not
    survive its pipeline). Training bitwise plain Keras's comes first."""
    if not new:
        return []
    return list(_ops.cond(predicate, lambda: list(new), lambda: list(old)))


def _on_device(value, dtype):
    """`value` as a device array of `dtype`, put there as `jnp.asarray` puts
    it (uncommitted) but without compiling a program (`jnp.asarray` of a
    Python scalar compiles one to stage it: milliseconds at a fit's start).

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.backends.jax.engine import _on_device
        >>> _on_device(3, np.int32).dtype, _on_device(3, np.int32).committed
        (dtype('int32'), False)
    """
    return jax.device_put(np.asarray(value, dtype))


def _copied(array):
    """A copy of a device array on its devices, with its sharding, made
    without compiling a program (`jnp.array` compiles a copy per shape: 5-10
    ms each at a fit's start)."""
    try:
        return jax.device_put(array, may_alias=False)
    except TypeError:  # a JAX without `may_alias`
        return jnp.array(array)


def _nbytes(data) -> int:
    """The bytes of the arrays of a batch (0 for None)."""
    if data is None:
        return 0
    total = 0
    for leaf in jax.tree_util.tree_leaves(data):
        # From the shape and dtype: a JAX array's `nbytes` costs microseconds.
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        try:
            total += math.prod(shape) * np.dtype(dtype).itemsize
        except TypeError:  # no shape, or a dtype NumPy does not know (a PRNG key's)
            total += int(getattr(leaf, "nbytes", 0) or 0)
    return total


def _examples(data) -> float:
    """The examples in a batch: the length of its first array (NaN: none)."""
    for leaf in jax.tree_util.tree_leaves(data):
        shape = getattr(leaf, "shape", None)
        if shape:
            return float(shape[0])
    return float("nan")


def _histograms(request: Request, step, tensors, full: Optional[bool] = None):
    """`stats.histograms` of `tensors` at the request's histogram steps, NaN
    at the others: in the full variant of the step (`full`) computed and
    kept by a select at those steps, in the every-step one not computed;
    with `full` None, one `lax.cond`."""
    def compute():
        return stats_lib.histograms(tensors, request.bins)

    def nothing():
        counts, ranges = jax.eval_shape(compute)
        return (jnp.full(counts.shape, np.nan, counts.dtype),
                jnp.full(ranges.shape, np.nan, ranges.dtype))

    at = request.histograms_at(step)
    if full is None or isinstance(at, bool):
        return _ops.cond(at, compute, nothing)
    if not full:
        return nothing()
    return tuple(jnp.where(at, value, empty) for value, empty in zip(compute(), nothing()))


def _scheduled(request: Request, step, compute, full: Optional[bool] = None):
    """`compute(request.stats)` at the steps the request's schedule records
    in full; at the others only its every-step (`frequent`) statistics, the
    other columns NaN. In the full variant of the step (`full` True) all are
    computed and a select keeps the others at the scheduled steps only; in
    the every-step variant (`full` False) only the frequent ones are
    computed; with `full` None, one `lax.cond` (a step pays for what it
    records)."""
    stats = tuple(request.stats)
    frequent = tuple(s for s in stats if s in request.frequent)
    scheduled = request.records_at(step)
    if scheduled is True or frequent == stats:
        return compute(stats)

    def part():
        if not frequent:  # nothing recorded at this step: not computed
            return jnp.full(jax.eval_shape(lambda: compute(stats)).shape, np.nan)
        table = compute(frequent)
        nan = jnp.full((table.shape[0],), np.nan, table.dtype)
        return jnp.stack([table[:, frequent.index(s)] if s in frequent else nan
                          for s in stats], axis=1)

    if scheduled is False or full is False:
        return part()
    if full is None:
        return _ops.cond(scheduled, lambda: compute(stats), part)
    table = compute(stats)
    # The frequent columns the same as the every-step variant's (one pass gives both).
    kept = np.asarray([s in frequent for s in stats])
    return jnp.where(jnp.logical_or(scheduled, kept), table, jnp.asarray(np.nan, table.dtype))


def _accumulator_positions(optimizer, variables) -> Optional[List[int]]:
    """The position of each variable's gradient accumulator among the
    optimizer's variables; None where one is not found there."""
    where = {id(v): i for i, v in enumerate(optimizer.variables)}
    try:
        found = [where.get(id(a)) for a in keras_objects.accumulators(optimizer, variables)]
    except (AttributeError, KeyError, IndexError, ValueError):
        return None
    return None if any(i is None for i in found) else found


def _flat_logs(logs) -> dict:
    """The scalar logs of a train step, nested dicts flattened as Keras
    flattens them for the callbacks (`keras.src.utils.python_utils.pythonify_logs`:
    keys in sorted order, a nested dict's keys at the top level; a train
    step's metrics loop logs the compiled metrics as one dict)."""
    out = {}
    for name, value in sorted((logs or {}).items()):
        if isinstance(value, dict):
            out.update(_flat_logs(value))
        elif hasattr(value, "shape") or isinstance(value, (int, float, np.number)):
            if jnp.ndim(value) == 0:
                out[name] = value
            else:
                out.pop(name, None)  # Keras's value for the name: not a scalar
    return out


def _of_the_step(value) -> bool:
    """Whether `value` is one of the step's own (a value of its jit trace, or
    concrete), not one of a transformation inside it (`jax.value_and_grad`,
    `vmap`), which cannot leave that transformation."""
    if not isinstance(value, jax.core.Tracer):
        return hasattr(value, "shape")
    return type(value).__name__ == "DynamicJaxprTracer"


class _Joint:
    """The every-step statistics of one apply's requests that compute the
    same statistics (the gradients' and the weights' norms and counts), taken
    as one table over all their tensors (`_joint_tables`): one set of padded
    matrices and reductions, not one per request; the global norm and the
    freeze's finite test read the gradients' rows of it."""

    def __init__(self, tables: Dict[tuple, jnp.ndarray], gradients: Optional[tuple]):
        self._tables = tables  # (request number, stats) -> its rows
        self._gradients = gradients  # (positions, stats, rows) of a gradients request, or None

    def table(self, number: int, stats, compute):
        found = self._tables.get((number, tuple(stats)))
        return compute() if found is None else found

    def _column(self, floats, name):
        if self._gradients is None:
            return None
        positions, stats, rows = self._gradients
        if list(positions) != list(floats) or name not in stats:
            return None
        return rows[:, stats.index(name)]

    def norm(self, floats):
        """The global norm of the gradients `floats`, from their l2 norms here (None: not here)."""
        norms = self._column(floats, "l2_norm")
        return None if norms is None else reductions.global_norm(norms)

    def nonfinite(self, floats):
        """The NaN and Inf elements of each of the gradients `floats`, by
        their counts here (None: not here)."""
        nan, inf = self._column(floats, "nan_count"), self._column(floats, "inf_count")
        return None if nan is None or inf is None else nan + inf

    def all_finite(self, floats):
        """Whether the gradients `floats` are all finite, by their counts here (None: not here)."""
        counts = self.nonfinite(floats)
        return None if counts is None else jnp.sum(counts) == 0


def _joint_tables(requests, hook: "_Hook", step, full, grads, new_trainable) -> _Joint:
    """In the every-step variant (`full` False): the statistics of the
    requests of gradients and weights of `hook` whose statistics at this step
    are the every-step norms and counts (`stats.NORM_STATISTICS`; `_scheduled`
    takes the frequent ones, or all of them at every step), as one table over
    their tensors, each set of tensors once, every column for each; each
    request's rows and columns are cut from it."""
    if full is not False:
        return _Joint({}, None)
    entries, blocks = [], {}
    for number, request in enumerate(requests):
        if request.kind not in ("gradients", "weights"):
            continue
        positions = tuple(hook.positions(request))
        if not positions:
            continue
        stats = tuple(request.stats)
        frequent = tuple(s for s in stats if s in request.frequent)
        scheduled = request.records_at(step)
        taken = stats if (scheduled is True or frequent == stats) else frequent
        if not taken or not set(taken) <= set(stats_lib.NORM_STATISTICS):
            continue
        source = grads if request.kind == "gradients" else new_trainable
        blocks.setdefault((request.kind, positions), [source[i] for i in positions])
        entries.append((number, request.kind, positions, taken))
    if len({kind for kind, _ in blocks}) < 2:
        # One kind: the requests' own tables share their reductions (XLA computes them once).
        return _Joint({}, None)
    union = tuple(s for s in stats_lib.NORM_STATISTICS
                  if any(s in taken for _, _, _, taken in entries))
    rows = stats_lib.tensor_statistics([t for tensors in blocks.values() for t in tensors],
                                       union)
    where, start = {}, 0
    for block, tensors in blocks.items():
        where[block] = rows[start:start + len(tensors)]
        start += len(tensors)
    tables, gradients = {}, None
    for number, kind, positions, taken in entries:
        part = where[(kind, positions)]
        tables[(number, taken)] = part[:, [union.index(s) for s in taken]]
    for (kind, positions), part in where.items():
        if kind == "gradients" and gradients is None:
            gradients = (positions, union, part)
    return _Joint(tables, gradients)


def _all_finite(tensors):
    """Whether every element of `tensors` is finite, from their NaN and Inf
    counts as the statistics count them: the same reductions as a request's
    counts of these tensors (XLA computes them once), not a pass of its own."""
    if not tensors:
        return jnp.asarray(True)
    counts = stats_lib.tensor_statistics(tensors, ["nan_count", "inf_count"])
    return jnp.sum(counts) == 0


def _clipped(clipping, grads, norm):
    """Whether the optimizer's clipping changed the gradients."""
    kind, value = clipping
    if kind == "clipvalue":
        return jnp.any(jnp.stack([jnp.max(jnp.abs(g)) > value for g in grads]))
    if kind == "clipnorm":
        norms = stats_lib.tensor_statistics(grads, ["l2_norm"])[:, 0]
        return jnp.any(norms > value)
    return norm > value


def _weight_table(stats, weights, before, start):
    """`stats` of the weights after the update, with the update ratio (from
    their values before it) and the distance from the fit's start."""
    base_names = tuple(s for s in stats if s in stats_lib.ALL_STATISTICS)
    columns = {}
    if base_names:
        base = stats_lib.tensor_statistics(weights, base_names)
        columns = {s: base[:, i] for i, s in enumerate(base_names)}
    def norm_of_change(since):  # of each weight: ||after - since||, on the packed tensors
        after = stats_lib.Packed.of(weights)
        since = stats_lib.Packed.of([s.astype(w.dtype) for w, s in zip(weights, since)])
        return stats_lib.tensor_statistics(after.less(since), ["l2_norm"])[:, 0]

    if "update_ratio" in stats:
        update = norm_of_change(before)
        previous = stats_lib.tensor_statistics(before, ["l2_norm"])[:, 0]
        columns["update_ratio"] = jnp.where(update == 0, jnp.zeros_like(update),
                                            update / previous)
    if "distance_from_start" in stats and start is not None:
        columns["distance_from_start"] = norm_of_change(start)
    return jnp.stack([columns[s] for s in stats], axis=1)


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model) -> Engine:
    """The model's engine, created on first use (not stored on the model)."""
    engine = _ENGINES.get(model)
    if engine is None:
        engine = Engine(model)
        _ENGINES[model] = engine
    return engine


__all__ = ["Engine", "engine_for", "KINDS"]
