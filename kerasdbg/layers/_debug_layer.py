"""Shared machinery of the debug layers (`PrintLayer`, `TapLayer`).

A debug layer is an identity: it returns its input unchanged (same tensor,
same dtype, same mask) and, at the steps it selects, writes what it wants to
show into a ring buffer in-graph. The host reads the buffer after each
execution and hands the new records, in step order, to `_consume`. The
backend's side is chosen once, from `keras.config.backend()`:
`kerasdbg.backends.tensorflow.layer_sink` (an untracked sync-on-read buffer
in TensorFlow's graph), or `kerasdbg.backends.jax.layer_record` and
`kerasdbg.backends.jax.layer_sink` (the counters and the buffer as
non-trainable variables that Keras's stateless steps carry in their state).

Step numbers:

- in `fit`: the number the optimizer step of this forward pass gets, the
  same as in `GradientStatistics` (it continues across `fit` calls):
  `model.optimizer`'s count of steps + 1 with Keras's `train_step`; with a
  custom one, the largest count of the optimizers the model holds + 1 (a
  GAN applies its own, never `model.optimizer`); batches, not updates,
  under gradient accumulation;
- in `evaluate`, `predict` and other calls: the layer's own count of calls in
  that mode (1-based, over the layer's lifetime, saved with the model).

Counters are `ON_READ` / `ONLY_FIRST_REPLICA` variables: each replica counts
for itself, so a step is never counted once per replica (a counter with
`aggregation="sum"` counts each step once per replica). On JAX they are
int32 and a step is one program over the global batch (also under
`keras.distribution`): one record per call, replica 0, describing the whole
batch.

Saved with the model: the counters (`calls`, `mode_calls`) only, on every
backend; the buffers and a tap's runs of flagged examples are not (on JAX
they are non-trainable weights of the layer, in `get_weights`, but left out
of `.keras` files, so a file loads on either backend).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import keras
import numpy as np

from kerasdbg import _validation as check
from kerasdbg.errors import UnsupportedBackendError
from kerasdbg.layers import _lazy
from kerasdbg.sinks import workers as _workers

# TensorFlow and its capture, on first use: the layers import on every
# backend (and without TensorFlow), and refuse to be made where they cannot
# record (`DebugLayer.BACKENDS`).
tf = _lazy.module("tensorflow")
_buffers = _lazy.module("kerasdbg.backends.tensorflow.buffers")
graph_functions = _lazy.module("kerasdbg.backends.tensorflow.graph_functions")
keras_objects = _lazy.module("kerasdbg.capture.keras_objects")
reads = _lazy.module("kerasdbg.backends.tensorflow.variable_reads")
_layer_sink = _lazy.module("kerasdbg.backends.tensorflow.layer_sink")
_jax_record = _lazy.module("kerasdbg.backends.jax.layer_record")
_jax_sink = _lazy.module("kerasdbg.backends.jax.layer_sink")


def on_jax() -> bool:
    """Whether the layers record through JAX's side (Keras's backend, fixed
    when Keras is imported)."""
    return keras.config.backend() == "jax"


def layer_sink():
    """The host side of the debug layers on Keras's backend (the model's
    sink, `flush_layers`, `current_fit_step`)."""
    return _jax_sink if on_jax() else _layer_sink

MODES = ("fit", "evaluate", "predict", "call")
REPLICAS = ("first", "all")


class LayerRecord(NamedTuple):
    """One recorded call of a debug layer.

    Attributes:
        step: see the module docstring.
        mode: "fit", "evaluate", "predict" or "call".
        replica: the replica that recorded it (0 without a strategy).
        values: field name -> NumPy array.
    """

    step: int
    mode: str
    replica: int
    values: Dict[str, np.ndarray]


HEAD = ("id", "mode", "step")
"""The first columns of a buffer row: the call id, the mode's index, the step."""

WIDE_ROW = 64
"""Buffers with rows wider than this are read in two steps (ids, then all)."""


