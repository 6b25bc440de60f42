"""The requested quantities, computed in the graph and written to the buffers.

At each optimizer apply the gradients (the model's and, where clipping or
gradient accumulation make it differ, the applied one), the weights after
the update (with their update ratio and distance from the start) and the
histograms of both; at each train step the class counts. `_scheduled_table`
groups the slots that ask for statistics by schedule and builds one
`tf.cond` chain, so each (tensor, statistic) is computed at most once per
step whatever the number of requests asking for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

import keras
import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.backends.tensorflow import graph_functions
from kerasdbg.capture import keras_objects
from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg import stats as stats_lib
from kerasdbg.quantities import reductions
from kerasdbg.capture.requests import MAX_CLASSES, WEIGHT_EXTRA_STATISTICS, _and, _or, _scheduled
from kerasdbg.backends.tensorflow.channels import Slot
from kerasdbg.schedule import Schedule

if TYPE_CHECKING:
    from kerasdbg.backends.tensorflow.engine import EngineView, _ApplyContext, _StepState


def _dense(gradient) -> tf.Tensor:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def _several_replicas():
    """The replica context when there are several replicas, else None."""
    replicas = tf.distribute.get_replica_context()
    if replicas is not None and replicas.num_replicas_in_sync > 1:
        return replicas
    return None


class Quantities:
    """Computes the quantities the requests ask for and writes them to their
    slots' buffers, in the graph; owned by the `Engine`, which calls it
    around each optimizer apply and at the end of each train step."""

    def __init__(self, view: "EngineView"):
        self._view = view

    def copy_weights(self, context: _ApplyContext) -> None:
        """Before the update: the weights at the fit's start (distances from
        the start) and before this update (update ratios), into the hook's
        flat copies, at the steps a weights slot reads them.

        The weights are packed outside the conditions (`stats.Packed`: the
        small ones concatenated per dtype, a copy of few bytes at every
        step; a large one flattened, no copy), so that each condition takes
        one vector per group, not one input per variable, and writes each
        copy with one assign."""
        channel, hook = context.channel, context.channel.hook
        step = context.step
        weight_slots = channel.slots_of("weights")
        ratios = [s for s in weight_slots if "update_ratio" in s.request.stats]
        starts = bool(channel.initial and weight_slots)
        snapshots = bool(channel.previous and ratios)
        if not (starts or snapshots):
            return
        # The copies' layout is `stats.plan` of these same values (`Channel.copy_groups`).
        now = stats_lib.Packed.of([reads.read(v) for v in channel.variables])

        def assign(copies):
            for copy, vector in zip(copies, now.vectors):
                copy.assign(tf.cast(vector, copy.dtype))

        if starts:

            def start():
                assign(channel.initial)
                hook.started.assign(tf.ones([], tf.int64))

            if self._view.variant is not False:
                # The full variant runs each fit's first execution (`Variants.wanted`).
                _buffers.run_if(tf.equal(hook.started.read_value(), 0), start)
        if snapshots:
            _buffers.run_if(_and(_any([self.needs_at(s.request, "update_ratio", step)
                                       for s in ratios]),
                                 hook.updates_at(step)), lambda: assign(channel.previous))

    def record_model_gradients(self, context: _ApplyContext, optimizer, grads) -> None:
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
        tensors = self._view.tensors_of(channel)
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
        row, train_id = self._view.row(context.state.train_id), context.state.train_id
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
            accumulated = iter(keras_objects.accumulators(optimizer, variables))
            applied = [None if g is None else
                       (g + tf.cast(reads.read(next(accumulated)), g.dtype)) / hook.accumulation
                       for g in applied]
        if not hook.clipping:
            return applied, None
        kind, value = hook.clipping
        present = [g for g in applied if g is not None]
        if not present:
            return applied, tf.constant(False)
        # What the optimizer applies is what its own clipping makes of them;
        # whether it clipped is judged on the norms (or largest magnitudes).
        applied = keras_objects.clip_gradients(optimizer, applied)
        if kind == "clipvalue":
            clipped = tf.reduce_any(tf.stack([tf.reduce_max(tf.abs(g)) > value for g in present]))
        else:
            norms = stats_lib.tensor_statistics(present, ["l2_norm"])[:, 0]
            clipped = tf.reduce_any(norms > value) if kind == "clipnorm" else \
                reductions.global_norm(norms) > value
        if hook.accumulation:
            clipped = tf.logical_and(clipped, hook.updates_at(context.step))
        return applied, clipped

    def record_applied(self, context: _ApplyContext, reduced) -> None:
        """The gradient the optimizer applies (after clipping, summed over
        replicas), from the routed reduction, when it is the model's; with
        clipping or accumulation `record_model_gradients` did it all."""
        channel = context.channel
        inner = channel.hook.inner
        if channel.hook.separate:
            grads = context.applied
        else:
            by_key = {keras_objects.variable_key(inner, v): g for g, v in reduced if g is not None}
            grads = [by_key.get(k) for k in channel.keys]
        step = context.step
        row, train_id = self._view.row(context.state.train_id), context.state.train_id
        tensors = self._view.tensors_of(channel)
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

        plan = _scheduled_table(slots, step, gate, _gradient_table, (),
                                [[grads[i] for i in wanted], [grads[i] for i in others]],
                                every_step_only=self._view.variant is False)
        if plan is not None:
            table, columns, global_norm = plan
            tail = [global_norm]
            if not applied:
                tail.append(tf.constant(np.nan, tf.float64) if clipped is None
                            else tf.cast(clipped, tf.float64))
            tail = [tf.stack(tail)]
            for slot in slots:
                values = _slot_rows(table, wanted, slot.positions, slot.present,
                                    [columns.index(s) for s in slot.request.stats])
                buffer = slot.applied_values if applied else slot.values
                _write_if(_and(gate, self.writes_at(slot.request, step)), buffer, row, train_id,
                          [values] + tail)
        if not applied:
            for slot in slots:
                mine = [grads[i] for i in slot.positions]
                _buffers.run_if(self.histograms_at(slot.request, step),
                                lambda slot=slot, mine=mine: self.record_histograms(
                                    slot, mine, row, train_id))

    def record_classes(self, state: _StepState, classes) -> None:
        """At the end of the train step: its class counts added to the totals
        of the "classes" requests `classes`, which learn whether the traced
        train step had labels."""
        counts = self._class_counts(state, classes)
        for request in classes:
            request.labelled = counts is not None
        if counts is not None:
            for request in classes:
                totals = request.totals.read_value() + counts
                request.totals.assign(totals)

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

    def record_weights(self, slots: List[Slot], step, updates, row, train_id) -> None:
        """Statistics of the weights after the update, each computed once per
        step for all `slots` (`_scheduled_table`)."""
        channel = slots[0].channel
        wanted = sorted({i for s in slots for i in s.positions})

        stats = {s for slot in slots for s in slot.request.base_stats}
        ratio, distance = "update_ratio" in stats, "distance_from_start" in stats
        inputs = [stats_lib.Packed.of([reads.read(channel.variables[i]) for i in wanted]),
                  _copies_of(channel, channel.previous, wanted) if ratio else [],
                  _copies_of(channel, channel.initial, wanted) if distance else []]
        plan = _scheduled_table(slots, step, updates, _weight_table, (ratio, distance), inputs,
                                every_step_only=self._view.variant is False)
        if plan is None:
            return
        table, columns, _ = plan
        for slot in slots:
            values = _slot_rows(table, wanted, slot.positions, [True] * len(slot.positions),
                                [columns.index(s) for s in slot.request.stats])
            _write_if(_and(updates, self.writes_at(slot.request, step)), slot.values, row,
                      train_id, [values])

    def _records_at(self, request, step):
        """`request.records_at(step)`; never in the every-step variant of the
        train function, where the schedule does not take every step."""
        if self._view.variant is False and not request.schedule.every_step:
            return False
        return request.records_at(step)

    def writes_at(self, request, step):
        """In the graph: whether `request` writes values at `step` (in the
        every-step variant, at the steps of its `frequent` statistics)."""
        return _or(self._records_at(request, step), request.frequent_at(step))

    def needs_at(self, request, statistic: str, step):
        """In the graph: whether `request` records `statistic` at `step`."""
        if statistic in request.frequent:
            return request.frequent_at(step)
        return self._records_at(request, step) if statistic in request.stats else False

    def histograms_at(self, request, step):
        """In the graph: whether `request` takes its histograms at `step`
        (never in the every-step variant of the train function)."""
        if self._view.variant is False:
            return False
        return request.histograms_at(step)

    def record_histograms(self, slot: Slot, tensors, row, train_id) -> None:
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


def _gradient_table(stats, settings, wanted, others):
    """`(table, global norm)`: `stats` of the gradients `wanted`, and the
    norm of all of them (`others` too)."""
    table = graph_functions.statistics_table(wanted, stats) if wanted else \
        tf.zeros([0, len(stats)], tf.float64)
    norms = [table[:, stats.index("l2_norm")]]
    if others:
        norms.append(graph_functions.statistics_table(others, ["l2_norm"])[:, 0])
    return table, reductions.global_norm(norms)


def _weight_table(stats, settings, weights, previous, initial):
    """`(table, 0)`: `stats` of the weights after the update, the update
    ratio from their copies before it (`previous`) and the distance from
    their copies at the start (`initial`), three `stats.Packed` of one
    layout; `settings` says which copies are given."""
    ratio, distance = settings
    base_names = tuple(s for s in stats if s in stats_lib.ALL_STATISTICS)
    base = graph_functions.statistics_table(weights, base_names)
    columns = {s: base[:, i] for i, s in enumerate(base_names)}
    # The norms of the update, of the weights before it and of the drift
    # from the start: one call, so one fault test and one finishing step.
    ratio = ratio and "update_ratio" in stats
    distance = distance and "distance_from_start" in stats
    extras = []
    if ratio:
        extras += [weights.zip_with(previous, lambda w, p: w - tf.cast(p, w.dtype)), previous]
    if distance:
        extras += [weights.zip_with(initial, lambda w, i: w - tf.cast(i, w.dtype))]
    norms = tf.unstack(tf.reshape(
        graph_functions.statistics_table(stats_lib.Packed.joined(extras), ["l2_norm"]),
        [-1, len(weights)])) if extras else []
    if ratio:
        update, before = norms[0], norms[1]
        # 0/0 (a zero tensor that did not move) is no update at all.
        columns["update_ratio"] = tf.where(
            tf.equal(update, 0), tf.zeros_like(update), update / before)
    if distance:
        columns["distance_from_start"] = norms[-1]
    return tf.stack([columns[s] for s in stats], axis=1), tf.constant(0.0, tf.float64)


def _scheduled_table(slots: List[Slot], step, gate, recipe, settings, inputs,
                     every_step_only: bool = False):
    """The statistics the slots record at `step`, each computed once.

    Slots are grouped by schedule. In the graph, the first group (largest
    set of statistics first) whose schedule holds at `step` computes its
    statistics and those of every later group and every slot's `frequent`
    ones; when none holds, only the `frequent` ones are computed. So each
    (tensor, statistic) is computed at most once per step, whatever the
    number of slots (consumers) asking for it, and nothing when none does.

    `inputs` are lists of tensors (or `stats.Packed`), packed here, outside
    the chain: the call and each condition of the chain take one vector per
    dtype of the small tensors and one per large tensor, not one input per
    tensor (with 2,000 variables, inputs per condition were most of the
    trace time). `recipe(stats, settings, *packs)` returns `(table [rows,
    len(stats)], scalar)`, rows being the tensors of `inputs[0]`. The chain
    of conditions and the recipe are one call of a function shared by every
    call with the same structure and input signature (`_graph_functions`):
    the train step gets one call op, and the function is traced once
    whatever the number of fits. Returns `(table [rows, len(columns)],
    columns, scalar)`, NaN where a statistic was not computed at this step,
    or None when no slot ever records. `every_step_only`: in the every-step
    variant of the train function, the statistics a schedule takes at some
    steps only are left out (no condition: the host runs the full variant
    at those steps, `variants.Variants`).
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
    if every_step_only:
        predicates = [p if schedule.every_step else False
                      for p, schedule in zip(predicates, groups)]
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
    # The chain, from the most statistics to the fewest, then the frequent ones.
    levels = tuple(ordered([s for j in chain[k:] for s in full[j]] + list(frequent))
                   for k in range(len(chain))) + (frequent,)
    flags = [predicates[k] for k in chain] + [frequent_gate]
    # Python bools are part of the function's structure, tensors its arguments.
    static = tuple(f if f is True or f is False else None for f in flags)
    dynamic = [tf.cast(f, tf.bool) for f in flags if f is not True and f is not False]
    packs = [stats_lib.Packed.of(tensors) for tensors in inputs]
    layouts = tuple(pack.layout for pack in packs)
    rows = len(packs[0])

    def run(flags, *vectors):
        nan = tf.constant(np.nan, tf.float64)
        given = iter(flags)
        predicate = [s if s is not None else next(given) for s in static]
        packed = [stats_lib.Packed(v, *layout) for v, layout in zip(vectors, layouts)]

        def widened(stats):
            table, scalar = recipe(stats, settings, *packed)
            parts = tf.unstack(table, num=len(stats), axis=1) if stats else []
            by_name = dict(zip(stats, parts))
            fill = tf.fill([rows], nan)
            return tf.stack([by_name.get(s, fill) for s in columns], axis=1), tf.cast(
                scalar, tf.float64)

        def idle():
            return tf.fill([rows, len(columns)], nan), nan

        def branch(k):
            if k == len(levels):
                return idle()
            if not levels[k] or predicate[k] is False:
                return branch(k + 1)
            if predicate[k] is True:
                return widened(levels[k])
            if k == len(levels) - 1:
                # The statistics of every step (a frozen step's, past a last
                # step: not written): computed, and kept by a select, not a
                # condition (the every-step variant holds none).
                table, scalar = widened(levels[k])
                return (tf.where(predicate[k], table, tf.fill([rows, len(columns)], nan)),
                        tf.where(predicate[k], scalar, nan))
            return tf.cond(predicate[k], lambda: widened(levels[k]), lambda: branch(k + 1))

        return branch(0)

    key = ("scheduled", recipe.__qualname__, settings, levels, columns, static, layouts)
    table, scalar = graph_functions.shared_call(
        key, run, [dynamic] + [pack.vectors for pack in packs], inline=False)
    return table, columns, scalar


