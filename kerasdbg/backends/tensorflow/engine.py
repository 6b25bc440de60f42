"""The core of the capture engine: one per model, the life cycle, the train step.

`engine_for(model)` gives the model's `Engine`. It wraps the model's
`train_step` for the duration of a `fit`, routes every optimizer apply of
the traced train step through itself (`_route_apply`, `_route_reduce`),
finds the apply's channel and has its `Quantities` and `Faults` do their
work around the update; its `Collector` reads the buffers on the host. The
package docstring (`kerasdbg.capture`) describes the life cycle.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.backends.tensorflow import ops as _ops
from kerasdbg.sinks import events as _events
from kerasdbg.backends.tensorflow import distribute
from kerasdbg.capture import keras_objects
from kerasdbg.backends.tensorflow import optimizer_routing as routing
from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg.backends.tensorflow.channels import Channel, Hook
from kerasdbg.capture import fit_end
from kerasdbg.capture import progress as _progress
from kerasdbg.capture import reads as read_clock
from kerasdbg.backends.tensorflow.collect import Collector
from kerasdbg.capture.interface import LOSS_FROM_COMPUTE_LOSS, LOSS_FROM_METRIC, Capture
from kerasdbg.backends.tensorflow import faults as faults_module
from kerasdbg.backends.tensorflow import logits as _logits_lib
from kerasdbg.backends.tensorflow.faults import Faults
from kerasdbg.backends.tensorflow.quantities import Quantities, _several_replicas
from kerasdbg.backends.tensorflow import variants as _variants
from kerasdbg.capture.requests import (
    CLASS_COLUMNS, MAX_CLASSES, MAX_STEP_SCALARS, Request, _STEP_FIXED, _and,
    unique_paths,
)


class _StepState:
    """What the engine keeps about the train step being traced (per replica)."""

    def __init__(self, engine: "Engine", train_id, x):
        self.engine = engine
        self.train_id = train_id
        self.x = x
        self.applies: Dict[int, int] = {}
        self.in_apply = False
        self.loss = None  # compute_loss's, this replica's
        self.loss_from_metric = False  # the loss given to the metric "loss", not compute_loss's
        self.loss_sum = None  # summed over replicas
        self.y = self.y_pred = None
        self.fault = None
        self.first_step = None  # the step of the first optimizer apply
        self.frozen_before = None  # whether an earlier step froze the weights
        self.localizations: List[Callable[[], None]] = []  # for the step's end
        # The applies traced so far, in order, and the index among them of the
        # first whose own fault test failed (-1: none), in-graph.
        self.order: List["Channel"] = []
        self.first_fault = None
        # The guard's values of the applies: (name, optimizer, tensor), and
        # whether an apply skipped its step.
        self.guard: List[tuple] = []
        self.skip = None
        self.forced = None  # whether the step is skipped after a rollback
        self.logits = None  # layer path -> the largest attention logits of its calls


class _ApplyContext:
    """One apply being traced: its channel and what `_before_apply` found."""

    def __init__(self, state: _StepState, channel: Channel):
        self.state = state
        self.channel = channel
        self.step = None
        self.frozen = None
        self.frozen_before = None
        self.loss = None
        self.step_slots = None
        self.clipped = None
        self.applied = None
        self.spike = None  # the guard's spike test (in-graph), when armed
        self.skip = None  # whether this apply skips its step, when a skip is armed
        self.iterations = None  # the optimizer's step count before the apply


class _Traced:
    """The instrumented train function of a model's last `fit`, kept for a
    later `fit` whose requests build the same graph (`Engine._graph_key`):
    that fit runs it instead of tracing again. It hangs on Keras's own train
    function of that fit (`TRACED_ATTRIBUTE`), which the model holds again
    after the fit: a `compile` that drops Keras's function drops it too, and
    the model's own attributes are as kerasdbg found them.

    It holds no request (their consumers are the callbacks of that fit): the
    requests' trace state (`Request.trace_state`) and, per channel, the slots
    by the position of their request in the engine's list."""

    def __init__(self, key, function, states, slots, considered, engine: "Engine"):
        self.key = key  # Keras's function it stood in for is part of it
        self.function = function
        self.states = states
        self.slots = slots  # [(channel, position, slot)]
        self.considered = considered  # [(channel, position)]
        self.several = engine._several
        self.loss_captured = engine.loss_captured
        self.loss_origin = engine.loss_origin
        self.step_names = list(engine._step_names)
        self.bypassed = dict(engine.bypassed)
        self.routed = set(engine.routed)


