"""`StepRecorder`: the full tensors of a few training steps, in one file."""

from __future__ import annotations

import os
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Union

from kerasdbg import capture as _capture
from kerasdbg.capture import keras_objects
from kerasdbg import _qualified
from kerasdbg import _replay
from kerasdbg import _validation as check
from kerasdbg.sinks import workers as _workers
from kerasdbg import trace as trace_lib
from kerasdbg.callbacks._recording import RecordingCallback

RECORDABLE = _capture.RECORDABLE


class StepRecorder(RecordingCallback):
    """Records the full tensors of chosen training steps into one `.npz` file.

    For each recorded optimizer step: the loss, the learning rate the update
    used, the gradients the optimizer applied (after clipping and, under a
    `tf.distribute` strategy, summed over replicas), the weights after the
    update, and every layer's output for the step's batch. The file is the
    one `kerasdbg.TraceWriter` writes from plain Python (a custom loop, a
    `tf.compat.v1` session), so a migrated or re-distributed model can be
    compared with the original by `kerasdbg.compare_traces` or
    `kerasdbg compare A B`. Read it with `numpy.load` or `kerasdbg.load_trace`.

    Works with any `steps_per_execution`, with `jit_compile` on or off, and
    under `OneDeviceStrategy` and `MirroredStrategy` (layer outputs then hold
    the whole global batch, the replicas' slices in order). Steps are
    `optimizer.iterations` after the update, from 1; step 0 records the
    weights before training (when `fit` starts at step 0). The file is
    written once every requested step is recorded, and at the end of `fit`.
    Steps asked for that the fit did not reach are said at the end of `fit`,
    once, with the steps it ran; a fit that reached none of them writes no
    file (rather than an empty one).

    It records the first optimizer the train step applies to the selected
    variables (`model.optimizer` with Keras's `train_step`; with several
    optimizers, the first one applied), also for a model built inside `fit`.
    A model with nothing trainable, or no variable selected, warns once and
    records what does not need the variables.

    On the JAX backend it works with any `steps_per_execution`, `jit_compile`
    on or off, and under a `keras.distribution` (the gradients and layer
    outputs are the global ones): the host calls a second variant of the
    step, which also returns the tensors, at the recorded steps only (one
    more trace and compile per fit; the other steps run as without it). The
    layer outputs there come from `model`'s layers replayed under a
    `StatelessScope` on the step's batch with the step's starting weights,
    and need no static batch dimension.

    Memory: the recorded steps are kept in full until read, on every
    replica (steps x (2 x weights + layer outputs)). Layer outputs come from
    a replay of the forward pass at recorded steps only (Functional and
    Sequential models; a layer called several times: its first call; a
    layer with several outputs: its first float one). The replay does not
    change training, but Dropout-like layers draw a fresh random mask in it;
    compare outputs with such layers inactive. Under XLA layer outputs need
    a static batch dimension or a batch size `fit` knows (arrays, or a
    dataset batched with `drop_remainder=True`); without either they are
    left out with a warning.

    Args:
        path: the `.npz` file to write.
        steps: how many first steps to record (`3` records steps 1, 2, 3),
            or a list of steps (0 for the initial weights). Defaults to `3`.
        record: which of "loss", "learning_rate", "gradients", "weights",
            "layer_outputs". Defaults to all of them.
        include: regular expression; only variable paths it matches are
            recorded. Defaults to None (all trainable float variables).
        exclude: regular expression; variable paths it matches are left
            out. Defaults to None.
        layers: the layers whose outputs "layer_outputs" records, in the
            forms of `insert_taps`'s `layers`: a regular expression searched
            in layer names and paths (`outer/inner/name`), a list of names or
            paths, or a callable `layer -> bool`. Defaults to None (every
            layer).
        strict: raise on a failure of the recording instead of warning and
            letting training go on. Defaults to `False`.

    Examples:
        >>> import os, tempfile
        >>> import keras, numpy as np
        >>> from kerasdbg.callbacks import StepRecorder
        >>> path = os.path.join(tempfile.mkdtemp(), "keras.npz")
        >>> inputs = keras.Input((3,), name="x")
        >>> model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((4, 3)), np.zeros((4, 1))
        >>> _ = model.fit(x, y, batch_size=2, epochs=1, verbose=0,
        ...               callbacks=[StepRecorder(path, steps=2)])
        >>> trace = np.load(path)
        >>> trace["gradients/dense/kernel@2"].shape, trace["layer_outputs/dense@1"].shape
        ((3, 1), (2, 1))
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        steps: Union[int, Sequence[int]] = 3,
        record: Sequence[str] = RECORDABLE,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        layers: Union[None, str, Sequence[str], Callable] = None,
        strict: bool = False,
    ):
        super().__init__()
        owner = "StepRecorder"
        _capture.supported(owner, "tensors")
        path = check.optional_path(owner, "path", path)
        if path is None:
            raise TypeError(f"{owner}: `path` must be a str or an os.PathLike. Received: path=None")
        self.path = path
        if isinstance(steps, int) and not isinstance(steps, bool):
            self.steps = check.positive_int(owner, "steps", steps)
            self._steps = tuple(range(1, steps + 1))
        elif isinstance(steps, (list, tuple)) and steps:
            for step in steps:
                if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                    raise ValueError(
                        f"{owner}: `steps` must be a positive int or a non-empty list of "
                        f"ints >= 0. Received: steps={steps!r}")
            self.steps = list(steps)
            self._steps = tuple(sorted(set(steps)))
        else:
            raise TypeError(
                f"{owner}: `steps` must be a positive int or a non-empty list of ints >= 0. "
                f"Received: steps={steps!r}")
        self.record = check.choices(owner, "record", record, RECORDABLE)
        self.include = check.optional_regex(owner, "include", include)
        self.exclude = check.optional_regex(owner, "exclude", exclude)
        self.layers = check.layer_selection(owner, "layers", layers)
        self.strict = check.boolean(owner, "strict", strict)
        self._request = None  # a TensorRequest of TensorFlow's capture
        self._writer: Optional[trace_lib.TraceWriter] = None
        self._saved = False
        self._start = 0
        self._wanted: List[int] = []
        self._recorded: set = set()

    def get_config(self) -> dict:
        """The constructor's arguments, JSON-able: a callable `layers` by its
        qualified name (a lambda cannot be saved: TypeError)."""
        layers = self.layers
        if callable(layers):
            layers = {"function": _qualified.name_of("StepRecorder", "layers", layers)}
        return {"path": self.path, "steps": self.steps, "record": list(self.record),
                "include": self.include, "exclude": self.exclude, "layers": layers,
                "strict": self.strict}

    @classmethod
    def from_config(cls, config: dict) -> "StepRecorder":
        config = dict(config)
        if isinstance(config.get("layers"), dict):
            config["layers"] = _qualified.resolve(config["layers"]["function"])
        return cls(**config)

    @property
    def destination(self) -> str:
        return self.path

    # --------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        model = self.model
        self._failed = False
        layers = []
        if "layer_outputs" in self.record:
            available = _replay.recordable_layers(model)
            layers = self._selected_layers(model, available)
            if not available:
                warnings.warn(
                    f"StepRecorder records no layer outputs: {type(model).__name__} is not a "
                    "Functional or Sequential model, whose forward pass it can replay.",
                    RuntimeWarning, stacklevel=2)
        # The optimizer it records is known in the trace; the one that stepped
        # most (a GAN's second fit: not `model.optimizer`) tells where steps are.
        start = max(keras_objects.step_number(o) for _, o in keras_objects.find_optimizers(model))
        initial = 0 in self._steps and start == 0 and "weights" in self.record
        steps = [s for s in self._steps if s > start]
        self._request = None
        self._start = start
        self._wanted = ([0] if initial else []) + steps
        self._recorded: set = set()
        # A later fit past the recorded steps leaves the file as it is.
        self._saved = not (steps or initial)
        if self._saved and not os.path.exists(self.path):
            # Every step asked is behind this fit's first one (a model trained before).
            self._say_missing(start, start)
        # Under several workers the chief saves the file; the others record
        # the same steps (their graphs must match the chief's) and save nothing.
        strategy = getattr(model, "distribute_strategy", None)  # TensorFlow's only
        target = _workers.file_path(self.path, strategy, "StepRecorder")
        self._writer = None if self._saved or target is None else trace_lib.TraceWriter(
            target, source="StepRecorder")
        if steps or initial:
            engine = _capture.engine_for(model)
            self._request = engine.tensor_request(
                steps, self.record, layers, self._consume, include=self.include,
                exclude=self.exclude, strict=self.strict, initial=initial, start=start)
            engine.attach(self._request)

    def _selected_layers(self, model, available: List[str]) -> List[str]:
        """The qualified names of `available` that `layers` selects; a selection
        that names no layer of the model warns (raises when strict) and
        records no layer output."""
        if self.layers is None or not available:
            return list(available)
        try:
            chosen = _replay.select_layers("StepRecorder", model, self.layers)
        except ValueError as error:
            if self.strict:
                raise
            warnings.warn(f"{error} StepRecorder records no layer outputs this fit.",
                          RuntimeWarning, stacklevel=3)
            return []
        names = {_replay.qualified_name(path, layer)
                 for path, layer in _replay.walk(model) if (path, id(layer)) in chosen}
        layers = [name for name in available if name in names]
        if not layers:  # e.g. only input layers, whose "output" is the batch
            message = (f"StepRecorder: `layers`={self.layers!r} selects no layer whose output "
                       f"can be recorded. Recordable: {', '.join(available)}. StepRecorder "
                       "records no layer outputs this fit.")
            if self.strict:
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return layers

    def on_train_batch_begin(self, batch, logs=None):
        if self._request is not None:
            _capture.engine_for(self.model).prepare()

    def on_train_batch_end(self, batch, logs=None):
        if self._request is not None and not self._request.complete:
            _capture.engine_for(self.model).collect()

    def on_train_end(self, logs=None):
        if self._request is not None:
            _capture.engine_for(self.model).detach(self._request)
        missing = [s for s in self._wanted if s not in self._recorded]
        # A request that found no variable to record was said by the engine already.
        said = self._request is not None and not self._request.variables \
            and not hasattr(self._request, "why")  # JAX's says it when it reads
        if missing and not said:
            end = max((keras_objects.step_number(o)
                       for _, o in keras_objects.find_optimizers(self.model)), default=self._start)
            self._say_missing(self._start, end, missing)
        # No file rather than an empty one when no step asked for was reached.
        if not self._saved and self._recorded:
            self._save()

    def _say_missing(self, start: int, end: int, missing: Optional[List[int]] = None) -> None:
        """Says once, at the end of the fit, which steps asked for were not
        recorded, the steps the fit ran, and what the file holds."""
        asked = list(self._steps) if missing is None else missing
        ran = f"steps {start + 1}-{end}" if end > start else "no step"
        if end == start + 1:
            ran = f"step {end}"
        if not self._recorded:
            written = f"it wrote no file to {self.path!r}"
            if os.path.exists(self.path):
                written += " (the file there is from an earlier fit)"
            message = (f"StepRecorder records nothing this fit: it was asked for step(s) "
                       f"{', '.join(map(str, asked))} (`steps`={self.steps!r}) and this fit ran "
                       f"{ran} (the optimizer's steps, from 1; 0 is the initial weights); "
                       f"{written}.")
        else:
            message = (f"StepRecorder did not record step(s) {', '.join(map(str, asked))} "
                       f"(`steps`={self.steps!r}): this fit ran {ran}. {self.path!r} holds "
                       f"step(s) {', '.join(map(str, sorted(self._recorded)))}.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -------------------------------------------------------- records
    def _consume(self, steps: Dict[int, Dict[str, object]]) -> None:
        self._recorded.update(steps)
        for step, tensors in steps.items():
            if self._writer is not None:
                self._guarded(self._writer.record, step, **tensors)
        if self._request is not None and self._request.complete:
            self._save()

    def _save(self) -> None:
        if self._writer is not None:
            self._guarded(self._writer.save)
            self._saved = True