def _write_if(predicate, buffer, row, train_id, parts) -> None:
    """Writes `[train_id, *parts]` into row `row` of `buffer` where
    `predicate` holds (a Python bool or a tensor). Where it is a tensor the row
    is written anyway, its id NaN where it does not hold: the host takes a
    row whose id is the step's (`Collector`), and the row overwritten held a
    step read already (a ring's rows are read before a step could reach
    them again). A select, not a condition."""
    if predicate is False:
        return
    identity = tf.cast(train_id, tf.float64)
    if predicate is not True:
        identity = tf.where(predicate, identity, tf.constant(np.nan, tf.float64))
    _buffers.write_row(buffer, row, tf.concat([identity[None]] + list(parts), 0))


def _copies_of(channel, copies, wanted: List[int]) -> stats_lib.Packed:
    """The flat `copies` of the channel's weights (`Channel.previous` or
    `initial`), as `stats.Packed.of` of the weights at `wanted` gives them."""
    packed = stats_lib.Packed([c.read_value() for c in copies], channel.copy_groups,
                              len(channel.variables))
    if list(wanted) == list(range(len(channel.variables))):
        return packed
    pieces = dict(zip(packed.order, packed.pieces()))
    empty = tf.zeros([0], tf.float32)
    return stats_lib.Packed.of([pieces.get(i, empty) for i in wanted])


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