TRACED_ATTRIBUTE = "_kerasdbg_traced"
"""The attribute of Keras's train function that holds its `_Traced` (not on
the engine: the function refers to the model, and the engine table's values
must not keep its keys alive)."""


def _pop_traced(function) -> Optional[_Traced]:
    """The `_Traced` that hangs on Keras's train function `function`, taken off."""
    traced = getattr(function, TRACED_ATTRIBUTE, None)
    if isinstance(traced, _Traced):
        try:
            delattr(function, TRACED_ATTRIBUTE)
        except (AttributeError, TypeError):
            return None
        return traced
    return None


def _same_key(a, b) -> bool:
    """Keys of `_graph_key`: `(identities, values)`, identities compared by `is`."""
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))
            and a[1] == b[1])


_ABSENT = object()
_TLS = threading.local()
# (replica id, id(inner optimizer)) -> the apply being traced: the reduction
# may run in another thread than `apply` (a merge_call under Mirrored).
_CONTEXTS: Dict[Tuple[Optional[int], int], _ApplyContext] = {}
# (replica id or None in a cross-replica context, id(inner optimizer)) -> the
# flag that skips the update of the apply being traced (see `_route_update`).
_GATES = faults_module.GATES


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
    replicas = tf.distribute.get_replica_context()
    if replicas is not None and replicas.num_replicas_in_sync == 1 and not tf.executing_eagerly():
        # The sum over one replica is the gradients themselves. Keras's
        # reduction calls `ReplicaContext.all_reduce`, whose graph-mode
        # `tf.custom_gradient` registers a gradient function that keeps the
        # whole traced step alive for the life of the process (TensorFlow
        # issue #97697): one leaked train graph per trace, the larger the
        # more kerasdbg records. Skipped here, instrumented traces leak none.
        reduced = list(grads_and_vars)
    else:
        reduced = original(grads_and_vars)
    context = _CONTEXTS.get((distribute.replica_id(), id(optimizer)))
    if context is not None:
        engine = context.state.engine
        engine._guard(lambda: engine.quantities.record_applied(context, reduced))
    else:
        state = getattr(_TLS, "state", None)
        if state is not None and not state.in_apply:
            # The optimizer reduces the gradients it applies, but its `apply`
            # did not pass through `_route_apply`: something calls a copy of
            # it that it saved (an instance attribute `apply`, say).
            state.engine.bypassed.setdefault(id(optimizer), optimizer)
    return reduced


def _route_update(optimizer, original, distribution, grads_and_vars, learning_rate):
    """The variables' update, skipped in a frozen step of an apply that has
    a `Gate` (`Faults.apply_unless_frozen`)."""
    gate = _GATES.get((distribute.replica_id(), id(optimizer)))
    if gate is None:
        return original(distribution, grads_and_vars, learning_rate)
    _skip_if(gate.frozen, optimizer, lambda: original(distribution, grads_and_vars,
                                                      learning_rate))
    return None


def _route_average(optimizer, original, variables):
    """EMA's update of its averages and its overwrite of the variables with
    them (`use_ema=True`), skipped in a frozen step (see `_route_update`):
    both come after the update and read the variables it wrote, so plain
    Keras too runs neither in the call that meets the end of a dataset of
    unknown length."""
    gate = _GATES.get((distribute.replica_id(), id(optimizer)))
    if gate is None:
        return original(variables)
    if getattr(original, "func", original).__name__ == routing.AVERAGE_METHODS[1]:
        # The overwrite runs in Keras's own condition on the step count and
        # reads no count itself: a read here would put the count's variable
        # in that condition, and the count written after it would wait for
        # this step's batch.
        def run():
            original(variables)
            return tf.constant(True)

        tf.cond(gate.frozen, lambda: tf.constant(False), run)
        return None
    _skip_if(gate.frozen, optimizer, lambda: original(variables))
    return None


def _route_weight_decay(optimizer, original, variables):
    """Weight decay, skipped after a step froze the weights and undone at the
    step that freezes them (see `_route_update`).

    Keras decays the weights before the gradients are known, and plain Keras
    also decays in the call that meets the end of a dataset of unknown
    length, where no batch comes: the decay itself waits only for the flag an
    earlier step left, and the values before it are put back once this
    step's fault test says so (that condition waits for the batch, the decay
    does not)."""
    gate = _GATES.get((distribute.replica_id(), id(optimizer)))
    if gate is None or getattr(optimizer, "weight_decay", None) is None:
        return original(variables)
    variables = list(variables)
    before = [tf.identity(reads.read(v)) for v in variables]
    _skip_if(gate.frozen_before, optimizer, lambda: original(variables))

    def restore():
        for variable, value in zip(variables, before):
            variable.assign(value)
        return tf.constant(True)

    tf.cond(tf.logical_and(gate.frozen, tf.logical_not(gate.frozen_before)), restore,
            lambda: tf.constant(False))
    return None