class _Buffers:
    """The untracked ring buffer of one layer (not saved with the model):
    one float64 row per recorded call, `HEAD` then every field flattened."""

    def __init__(self, slots: int, fields: Dict[str, Tuple[tuple, tf.DType]], name: str):
        self.slots = slots
        self.layout = []  # (key, shape, dtype, first column, end column)
        width = len(HEAD)
        for key, (shape, dtype) in fields.items():
            size = int(np.prod(shape, dtype=np.int64))
            self.layout.append((key, tuple(shape), tf.as_dtype(dtype), width, width + size))
            width += size
        self.layout = tuple(self.layout)
        self.width = width
        # Row `slots` takes the calls that record nothing (no condition in
        # the graph); it is never read.
        self.rows = _buffers.on_read_variable(
            tf.zeros([slots + 1, width], tf.float64), f"{name}_rows")


def _step_function(compute, key, layout, slots: int, mode: str, every_n_steps: int):
    """The in-graph work of one call of a debug layer, as one function of
    the values of its variables (shared by the layers with the same settings
    and input signature; see `kerasdbg.backends.tensorflow.graph_functions`).

    Inputs: the layer's input, `[calls, mode_calls, *step counters]` and the
    state variable's value (or None). Outputs: `calls` and `mode_calls`
    counted, the step `number` and whether `every_n_steps` `selected` it; when
    `compute` is given (this replica records), also the buffer `row` (`HEAD`,
    then the fields), its `slot` (the scratch row `slots` at the steps
    `every_n_steps` skips) and the new `state`. `compute` must not hold the
    layer (a static method): the function outlives it in a cache.
    """
    mode_index = MODES.index(mode)
    one_hot = np.eye(len(MODES), dtype=np.int64)[mode_index]
    width = layout[-1][4] if layout else len(HEAD)

    def step(x, counts, state):
        calls, mode_calls, counters = counts[0] + 1, counts[1] + one_hot, counts[2:]
        if counters:
            # Counts batches also with gradient accumulation (where
            # `optimizer.iterations` counts updates), as the statistics do,
            # and follows the optimizers a custom train step applies.
            number = (counters[0] if len(counters) == 1 else tf.reduce_max(tf.stack(counters))) + 1
        else:
            number = mode_calls[mode_index]
        selected = tf.constant(True) if every_n_steps == 1 else \
            tf.equal(tf.math.floormod(number, every_n_steps), 0)
        out = {"calls": calls, "mode_calls": mode_calls, "number": number, "selected": selected}
        if compute is None:
            return out

        def record():
            values, new_state = compute(key, x, state, mode)
            head = tf.cast(tf.stack([calls, tf.constant(mode_index, tf.int64), number]), tf.float64)
            parts = [head] + [tf.reshape(tf.cast(values[name], tf.float64), [-1])
                              for name, _, _, start, end in layout if end > start]
            return tf.concat(parts, 0), state if new_state is None else new_state

        slot = tf.math.floormod(calls - 1, slots)
        if every_n_steps == 1:
            row, new_state = record()
        else:
            skipped = lambda: (tf.zeros([width], tf.float64), state)  # noqa: E731
            if state is None:
                row = tf.cond(selected, lambda: record()[0], lambda: skipped()[0])
                new_state = None
            else:
                row, new_state = tf.cond(selected, record, skipped)
            slot = tf.where(selected, slot, tf.constant(slots, tf.int64))
        out.update(row=row, slot=slot)
        if new_state is not None:
            out["state"] = new_state
        return out

    return graph_functions.shared_step(step, (compute, key, layout, slots, mode, every_n_steps))


def _step_count(counter, model):
    """A step counter's value as kerasdbg numbers steps: Keras's count, plus
    the steps kerasdbg kept it from counting (skipped or frozen)."""
    value = reads.read(counter)
    for _, optimizer in keras_objects.find_optimizers(model):
        if keras_objects.raw_iterations(optimizer) is counter:
            skipped = keras_objects.uncounted_steps(optimizer)
            if skipped is not None:
                value = value + tf.cast(skipped.read_value(), value.dtype)
            break
    return value


