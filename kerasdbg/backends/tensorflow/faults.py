"""Fault handling: the in-graph fault test, the freeze, and NaN localisation.

At each optimizer apply the loss and the gradients are tested (one
all-reduce of a small vector, so every replica takes the same decision); a
fault a "step" request's `Freeze` names sets a sticky flag after which the
updates are skipped and the forward pass's state variables (BatchNormalization's
moving statistics) are put back as they were after the last unfrozen step.
At the first non-finite loss or gradient of the fit, a request that
localises replays the forward pass layer by layer to find where the
non-finite values first appear. On the host, what was found becomes the
`faults/...` scalars of the step's record.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.backends.tensorflow import graph_functions
from kerasdbg.backends.tensorflow import ops as _ops
from kerasdbg import _replay
from kerasdbg.records import tags as _tags
from kerasdbg.backends.tensorflow import distribute
from kerasdbg.capture import keras_objects
from kerasdbg.backends.tensorflow import optimizer_routing as routing
from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg import stats as stats_lib
from kerasdbg.backends.tensorflow.channels import _zeros_like
from kerasdbg.backends.tensorflow.quantities import _dense, _several_replicas
from kerasdbg.quantities import reductions
from kerasdbg.capture.interface import FaultState
from kerasdbg.capture.requests import Freeze, merged_freeze
from kerasdbg.quantities.spikes import MIN_RELATIVE_STD, Spike

if TYPE_CHECKING:
    from kerasdbg.backends.tensorflow.engine import EngineView, _ApplyContext, _StepState


MAX_FLAGGED = 4096
"""Variables of one optimizer whose non-finite gradient NaN localisation can name."""
MAX_GUARD_VALUES = 512
"""Values per train step the guard records (`step/skipped`, `step/gradient_norm`,
`step/spike_fraction` of each optimizer)."""


class Gate(NamedTuple):
    """What skips parts of an optimizer's `apply` in a frozen step."""

    frozen: object
    """The update: this step is frozen (a fault now or before)."""
    frozen_before: object
    """Weight decay: an earlier step froze the weights."""


GATES: Dict[Tuple[Optional[int], int], Gate] = {}
"""(replica id, id of the inner optimizer) -> the `Gate` of the apply being
traced (`Faults.apply_unless_frozen`), read by the engine's routes."""


_REPLAYS = "_kerasdbg_replays"
"""The model's attribute holding its NaN-localisation replays, by channel,
buffer and input signature, kept across fits."""


class Snapshot(NamedTuple):
    """What `Faults.snapshot` copied: the variables and their values (NumPy)."""

    variables: list
    values: list