def _skip_if(flag, optimizer, function) -> None:
    """`function()` unless `flag`, in a `tf.cond` that reads the step count
    before it: a condition that read `iterations` would hold back `apply`'s
    count of the step (written after it) until the condition's inputs are
    known, where plain Keras counts it without the batch."""
    iterations = keras_objects.raw_iterations(optimizer)
    step_count = reads.read(iterations)

    def run():
        object.__setattr__(optimizer, keras_objects.ITERATIONS_ATTRIBUTE, step_count)
        try:
            function()
        finally:
            object.__setattr__(optimizer, keras_objects.ITERATIONS_ATTRIBUTE, iterations)
        return tf.constant(True)

    tf.cond(flag, lambda: tf.constant(False), run)


class EngineView:
    """What the engine's parts read of it, read-only: the `Collector` on the
    host, `Quantities` and `Faults` in the trace. Live (each property reads
    the engine's current state, which changes between fits) and cheap (one
    attribute read each: the collector reads at every batch end).

    It refers to the engine weakly: the engine owns its parts, and no cycle
    delays freeing the engine (its buffers) once its model is gone.
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: "Engine"):
        self._engine = weakref.proxy(engine)

    @property
    def model(self):
        """The model, or None once it is gone."""
        return self._engine._model()

    @property
    def requests(self) -> List[Request]:
        """The requests attached, in order."""
        return self._engine.requests

    @property
    def hooks(self) -> Dict[int, Hook]:
        """The optimizers seen, by id."""
        return self._engine.hooks

    @property
    def channels(self) -> List[Channel]:
        """The applies seen, in the order they were created (`Channel.number`)."""
        return self._engine.channels

    @property
    def rows(self) -> Optional[int]:
        """The rows of every buffer (a multiple of `steps_per_execution`)."""
        return self._engine.rows

    @property
    def steps_per_execution(self) -> Optional[int]:
        return self._engine._steps_per_execution

    @property
    def calls(self) -> Optional[tf.Variable]:
        """The buffer of the train-step id of the last train step run."""
        return self._engine._calls

    @property
    def step_values(self) -> Optional[tf.Variable]:
        """The buffer of the train steps' own rows (see `Engine.__init__`), or None."""
        return self._engine._step_values

    @property
    def step_names(self) -> List[str]:
        """The names of the scalars the train step returns, as in the step rows."""
        return self._engine._step_names

    @property
    def several_optimizers(self) -> bool:
        return self._engine.several_optimizers

    @property
    def loss_captured(self) -> bool:
        """Whether the traced train step called `compute_loss` (or gave its
        loss to its metric named "loss": `loss_origin`)."""
        return self._engine.loss_captured

    @property
    def loss_origin(self) -> str:
        return self._engine.loss_origin

    @property
    def bypassed(self) -> Dict[int, object]:
        """The optimizers that applied gradients without their `apply`
        passing through the route, by id."""
        return self._engine.bypassed

    @property
    def routed(self) -> set:
        """The ids of the optimizers whose `apply` passed through the route."""
        return self._engine.routed

    @property
    def variant(self) -> Optional[bool]:
        """In a trace: False where it builds the every-step variant of the
        train function (`variants`), which leaves out what a schedule takes
        at some steps only; True or None: everything."""
        return self._engine.variant

    @property
    def variants(self) -> Optional[_variants.Variants]:
        """The host's choice of variant this fit, once made, or None."""
        chosen = self._engine._variants
        return chosen if isinstance(chosen, _variants.Variants) else None

    def wants(self, *kinds: str) -> bool:
        """Whether a request of one of these kinds is attached."""
        return self._engine._wants(*kinds)

    def row(self, train_id):
        """The buffers' row of train step `train_id` (in-graph)."""
        return self._engine._row(train_id)

    def tensors_of(self, channel: Channel) -> Optional[Request]:
        """The `tensors` request bound to `channel`, or None."""
        return self._engine._tensor_request(channel)


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model) -> "Engine":
    """The model's engine, created on first use (not stored on the model)."""
    engine = _ENGINES.get(model)
    if engine is None:
        engine = Engine(model)
        _ENGINES[model] = engine
    return engine


