"""The capture engine: gets per-step data out of the compiled train function.

One engine per model, shared by every kerasdbg callback on it. During a `fit`
it wraps two optimizer methods (see `_keras_internals`), so that each
optimizer step computes the requested statistics in-graph and stores them in
ring buffers with one row per step of an execution. After each execution the
host reads the buffers once and hands the new rows to the callbacks.

Life cycle, driven by the callbacks:

- `attach(request)` in `on_train_begin`: the first one patches the optimizer
  and forces a retrace (`make_train_function(force=True)`); later ones only
  add their request, since nothing is traced before the first batch.
- `prepare()` in `on_train_batch_begin`: creates the buffers once the whole
  set of requests and `steps_per_execution` are known, before the trace.
- `collect()` in `on_train_batch_end` (and at the end): reads new rows.
- `detach(request)` in `on_train_end`: the last one restores the optimizer
  and forces a retrace, so a later `fit` without the callbacks runs the plain
  train step again.

Buffers are `ON_READ` / `ONLY_FIRST_REPLICA` variables: under a
`tf.distribute` strategy each replica writes its own copy without any
communication, and the host reads replica 0. Rows are addressed by a call id
(one per `optimizer.apply`), `row = (call_id - 1) % steps_per_execution`, so
consecutive calls of one execution never share a row and the host needs no
reset between executions.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from kerasdbg import _buffers
from kerasdbg import _replay
from kerasdbg import _keras_internals as internals
from kerasdbg import stats as stats_lib


class Record(NamedTuple):
    """What one optimizer step recorded for one request.

    Attributes:
        step: `optimizer.iterations` after the update (1-based). A step the
            loss scaler skipped carries the number the update would have had.
        skipped: whether the loss scaler skipped the update.
        values: the request's columns for this step, or None if the step was
            not recorded (`every_n_steps`, or skipped before the gradients).
        histograms: `(counts [V, bins], ranges [V, 2])`, or None.
    """

    step: int
    skipped: bool
    values: Optional[np.ndarray]
    histograms: Optional[tuple]


WEIGHT_EXTRA_STATISTICS = ("update_ratio", "distance_from_start")
MAX_FLAGGED = 4096
"""Variables whose non-finite gradient NaN localisation can name, for a model
that is built only inside `fit`."""
MAX_CLASSES = 1000
"""Classes a "classes" request can count (its buffer is sized before the trace)."""
CLASS_COLUMNS = ("seen", "mispredicted")
STEP_COLUMNS = ("loss", "frozen", "fault")
"""Columns of a "step" request: the step's loss (summed over replicas, as
the applied gradient sees it; NaN when `compute_loss` was not called),
whether the weights were frozen at that step, and whether the step had an
in-graph fault (NaN when no fault is watched)."""


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
            steps: `_step_tensors.TensorRequest`), "step" (the loss of each step and
            whether it was frozen; `variables`, `paths` and `stats` empty) or
            "classes" (labels seen and mispredicted per class, summed over
            the fit; `variables`, `paths` and `stats` empty).
        variables: the Keras variables to describe.
        paths: one unique display path per variable.
        stats: statistic names (`stats.ALL_STATISTICS`, plus for weights
            `WEIGHT_EXTRA_STATISTICS`).
        every_n_steps: record scalars at steps divisible by this.
        histogram_every_n_steps: record histograms at steps divisible by
            this, or None for no histograms.
        consumer: called as `consumer(records)` with a list of `Record`.
        bins: histogram bins.
        strict: a failure of the instrumentation raises instead of warning.
        freeze: for a "step" request, the faults that freeze the weights.
        localize: for a "step" request, find at the first non-finite loss or
            gradient the first layer whose output was non-finite and the
            variables whose gradient was (see `Engine.nan_source`).
        last_step: record scalars only up to this optimizer step (for what
            a rule reads at the start of training only), or None.
    """

    def __init__(
        self,
        kind: str,
        variables: Sequence,
        paths: Sequence[str],
        stats: Sequence[str],
        every_n_steps: int,
        histogram_every_n_steps: Optional[int],
        consumer: Callable[[List[Record]], None],
        bins: int = stats_lib.DEFAULT_HISTOGRAM_BINS,
        strict: bool = False,
        freeze: Optional[Freeze] = None,
        localize: bool = False,
        last_step: Optional[int] = None,
    ):
        self.kind = kind
        self.last_step = last_step
        self.freeze = freeze
        self.localize = localize
        self.strict = strict
        self.variables = list(variables)
        self.paths = list(paths)
        self.stats = tuple(stats)
        self.every_n_steps = every_n_steps
        self.histogram_every_n_steps = histogram_every_n_steps
        self.consumer = consumer
        self.bins = bins
        # Statistics computed by `tensor_statistics` (the rest are derived).
        self.base_stats = tuple(s for s in self.stats if s in stats_lib.ALL_STATISTICS)
        if kind == "gradients" and "l2_norm" not in self.base_stats:
            # The global norm is derived from the per-variable norms.
            self.base_stats += ("l2_norm",)
        self.columns = [f"{p}/{s}" for p in self.paths for s in self.stats]
        if kind == "gradients":
            self.columns.append("global_norm")
        if kind == "step":
            self.columns = list(STEP_COLUMNS)
        if kind == "classes":
            self.paths = [str(k) for k in range(MAX_CLASSES)]
            self.stats = CLASS_COLUMNS
            self.columns = [f"{p}/{c}" for p in self.paths for c in CLASS_COLUMNS]
            self.present = [False] * MAX_CLASSES
        self.totals: Optional[tf.Variable] = None
        self._tags = None
        # Which variables had a gradient in the traced step (None grads are
        # known at trace time); filled by the engine.
        self.present = [True] * len(self.variables)
        self.keys: List[int] = []
        self.values = self.ids = None
        self.hist_counts = self.hist_ranges = self.hist_ids = None
        self.previous: List[tf.Variable] = []
        self.initial: List[tf.Variable] = []

    def tags(self) -> List[Optional[str]]:
        """TensorBoard tag of each column, `<kind>/<column>`; None for the
        columns of variables without a gradient (or classes not in the output)."""
        key = tuple(self.present)
        if self._tags is None or self._tags[0] != key:
            tags, width = [], len(self.stats)
            for i, _ in enumerate(self.paths):
                for column in self.columns[i * width:(i + 1) * width]:
                    tags.append(f"{self.kind}/{column}" if self.present[i] else None)
            tags.extend(f"{self.kind}/{c}" for c in self.columns[len(tags):])
            self._tags = (key, tags)
        return self._tags[1]

    def build(self, optimizer, steps_per_execution: int) -> None:
        """Creates this request's buffers (in the strategy's scope)."""
        n = steps_per_execution
        self.keys = [internals.variable_key(optimizer, v) for v in self.variables]
        self.values = _buffers.on_read_variable(
            tf.fill([n, len(self.columns)], tf.constant(np.nan, tf.float64)),
            f"kerasdbg_{self.kind}_values",
        )
        self.ids = _buffers.on_read_variable(tf.zeros([n], tf.int64), f"kerasdbg_{self.kind}_ids")
        if self.histogram_every_n_steps:
            v = len(self.variables)
            self.hist_counts = _buffers.on_read_variable(
                tf.zeros([n, v, self.bins], tf.float64), f"kerasdbg_{self.kind}_hist"
            )
            self.hist_ranges = _buffers.on_read_variable(
                tf.zeros([n, v, 2], tf.float64), f"kerasdbg_{self.kind}_hist_ranges"
            )
            self.hist_ids = _buffers.on_read_variable(
                tf.zeros([n], tf.int64), f"kerasdbg_{self.kind}_hist_ids"
            )
        if self.kind == "classes":
            self.totals = _buffers.on_read_variable(
                tf.zeros([MAX_CLASSES, len(CLASS_COLUMNS)], tf.float64), "kerasdbg_class_totals")
        if self.kind == "weights" and "update_ratio" in self.stats:
            self.previous = [
                _buffers.on_read_variable(internals.read(v), "kerasdbg_previous")
                for v in self.variables
            ]
        if self.kind == "weights" and "distance_from_start" in self.stats:
            self.initial = [
                _buffers.on_read_variable(internals.read(v), "kerasdbg_initial")
                for v in self.variables
            ]

    def records_at(self, step) -> object:
        every = _every(step, self.every_n_steps)
        if self.last_step is None:
            return every
        return tf.logical_and(every, tf.less_equal(step, tf.cast(self.last_step, step.dtype)))

    def histograms_at(self, step) -> object:
        if not self.histogram_every_n_steps:
            return False
        return _every(step, self.histogram_every_n_steps)

    def written_at(self, steps: Sequence[int]) -> Tuple[bool, bool]:
        """On the host: whether any of these steps wrote values, histograms
        (as `records_at` and `histograms_at` decided in the graph), so that
        `collect` reads only the buffers that hold something new."""
        values = self.kind not in ("gradients", "weights") or any(
            step % self.every_n_steps == 0 and (self.last_step is None or step <= self.last_step)
            for step in steps
        )
        histograms = self.hist_ids is not None and any(
            step % self.histogram_every_n_steps == 0 for step in steps
        )
        return values, histograms


