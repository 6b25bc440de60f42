"""The engine request behind `StepRecorder`: full tensors at a few steps.

Statistics requests keep one row per step in ring buffers; this one keeps
whole tensors, so it keeps them only at the steps asked for, one slot per
step (memory: slots x the recorded tensors), and the host reads a slot once
it is filled:

- loss and learning rate: `[slots]` float64 buffers;
- gradients (as applied: clipped, summed over replicas) and weights (after
  the update): one `[slots, *shape]` buffer per variable;
- layer outputs: one shape-less buffer per layer and slot, because the batch
  dimension is only known at run time. Under a strategy each replica keeps
  its own slice of the batch and the host concatenates the replicas. XLA
  needs the buffer's shape before it compiles: it is set at trace time, from
  the static batch dimension or else padded to the fit's per-replica batch
  size (`max_rows`; a per-slot row count cuts the padding off). When neither
  is known, layer outputs are left out with a warning.

Layer outputs come from a replay of the forward pass (`_replay`) on the
step's inputs with the step's weights, inside a `tf.cond` taken at recorded
steps only. The replay leaves no trace on training: the state it updates
(BatchNormalization's moving statistics, random seed generators) is put
back. Layers that draw random numbers (Dropout) draw a fresh mask in it.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from kerasdbg.backends.tensorflow import buffers as _buffers
from kerasdbg.backends.tensorflow import quantities
from kerasdbg.capture.requests import Request
from kerasdbg.capture import keras_objects
from kerasdbg.backends.tensorflow import variable_reads as reads
from kerasdbg import _replay

from kerasdbg.capture.requests import RECORDABLE  # noqa: E402,F401 - what a request may record


def recordable_layers(model) -> List[str]:
    """Qualified names of the layers whose outputs a replay can record."""
    if not _replay.is_graph_model(model):
        return []
    return [
        _replay.qualified_name(path, layer)
        for path, layer in _replay.walk(model)
        if not isinstance(layer, keras.layers.InputLayer)
    ]


class TensorRequest(Request):
    """What a `StepRecorder` asks the engine for.

    The engine binds the request to the first optimizer apply of the train
    step whose variables it selects (`bind`), at trace time: a model built
    only inside `fit` has no variables before.

    Args:
        steps: the optimizer steps (>= 1) to record.
        record: which of `RECORDABLE`.
        layers: qualified layer names whose outputs are recorded.
        consumer: called with `{step: {kind: value}}` for the steps whose
            slots were filled since the last call: "loss" and
            "learning_rate" arrays, and `{name: array}` under "gradients",
            "weights" and "layer_outputs" (`TraceWriter.record`'s arguments).
        include, exclude: regular expressions on variable paths.
        strict: a failure raises instead of warning.
    """

    def __init__(self, steps: Sequence[int], record: Sequence[str], layers: Sequence[str],
                 consumer, include=None, exclude=None, strict: bool = False,
                 initial: bool = False):
        super().__init__("tensors", consumer=consumer, include=include, exclude=exclude,
                         strict=strict, owner="StepRecorder")
        self.steps = tuple(sorted(steps))
        self.record = tuple(record)
        self.layers = list(layers) if "layer_outputs" in record else []
        self.handed: set = set()
        self.initial = initial
        self.initial_handed = False
        self.initial_buffers: List[tf.Variable] = []
        self.initial_set: Optional[tf.Variable] = None
        self.jit = False
        self.channel = None
        self.positions: List[int] = []
        self.variables: list = []
        self.paths: List[str] = []
        self.present: List[bool] = []
        # Rows of a layer output per replica under XLA when the batch
        # dimension is not static (the fit's batch size over the replicas).
        self.max_rows: Optional[int] = None
        self.warned: set = set()
        self.slot_ids = self.loss = self.learning_rate = None
        self.gradients: List[tf.Variable] = []
        self.weights: List[tf.Variable] = []
        self.outputs: Dict[str, List[tf.Variable]] = {}

    def graph_key(self):
        """None: a fit with a `StepRecorder` traces its train step again (its
        buffers are sized for the steps and variables it records)."""
        return None

    def bind(self, channel, variables, paths) -> None:
        """Creates the buffers for `variables` (in the strategy's scope)."""
        n = len(self.steps)
        self.variables, self.paths = list(variables), list(paths)
        self.present = [True] * len(self.variables)
        if self.initial:
            # The weights of step 0, copied in the graph before the first update
            # (a variable created in this trace has no value to read yet).
            self.initial_buffers = [
                _buffers.on_read_variable(tf.zeros(v.shape, reads.read_handle(v).dtype.base_dtype),
                                          "kerasdbg_trace_initial") for v in self.variables]
            self.initial_set = _buffers.on_read_variable(tf.zeros([], tf.int64),
                                                         "kerasdbg_trace_initial_set")
        self.slot_ids = _buffers.on_read_variable(tf.zeros([n], tf.int64), "kerasdbg_trace_steps")
        nan = tf.fill([n], tf.constant(np.nan, tf.float64))
        self.loss = _buffers.on_read_variable(nan, "kerasdbg_trace_loss")
        self.learning_rate = _buffers.on_read_variable(nan, "kerasdbg_trace_lr")

        def slots(kind):
            return [
                _buffers.on_read_variable(
                    tf.zeros([n] + list(v.shape), reads.read(v).dtype), f"kerasdbg_trace_{kind}")
                for v in self.variables
            ] if kind in self.record else []

        self.gradients = slots("gradients")
        self.weights = slots("weights")
        self.outputs = {
            name: [_buffers.on_read_variable(tf.zeros([0]), "kerasdbg_trace_output", shapeless=True)
                   for _ in self.steps]
            for name in self.layers
        }
        # Valid rows of each layer output per slot (the rest is XLA padding).
        self.rows = {name: _buffers.on_read_variable(tf.zeros([n], tf.int64), "kerasdbg_trace_rows")
                     for name in self.layers}
        self.handed = set()

    # ------------------------------------------------------- in the graph
    def _slot(self, step):
        """`(hit, slot)`: whether `step` is recorded, and its slot index."""
        if not self.steps:
            return tf.constant(False), tf.constant(0, tf.int64)
        steps = tf.constant(self.steps, step.dtype)
        matches = tf.equal(steps, step)
        return tf.reduce_any(matches), tf.argmax(tf.cast(matches, tf.int32), output_type=tf.int64)

    def record_before(self, model, optimizer, step, loss, x):
        """Loss, learning rate and layer outputs of the step (before `apply`).

        Returns the step's `(hit, slot)` for `record_after`, so the train
        step tests the step once. The caller keeps it per call: under
        MirroredStrategy each replica's thread traces its own step.
        """
        if self.initial:
            def start():
                for buffer, variable in zip(self.initial_buffers, self.variables):
                    buffer.assign(reads.read(variable))
                self.initial_set.assign(tf.ones([], tf.int64))
                return tf.constant(True)

            tf.cond(tf.equal(self.initial_set.read_value(), 0), start, lambda: tf.constant(False))
        hit, slot = self._slot(step)
        if not self.steps:  # only step 0: the weights before training
            return hit, slot

        def write_rate():
            rate = keras_objects.inner_optimizer(optimizer).learning_rate
            _buffers.write_row(self.learning_rate, slot, tf.cast(reads.read(rate), tf.float64))
            return tf.constant(True)

        def write():
            if "loss" in self.record and loss is not None:
                _buffers.write_row(self.loss, slot, loss)
            if self.layers and x is not None:
                self._record_outputs(model, x, slot)
            return tf.constant(True)

        # Apart: the learning rate reads the step count (a schedule's), and a
        # condition that also waits for the batch (the loss, the outputs)
        # would hold back `apply`'s count of the step, which plain Keras
        # makes without the batch at the end of a dataset of unknown length.
        if "learning_rate" in self.record:
            tf.cond(hit, write_rate, lambda: tf.constant(False))
        tf.cond(hit, write, lambda: tf.constant(False))
        return hit, slot

    def _record_outputs(self, model, x, slot) -> None:
        state = [v for v in model.non_trainable_variables if not reads.on_read(v)]
        saved = [reads.read(v) for v in state]
        outputs: Dict[str, tf.Tensor] = {}

        def on_output(name, value):
            if name in self.outputs and name not in outputs:
                floats = [t for t in keras.tree.flatten(value)
                          if tf.is_tensor(t) and t.dtype.is_floating]
                if floats:
                    outputs[name] = floats[0]

        _replay.call_layer_by_layer(model, x, True, on_output)
        for variable, value in zip(state, saved):
            variable.assign(value)
        stored = {}
        for name, tensor in outputs.items():
            rows = tf.shape(tensor, out_type=tf.int64)[0] if tensor.shape.rank else tf.constant(
                1, tf.int64)
            if self.jit:
                # XLA compiles with the shape the buffer holds: set it now.
                shape = tensor.shape
                if not shape.is_fully_defined():
                    if self.max_rows is None or not shape[1:].is_fully_defined():
                        self._warn_once(
                            "dynamic", "StepRecorder leaves out the layer outputs under XLA "
                            f"(jit_compile=True): the output of `{name}` has the shape "
                            f"{shape}, and the batch size of the fit is unknown. Batch the "
                            "dataset with `drop_remainder=True`, or compile with "
                            "jit_compile=False, to record them.")
                        return
                    shape = tf.TensorShape([self.max_rows]).concatenate(shape[1:])
                    padding = [[0, self.max_rows - rows]] + [[0, 0]] * (shape.rank - 1)
                    tensor = tf.pad(tensor, padding)
                with tf.init_scope():
                    for buffer in self.outputs[name]:
                        buffer.assign(tf.zeros(shape, tensor.dtype))
            stored[name] = (tensor, rows)
        branches = [
            (lambda k=k: self._assign_outputs(stored, slot, k)) for k in range(len(self.steps))
        ]
        tf.switch_case(tf.cast(slot, tf.int32), branches)

    def _assign_outputs(self, stored, slot, k):
        for name, (tensor, rows) in stored.items():
            self.outputs[name][k].assign(tensor)
            _buffers.write_row(self.rows[name], slot, rows)
        return tf.constant(True)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def record_gradients(self, step, grads) -> None:
        """The applied gradients of this request's variables, in their order."""
        if not self.gradients or not self.steps:
            return
        hit, slot = self._slot(step)
        self.present = [g is not None for g in grads]

        def write():
            for buffer, grad in zip(self.gradients, grads):
                if grad is not None:
                    _buffers.write_row(buffer, slot, quantities._dense(grad))
            return tf.constant(True)

        tf.cond(hit, write, lambda: tf.constant(False))

    def record_after(self, step, step_slot) -> None:
        """Weights after the update, and the slot's step id (last);
        `step_slot` is what `record_before` returned in the same call."""
        hit, slot = step_slot
        if not self.steps:
            return

        def write():
            for buffer, variable in zip(self.weights, self.variables):
                _buffers.write_row(buffer, slot, reads.read(variable))
            _buffers.write_row(self.slot_ids, slot, tf.cast(step, tf.int64))
            return tf.constant(True)

        tf.cond(hit, write, lambda: tf.constant(False))

    # ----------------------------------------------------------- on host
    def collect(self) -> None:
        if self.slot_ids is None:
            return
        if self.initial and not self.initial_handed and _buffers.read(self.initial_set):
            self.initial_handed = True
            self.consumer({0: {"weights": {p: _buffers.read(b).copy() for p, b
                                           in zip(self.paths, self.initial_buffers)}}})
        ids = _buffers.read(self.slot_ids)
        new = [k for k, s in enumerate(self.steps) if ids[k] == s and s not in self.handed]
        if not new:
            return
        loss, rate = _buffers.read(self.loss), _buffers.read(self.learning_rate)
        gradients = [_buffers.read(b) for b in self.gradients]
        weights = [_buffers.read(b) for b in self.weights]
        result = {}
        for k in new:
            step = self.steps[k]
            tensors: Dict[str, object] = {}
            if "loss" in self.record and not np.isnan(loss[k]):
                tensors["loss"] = np.asarray(loss[k])
            if "learning_rate" in self.record:
                tensors["learning_rate"] = np.asarray(rate[k])
            if gradients:
                tensors["gradients"] = {path: buffer[k].copy() for path, buffer, present
                                        in zip(self.paths, gradients, self.present) if present}
            if weights:
                tensors["weights"] = {path: buffer[k].copy()
                                      for path, buffer in zip(self.paths, weights)}
            outputs = {}
            for name, buffers in self.outputs.items():
                parts = _buffers.read_replicas(buffers[k])
                rows = [int(r[k]) for r in _buffers.read_replicas(self.rows[name])]
                if rows[0] > 0:
                    outputs[name] = parts[0] if parts[0].ndim == 0 else np.concatenate(
                        [p[:r] for p, r in zip(parts, rows)], axis=0)
            if outputs:
                tensors["layer_outputs"] = outputs
            result[step] = tensors
            self.handed.add(step)
        self.consumer(result)

    @property
    def complete(self) -> bool:
        return len(self.handed) == len(self.steps) and (self.initial_handed or not self.initial)
