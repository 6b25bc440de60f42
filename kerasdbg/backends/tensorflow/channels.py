"""Where the captured data goes: per-optimizer and per-apply buffers and tags.

A `Hook` per optimizer the train step applies, a `Channel` per apply of it
in the train step (WGAN-GP's discriminator: three), with a `Slot` per
request: the variables it selects among those the optimizer applies, its
buffers (one row per train step of an execution) and the tags of their
columns. The hook keeps the copies of the weights that update ratios and
distances from the start read, shared by its channels and requests.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.records import tags as _tags
from kerasdbg.capture import keras_objects
from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg import stats as stats_lib
from kerasdbg.capture.requests import Request


def _zeros_like(variable) -> tf.Tensor:
    return tf.zeros(variable.shape, reads.read_handle(variable).dtype.base_dtype)


def _flat_dtype(variable) -> tf.DType:
    """The dtype of the variable's values as the statistics take them
    (`stats.flat_tensors`: floating point kept, anything else float32)."""
    dtype = reads.read_handle(variable).dtype.base_dtype
    return dtype if dtype.is_floating else tf.float32


class Hook:
    """One optimizer the train step applies."""

    def __init__(self, name: str, optimizer, index: int):
        self.name = name
        self.optimizer = optimizer
        self.inner = keras_objects.inner_optimizer(optimizer)
        self.index = index
        self.channels: List["Channel"] = []
        self.clipping = keras_objects.clipping(optimizer)
        self.accumulation = keras_objects.accumulation_steps(optimizer)
        self.scaled = self.inner is not optimizer
        # One copy of the weights before each update (update ratios) and one
        # at the start of the fit (distances), shared by the channels (of the
        # same variables) and requests of this optimizer: by the channel's
        # variable keys, flat buffers, one per group of its `copy_groups`
        # (the small weights of one dtype together: one write, and one input
        # of a condition, for all of them).
        self.previous: Dict[tuple, List[tf.Variable]] = {}
        self.initial: Dict[tuple, List[tf.Variable]] = {}
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
        return tuple(_tags.tensor(kind, p) if present else None
                     for p, present in zip(self.paths, self.present))


class Channel:
    """One apply of one optimizer in the train step (the `index`-th)."""

    def __init__(self, hook: Hook, index: int, variables, paths: List[str]):
        self.hook = hook
        self.index = index
        self.variables = list(variables)
        self.paths = paths
        self.keys = [keras_objects.variable_key(hook.optimizer, v) for v in self.variables]
        self.meta: Optional[tf.Variable] = None
        self.slots: Dict[int, Slot] = {}
        self.considered: set = set()  # the requests `build` has given their slots
        self.number = -1  # its index in `Engine.channels`
        self._copy_groups: Optional[tuple] = None

    @property
    def copy_groups(self) -> tuple:
        """`stats.plan` of this channel's variables: the layout of its weight
        copies, that of `stats.Packed.of` of the variables' values."""
        if self._copy_groups is None:
            self._copy_groups = stats_lib.plan(
                [v.shape.num_elements() for v in self.variables],
                [_flat_dtype(v) for v in self.variables])
        return self._copy_groups

    @property
    def previous(self) -> List[tf.Variable]:
        """The hook's copy of this channel's variables before the update:
        one flat buffer per group of `copy_groups` ([] when none is kept)."""
        return self.hook.previous.get(tuple(self.keys), [])

    @property
    def initial(self) -> List[tf.Variable]:
        """The hook's copy of this channel's variables at the fit's start
        (as `previous`)."""
        return self.hook.initial.get(tuple(self.keys), [])

    def _copies(self, name: str) -> List[tf.Variable]:
        # Zeros, filled in the graph: a variable created in this trace has
        # no value to read yet.
        dtypes = [_flat_dtype(v) for v in self.variables]
        return [_buffers.on_read_variable(
            tf.zeros([sum(sizes)], dtypes[positions[0]]), name)
            for positions, sizes in self.copy_groups]

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
                         if keras_objects.is_float(v) and request.selects(p)]
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
            hook, keys = self.hook, tuple(self.keys)
            if request.kind == "weights" and "update_ratio" in request.stats:
                if keys not in hook.previous:
                    hook.previous[keys] = self._copies("kerasdbg_previous")
            if request.kind == "weights" and "distance_from_start" in request.stats:
                if keys not in hook.initial:
                    hook.initial[keys] = self._copies("kerasdbg_initial")
                if hook.started is None:
                    # Whether `initial` holds the weights at the start of the fit.
                    hook.started = _buffers.on_read_variable(tf.zeros([], tf.int64),
                                                             "kerasdbg_started")

    def slots_of(self, kind: str) -> List[Slot]:
        return [s for s in self.slots.values() if s.request.kind == kind]