def _every(step, n: int):
    if n == 1:
        return True
    return tf.equal(tf.math.floormod(step, n), 0)


class _StepState(NamedTuple):
    """What `_before_apply` hands to the rest of the step (trace time)."""

    step: tf.Tensor
    loss: Optional[tf.Tensor]
    fault: Optional[tf.Tensor]
    frozen: Optional[tf.Tensor]
    classes: Optional[tf.Tensor] = None
    # `(hit, slot)` of each tensor request, in `_tensor_requests()` order.
    step_slots: tuple = ()


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


def _squared_norm(tensors) -> tf.Tensor:
    """The squared global norm of `tensors`, from `stats` (finite elements,
    no float32 overflow), as the recorded `global_norm`."""
    if not tensors:
        return tf.constant(0.0, tf.float64)
    return tf.reduce_sum(tf.square(stats_lib.tensor_statistics(tensors, ["l2_norm"])[:, 0]))


def _dense(gradient) -> tf.Tensor:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model) -> "Engine":
    """The model's engine, created on first use (not stored on the model)."""
    engine = _ENGINES.get(model)
    if engine is None:
        engine = Engine(model)
        _ENGINES[model] = engine
    return engine


class Engine:
    """The capture engine of one model. See the module docstring."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.requests: List[Request] = []
        self.trace_count = 0
        self._optimizer = None
        self._prepared = False
        self._calls: Optional[tf.Variable] = None
        self._meta: Optional[tf.Variable] = None
        self._last_call = 0
        self._steps_per_execution = None
        self._failed = False
        self._frozen: Optional[tf.Variable] = None
        # Non-trainable state the forward pass updates (BatchNormalization's
        # moving statistics) and its copy after the last unfrozen step.
        self._state: List[tuple] = []
        # NaN localisation: [step, first layer index, one flag per variable].
        self._nan_row: Optional[tf.Variable] = None
        self.nan_layers: List[str] = []
        self.nan_variables: List[str] = []
        self._loss_patched = False
        # The loss `compute_loss` returned, per replica thread, until `apply`.
        self._captured = threading.local()

    # ----------------------------------------------------------- lifecycle
    @property
    def installed(self) -> bool:
        return self._optimizer is not None

    def attach(self, request: Request) -> None:
        """Adds a request; the first one patches the optimizer (retrace)."""
        model = self._model()
        if self._prepared:
            # The last fit ended without on_train_end (an exception): start over.
            self._reset()
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "kerasdbg: the model has no optimizer; call `model.compile()` "
                "before `fit`."
            )
        if not self.installed:
            internals.check_supported(model.optimizer)
            self._install(model.optimizer)
            model.make_train_function(force=True)
        if request.kind in ("step", "classes", "tensors") and not self._loss_patched:
            self._patch_compute_loss(model)
        self.requests.append(request)

    def prepare(self) -> None:
        """Creates the buffers before the first trace of this fit."""
        if self._prepared or not self.requests:
            return
        model = self._model()
        internals.build_optimizer_before_trace(model)
        n = int(model.steps_per_execution)
        strategy = model.distribute_strategy
        with strategy.scope():
            if self._calls is None:
                self._calls = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_calls")
            if self._meta is None or self._steps_per_execution != n:
                self._meta = _buffers.on_read_variable(tf.zeros([n, 3], tf.int64), "kerasdbg_meta")
            if self._freeze() is not None and self._frozen is None:
                self._frozen = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_frozen")
            if self._freeze() is not None:
                self._prepare_state(model, strategy)
            if self._localizes():
                # One flag per variable; a model built only inside `fit` (a
                # subclassed one) has none yet, so room for many.
                width = 2 + (len(model.trainable_variables) if model.built else MAX_FLAGGED)
                if self._nan_row is None or int(self._nan_row.shape[0]) != width:
                    self._nan_row = _buffers.on_read_variable(
                        tf.zeros([width], tf.int64), "kerasdbg_nan_source")
            for request in self.requests:
                request.build(self._optimizer, n)
                if request.kind == "tensors":
                    request.jit = getattr(model, "jit_compile", False) is True
                if request.kind == "classes":
                    request.totals.assign(tf.zeros_like(request.totals))
        self._steps_per_execution = n
        self._last_call = int(self._calls.numpy())
        if self._frozen is not None:
            self.unfreeze()
        if self._nan_row is not None:
            self._nan_row.assign(tf.zeros_like(self._nan_row))
        self._prepared = True

    def _prepare_state(self, model, strategy) -> None:
        """Copies of the forward pass's state variables, for frozen steps.

        The moving statistics of a BatchNormalization are updated by the
        forward pass, before `apply` knows the step is faulty; a frozen step
        puts back their values after the last unfrozen step. Under a
        strategy each replica keeps its own (Keras updates them per replica).
        """
        variables = [
            v for v in model.non_trainable_variables
            if internals.is_float(v) and not internals.on_read(v)
        ] if model.built else []
        known = [s[0] for s in self._state]
        if len(known) != len(variables) or any(a is not b for a, b in zip(known, variables)):
            self._state = [
                (v, _buffers.on_read_variable(internals.read(v), "kerasdbg_state"))
                for v in variables
            ]
        if self._state:
            def save():
                for variable, copy in self._state:
                    copy.assign(internals.read(variable))

            strategy.run(tf.function(save))

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

        Returns None until one occurred, else `{"step", "layer", "variables"}`:
        the first layer (qualified name, in graph order, inputs first) whose
        output held NaN/Inf on any replica, or None if none did (or the model
        is subclassed), and the paths of the variables whose gradient did.
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
        flags = np.any([r[2:] for r in hits], axis=0)
        variables = [p for p, bad in zip(self.nan_variables, flags) if bad]
        return {"step": int(hits[0][0]), "layer": layer, "variables": variables}

    def unfreeze(self) -> None:
        """Lets the weights change again after a fault froze them (host side)."""
        if self._frozen is not None:
            self._frozen.assign(tf.zeros([], tf.int64))

    @property
    def frozen(self) -> bool:
        """Whether a fault has frozen the weights (replica 0's flag)."""
        return self._frozen is not None and bool(_buffers.read(self._frozen))

    def detach(self, request: Request) -> None:
        """Removes a request; the last one restores the optimizer (retrace)."""
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
        self.collect()
        self._reset()

    def _reset(self) -> None:
        model = self._model()
        self.requests = []
        self._prepared = False
        self._failed = False
        if self._loss_patched:
            if model is not None:
                internals.unpatch(model, "compute_loss")
            self._loss_patched = False
        if self.installed:
            self._uninstall()
            if model is not None:
                model.make_train_function(force=True)

    def _patch_compute_loss(self, model) -> None:
        original = model.compute_loss
        captured = self._captured

        def compute_loss(*args, **kwargs):
            loss = original(*args, **kwargs)
            captured.loss = loss
            captured.x = args[0] if args else kwargs.get("x")
            captured.y = args[1] if len(args) > 1 else kwargs.get("y")
            captured.y_pred = args[2] if len(args) > 2 else kwargs.get("y_pred")
            return loss

        internals.patch(model, "compute_loss", compute_loss)
        self._loss_patched = True

    def _captured_loss(self):
        """The loss of the step being applied, from this replica's trace, or None."""
        loss = getattr(self._captured, "loss", None)
        self._captured.loss = None
        if loss is None or not tf.is_tensor(loss):
            return None
        if not tf.executing_eagerly() and getattr(loss, "graph", None) is not (
            tf.compat.v1.get_default_graph()
        ):
            return None  # left over from another function (a custom train_step)
        return tf.reduce_sum(tf.cast(loss, tf.float64))

    def _captured_inputs(self):
        """The inputs `compute_loss` saw in this trace, or None."""
        x = getattr(self._captured, "x", None)
        self._captured.x = None
        tensors = [t for t in keras.tree.flatten(x) if tf.is_tensor(t)]
        if not tensors or (not tf.executing_eagerly() and any(
                getattr(t, "graph", None) is not tf.compat.v1.get_default_graph() for t in tensors)):
            return None  # not called, or left over from another function
        return x

    def _install(self, optimizer) -> None:
        inner = internals.inner_optimizer(optimizer)
        original_apply = optimizer.apply
        original_reduce = getattr(inner, internals.REDUCE_METHOD)

        def apply(grads, trainable_variables=None):
            return self._apply(original_apply, optimizer, grads, trainable_variables)

        def reduce(grads_and_vars):
            reduced = original_reduce(grads_and_vars)
            self._guard(lambda: self._record_gradients(inner, reduced))
            return reduced

        internals.patch(optimizer, "apply", apply)
        internals.patch(inner, internals.REDUCE_METHOD, reduce)
        self._optimizer = optimizer

    def _uninstall(self) -> None:
        optimizer = self._optimizer
        internals.unpatch(optimizer, "apply")
        internals.unpatch(internals.inner_optimizer(optimizer), internals.REDUCE_METHOD)
        self._optimizer = None

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

    def _position(self):
        """Call id of the step being applied and its ring-buffer row."""
        call_id = self._calls.read_value() + 1
        return call_id, tf.math.floormod(call_id - 1, self._steps_per_execution)

    def _apply(self, original_apply, optimizer, grads, trainable_variables):
        before = self._guard(lambda: self._before_apply(optimizer, grads, trainable_variables))
        applied = None
        if before is not None and before.frozen is not None:
            self._guard(lambda: self._keep_state_unless_frozen(before.frozen))
            applied = self._guard(
                lambda: self._apply_unless_frozen(
                    original_apply, optimizer, grads, trainable_variables, before.frozen
                )
            )
        if applied is None:
            original_apply(grads, trainable_variables)
        if before is not None:
            self._guard(lambda: self._after_apply(optimizer, before))

    def _before_apply(self, optimizer, grads, trainable_variables) -> "_StepState":
        self.trace_count += 1
        step = internals.read(optimizer.iterations) + 1
        x = self._captured_inputs()
        loss, nonfinite, fault, frozen = self._step_loss_and_fault(optimizer, grads)
        if nonfinite is not None and self._localizes():
            if trainable_variables is None:
                trainable_variables = internals.optimizer_variables(
                    internals.inner_optimizer(optimizer))
            self._localize(step, nonfinite, grads, list(trainable_variables), x)
        # Kept in the returned state, not on the request: under Mirrored the
        # replicas' threads trace their steps at the same time.
        step_slots = tuple(request.record_before(self._model(), optimizer, step, loss, x)
                           for request in self._tensor_requests())
        for request in self._weight_requests():
            if request.previous:

                def snapshot(request=request):
                    for copy, variable in zip(request.previous, request.variables):
                        copy.assign(internals.read(variable))

                _buffers.run_if(request.records_at(step), snapshot)
        classes = None
        requests = [r for r in self.requests if r.kind == "classes"]
        if requests:
            classes = self._class_counts(requests)
        return _StepState(step, loss, fault, frozen, classes, step_slots)

    def _class_counts(self, requests):
        """`[MAX_CLASSES, 2]` labels seen and mispredicted in this step (all
        replicas), from the first output; None when there are no labels."""
        y = getattr(self._captured, "y", None)
        y_pred = getattr(self._captured, "y_pred", None)
        self._captured.y = self._captured.y_pred = None
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
        replicas = tf.distribute.get_replica_context()
        if replicas is not None and replicas.num_replicas_in_sync > 1:
            counts = replicas.all_reduce(tf.distribute.ReduceOp.SUM, counts)
        return tf.pad(counts, [[0, MAX_CLASSES - classes], [0, 0]])

    def _step_loss_and_fault(self, optimizer, grads):
        """`(loss, nonfinite, fault, frozen)` of the step, each None if unused.

        `loss` is summed over replicas; `nonfinite` says the loss or a
        gradient held NaN/Inf, `fault` adds a gradient norm above the limit,
        `frozen` is the sticky flag that skips the update. One all-reduce of a
        small vector gives every replica the same loss and the same fault,
        hence the same decision.
        """
        freeze = self._freeze()
        # The faults are tested to freeze, or only to localise a NaN.
        watched = freeze or (Freeze() if self._localizes() else None)
        if watched is None and not any(r.kind in ("step", "tensors") for r in self.requests):
            return None, None, None, None
        local = self._captured_loss()
        parts = [tf.constant(np.nan, tf.float64) if local is None else local]
        present = [g for g in grads if g is not None]
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        check_grads = watched is not None and watched.nonfinite_gradients and not scaled
        if check_grads:
            # One pass per gradient (a sum of squares could overflow float32
            # for finite gradients with a norm above 1.8e19).
            finite = tf.reduce_all(tf.stack(
                [tf.constant(True)] + [tf.reduce_all(tf.math.is_finite(_dense(g))) for g in present]))
            parts.append(tf.cast(tf.logical_not(finite), tf.float64))
        vector = tf.stack(parts)
        replicas = tf.distribute.get_replica_context()
        several = replicas is not None and replicas.num_replicas_in_sync > 1
        if several:
            vector = replicas.all_reduce(tf.distribute.ReduceOp.SUM, vector)
        loss = vector[0]
        if watched is None:
            return loss, None, None, None
        nonfinite = tf.constant(False)
        if watched.nonfinite_loss and local is not None:
            nonfinite = tf.logical_or(nonfinite, tf.logical_not(tf.math.is_finite(loss)))
        if check_grads:
            nonfinite = tf.logical_or(nonfinite, vector[1] > 0)
        fault = nonfinite
        if watched.max_gradient_norm is not None:
            if several:
                # The norm of the summed gradient, as the optimizer applies it.
                present = replicas.all_reduce(
                    tf.distribute.ReduceOp.SUM, [_dense(g) for g in present])
            squares = _squared_norm(present)
            if scaled:
                squares = squares / tf.square(tf.cast(optimizer.dynamic_scale, tf.float64))
            fault = tf.logical_or(fault, tf.sqrt(squares) > watched.max_gradient_norm)
        if freeze is None:
            return loss, nonfinite, fault, None
        frozen = tf.logical_or(self._frozen.read_value() > 0, fault)
        self._frozen.assign(tf.cast(frozen, tf.int64))
        return loss, nonfinite, fault, frozen

    def _localize(self, step, nonfinite, grads, variables, x) -> None:
        """On the first fault of the fit, replays the forward pass layer by
        layer and records where non-finite values first appear.

        Costs nothing on healthy steps but the fault test itself: the replay
        sits in a `tf.cond` taken once.
        """
        model = self._model()
        row = self._nan_row
        variables = variables[: int(row.shape[0]) - 2]
        self.nan_variables = unique_paths(variables)

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
                for g in list(grads)[: len(variables)]
            ]
            padding = [tf.constant(0, tf.int64)] * (int(row.shape[0]) - 2 - len(variable_flags))
            row.assign(tf.stack([tf.cast(step, tf.int64), first] + variable_flags + padding))
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
            return tf.constant(False)

        tf.cond(frozen, restore, save)

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
            # (patched) reduction records them, and nothing is applied.
            if scaled:
                scale = optimizer.dynamic_scale
                grads = [g if g is None else g / tf.cast(scale, g.dtype) for g in grads]
            if trainable_variables is None:
                trainable_variables = internals.optimizer_variables(inner)
            variables = [internals.read_handle(v) for v in trainable_variables]
            getattr(inner, internals.REDUCE_METHOD)(list(zip(grads, variables)))
            optimizer.iterations.assign_add(1)

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

    def _after_apply(self, optimizer, before: "_StepState"):
        step = before.step
        after = internals.read(optimizer.iterations)
        skipped = tf.equal(after, step - 1)
        call_id, row = self._position()
        for request in self._weight_requests():
            _buffers.run_if(
                request.records_at(step),
                lambda request=request: self._record_weights(request, call_id, row),
            )
            _buffers.run_if(
                request.histograms_at(step),
                lambda request=request: self._record_histograms(
                    request, [internals.read(v) for v in request.variables], call_id, row
                ),
            )
        for request in self.requests:
            if request.kind == "classes" and before.classes is not None:
                totals = request.totals.read_value() + before.classes
                request.totals.assign(totals)
                _buffers.write_row(request.values, row, tf.reshape(totals, [-1]))
                _buffers.write_row(request.ids, row, call_id)
            if request.kind == "step":
                frozen = tf.constant(False) if before.frozen is None else before.frozen
                fault = tf.constant(np.nan, tf.float64) if before.fault is None else tf.cast(
                    before.fault, tf.float64)
                values = tf.stack([before.loss, tf.cast(frozen, tf.float64), fault])
                _buffers.write_row(request.values, row, values)
                _buffers.write_row(request.ids, row, call_id)
        for request, step_slot in zip(self._tensor_requests(), before.step_slots):
            request.record_after(step, step_slot)
        meta = tf.stack([call_id, step, tf.cast(skipped, tf.int64)])
        _buffers.write_row(self._meta, row, meta)
        self._calls.assign_add(1)

    def _ring_requests(self):
        """The requests with one ring-buffer row per step (all but "tensors")."""
        return [r for r in self.requests if r.kind != "tensors"]

    def _tensor_requests(self):
        return [r for r in self.requests if r.kind == "tensors"]

    def _weight_requests(self):
        return [r for r in self.requests if r.kind == "weights"]

    def _record_weights(self, request: Request, call_id, row) -> None:
        weights = [internals.read(v) for v in request.variables]
        base = stats_lib.tensor_statistics(weights, request.base_stats)
        columns = {s: base[:, i] for i, s in enumerate(request.base_stats)}
        # The norms of the update, of the weights before it and of the drift
        # from the start: one call, so one fault test and one finishing step.
        extras = []
        if request.previous:
            previous = [p.read_value() for p in request.previous]
            extras += [w - tf.cast(p, w.dtype) for w, p in zip(weights, previous)] + previous
        if request.initial:
            extras += [w - tf.cast(i.read_value(), w.dtype) for w, i in zip(weights, request.initial)]
        norms = tf.unstack(
            tf.reshape(stats_lib.tensor_statistics(extras, ["l2_norm"]), [-1, len(weights)])
        ) if extras else []
        if request.previous:
            update, before = norms[0], norms[1]
            # 0/0 (a zero tensor that did not move) is no update at all.
            columns["update_ratio"] = tf.where(
                tf.equal(update, 0), tf.zeros_like(update), update / before
            )
        if request.initial:
            columns["distance_from_start"] = norms[-1]
        table = tf.stack([columns[s] for s in request.stats], axis=1)
        _buffers.write_row(request.values, row, tf.reshape(table, [-1]))
        _buffers.write_row(request.ids, row, call_id)

    def _record_gradients(self, inner, reduced) -> None:
        requests = [r for r in self.requests if r.kind == "gradients"]
        if not requests and not self._tensor_requests():
            return
        step = internals.read(inner.iterations) + 1
        call_id, row = self._position()
        by_key = {internals.variable_key(inner, v): g for g, v in reduced if g is not None}
        for request in self._tensor_requests():
            request.record_gradients(step, by_key)
        for request in requests:
            grads = [by_key.get(k) for k in request.keys]
            request.present = [g is not None for g in grads]
            others = [g for k, g in by_key.items() if k not in set(request.keys)]
            present = [g for g in grads if g is not None]

            def record(request=request, grads=grads, present=present, others=others):
                table = stats_lib.tensor_statistics(present, request.base_stats)
                nan_row = tf.fill([len(request.base_stats)], tf.constant(np.nan, tf.float64))
                rows, i = [], 0
                for g in grads:
                    rows.append(nan_row if g is None else table[i])
                    i += g is not None
                full = tf.stack(rows) if rows else tf.zeros([0, len(request.base_stats)], tf.float64)
                l2 = table[:, request.base_stats.index("l2_norm")]
                squares = tf.reduce_sum(tf.square(l2))
                if others:
                    other_l2 = stats_lib.tensor_statistics(others, ["l2_norm"])[:, 0]
                    squares += tf.reduce_sum(tf.square(other_l2))
                keep = [request.base_stats.index(s) for s in request.stats]
                values = tf.concat(
                    [tf.reshape(tf.gather(full, keep, axis=1), [-1]), [tf.sqrt(squares)]], 0
                )
                _buffers.write_row(request.values, row, values)
                _buffers.write_row(request.ids, row, call_id)

            _buffers.run_if(request.records_at(step), record)
            _buffers.run_if(
                request.histograms_at(step),
                lambda request=request, grads=grads: self._record_histograms(
                    request, grads, call_id, row
                ),
            )

    def _record_histograms(self, request: Request, tensors, call_id, row) -> None:
        present = [t for t in tensors if t is not None]
        counts, ranges = stats_lib.histograms(present, request.bins)
        empty_counts = tf.zeros([request.bins], tf.float64)
        empty_range = tf.constant([np.nan, np.nan], tf.float64)
        all_counts, all_ranges, i = [], [], 0
        for t in tensors:
            all_counts.append(empty_counts if t is None else counts[i])
            all_ranges.append(empty_range if t is None else ranges[i])
            i += t is not None
        _buffers.write_row(request.hist_counts, row, tf.stack(all_counts))
        _buffers.write_row(request.hist_ranges, row, tf.stack(all_ranges))
        _buffers.write_row(request.hist_ids, row, call_id)

    # ----------------------------------------------------------- on host
    def collect(self) -> None:
        """Reads the rows written since the last call and hands them out."""
        if not self._prepared:
            return
        for request in self._tensor_requests():
            request.collect()
        # Each callback collects at each batch end; the first read tells the
        # later ones there is nothing new (a read costs 10-30 us).
        calls = int(_buffers.read(self._calls))
        if calls <= self._last_call:
            return
        meta = _buffers.read(self._meta)
        n = self._steps_per_execution
        first = max(self._last_call + 1, calls - n + 1)
        if first > self._last_call + 1 and self._ring_requests():
            warnings.warn(
                f"kerasdbg lost {first - self._last_call - 1} step records: the "
                "train function ran more than steps_per_execution steps between "
                "two callback events.",
                RuntimeWarning,
                stacklevel=2,
            )
        rows = [((call_id - 1) % n, call_id) for call_id in range(first, calls + 1)]
        rows = [(row, call_id) for row, call_id in rows if meta[row, 0] == call_id]
        steps = [int(meta[row, 1]) for row, _ in rows]
        for request in self._ring_requests():
            # A buffer no step of these wrote is not read (10-30 us each).
            has_values, has_histograms = request.written_at(steps)
            if has_values:
                values, ids = _buffers.read(request.values), _buffers.read(request.ids)
            if has_histograms:
                hist = [_buffers.read(b) for b in
                        (request.hist_ids, request.hist_counts, request.hist_ranges)]
            records = []
            for (row, call_id), step in zip(rows, steps):
                histograms = None
                if has_histograms and hist[0][row] == call_id:
                    histograms = (hist[1][row], hist[2][row])
                records.append(
                    Record(
                        step=step,
                        skipped=bool(meta[row, 2]),
                        values=values[row].copy() if has_values and ids[row] == call_id else None,
                        histograms=histograms,
                    )
                )
            if records:
                request.consumer(records)
        self._last_call = calls