def _nonfinite_flags(packed: "stats_lib.Packed", missing) -> tf.Tensor:
    """`[len(missing)]` int64: 1 where the gradient (the packed ones, in the
    order of the present ones) holds a NaN/Inf, 0 where it does not or is
    missing (`missing[i]`)."""
    blocks = []
    for vector, (positions, sizes) in zip(packed.vectors, packed.groups):
        bad = tf.cast(tf.logical_not(tf.math.is_finite(vector)), tf.int32)
        if len(positions) > 1:
            ids = tf.constant(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
            blocks.append(tf.math.unsorted_segment_sum(bad, ids, len(sizes)) > 0)
        else:
            blocks.append(tf.reshape(tf.reduce_any(bad > 0), [1]))
    order = packed.order
    flags = tf.concat([tf.cast(b, tf.int64) for b in blocks] + [tf.zeros([1], tf.int64)], 0)
    where = {p: k for k, p in enumerate(order)}
    present = iter(range(len(missing) - sum(missing)))
    index = [len(order) if gone else where.get(next(present), len(order)) for gone in missing]
    return tf.gather(flags, index)


def _spikes(test: Spike, value, window, count):
    """Whether `value` spikes against the window of `test` (in-graph,
    float64): more than `sigmas` standard deviations above the window's mean
    (the deviation at least `MIN_RELATIVE_STD` x |mean|), or more than
    `factor` x its largest value (when that is positive); never before the
    window is full, never for a NaN/Inf (that is another fault)."""
    mean = tf.reduce_mean(window)
    spike = tf.constant(False)
    if test.sigmas is not None:
        std = tf.sqrt(tf.reduce_mean(tf.square(window - mean)))
        std = tf.maximum(std, MIN_RELATIVE_STD * tf.abs(mean))
        spike = tf.logical_or(spike, value > mean + test.sigmas * std)
    if test.factor is not None:
        largest = tf.reduce_max(window)
        spike = tf.logical_or(spike, tf.logical_and(largest > 0, value > test.factor * largest))
    return tf.logical_and(tf.logical_and(count >= test.window, tf.math.is_finite(value)), spike)


class Faults(FaultState):
    """The fault handling of one engine: its variables (the frozen flag, the
    copies of the state variables, the NaN source) and what it found; owned
    by the `Engine`, which calls it before each optimizer apply, for the
    update itself, at the end of each train step and when it collects."""

    def __init__(self, view: "EngineView"):
        self._view = view
        self._frozen: Optional[tf.Variable] = None
        # Non-trainable state the forward pass updates (BatchNormalization's
        # moving statistics) and its copy after the last unfrozen step.
        self._state: List[tuple] = []
        self._state_saved: Optional[tf.Variable] = None
        self._save = None  # (state, strategy, the function that saves it)
        # NaN localisation: [step, first layer index, channel, one flag per variable].
        self._nan_row: Optional[tf.Variable] = None
        self.nan_layers: List[str] = []
        # The optimizers of the train step's applies, in order (from the trace),
        # and, by step, those a fault found after the first apply had reached.
        self.apply_order: List[str] = []
        self._late_faults: Dict[int, List[str]] = {}
        # The guard (spike tests, skips): per optimizer and spike test, the
        # window of accepted values and their count; per optimizer, the last
        # steps' skip and spike flags and the steps counted; the train
        # steps' guard values and what they are (`guard_names`).
        self._windows: Dict[tuple, Tuple[tf.Variable, tf.Variable]] = {}
        self._flags: Dict[int, Tuple[tf.Variable, tf.Variable]] = {}
        self._last_steps: Dict[int, tf.Variable] = {}  # the last step each optimizer's guard saw
        self._guard: Optional[tf.Variable] = None
        self.guard_names: List[Tuple[str, str]] = []
        # The batches left to skip after a rollback (set by the host).
        self._forced: Optional[tf.Variable] = None

    # ----------------------------------------------------------- lifecycle
    def prepare(self, model, strategy) -> None:
        """Creates the variables the requests' faults need, before the trace
        (in the strategy's scope)."""
        if self._freeze() is not None and self._frozen is None:
            self._frozen = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_frozen")
        if self._freeze() is not None:
            self._prepare_state(model, strategy)
            for _, optimizer in keras_objects.find_optimizers(model):
                # The steps a freeze or a skip keeps from `iterations` (they number
                # the optimizer's steps in every later fit too).
                if keras_objects.uncounted_steps(optimizer) is None:
                    keras_objects.keep_uncounted_steps(optimizer, _buffers.on_read_variable(
                        tf.zeros([], tf.int64), "kerasdbg_uncounted_steps"))
        if self._localizes() and self._nan_row is None:
            self._nan_row = _buffers.on_read_variable(
                tf.zeros([3 + MAX_FLAGGED], tf.int64), "kerasdbg_nan_source")
        if self._guards() or self._logits():
            self._prepare_guard(model)

    def _logits(self) -> bool:
        """Whether a request asks for the largest logits (written with the guard's values)."""
        return any(getattr(r, "logits", False) for r in self._view.requests)

    def _guards(self) -> bool:
        """Whether a spike test or a skip is armed."""
        freeze = self._freeze()
        return freeze is not None and bool(freeze.spikes or freeze.skip or freeze.rollback)

    def _prepare_guard(self, model) -> None:
        """The guard's variables (in the strategy's scope, before the trace):
        its buffer of values per train step, and per optimizer of the model
        the windows of its spike tests, its recent skip and spike flags and
        the steps skipped (kept on the optimizer's side: they number its
        steps in every later fit too)."""
        freeze = self._freeze() or Freeze()
        rows = self._view.rows
        if self._forced is None:
            self._forced = _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_forced_skips")
        if self._guard is None or int(self._guard.shape[0]) != rows:
            self._guard = _buffers.on_read_variable(
                tf.fill([rows, 1 + MAX_GUARD_VALUES], tf.constant(np.nan, tf.float64)),
                "kerasdbg_guard")
        for _, optimizer in keras_objects.find_optimizers(model):
            inner = keras_objects.inner_optimizer(optimizer)
            for spike in freeze.spikes:
                key = (id(inner), spike.quantity, spike.window)
                if key not in self._windows:
                    self._windows[key] = (
                        _buffers.on_read_variable(tf.zeros([spike.window], tf.float64),
                                                  "kerasdbg_spike_window"),
                        _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_spike_count"))
            if id(inner) not in self._last_steps:
                self._last_steps[id(inner)] = _buffers.on_read_variable(
                    tf.zeros([], tf.int64), "kerasdbg_guard_last_step")
            if (id(inner), freeze.skip_window) not in self._flags:
                self._flags[(id(inner), freeze.skip_window)] = (
                    _buffers.on_read_variable(tf.zeros([freeze.skip_window, 2], tf.int64),
                                              "kerasdbg_skip_flags"),
                    _buffers.on_read_variable(tf.zeros([], tf.int64), "kerasdbg_guard_steps"))

    def begin_fit(self) -> None:
        """At the start of a fit: the weights unfrozen, no NaN source, no late fault."""
        if self._frozen is not None:
            self.unfreeze()
        if self._nan_row is not None:
            self._nan_row.assign(tf.zeros_like(self._nan_row))
        if self._forced is not None:  # a rollback's skips are its fit's
            self._forced.assign(tf.zeros([], tf.int64))
        self._forget_stale_windows()
        self._late_faults = {}
        self._source = None

    def _forget_stale_windows(self) -> None:
        """Empties the spike windows and skip flags of an optimizer that
        trained steps the guard did not see (a fit without it in between):
        its values then are no measure of the steps to come."""
        for _, optimizer in keras_objects.find_optimizers(self._view.model):
            inner = keras_objects.inner_optimizer(optimizer)
            last = self._last_steps.get(id(inner))
            if last is None or int(_buffers.read(last)) in (0, keras_objects.step_number(inner)):
                continue
            for (owner, _, _), (window, count) in self._windows.items():
                if owner == id(inner):
                    window.assign(tf.zeros_like(window))
                    count.assign(tf.zeros([], tf.int64))
            for (owner, _), (flags, steps) in self._flags.items():
                if owner == id(inner):
                    flags.assign(tf.zeros_like(flags))
                    steps.assign(tf.zeros([], tf.int64))

    def _freeze(self) -> Optional[Freeze]:
        """The faults that freeze the weights: the requests' merged (`merged_freeze`)."""
        return merged_freeze(self._view.requests)

    def _localizes(self) -> bool:
        return any(r.localize for r in self._view.requests)

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
            # One function per set of copies, kept: a function made at every
            # fit would be traced at every fit.
            if self._save is None or self._save[0] is not self._state or \
                    self._save[1] is not strategy:
                state, saved = self._state, self._state_saved

                def save():
                    for variable, copy in state:
                        copy.assign(reads.read(variable))
                    saved.assign(tf.ones([], tf.int64))

                self._save = (state, strategy, tf.function(save, autograph=False))
            strategy.run(self._save[2])

    @staticmethod
    def _state_variables(model) -> list:
        return [v for v in model.non_trainable_variables
                if keras_objects.is_float(v) and not reads.on_read(v)]

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

    def _make_state_now(self, model) -> None:
        with tf.init_scope(), model.distribute_strategy.scope():
            self._make_state(model)

    # ------------------------------------------------------- in the graph
    def before_apply(self, context: _ApplyContext, optimizer, grads) -> None:
        """The fault test of an apply, before its update: `context.loss` and
        `context.frozen` (`_step_loss_and_fault`), the train step's fault and
        the position of the first apply that found one, and at the first
        non-finite value of the fit its source (`_localize`)."""
        channel, state = context.channel, context.state
        step = context.step
        loss, nonfinite, fault, frozen = self._step_loss_and_fault(context, optimizer, grads)
        context.loss, context.frozen = loss, frozen
        context.frozen_before = state.frozen_before
        if context.skip is not None:
            state.skip = context.skip if state.skip is None else tf.logical_or(
                state.skip, context.skip)
        position = tf.constant(len(state.order), tf.int64)
        state.order.append(channel)
        if fault is not None:
            state.fault = fault if state.fault is None else tf.logical_or(state.fault, fault)
            earlier = tf.constant(-1, tf.int64) if state.first_fault is None else state.first_fault
            state.first_fault = tf.where(tf.logical_and(fault, earlier < 0), position, earlier)
        if nonfinite is not None and self._localizes():
            if frozen is None:
                self._localize(context, step, nonfinite, grads)
            else:
                # After the applies, at the end of the step: the replay reads
                # the weights, and an update written after that read would
                # wait for the batch, where plain Keras's writes of `apply`
                # that need no batch (its step count) do not. A fault skips
                # the update, so the weights it reads are the same.
                state.localizations.append(
                    lambda: self._localize(context, step, nonfinite, grads))

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
        wants_loss = self._view.wants("step", "tensors")
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
            # Packed once (small gradients concatenated per dtype): the
            # finiteness test and, at a fault, the NaN localisation take it.
            context.packed_grads = stats_lib.Packed.of([_dense(g) for g in present])
            parts.append(tf.cast(tf.logical_not(reductions.all_finite(context.packed_grads)), tf.float64))
        vector = tf.stack(parts)
        replicas = _several_replicas()
        if replicas is not None:
            vector = replicas.all_reduce(tf.distribute.ReduceOp.SUM, vector)
        loss = None if local is None else vector[0]
        if loss is not None:
            state.loss_sum = loss
        nonfinite = tf.constant(False)
        if watched.nonfinite_loss and loss is not None:
            nonfinite = tf.logical_or(nonfinite, tf.logical_not(reductions.all_finite(loss)))
        if check_grads:
            nonfinite = tf.logical_or(nonfinite, vector[1] > 0)
        fault = nonfinite
        over = None
        norm = None
        norm_spiked = any(spike.quantity == "gradient_norm" for spike in watched.spikes)
        if watched.max_gradient_norm is not None or norm_spiked:
            if replicas is not None:
                # The norm of the summed gradient, as the optimizer applies it.
                present = replicas.all_reduce(
                    tf.distribute.ReduceOp.SUM, [_dense(g) for g in present])
            norm = reductions.norm_of(present)
            if scaled:
                norm = norm / tf.cast(optimizer.dynamic_scale, tf.float64)
        if watched.max_gradient_norm is not None:
            over = norm > watched.max_gradient_norm
            if scaled:
                # An overflow of the scaled gradients is the loss scaler's to skip.
                over = tf.logical_and(reductions.all_finite(norm), over)
            fault = tf.logical_or(fault, over)
        if freeze is None:
            return loss, nonfinite, fault, None
        before = self._frozen.read_value() > 0
        if state.frozen_before is None:
            # As the last train step left it: known before this step's batch.
            state.frozen_before = before
        if not self._guards():
            frozen = tf.logical_or(before, fault)
            self._frozen.assign(tf.cast(frozen, tf.int64))
            return loss, nonfinite, fault, frozen
        frozen = self._guard_step(context, optimizer, freeze, before,
                                  {"loss": loss, "gradient_norm": norm},
                                  {"nonfinite": nonfinite, "max_gradient_norm": over})
        fault = tf.logical_or(fault, context.spike)
        self._frozen.assign(tf.cast(frozen, tf.int64))
        return loss, nonfinite, fault, frozen

    def _guard_step(self, context: "_ApplyContext", optimizer, freeze: Freeze, before,
                    values: Dict[str, object], faults: Dict[str, object]):
        """The spike tests and the skip of one apply (in-graph): sets
        `context.spike` and `context.skip` and returns whether the weights
        are frozen from this step on.

        Every input is the same on every replica (summed over them), so every
        replica takes the same decision. A fault whose kind `freeze.skip`
        names skips this step (nothing applied, the step not counted by the
        optimizer) unless `max_skips` steps were skipped among the last
        `skip_window`, or the weights are frozen already: then it freezes them.
        """
        inner = keras_objects.inner_optimizer(optimizer)
        spike = tf.constant(False)
        tested = []
        faults = dict(faults)
        for test in freeze.spikes:
            value = values.get(test.quantity)
            if value is None:
                continue
            window, count = self._windows[(id(inner), test.quantity, test.window)]
            found = _spikes(test, tf.cast(value, tf.float64), window.read_value(),
                            count.read_value())
            kind = f"{test.quantity}_spike"
            faults[kind] = found if faults.get(kind) is None else tf.logical_or(faults[kind], found)
            spike = tf.logical_or(spike, found)
            tested.append((test, tf.cast(value, tf.float64), window, count))
        no = tf.constant(False)
        skipping = [faults[kind] for kind in freeze.skip if faults.get(kind) is not None]
        stopping = [flag for kind, flag in faults.items()
                    if flag is not None and kind not in freeze.skip]
        skip_fault = tf.reduce_any(tf.stack(skipping)) if skipping else no
        stop_fault = tf.reduce_any(tf.stack(stopping)) if stopping else no
        fault = tf.logical_or(skip_fault, stop_fault)
        flags, steps = self._flags[(id(inner), freeze.skip_window)]
        recent = flags.read_value()
        skip = tf.logical_and(
            tf.logical_and(skip_fault, tf.logical_not(stop_fault)),
            tf.logical_and(tf.logical_not(before),
                           tf.reduce_sum(recent[:, 0]) < freeze.max_skips))
        frozen = tf.logical_or(before, tf.logical_and(fault, tf.logical_not(skip)))
        forced = None
        if freeze.rollback:
            # The batches after a rollback are skipped whatever they hold, and
            # count in no budget; their values enter no window.
            forced = context.state.forced
            if forced is None:  # once per train step, whatever its applies
                left = self._forced.read_value()
                forced = context.state.forced = left > 0
                self._forced.assign(left - tf.cast(forced, tf.int64))
            frozen = tf.logical_and(frozen, tf.logical_not(forced))
            fault = tf.logical_or(fault, forced)
        # A value enters its window when its step had no fault and the
        # weights were not frozen before it.
        accept = tf.logical_not(tf.logical_or(fault, before))
        for test, value, window, count in tested:
            take = tf.logical_and(accept, tf.math.is_finite(value))
            number = count.read_value()
            position = tf.math.floormod(number, test.window)
            window.assign(tf.where(take, tf.tensor_scatter_nd_update(
                window.read_value(), [[position]], [value]), window.read_value()))
            count.assign(number + tf.cast(take, tf.int64))
        budgeted = skip
        if forced is not None:
            skip = tf.logical_or(skip, forced)
        self._last_steps[id(inner)].assign(tf.cast(context.step, tf.int64))
        number = steps.read_value()
        row = tf.stack([tf.cast(budgeted, tf.int64), tf.cast(spike, tf.int64)])
        recent = tf.tensor_scatter_nd_update(
            recent, [[tf.math.floormod(number, freeze.skip_window)]], [row])
        flags.assign(recent)
        steps.assign(number + 1)
        # The fraction of spiky steps among the last `skip_window` (fewer at first).
        seen = tf.cast(tf.minimum(number + 1, freeze.skip_window), tf.float64)
        spikes = tf.cast(tf.reduce_sum(recent[:, 1]), tf.float64)
        armed = bool(freeze.skip) or freeze.rollback
        context.spike, context.skip = spike, skip if armed else None
        name = context.channel.hook.name
        guard = context.state.guard
        if armed:
            guard.append(("skipped", name, tf.cast(skip, tf.float64), "optimizer"))
        if forced is not None:
            guard.append(("skipped_after_rollback", name, tf.cast(forced, tf.float64),
                          "optimizer"))
        if freeze.skip:
            # Why a step was skipped: `faults/skip/<kind>` at its step.
            for kind, flag in faults.items():
                if flag is not None and kind in freeze.skip:
                    guard.append((kind, name, tf.cast(tf.logical_and(budgeted, flag), tf.float64),
                                  "reason"))
        if values.get("gradient_norm") is not None:
            guard.append(("gradient_norm", name, tf.cast(values["gradient_norm"], tf.float64),
                          "optimizer"))
        if freeze.spikes:
            guard.append(("spike_fraction", name, spikes / seen, "optimizer"))
        return frozen

    def _localize(self, context: _ApplyContext, step, nonfinite, grads) -> None:
        """On the first fault of the fit, replays the forward pass layer by
        layer and records where non-finite values first appear.

        Costs nothing on healthy steps but the fault test itself: the replay
        sits in a `tf.cond` taken once. With one replica it is a kept call
        of a function traced once per input signature over the fits
        (`_graph_functions`): no step instantiates it, so the graph
        optimizer never works on this second forward pass, until a fault.
        """
        model = self._view.model
        row = self._nan_row
        x = context.state.x
        number = context.channel.number
        grads = list(grads)[:MAX_FLAGGED]
        # The replay keeps no graph tensor (a cached function would keep the
        # first trace's graph alive), only which gradients are missing and
        # the layout of the packed others.
        missing = tuple(g is None for g in grads)
        given_grads = [g for g in grads if g is not None]
        packed = getattr(context, "packed_grads", None)
        if packed is not None and len(packed) != len(given_grads):
            packed = None  # more than MAX_FLAGGED gradients: packed again, in the branch

        def replay(x, vectors, step, layout):
            names, flags = [], []

            def on_output(name, outputs):
                for tensor in keras.tree.flatten(outputs):
                    if tf.is_tensor(tensor) and tensor.dtype.is_floating:
                        names.append(name)
                        flags.append(tf.logical_not(reductions.all_finite(tensor)))

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
            head = tf.stack([tf.cast(step, tf.int64), first, tf.constant(number, tf.int64)])
            variable_flags = _nonfinite_flags(stats_lib.Packed(vectors, *layout), missing)
            # One zeros op, not thousands of stacked scalars (XLA compiles each).
            padding = tf.zeros([MAX_FLAGGED - len(missing)], tf.int64)
            row.assign(tf.concat([head, variable_flags, padding], 0))
            return tf.constant(True)

        def run():
            # Packed (dense) here, in the branch a fault takes, unless the
            # fault test packed them: a sparse gradient (an Embedding's) is
            # not expanded at every healthy step for this.
            pack = packed if packed is not None else stats_lib.Packed.of(
                [_dense(g) for g in given_grads])
            if _several_replicas() is not None or x is None or tf.executing_eagerly():
                # Under a strategy each replica traces its own replay (a shared
                # function would keep the first replica's captures).
                return replay(x, pack.vectors, step, pack.layout)
            # On the model: the function holds the model (an engine holding it
            # would keep the model alive through `engine_for`'s weak table).
            cached = vars(model).get(_REPLAYS)
            if cached is None:
                cached = {}
                object.__setattr__(model, _REPLAYS, cached)
            layout = pack.layout
            key = (number, id(row), missing, layout, _ops.xla_form(),
                   tuple(graph_functions.signature_key(t) for t in keras.tree.flatten(x)),
                   tuple(graph_functions.signature_key(v) for v in pack.vectors))
            function = cached.get(key)
            if function is None:
                function = cached[key] = tf.function(
                    lambda x, vectors, step: replay(x, vectors, step, layout),
                    autograph=False, reduce_retracing=False,
                    experimental_attributes={"_noinline": True})
            return function(x, pack.vectors, tf.cast(step, tf.int64))

        first_time = tf.logical_and(nonfinite, tf.equal(row.read_value()[0], 0))
        tf.cond(first_time, run, lambda: tf.constant(False))

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
                copy.assign(tf.cast(reads.read(variable), copy.dtype))
            self._state_saved.assign(tf.ones([], tf.int64))
            return tf.constant(False)

        saved = self._state_saved.read_value() > 0
        _buffers.run_if(tf.logical_and(frozen, saved), restore)
        _buffers.run_if(tf.logical_not(frozen), save)

    def apply_unless_frozen(self, original_apply, optimizer, grads, trainable_variables, frozen,
                            frozen_before, skip=None):
        """Applies the update unless `frozen` or `skip` (`skip`: None when no
        skip is armed); a frozen or skipped step changes no variable of the
        optimizer, its step count included, and counts in
        `keras_objects.uncounted_steps` instead (which numbers the steps).

        Where the optimizer allows it (`update_gateable`, with one replica),
        Keras's own `apply` runs as it is, and two conditions inside it skip
        what a frozen step must not change: the variables' update
        (`_route_update`, on `frozen`) and weight decay (`_route_weight_decay`,
        on `frozen_before`: whether an earlier train step froze the weights,
        known before this step's batch). The rest of
        `apply` (the learning rate) is as in plain Keras, also in the call
        that meets the end of a dataset of unknown length, where no batch
        comes and plain Keras still counts a step and decays the weights (the
        update waits for the batch); the step count of a frozen step is taken
        back after it, with no condition. At the faulty step itself the decay
        (it comes before the gradients in Keras's `apply`) is undone once the
        fault test is known.

        Elsewhere a `tf.cond` on `frozen` chooses between nothing and
        `apply`; strategies that need `merge_call` (Mirrored, OneDevice)
        get it in cross-replica context, as `LossScaleOptimizer` does.
        """

        inner = keras_objects.inner_optimizer(optimizer)
        scaled = inner is not optimizer
        # Built here, not inside a branch (a LossScaleOptimizer builds in apply).
        keras_objects.ensure_built(optimizer, trainable_variables)
        no_merge_call = tf.__internal__.distribute.strategy_supports_no_merge_call()
        # One replica: the routes swap the optimizer's step count for a read
        # of it while they trace, which replicas tracing at once would mix.
        variables = (keras_objects.optimizer_variables(inner) if trainable_variables is None
                     else list(trainable_variables))
        if skip is not None:
            frozen = tf.logical_or(frozen, skip)
        # Neither a frozen nor a skipped step is counted: as if its batch had not come.
        uncounted = keras_objects.uncounted_steps(optimizer)
        if uncounted is not None:
            uncounted.assign_add(tf.cast(frozen, tf.int64))
        if (no_merge_call and _several_replicas() is None and frozen_before is not None
                and routing.update_gateable(optimizer, variables)):
            key = (distribute.replica_id(), id(inner))
            GATES[key] = Gate(frozen, frozen_before)
            try:
                original_apply(grads, trainable_variables)
            finally:
                GATES.pop(key, None)
            iterations = keras_objects.raw_iterations(optimizer)
            iterations.assign_sub(tf.cast(frozen, iterations.dtype))
            return True

        def count_step(grads, trainable_variables):
            # The gradient statistics of a frozen step are recorded too: the
            # (routed) reduction records them, and nothing is applied (the
            # step count neither).
            if scaled:
                scale = optimizer.dynamic_scale
                grads = [g if g is None else g / tf.cast(scale, g.dtype) for g in grads]
            if trainable_variables is None:
                trainable_variables = keras_objects.optimizer_variables(inner)
            variables = [reads.read_handle(v) for v in trainable_variables]
            getattr(inner, routing.REDUCE_METHOD)(list(zip(grads, variables)))

        def branch(function):
            def run():
                function()
                return tf.constant(True)

            return run

        if no_merge_call:
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

    def end_step(self, model, state: "_StepState"):
        """At the end of the train step: the NaN localisations left to it,
        then whether the weights are frozen (None when no fault freezes
        them); a frozen step puts back the state variables, any other saves
        them (after the replay, which updates them too)."""
        for localize in state.localizations:
            localize()
        freeze = self._freeze()
        frozen = None
        if freeze is not None:
            frozen = self._frozen.read_value() > 0
            if not self._state_matches(self._state_variables(model)):
                distribute.merge_call(lambda: self._make_state_now(model))
            # A skipped step puts the state back too (it is not frozen after).
            self._keep_state_unless_frozen(
                frozen if state.skip is None else tf.logical_or(frozen, state.skip))
        if self._guard is not None and (self._guards() or self._logits()):
            self._write_guard(state)
        return frozen

    def _write_guard(self, state: "_StepState") -> None:
        """The train step's guard values into its row of the guard buffer
        (`guard_names` says what each column holds)."""
        entries = state.guard[:MAX_GUARD_VALUES]
        if len(state.guard) > MAX_GUARD_VALUES and not getattr(self, "_guard_warned", False):
            self._guard_warned = True
            left = ", ".join(dict.fromkeys(f"{n}/{q}" if q else n
                                           for n, q, _, _ in state.guard[MAX_GUARD_VALUES:]))
            warnings.warn(f"kerasdbg records the first {MAX_GUARD_VALUES} of the "
                          f"{len(state.guard)} per-step values of its guard and logits: {left} "
                          "are left out.", RuntimeWarning, stacklevel=3)
        self.guard_names = [(name, qualifier, kind) for name, qualifier, _, kind in entries]
        values = [tf.cast(state.train_id, tf.float64)] + [
            tf.cast(value, tf.float64) for _, _, value, _ in entries]
        # The padding as one constant, not hundreds of stacked scalars.
        padding = tf.fill([1 + MAX_GUARD_VALUES - len(values)], tf.constant(np.nan, tf.float64))
        row = tf.math.floormod(state.train_id - 1, int(self._guard.shape[0]))
        _buffers.write_row(self._guard, row, tf.concat([_ops.stack_small(values), padding], 0))

    def guard_scalars(self, train_id: int, several: bool) -> Dict[str, float]:
        """The guard's values of train step `train_id` (host read), by tag:
        `step/skipped`, `step/gradient_norm`, `step/spike_fraction`
        (`step/<optimizer>/<name>` with `several` optimizers), why a step was
        skipped (`faults/skip/<kind>[/<optimizer>]` = 1 at it: "nonfinite",
        "max_gradient_norm", "loss_spike", "gradient_norm_spike"), and the
        largest logits (`step/max_attention_logit`, per layer
        `step/<layer>/max_attention_logit` with several, and
        `step/max_output_logit`): the largest over replicas (the others are
        the same on every replica)."""
        if self._guard is None or not self.guard_names:
            return {}
        tables = getattr(self, "_guard_table", None)
        if tables is None:
            tables = self._guard_table = _buffers.read_replicas(self._guard)
        rows = [table[(train_id - 1) % table.shape[0]] for table in tables]
        rows = [row for row in rows if row[0] == train_id]
        if not rows:
            return {}
        values = np.max(np.stack(rows), axis=0)  # a NaN stays NaN: absent below
        scalars = {}
        # (A NaN here is a value: a non-finite gradient norm, a NaN logit.)
        for (name, qualifier, kind), value in zip(self.guard_names, values[1:]):
            if kind == "reason":
                if value > 0:
                    scalars[_tags.fault("skip", name, qualifier if several else None)] = 1.0
                continue
            if kind == "optimizer":
                qualifier = qualifier if several else None
            scalars[_tags.per_optimizer(_tags.STEP, name, qualifier)] = float(value)
        return scalars

    def forget_guard_read(self) -> None:
        """Drops the guard buffer read by `guard_scalars` (after a collect)."""
        self._guard_table = None

    # ----------------------------------------------------------- on host
    def keep_state(self) -> None:
        """Takes the forward pass's state variables as they are now as the
        values a frozen or skipped step puts back (after a rollback put the
        snapshot's back; host side)."""
        if self._save is not None and self._state:
            self._save[1].run(self._save[2])

    def skip_next(self, batches: int) -> None:
        """Skips the next `batches` train steps whatever they hold (after a
        rollback; host side)."""
        if self._forced is not None:
            self._forced.assign(tf.constant(batches, tf.int64))

    def guard_state(self) -> list:
        """The guard's variables that a rollback puts back: the spike windows
        and their counts, the skip and spike flags (host side)."""
        return [v for pair in list(self._windows.values()) + list(self._flags.values())
                for v in pair]

    def snapshot(self) -> "Snapshot":
        """A host copy of what a rollback puts back, taken between two
        executions: the model's variables (weights, the forward pass's
        state) but the debug layers' counters and buffers (their records go
        on), every optimizer's (slots, step count, loss scale), the steps
        kerasdbg kept each from counting, and the guard's spike windows and
        flags (host side)."""
        model = self._view.model
        debug = {id(v) for layer in model._flatten_layers()
                 if getattr(layer, "kerasdbg_debug_layer", False) for v in layer.variables}
        variables = [v for v in model.variables if id(v) not in debug]
        for _, optimizer in keras_objects.find_optimizers(model):
            variables += list(optimizer.variables)
            skipped = keras_objects.uncounted_steps(optimizer)
            if skipped is not None:
                variables.append(skipped)
        variables += self.guard_state()
        unique = list({id(v): v for v in variables}.values())
        return Snapshot(unique, [keras_objects.host_value(v) for v in unique])

    def put_back(self, snapshot: "Snapshot") -> None:
        """Assigns `snapshot`'s values to its variables (host side)."""
        for variable, value in zip(snapshot.variables, snapshot.values):
            variable.assign(value)

    def unfreeze(self) -> None:
        """Lets the weights change again after a fault froze them (host side)."""
        if self._frozen is not None:
            self._frozen.assign(tf.zeros([], tf.int64))

    @property
    def frozen(self) -> bool:
        """Whether a fault has frozen the weights (replica 0's flag)."""
        return self._frozen is not None and bool(_buffers.read(self._frozen))

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
        # Written once per fit (the first fault): once found, it is kept, and
        # several workers gather it only until then.
        if getattr(self, "_source", None) is not None:
            return self._source
        # Every worker's replicas: a NaN in one worker's shard is found by its
        # replay alone, and every worker must give the same verdict.
        rows = _buffers.read_all_workers(self._nan_row)
        hits = [r for r in rows if r[0] > 0]
        if not hits:
            return None
        indices = [int(r[1]) for r in hits if r[1] >= 0]
        layer = None
        if indices and min(indices) < len(self.nan_layers):
            layer = self.nan_layers[min(indices)]
        number = int(hits[0][2])
        channels = self._view.channels
        channel = channels[number] if 0 <= number < len(channels) else None
        flags = np.any([r[3:] for r in hits], axis=0)
        paths = channel.paths if channel is not None else []
        variables = [p for p, bad in zip(paths, flags) if bad]
        self._source = {"step": int(hits[0][0]), "layer": layer, "variables": variables,
                        "optimizer": channel.hook.name if channel is not None else None}
        return self._source

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

    def late_fault(self, step: int, position: int) -> None:
        """The fault of the train step at `step` was found by its apply at
        `position` (from 0) in the order of `apply_order`."""
        self._late_faults[step] = self.apply_order[:position + 1]

    def scalars(self, step: int, row) -> Dict[str, float]:
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
        model = self._view.model
        layer = source["layer"]
        if layer is not None:
            located = _tags.NAN_SOURCE_LAYER
            scalars[_tags.fault("nan_source", "layer", layer)] = 1.0
        elif _replay.is_graph_model(model):
            located = (_tags.NAN_SOURCE_LOSS if self._view.loss_captured
                       else _tags.NAN_SOURCE_TRAIN_STEP)
        else:
            located = _tags.NAN_SOURCE_HIDDEN
            scalars[_tags.fault("nan_source", "model", model.name)] = 1.0
        scalars[_tags.fault("nan_source", "located")] = float(located)
        for path in source["variables"]:
            scalars[_tags.fault("nan_source", "gradient", path)] = 1.0
        if self._view.several_optimizers and source.get("optimizer"):
            scalars[_tags.fault("nan_source", "optimizer", source["optimizer"])] = 1.0
        return scalars