class Engine(Capture):
    """TensorFlow's capture of one model. See the package docstring."""

    def tensor_request(self, steps, record, layers, consumer, *, include=None, exclude=None,
                       strict: bool = False, initial: bool = False, start: int = 0):
        """The request of a `StepRecorder` (`step_tensors.TensorRequest`),
        its rows sized for one replica's share of the fit's batch. (The
        step it starts after is read in the step: `start` is not needed.)"""
        from kerasdbg.backends.tensorflow import step_tensors

        request = step_tensors.TensorRequest(steps, record, layers, consumer, include=include,
                                             exclude=exclude, strict=strict, initial=initial)
        model = self._model()
        batch = keras_objects.fit_batch_size(model) if model is not None else None
        if batch is not None:
            replicas = model.distribute_strategy.num_replicas_in_sync
            request.max_rows = -(-batch // replicas)
        return request

    def replica_checker(self):
        """`replica_checks.checker` of the model (None with one replica)."""
        from kerasdbg.backends.tensorflow import replica_checks

        return replica_checks.checker(self._model())

    def build_before_trace(self) -> None:
        """Builds the optimizer of a model with Keras's own train step
        outside the first trace (`optimizer_routing.build_optimizer_before_trace`:
        else that trace creates variables and runs twice)."""
        model = self._model()
        if model is not None and keras_objects.uses_standard_train_step(model):
            routing.build_optimizer_before_trace(model)

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.requests: List[Request] = []
        self.trace_count = 0
        self.installed = False
        self._prepared = False
        self._failed = False
        self._calls: Optional[tf.Variable] = None
        self._steps_per_execution = None
        # Rows of every buffer: steps_per_execution, or a multiple of it when
        # every request can be read late (`Request.deferred`).
        self.rows: Optional[int] = None
        self.hooks: Dict[int, Hook] = {}
        self.channels: List[Channel] = []
        self._shadowed: Dict[str, object] = {}
        # Optimizers that reduced gradients in the traced step without their
        # `apply` passing through the route, by id.
        self.bypassed: Dict[int, object] = {}
        # The optimizers whose `apply` passed through the route, by id.
        self.routed: set = set()
        self._lock = threading.Lock()
        self._several: Optional[bool] = None
        # The "step" buffer: [row, train id, loss, loss captured, frozen,
        # fault, MAX_STEP_SCALARS returned scalars].
        self._step_values: Optional[tf.Variable] = None
        self._step_names: List[str] = []
        self._step_warned = False
        # Whether the traced train step called `compute_loss`.
        self.loss_captured = False
        self.loss_origin = LOSS_FROM_COMPUTE_LOSS
        self._loss_trackers: list = []  # the "loss" metrics watched (`_metric_loss`)
        # Which variant of the train function a trace builds (`EngineView.variant`)
        # and the host's choice between them this fit (`variants`).
        self.variant: Optional[bool] = None
        self._variants = None
        self._starts: Dict[int, int] = {}
        self._start_calls = 0
        # Keras's train function that this fit's stands in for (put back at
        # its end), and the requests of this fit in order.
        self._plain = _ABSENT
        self._fit_requests: List[Request] = []
        # What the requests record, computed in the graph; the fault test,
        # freeze and NaN localisation, with their variables; the host's reads.
        view = EngineView(self)
        self.quantities = Quantities(view)
        self.faults = Faults(view)
        self.collector = Collector(view, self.faults)

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
            routing.check_supported(model.optimizer)
            self._install(model)
        self.requests.append(request)
        _progress.of(self).arm()

    def prepare(self) -> None:
        """Creates the buffers it can before the first trace of this fit."""
        _progress.of(self).begin(self._model())
        if self._prepared or not self.requests:
            return
        model = self._model()
        if keras_objects.uses_standard_train_step(model):
            routing.build_optimizer_before_trace(model)
        n = int(model.steps_per_execution)
        strategy = model.distribute_strategy
        if self._calls is None:
            with strategy.scope():
                self._calls = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_calls")
        rows = n
        # Reads once per interval need rings `read_clock.RING_STEPS` tall; a
        # strategy's sync-on-read buffer is copied whole at each row write,
        # so there they stay one execution tall and the host reads each execution.
        if all(r.deferred for r in self.requests) and not isinstance(
                self._calls, tf.distribute.DistributedValues):
            rows = read_clock.ring_rows(n)
        if (self._steps_per_execution, self.rows) != (n, rows):
            self.channels, self.hooks = [], {}
            self._step_values = None
        self._steps_per_execution, self.rows = n, rows
        found = keras_objects.find_optimizers(model)
        self._fit_requests = list(self.requests)
        self._take_traced(model, found)
        with strategy.scope():
            if self._step_values is None and self._wants("step", "classes", "wrap"):
                self._step_values = _buffers.on_read_variable(
                    tf.fill([rows, _STEP_FIXED + MAX_STEP_SCALARS], tf.constant(np.nan, tf.float64)),
                    "kerasdbg_step")
            self.faults.prepare(model, strategy)
            for request in self.requests:
                if request.kind == "classes" and request.totals is not None:
                    request.totals.assign(tf.zeros_like(request.totals))
                elif request.kind == "classes":
                    request.totals = _buffers.on_read_variable(
                        tf.zeros([MAX_CLASSES, len(CLASS_COLUMNS)], tf.float64),
                        "kerasdbg_class_totals")
                if request.kind == "tensors":
                    request.jit = getattr(model, "jit_compile", False) is True
                    request.channel = None
            # The optimizers that are built: their channel is known now. With
            # several, which one applies first is known only in the trace.
            built = [(name, o) for name, o in found
                     if keras_objects.inner_optimizer(o).built
                     and getattr(keras_objects.inner_optimizer(o), "_trainable_variables", None)]
            for name, optimizer in built:
                hook = self._hook(optimizer, name)
                variables = keras_objects.optimizer_variables(
                    keras_objects.inner_optimizer(optimizer))
                self._channel_now(hook, 0, variables, bind_tensors=len(built) == 1)
        for hook in self.hooks.values():
            if hook.started is not None:  # distances count from this fit's start
                hook.started.assign(tf.zeros([], tf.int64))
        iterations = [keras_objects.step_number(o) for _, o in found]
        self._start_calls = int(self._calls.numpy())
        self._starts = {id(o): n for (_, o), n in zip(found, iterations)}
        self._variants = _variants.UNDECIDED
        self.collector.begin_fit(iterations, self._start_calls)
        self.faults.begin_fit()
        self._step_warned = False
        self._prepared = True

    def _take_traced(self, model, found) -> bool:
        """Runs, this fit, the function an earlier fit traced for requests
        that build the same graph, with this fit's requests in its slots;
        else has Keras make a new one (traced at its first call)."""
        # Taken off: it goes back at the end of a fit that ran it without a
        # failure (`_keep_traced`).
        traced = _pop_traced(model.train_function)
        if traced is not None:
            key = self._graph_key(model, found, model.train_function)
            if key is None or not _same_key(traced.key, key):
                traced = None
        if traced is None:
            model.make_train_function(force=True)
            if not model.run_eagerly:
                model.train_function = _variants.VariantFunction(
                    self, model.train_function,
                    lambda: model._make_function(model.train_step))
            return False
        for request, state in zip(self.requests, traced.states):
            request.adopt(state)
        for channel, position, slot in traced.slots:
            slot.request = self.requests[position]
            channel.slots[id(slot.request)] = slot
        for channel, position in traced.considered:
            channel.considered.add(id(self.requests[position]))
        self._several, self.loss_captured = traced.several, traced.loss_captured
        self.loss_origin = traced.loss_origin
        self._step_names = list(traced.step_names)
        self.bypassed, self.routed = dict(traced.bypassed), set(traced.routed)
        model.train_function = traced.function
        return True

    def _graph_key(self, model, found, plain):
        """What the instrumented train function depends on, or None when it
        cannot be reused: `(identities, values)` (`_same_key`). Keras's own
        function stands for its compiled configuration (`compile` makes a new
        one), the rest for what can change without it."""
        keys = tuple(r.graph_key() for r in self._fit_requests)
        if not keys or any(k is None for k in keys):
            return None
        variables = list(model.variables)
        optimizers = [o for _, o in found]
        identities = (plain, model.distribute_strategy, self._step_function,
                      self._loss_function, *optimizers, *variables)
        values = (keys, self._steps_per_execution, self.rows, model.jit_compile,
                  tuple(name for name, _ in found),
                  tuple(keras_objects.inner_optimizer(o).built for o in optimizers),
                  tuple(bool(v.trainable) for v in variables))
        return identities, values

    def _keep_traced(self, model) -> None:
        """At the end of a fit whose instrumented function traced (or ran)
        without a failure: keeps it on the model for the next fit."""
        if self._plain is _ABSENT or self._plain is None:
            return
        _pop_traced(self._plain)
        key = self._graph_key(model, keras_objects.find_optimizers(model), self._plain)
        if key is None:
            return
        positions = {id(r): k for k, r in enumerate(self._fit_requests)}
        slots, considered = [], []
        for channel in self.channels:
            for rid, slot in channel.slots.items():
                if rid in positions:
                    slots.append((channel, positions[rid], slot))
                    slot.request = None
            considered += [(channel, positions[rid]) for rid in channel.considered
                           if rid in positions]
        traced = _Traced(key, model.train_function,
                         [r.trace_state() for r in self._fit_requests], slots, considered, self)
        try:
            setattr(self._plain, TRACED_ATTRIBUTE, traced)
        except (AttributeError, TypeError):  # a train function of the user's own kind
            pass

    def _wants(self, *kinds) -> bool:
        return any(r.kind in kinds for r in self.requests)

    def variants(self) -> Optional[_variants.Variants]:
        """The host's choice of variant for this fit's executions (decided at
        its first execution, when every request is attached), or None: the
        full variant does all."""
        if self._variants is _variants.UNDECIDED:
            model = self._model()
            self._variants = None if model is None or not self._prepared else \
                _variants.Variants.of(self, model, self._start_calls, self._starts)
        return self._variants

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
            self._reset(keep=False)

    def _after_failed_fit(self) -> None:
        """`abort` for a `fit` that ended by an exception: the records are
        handed out if they can be, and the fit's own exception is what
        propagates (a consumer failing again here is left alone)."""
        _progress.of(self).end(finished=False)  # it may have raised in its first step
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
            self._reset(keep=False)

    def _reset(self, keep: bool = True) -> None:
        """Restores the model; `keep`: the instrumented function may serve a
        later fit (`_keep_traced`) if this one traced it without a failure."""
        model = self._model()
        if keep and self._prepared and not self._failed and self.installed \
                and model is not None:
            try:
                self._keep_traced(model)
            except Exception as error:  # noqa: BLE001 - a later fit traces again
                warnings.warn("kerasdbg could not keep the instrumented train function "
                              f"for the next fit: {type(error).__name__}: {error}",
                              RuntimeWarning, stacklevel=2)
        elif self._plain is not _ABSENT:
            _pop_traced(self._plain)
        self.requests = []
        self._fit_requests = []
        # The choice holds the requests (their consumers, the callbacks, hold
        # the model: an engine that kept them would keep its own key alive).
        self._variants = None
        self.variant = None
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
        self._step_function = getattr(original_step, "__func__", original_step)
        self._loss_function = getattr(original_loss, "__func__", original_loss)
        object.__setattr__(model, "train_step", train_step)
        object.__setattr__(model, "compute_loss", compute_loss)
        self._loss_trackers = keras_objects.watch_loss_metrics(model, "update_state",
                                                               self._metric_loss)
        self.installed = True
        self._several = None
        self.bypassed, self.routed = {}, set()
        fit_end.on_fit_end(model, self, self._after_failed_fit)
        # Keras's function of this fit, put back at its end: a later fit
        # without kerasdbg runs it as it was (`prepare` has Keras make the
        # instrumented one, or takes the one an earlier fit traced).
        self._plain = getattr(model, "train_function", None)

    def _metric_loss(self, value) -> None:
        """The step's loss where the train step does not call `compute_loss`
        (the keras.io guide's lower-level step: its own loss function, and a
        `Mean` named "loss" it updates with `update_state(loss)`): the value
        it gives that metric (`keras_objects.watch_loss_metrics`). Its
        `result()`, which the step returns as its `loss`, is the mean since
        the epoch began, not the step's."""
        state = getattr(_TLS, "state", None)
        if state is None or state.engine is not self or state.loss is not None \
                or not tf.is_tensor(value):
            return
        # As `compute_loss` scales it: over several replicas, the sum of the
        # replicas' values is the global batch's loss.
        loss = tf.convert_to_tensor(value)
        replicas = _several_replicas()
        if replicas is not None:
            loss = loss / tf.cast(replicas.num_replicas_in_sync, loss.dtype)
        state.loss, state.loss_from_metric = loss, True

    def _uninstall(self, model) -> None:
        self.installed = False
        _progress.of(self).end(finished=False)
        keras_objects.unwatch_loss_metrics(self._loss_trackers, "update_state")
        self._loss_trackers = []
        if model is None:
            return
        fit_end.cancel_fit_end(model, self)
        for name, value in self._shadowed.items():
            if value is _ABSENT:
                keras_objects.unpatch(model, name)
            else:
                object.__setattr__(model, name, value)
        if self._plain is not _ABSENT:
            model.train_function = self._plain
        self._plain = _ABSENT

    # ------------------------------------------------------- in the graph
    def _guard(self, function: Callable[[], object]):
        """Runs trace-time instrumentation; a failure warns unless strict."""
        if self._failed or not self._prepared:
            return None
        depth = keras_objects.name_scope_depth()
        try:
            return function()
        except Exception as error:  # noqa: BLE001 - any failure of ours
            keras_objects.drop_name_scopes(depth)
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
        return tf.math.floormod(train_id - 1, self.rows)

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
            with routing.optimizer_routes(_route_apply, _route_reduce, _route_update,
                                          _route_weight_decay, _route_average), \
                    self._logits(state):
                logs = step_function(data)
        finally:
            _TLS.state = previous
        self._guard(lambda: self._end_step(state, logs))
        return logs

    def _logits(self, state: _StepState):
        """While the train step is traced: the largest attention logits of the
        model's `MultiHeadAttention` layers into `state.logits`, when a
        "step" request asks for them."""
        if not any(r.kind == "step" and getattr(r, "logits", False) for r in self.requests):
            return contextlib.nullcontext()
        state.logits = {}
        return _logits_lib.attention_logits(self._model(), state.logits)

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
                    names = dict((id(o), n)
                                 for n, o in keras_objects.find_optimizers(self._model()))
                    name = names.get(id(optimizer), optimizer.name)
                hook = Hook(name, optimizer, len(self.hooks))
                self.hooks[id(optimizer)] = hook
            return hook

    def _paths(self, variables) -> List[str]:
        """Display paths: unique over the model's variables, stable across channels."""
        model = self._model()
        every = list(model.variables) if model is not None else []
        known = dict(zip((id(reads.read_handle(v)) for v in every), unique_paths(every)))
        return [known.get(id(reads.read_handle(v))) or getattr(v, "path", None) or v.name
                for v in variables]

    def _channel_now(self, hook: Hook, index: int, variables, bind_tensors: bool = True) -> Channel:
        """The channel of the `index`-th apply of `hook` on `variables`,
        created now (eagerly, or in a cross-replica context) if needed;
        `bind_tensors=False` leaves a `StepRecorder` to the first apply."""
        keys = [keras_objects.variable_key(hook.optimizer, v) for v in variables]
        requests = [r for r in self.requests if bind_tensors or r.kind != "tensors"]
        with self._lock:
            for channel in hook.channels:
                if channel.index == index and channel.keys == keys:
                    channel.build(requests, self.rows)
                    return channel
            hook.channels = [c for c in hook.channels if c.index != index]
            channel = Channel(hook, index, variables, self._paths(variables))
            channel.build(requests, self.rows)
            channel.number = len(self.channels)
            self.channels.append(channel)
            hook.channels.append(channel)
            return channel

    def _channel(self, hook: Hook, index: int, variables) -> Channel:
        """`_channel_now` from the trace: buffers are created outside it."""
        keys = [keras_objects.variable_key(hook.optimizer, v) for v in variables]

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
        distribute.merge_call(create)
        channel = ready()
        if channel is None:
            raise RuntimeError(f"kerasdbg: no channel for apply {index} of {hook.name}")
        return channel

    def _apply(self, state: _StepState, optimizer, original, grads, trainable_variables):
        inner = keras_objects.inner_optimizer(optimizer)
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif inner.built:
            variables = keras_objects.optimizer_variables(inner)
        else:
            variables = None
        if not grads or variables is None or len(variables) != len(grads):
            return original(grads, trainable_variables)
        self.routed.add(id(optimizer))
        hook = self._hook(optimizer)
        index = state.applies.get(id(hook), 0)
        state.applies[id(hook)] = index + 1
        channel = self._guard(lambda: self._channel(hook, index, variables))
        if channel is None:
            return original(grads, trainable_variables)
        context = _ApplyContext(state, channel)
        before = self._guard(lambda: self._before_apply(context, optimizer, grads))
        key = (distribute.replica_id(), id(inner))
        _CONTEXTS[key] = context
        try:
            applied = None
            if before is not None and context.frozen is not None:
                applied = self._guard(lambda: self.faults.apply_unless_frozen(
                    original, optimizer, grads, trainable_variables, context.frozen,
                    context.frozen_before, context.skip))
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
        context.iterations = reads.read(keras_objects.raw_iterations(optimizer))
        step = context.iterations + 1
        skipped = keras_objects.uncounted_steps(optimizer)
        if skipped is not None:
            # kerasdbg numbers the steps it skipped too (`iterations` does not count them).
            step = step + tf.cast(skipped.read_value(), step.dtype)
        context.step = step
        if state.first_step is None:
            state.first_step = step
        self.faults.before_apply(context, optimizer, grads)
        if hook.separate:
            self.quantities.record_model_gradients(context, optimizer, grads)
        self.quantities.copy_weights(context)
        tensors = self._tensor_request(channel)
        if tensors is not None:
            context.step_slots = tensors.record_before(self._model(), optimizer, step,
                                                       context.loss, state.x)
        return True

    def _tensor_request(self, channel: Channel):
        for request in self.requests:
            if request.kind == "tensors" and request.channel is channel:
                return request
        return None

    def _after_apply(self, context: _ApplyContext, optimizer) -> None:
        channel, hook = context.channel, context.channel.hook
        step = context.step
        after = reads.read(keras_objects.raw_iterations(optimizer))
        # The loss scaler skipped the step (kerasdbg's own skip is not the
        # scaler's, nor a frozen step, which no optimizer counts either).
        skipped = tf.equal(after, context.iterations)
        if context.skip is not None:
            skipped = tf.logical_and(skipped, tf.logical_not(context.skip))
        if context.frozen is not None:
            skipped = tf.logical_and(skipped, tf.logical_not(context.frozen))
        train_id = context.state.train_id
        row = self._row(train_id)
        # The weights describe updates that happened: not the batches gradient
        # accumulation only adds up, not the steps a fault froze.
        updates = hook.updates_at(step)
        if context.frozen is not None:
            updates = _and(updates, tf.logical_not(context.frozen))
        if context.skip is not None:
            updates = _and(updates, tf.logical_not(context.skip))
        weight_slots = channel.slots_of("weights")
        if weight_slots:
            self.quantities.record_weights(weight_slots, step, updates, row, train_id)
        for slot in channel.slots_of("weights"):
            _buffers.run_if(
                _and(self.quantities.histograms_at(slot.request, step), updates),
                lambda slot=slot: self.quantities.record_histograms(
                    slot, [reads.read(v) for v in slot.variables], row, train_id),
            )
        tensors = self._tensor_request(channel)
        if tensors is not None and context.step_slots is not None:
            tensors.record_after(step, context.step_slots)
        updated = tf.constant(1, tf.int64) if updates is True else tf.cast(updates, tf.int64)
        meta = _ops.stack_small([train_id, step, tf.cast(skipped, tf.int64), updated])
        _buffers.write_row(channel.meta, row, meta)

    def _end_step(self, state: _StepState, logs) -> None:
        """The train step's own row (loss, frozen, returned scalars), the
        class counts, the state kept for frozen steps; then counts the step."""
        model = self._model()
        if self._several is None and state.applies:
            self._several = len(state.applies) > 1
        if state.logits is not None:
            self._guard(lambda: self._largest_logits(state))
        frozen = self.faults.end_step(model, state)
        row = self._row(state.train_id)
        if self._step_values is not None:
            self._write_step(state, logs, frozen, row)
        classes = [r for r in self.requests if r.kind == "classes"]
        if classes:
            self.quantities.record_classes(state, classes)
        self._calls.assign_add(1)

    def _largest_logits(self, state: _StepState) -> None:
        """The step's largest logits into its guard values: of each attention
        layer (`step/max_attention_logit`, `step/<layer>/max_attention_logit`
        with several) and of the model's output (`step/max_output_logit`)."""
        several = len(state.logits) > 1
        for path, values in state.logits.items():
            value = values[0] if len(values) == 1 else tf.reduce_max(tf.stack(values))
            state.guard.append(("max_attention_logit", path if several else None, value,
                                "layer"))
        if state.y_pred is not None:
            value = _logits_lib.largest_output(state.y_pred)
            if value is not None:
                state.guard.append(("max_output_logit", None, value, "layer"))

    def _write_step(self, state: _StepState, logs, frozen, row) -> None:
        self.loss_captured = state.loss is not None
        self.loss_origin = LOSS_FROM_METRIC if state.loss_from_metric else LOSS_FROM_COMPUTE_LOSS
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
        self.faults.apply_order = [channel.hook.name for channel in state.order]
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
        _buffers.write_row(self._step_values, row, _ops.stack_small(fixed + scalars + padding))

    # ----------------------------------------------------------- on host
    def collect(self, final: bool = True, batch: Optional[int] = None) -> None:
        """Reads the rows written since the last call and hands them out
        (`Collector.collect`); at the end of batch `batch` (`final=False`)
        deferred requests may wait until the buffers are about to be full."""
        _progress.of(self).end()
        if not self._prepared:
            return
        if self._failed and self.installed:
            # Instrumenting the trace failed part-way (a warning said so): the
            # rest of this fit runs the plain train step, no half-armed freeze.
            self._uninstall(self._model())
        self.collector.collect(final, batch)


def _wrapped(wrapper, step_function, row):
    def step(data):
        return wrapper(step_function, data, row)

    return step