class _HostState:
    """Plain attributes of a debug layer's host side (last ids read, records)."""


class DebugLayer(keras.layers.Layer):
    """Base class of the identity layers that record in-graph."""

    kerasdbg_debug_layer = True
    """Marks kerasdbg's debug layers for the replays (`_replay.is_debug_layer`)."""

    BACKENDS = ("tensorflow", "jax")
    """The Keras backends the debug layers record on (made elsewhere, they raise)."""

    MODES = MODES

    KIND = ""
    """Which fields the layer records on JAX (`layer_record.VALUES`)."""

    follows_chief = False
    """Whether, under several workers, every worker reads the records of the
    whole cluster (the same ones everywhere, so rules on them decide alike)
    instead of its own replicas' (`_layer_sink.flush_layers`)."""

    def __init__(
        self,
        every_n_steps: int = 1,
        replicas: str = "first",
        buffer_steps: int = 64,
        strict: bool = False,
        **kwargs,
    ):
        owner = type(self).__name__
        # Before anything is built: on another backend the layer would record
        # nothing (JAX traces it with tracers TensorFlow cannot take).
        check_backend(owner)
        super().__init__(**kwargs)
        # An identity has nothing to rematerialize: made inside a
        # `keras.RematScope`, the layer is not wrapped in `jax.checkpoint`
        # (its writes could not leave it).
        self._remat_mode = None
        self.every_n_steps = check.positive_int(owner, "every_n_steps", every_n_steps)
        self.replicas = check.one_of(owner, "replicas", replicas, REPLICAS)
        self.buffer_steps = check.positive_int(owner, "buffer_steps", buffer_steps)
        self.strict = check.boolean(owner, "strict", strict)
        self.supports_masking = True
        # An identity keeps its input's dtype (no autocast to the policy).
        self._convert_input_args = False
        # (Not `_buffers`: on the PyTorch backend a layer is a torch.nn.Module,
        # whose own `_buffers` it would overwrite.)
        self._ring: Optional[_Buffers] = None
        # Host-side state lives outside Keras's attribute tracking, whose
        # wrapped lists and dicts cost tens of microseconds per update.
        self._host = _HostState()
        self._host.last_id = []
        self._host.fit_checked = {}
        # The loops ("fit", "evaluate", ...) whose step function traced this layer.
        self._host.traced_in = set()
        self._failed = False
        self._warned_slots = False
        # On a structure of tensors (a dict, list or tuple): one layer of
        # this class per tensor, by its path in the structure (see `parts`).
        self._parts = None

    # ------------------------------------------------------------ keras
    def build(self, input_shape):
        if not _is_shape(input_shape):
            self._build_parts(input_shape)
            return
        self._input_shape = tuple(input_shape)
        self._host.last_id = []
        if on_jax():
            # Tracked non-trainable variables: Keras's stateless steps carry them.
            self.calls = _jax_record.int_variable(0, "calls")
            self.mode_calls = _jax_record.int_variable(np.zeros(len(MODES)), "mode_calls")
            self._ring = _jax_record.Ring(self.buffer_steps, self._fields(self._input_shape))
            self._ring_rows = self._ring.rows
            super().build(input_shape)
            return
        # Counters are weights (saved with the model); the ring buffers are not.
        self.calls = keras.Variable(
            0, dtype="int64", trainable=False, name="calls",
            synchronization="on_read", aggregation="only_first_replica",
        )
        self.mode_calls = keras.Variable(
            np.zeros(len(MODES), np.int64), dtype="int64", trainable=False,
            name="mode_calls", synchronization="on_read", aggregation="only_first_replica",
        )
        self._ring = _Buffers(self.buffer_steps, self._fields(self._input_shape), self.name)
        super().build(input_shape)

    def save_own_variables(self, store) -> None:
        # The counters only (as on TensorFlow, where the buffers are untracked).
        if self._parts is None and self._ring is not None:
            store["0"] = np.asarray(keras.ops.convert_to_numpy(self.calls.value))
            store["1"] = np.asarray(keras.ops.convert_to_numpy(self.mode_calls.value))

    def load_own_variables(self, store) -> None:
        if self._parts is None and self._ring is not None and "0" in store:
            for key, variable in (("0", self.calls), ("1", self.mode_calls)):
                variable.assign(np.asarray(store[key]).astype(variable.dtype))

    def __call__(self, inputs, *args, **kwargs):
        # Arrays become tensors of their own dtype (inputs are not autocast);
        # a structure of tensors keeps its structure (one part per tensor).
        convert = keras.ops.convert_to_tensor if on_jax() else tf.convert_to_tensor
        if _is_structure(inputs):
            inputs = keras.tree.map_structure(
                lambda x: convert(x) if isinstance(x, (np.ndarray, np.generic))
                else x, inputs)
        elif isinstance(inputs, (np.ndarray, np.generic, list, float, int)):
            inputs = convert(inputs)
        return super().__call__(inputs, *args, **kwargs)

    # ------------------------------------------------------- structures
    @property
    def parts(self) -> Dict[str, "DebugLayer"]:
        """On a structure of tensors (the outputs of a layer with several
        outputs: a dict, a list, a tuple), the layer of each tensor, by its
        path in the structure (`"a"`, `"0"`, `"a/0"`): a layer of this class
        and settings named `<name>_<path with _>`, which records that tensor.
        Empty on one tensor."""
        return dict(self._parts) if self._parts is not None else {}

    def _build_parts(self, input_shape) -> None:
        boxed = keras.tree.map_shape_structure(_Shape, input_shape)
        with warnings.catch_warnings():
            # A PrintLayer's stream object is given to its parts, not saved.
            warnings.simplefilter("ignore", UserWarning)
            config = self.get_config()
        parts = {}
        for path, shape in keras.tree.flatten_with_path(boxed):
            key = "/".join(str(p) for p in path)
            name = f"{self.name}_" + "_".join(str(p).replace("/", "_") for p in path)
            part = type(self).from_config(dict(config, name=name))
            self._adopt(part, key)
            part.build(shape.shape)
            parts[key] = part
        self._parts = parts

    def _adopt(self, part: "DebugLayer", key: str) -> None:
        """Settings a part takes from this layer beyond its config."""

    def _check_single(self, what: str) -> None:
        """Raises for what only a layer on one tensor has (`history`, ...)."""
        if self._parts:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} records a structure of tensors, one "
                f"part per tensor; read `{what}` on a part: `layer.parts[key].{what}` with key "
                f"in {list(self._parts)}.")

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, inputs, *args, **kwargs):
        return keras.tree.map_structure(
            lambda x: keras.KerasTensor(x.shape, dtype=x.dtype, sparse=x.sparse), inputs)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            every_n_steps=self.every_n_steps,
            replicas=self.replicas,
            buffer_steps=self.buffer_steps,
            strict=self.strict,
        )
        return config

    def call(self, inputs):
        if self._parts is not None:
            # Each part records its tensor and returns it.
            leaves = keras.tree.flatten_with_path(inputs)
            return keras.tree.pack_sequence_as(inputs, [
                self._parts["/".join(str(p) for p in path)](leaf) for path, leaf in leaves])
        if on_jax():
            self._record_jax(inputs)
            return inputs
        context = keras_objects.step_context()
        try:
            self._record(inputs, context)
        except Exception as error:  # noqa: BLE001 - any failure of ours
            self._fail(error)
        if tf.executing_eagerly():
            self.flush()
        return inputs

    # -------------------------------------------------------- subclasses
    def _fields(self, input_shape) -> Dict[str, Tuple[tuple, tf.DType]]:
        """Field name -> (shape, dtype) of what one record holds."""
        raise NotImplementedError

    def _values_key(self) -> tuple:
        """Every setting `_compute_values` reads (hashable): layers with equal
        keys share one traced function."""
        raise NotImplementedError

    @staticmethod
    def _compute_values(key: tuple, inputs, state, mode: str):
        """The fields of one record, in-graph, and the layer's new state.

        `key` is `_values_key()`, `state` the value of `_state_variable()`
        (None without one) before this call, `mode` the loop's mode. Returns
        `(fields, new state)`; the new state is assigned to the state variable
        (None: unchanged). No variables here: the function is shared by every
        layer with the same key."""
        raise NotImplementedError

    def _state_variable(self) -> Optional[tf.Variable]:
        """A variable of what the layer tracks across recorded calls, or None."""
        return None

    def _consume(self, records: List[LayerRecord]) -> None:
        """Host side: what to do with new records, in call order."""
        raise NotImplementedError

    def _record_replica(self, replica) -> object:
        """Whether this replica records (a Python bool when known)."""
        return self.replicas == "all" or replica == 0

    # ---------------------------------------------------------- in graph
    def _record_jax(self, inputs) -> None:
        """One call on JAX (`kerasdbg.backends.jax.layer_record`)."""
        if not self._failed:
            try:
                where = _jax_record.context()
                self._host.traced_in.add(where.mode)
                _jax_sink.register(self, where)
                self._check_slots(where.model)
                _jax_record.record(self, inputs, where, _jax_record.VALUES[self.KIND])
            except Exception as error:  # noqa: BLE001 - any failure of ours
                self._fail(error)
        if _jax_record.eager(inputs):
            self.flush()

    def _check_slots(self, model) -> None:
        if model is not None and not self._warned_slots:
            spe = int(getattr(model, "steps_per_execution", 1) or 1)
            if spe > self.buffer_steps:
                self._warned_slots = True
                warnings.warn(
                    f"{type(self).__name__} {self.name!r}: steps_per_execution={spe} is "
                    f"larger than buffer_steps={self.buffer_steps}; only the last "
                    f"{self.buffer_steps} recorded steps of each execution are kept. "
                    f"Pass buffer_steps={spe} to keep them all.",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def _record(self, inputs, context: keras_objects.StepContext) -> None:
        if self._failed:
            return
        self._host.traced_in.add(context.mode)
        _layer_sink.register(self, context)
        self._check_slots(context.model)
        replica, static_replica = self._replica()
        records = static_replica is None or self._record_replica(static_replica)
        outputs = self._step(inputs, context, records)
        if not records:
            return  # known at trace time: this replica records nothing
        rows = self._ring.rows
        write = lambda: _buffers.write_row(rows, outputs["slot"], outputs["row"])  # noqa: E731
        if isinstance(rows, tf.distribute.DistributedValues) and self.every_n_steps > 1:
            # A sync-on-read buffer is rewritten whole at each write: only at
            # the recorded steps, not into the scratch row at every step.
            _buffers.run_if(outputs["selected"], write)
        else:
            write()

    def _step(self, inputs, context: keras_objects.StepContext, records: bool) -> dict:
        """Runs this call's shared step function (`_step_function`) on the
        layer's variables and writes back the counters and the state; with
        `records` False it only counts. Returns the function's outputs."""
        counters = keras_objects.step_counters(context.model) \
            if context.model is not None and context.mode == "fit" else []
        state_variable = self._state_variable() if records else None
        call = _step_function(
            self._compute_values if records else None, self._values_key() if records else None,
            self._ring.layout, self._ring.slots, context.mode, self.every_n_steps)
        outputs = call(
            inputs,
            [reads.read(v) for v in (self.calls, self.mode_calls)] + [
                _step_count(v, context.model) for v in counters],
            None if state_variable is None else reads.read(state_variable),
        )
        # Keras's `assign`: inside a stateless scope it goes to the scope.
        self.calls.assign(outputs["calls"])
        self.mode_calls.assign(outputs["mode_calls"])
        if state_variable is not None and context.mode not in ("evaluate", "predict"):
            state_variable.assign(outputs["state"], read_value=False)
        return outputs

    @staticmethod
    def _replica():
        """This replica's id (tensor or int) and its value if known statically."""
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            return 0, 0
        replica = replica_context.replica_id_in_sync_group
        static = tf.get_static_value(replica)
        return replica, None if static is None else int(static)

    # ------------------------------------------------------------ on host
    def _nothing_selected_since(self, key, step: int) -> bool:
        """After a train call: whether no step since the last one can have a record.

        Records of `fit` are at steps `iterations + 1` of the forward pass, so
        those of the calls since the last check lie in (last, step]. The first
        check for an optimizer answers False (read in full).
        """
        last = self._host.fit_checked.get(key)
        self._host.fit_checked[key] = step
        if last is None or step < last:
            return False
        every = self.every_n_steps
        return step // every == last // every

    def flush_unless_idle(self, fit_step=None) -> None:
        """`flush()`, unless `fit_step` (`(counters key, value)` after
        a train call, or None) shows no step since the last check can have a
        record: the layer sink and `ActivationStatistics` both check first."""
        if fit_step is None or not self._nothing_selected_since(*fit_step):
            self.flush()

    def traced_in(self, mode: str) -> bool:
        """Whether a step of `mode` ("fit", "evaluate", "predict", "call")
        traced this layer (its graph holds the recording)."""
        if self._parts:
            return any(part.traced_in(mode) for part in self._parts.values())
        return mode in self._host.traced_in

    def flush(self) -> None:
        """Hands the records written since the last flush to the layer.

        Called for you after each execution of `fit`/`evaluate`/`predict` and
        after each eager call; call it yourself after steps of your own
        `tf.function`, or on JAX after a loop of your own over
        `model.stateless_call` once the non-trainable values it returns are
        assigned to the model's variables.
        """
        for part in (self._parts or {}).values():
            part.flush()
        if self._ring is None or self.across_workers() is not None:
            # Under several workers such a layer's records arrive only
            # through `_layer_sink.flush_layers` (a collective), in step on
            # every worker.
            return
        self._deliver(self._read)

    def across_workers(self):
        """The worker this process is (`_workers.Worker`) when this layer's
        records are the cluster's, read on every worker alike
        (`follows_chief` under several workers), else None."""
        if not self.follows_chief or self._ring is None or on_jax():
            return None
        return _workers.of(getattr(self._ring.rows, "distribute_strategy", None))

    def _deliver(self, read: Callable[[], List[LayerRecord]]) -> None:
        try:
            records = read()
            if records:
                self._consume(records)
        except Exception as error:  # noqa: BLE001 - the host side must not stop fit
            self._fail(error)

    def _read(self) -> List[LayerRecord]:
        buffers = self._ring
        if on_jax():
            return self._records(_jax_sink.read(self))
        if buffers.width > WIDE_ROW:
            # Wide rows (histograms, sample rows): the ids first, the whole
            # buffer only when there is something new.
            ids = _buffers.read_replicas(buffers.rows, column=0)
            if self.replicas == "first":
                ids = ids[:1]
            last = self._host.last_id + [0] * (len(ids) - len(self._host.last_id))
            if not any((fresh[: buffers.slots] > seen).any() for fresh, seen in zip(ids, last)):
                return []
        tables = _buffers.read_replicas(buffers.rows)
        # Replica ids are global: under several workers, this worker's first
        # replica follows those of the workers before it.
        worker = _workers.of(getattr(buffers.rows, "distribute_strategy", None))
        offset = worker.position * len(tables) if worker is not None else 0
        return self._records(tables, offset)

    def _records(self, tables: List[np.ndarray], offset: int = 0) -> List[LayerRecord]:
        """The new records of `tables` (the buffers of consecutive replicas,
        the first one being replica `offset`), in call order."""
        buffers = self._ring
        if self.replicas == "first":
            tables = tables[:1]
        if len(self._host.last_id) < len(tables):
            self._host.last_id += [0] * (len(tables) - len(self._host.last_id))
        keyed = []
        for replica, table in enumerate(tables):
            ids = table[: buffers.slots, 0].astype(np.int64)
            last = self._host.last_id[replica]
            new = np.flatnonzero(ids > last)
            if not len(new):
                continue
            rows = new[np.argsort(ids[new])]
            full = len(rows) == buffers.slots and not self._warned_slots
            calls = int(ids.max()) if on_jax() else int(self.calls.numpy())
            if full and calls - last > buffers.slots:
                self._warned_slots = True
                warnings.warn(
                    f"{type(self).__name__} {self.name!r}: more than buffer_steps="
                    f"{buffers.slots} calls happened between two reads, so older "
                    "records were overwritten. Call `flush()` more often or raise "
                    "`buffer_steps`.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            for row in rows:
                values = {
                    key: table[row, start:end].reshape(shape).astype(
                        getattr(dtype, "as_numpy_dtype", dtype))
                    for key, shape, dtype, start, end in buffers.layout
                }
                keyed.append((int(ids[row]), replica, LayerRecord(
                    step=int(table[row, 2]),
                    mode=MODES[int(table[row, 1])],
                    replica=replica + offset,
                    values=values,
                )))
            self._host.last_id[replica] = int(ids[rows[-1]])
        # In call order, replica 0 first within a call.
        keyed.sort(key=lambda item: item[:2])
        return [record for _, _, record in keyed]

    def _fail(self, error: Exception) -> None:
        if self.strict:
            raise error
        if not self._failed:
            self._failed = True
            warnings.warn(
                f"{type(self).__name__} {self.name!r} stopped recording; the model "
                f"runs on unchanged. Cause: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=3,
            )


def check_backend(owner: str) -> None:
    """Raises `UnsupportedBackendError` naming `owner` (a debug layer, or a
    tool that makes them) unless Keras runs on a backend of
    `DebugLayer.BACKENDS`.

    Args:
        owner: the class or function, for the message.

    Raises:
        UnsupportedBackendError: Keras runs on another backend.
    """
    name = keras.config.backend()
    if name in DebugLayer.BACKENDS:
        return
    works = ", ".join(DebugLayer.BACKENDS)
    raise UnsupportedBackendError(
        f"{owner}: kerasdbg's debug layers (TapLayer, PrintLayer) record on the Keras "
        f"backends {works} only, and Keras runs on {name!r} here (KERAS_BACKEND). Works on: "
        f"{works}. On {name}, MultiOutputModel exposes the outputs of any layers, "
        "insert_taps inserts a layer of your own (`tap=`), and strip_debug_layers, "
        "load_run, kerasdbg check and kerasdbg report work.")


def _is_tensor(value) -> bool:
    if isinstance(value, (keras.KerasTensor, keras.Variable, np.ndarray)):
        return True
    if on_jax():
        return keras.ops.is_tensor(value)
    return isinstance(value, (tf.Tensor, tf.Variable))


def _is_structure(inputs) -> bool:
    """Whether `inputs` is a structure of tensors (not one tensor, nor a
    nested list of numbers, which is one tensor)."""
    if isinstance(inputs, dict):
        return True
    if not isinstance(inputs, (list, tuple)):
        return False
    return any(_is_tensor(leaf) for leaf in keras.tree.flatten(inputs))


def _is_shape(shape) -> bool:
    """Whether `shape` is one shape (a tuple or list of sizes), not a structure."""
    if not on_jax() and isinstance(shape, tf.TensorShape):
        return True
    return isinstance(shape, (tuple, list)) and all(
        d is None or isinstance(d, (int, np.integer)) for d in shape)


class _Shape:
    """A shape as one leaf, to flatten a structure of shapes with its paths."""

    def __init__(self, shape):
        self.shape = tuple(shape)
