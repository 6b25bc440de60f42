"""`StepTimer`: where the time of each execution goes, input or compute."""

from __future__ import annotations

import time
import warnings
from typing import List, Optional

import numpy as np
import pandas as pd

from kerasdbg import capture as _capture
from kerasdbg.sinks import layout as _layout
from kerasdbg.records import tags as _tags
from kerasdbg import _validation as check
from kerasdbg.callbacks._recording import RecordingCallback, release_writer
from kerasdbg.rules.rule import DiagnosisWarning

COLUMNS = ("step", "steps", "execution_seconds", "step_seconds", "input_seconds",
           "compute_seconds", "input_fraction", "examples", "examples_per_second")


def _tensorflow():
    """TensorFlow and the parts of its capture StepTimer writes with,
    imported on use (StepTimer runs on the TensorFlow backend only)."""
    import tensorflow as tf

    from kerasdbg.backends.tensorflow import buffers, variable_reads

    return tf, buffers, variable_reads


class StepTimer(RecordingCallback):
    """Times each execution of the train function and splits it into input and compute.

    For each execution (`steps_per_execution` optimizer steps): its wall
    time, the time per step, the time the steps waited for their batch
    (`input_seconds`: from the end of one step to the start of the next, the
    first step counted from the moment `fit` called the execution), the time
    they computed (`compute_seconds`: from the start of `train_step`, with
    its batch in hand, to the end of its weight update), the input
    fraction, and examples per second. On TensorFlow the two split times
    come from `tf.timestamp` ops around the model's `train_step` (replica 0
    under a strategy), and so does the count of examples; under XLA
    (`jit_compile=True`), which cannot compile `tf.timestamp`, only the wall
    time and the time per step are recorded.

    On JAX the timing is the host's, with and without `jit_compile`:
    `input_seconds` is the time Keras's loop spent in `next(iterator)`
    waiting for the execution's batches, `compute_seconds` the rest of the
    execution's wall time (dispatching the steps and waiting for the
    device). No step is made to wait for the device (`block_until_ready`):
    with `steps_per_execution > 1` the device computes one step while the
    host fetches the next batch, as without the timer, so `input_seconds`
    is then an upper bound of the time the device waited for its input.

    Warns once when training is input-bound: the median input fraction of
    the executions after the first `warmup` (whose time includes tracing) is
    above `input_bound_threshold`. The warning is a diagnosis,
    `kerasdbg.rules.DiagnosisWarning`, not a `RuntimeWarning` (a failure of
    kerasdbg): a busy machine can make any run input-bound.

    TensorBoard tags (events under `<log_dir>/train`, at the last step of each
    execution): `time/execution_seconds`, `time/step_seconds`,
    `time/input_seconds`, `time/compute_seconds`, `time/input_fraction`,
    `time/examples_per_second`. The `history` DataFrame holds every execution.

    Args:
        log_dir: TensorBoard log directory, or None to keep the records in
            Python only. Defaults to `None`.
        input_bound_threshold: the input fraction above which training is
            input-bound. Defaults to `0.5`.
        warmup: executions left out of the input-bound test. Defaults to `2`.
        strict: raise on a failure of the timer instead of warning. Defaults
            to `False`.

    Examples:
        >>> import keras, numpy as np
        >>> from kerasdbg.callbacks import StepTimer
        >>> inputs = keras.Input((3,), name="x")
        >>> model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(inputs))
        >>> model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        >>> timer = StepTimer()
        >>> _ = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=2, verbose=0,
        ...               callbacks=[timer])
        >>> timer.history.step.tolist(), timer.history.examples.tolist()
        ([2, 4], [4.0, 4.0])
    """

    def __init__(self, log_dir: Optional[str] = None, input_bound_threshold: float = 0.5,
                 warmup: int = 2, strict: bool = False):
        super().__init__()
        owner = "StepTimer"
        _capture.supported(owner, "wrap")
        self.log_dir = check.log_dir(owner, "log_dir", log_dir)
        self.input_bound_threshold = check.number(
            owner, "input_bound_threshold", input_bound_threshold, minimum=0.0, maximum=1.0)
        self.warmup = check.non_negative_int(owner, "warmup", warmup)
        self.strict = check.boolean(owner, "strict", strict)
        self._rows: List[dict] = []
        self._request = None
        self._writer = None
        self._warned = False
        self._timed = False
        self._host = False

    def get_config(self) -> dict:
        return {"log_dir": self.log_dir, "input_bound_threshold": self.input_bound_threshold,
                "warmup": self.warmup, "strict": self.strict}

    @property
    def history(self) -> pd.DataFrame:
        """One row per execution: `COLUMNS`."""
        return pd.DataFrame(self._rows, columns=list(COLUMNS))

    # --------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        model = self.model
        self._rows = []
        self._warned = False
        self._spe = int(model.steps_per_execution)
        # A capture that times on the host (JAX's) hands over one record per execution.
        self._host = _capture.engine_for(model).times_on_host
        if self._host:
            return self._begin_host_timing()
        tf, _buffers, reads = _tensorflow()  # noqa: F841 - TensorFlow's capture, on use
        self._timed = getattr(model, "jit_compile", False) is not True
        self._writer = self._open_writer()
        _layout.add("StepTimer", self._writer, _layout.timing_lines(self._timed), self.strict)
        # Under XLA the engine only counts the train steps.
        self._request = _capture.Request(
            "wrap", wrapper=self._timed_step if self._timed else None, strict=self.strict,
            owner="StepTimer")
        if self._timed:
            with model.distribute_strategy.scope():
                # [row, (start, end, examples)] per train step of an execution;
                # the request's, so that a later fit reusing the traced step
                # reads the buffer that step writes.
                self._request.buffers["times"] = _buffers.on_read_variable(
                    tf.zeros([self._spe, 3], tf.float64), "kerasdbg_step_times")
        engine = _capture.engine_for(model)
        engine.attach(self._request)
        self._last = None

    def _begin_host_timing(self) -> None:
        """JAX: the capture times each execution on the host and hands this
        callback one record per execution (see the class docstring)."""
        self._timed = True
        self._taken: List[object] = []
        self._writer = self._open_writer()
        _layout.add("StepTimer", self._writer, _layout.timing_lines(True), self.strict)
        self._request = _capture.Request("wrap", consumer=self._taken.extend,
                                         strict=self.strict, owner="StepTimer")
        _capture.engine_for(self.model).attach(self._request)
        self._last = None

    @property
    def _buffer(self) -> Optional[object]:
        return self._request.buffers.get("times") if self._request is not None else None

    def _timed_step(self, step_function, data, row):
        """The train step between two timestamps (in the graph)."""
        tf, _buffers, reads = _tensorflow()  # noqa: F841 - TensorFlow's capture, on use
        model, buffer = self.model, self._buffer
        flat = [t for t in tf.nest.flatten(data) if tf.is_tensor(t)]
        with tf.control_dependencies(flat):
            start = tf.timestamp()
        # Stateless ops (the matmuls of the step) are not ordered by
        # tf.function: without these edges the forward pass runs beside
        # `start` (before it, often) and the update after `end`.
        with tf.control_dependencies([start]):
            data = tf.nest.map_structure(
                lambda t: tf.identity(t) if tf.is_tensor(t) else t, data)
        logs = step_function(data)
        # Reads made after the step wait for its writes: the update writes
        # the trainable variables.
        done = [t for t in tf.nest.flatten(logs) if tf.is_tensor(t)]
        done += [reads.read(v) for v in model.trainable_variables]
        with tf.control_dependencies(done):
            end = tf.timestamp()
        examples = tf.cast(tf.shape(flat[0])[0], tf.float64) if flat and flat[0].shape.rank \
            else tf.constant(np.nan, tf.float64)
        _buffers.write_row(buffer, row, tf.stack([start, end, examples]))
        return logs

    def on_train_batch_begin(self, batch, logs=None):
        engine = _capture.engine_for(self.model)
        engine.prepare()
        if self._host:
            self._begin = time.time()
            return
        if self._last is None:
            self._last = engine.collector.train_steps()
        self._begin = time.time()

    def on_train_batch_end(self, batch, logs=None):
        self._guarded(self._record, time.time())

    def on_train_end(self, logs=None):
        if self._request is not None:
            _capture.engine_for(self.model).detach(self._request)
            self._request = None
        release_writer(self, self._writer)

    # -------------------------------------------------------- records
    def _record(self, end: float) -> None:
        if self._host:
            return self._record_host(end)
        tf, _buffers, reads = _tensorflow()  # noqa: F841 - TensorFlow's capture, on use
        engine = _capture.engine_for(self.model)
        last = engine.collector.train_steps()
        steps = last - self._last
        self._last = last
        if steps <= 0:
            return
        step = engine.collector.step_of(last)
        wall = end - self._begin
        row = {"step": step, "steps": steps, "execution_seconds": wall,
               "step_seconds": wall / steps, "input_seconds": np.nan, "compute_seconds": np.nan,
               "input_fraction": np.nan, "examples": np.nan, "examples_per_second": np.nan}
        if self._timed:
            replicas = _buffers.read_replicas(self._buffer)
            rows = [(i - 1) % self._spe for i in range(last - steps + 1, last + 1)]
            times = replicas[0][rows]
            previous_end = np.concatenate([[self._begin], times[:-1, 1]])
            input_seconds = float(np.sum(np.maximum(times[:, 0] - previous_end, 0.0)))
            compute = float(np.sum(times[:, 1] - times[:, 0]))
            examples = float(sum(r[rows, 2].sum() for r in replicas))
            row.update(input_seconds=input_seconds, compute_seconds=compute,
                       input_fraction=input_seconds / wall if wall > 0 else np.nan,
                       examples=examples,
                       examples_per_second=examples / wall if wall > 0 else np.nan)
        self._add(row)

    def _record_host(self, end: float) -> None:
        """JAX: the row of the execution that just ended, from its record."""
        _capture.engine_for(self.model).collect(final=False)
        taken, self._taken[:] = list(self._taken), []
        if not taken:
            return
        record = taken[-1]  # one execution per batch
        steps, waited, examples = (float(v) for v in record.values)
        wall = end - self._begin
        self._add({"step": record.step, "steps": int(steps), "execution_seconds": wall,
                   "step_seconds": wall / steps, "input_seconds": waited,
                   "compute_seconds": max(wall - waited, 0.0),
                   "input_fraction": waited / wall if wall > 0 else np.nan,
                   "examples": examples,
                   "examples_per_second": examples / wall if wall > 0 else np.nan})

    def _add(self, row: dict) -> None:
        self._rows.append(row)
        if self._writer is not None:
            scalars = {_tags.scalar(_tags.TIME, k): v for k, v in row.items()
                       if k not in ("step", "steps", "examples") and not np.isnan(v)}
            self._writer.write(row["step"], scalars=scalars)
        self._check_input_bound()

    def _check_input_bound(self) -> None:
        if self._warned or not self._timed:
            return
        fractions = [r["input_fraction"] for r in self._rows[self.warmup:]]
        if len(fractions) < 3:
            return
        median = float(np.median(fractions))
        if median > self.input_bound_threshold:
            self._warned = True
            warnings.warn(
                f"StepTimer: training is input-bound: the steps wait for their batch "
                f"{median:.2f} of the time (median over executions {self.warmup + 1}-"
                f"{len(self._rows)}; threshold {self.input_bound_threshold:g}). Speed up the "
                "input pipeline: `.prefetch(tf.data.AUTOTUNE)`, `num_parallel_calls` on maps, "
                "`.cache()`; `kerasdbg.doctor(model, data)` checks its order.",
                DiagnosisWarning, stacklevel=3)
