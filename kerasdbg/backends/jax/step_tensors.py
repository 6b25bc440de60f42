"""The request behind `StepRecorder` on JAX: full tensors at a few steps.

Keras's JAX trainer runs a Python loop over a jitted step, so the host
knows which step each call makes before it makes it: the engine calls a
second variant of its step, traced with this request, at the steps asked
for only (one more trace and compile in a fit with a `StepRecorder`;
every other step runs the step it runs without one, and nothing is
computed, kept or copied for the tensors there). That variant returns, beside
the step's own outputs:

- the gradients the first optimizer applying to the selected variables
  applied (after its clipping; unscaled under mixed precision), the
  weights after its update, and the learning rate the update used (read
  from the optimizer's variables as the step holds them, a schedule's
  included);
- the step's loss (`compute_loss`'s, as Keras's train step hands it to the
  metrics);
- the layer outputs: a replay of the forward pass (`_replay`) on the
  step's inputs with the weights before the update, under a
  `StatelessScope`, so that what the replay writes (BatchNormalization's
  moving statistics, seed generators) is thrown away. Layers that draw
  random numbers (Dropout) draw their own in it.

The host's guess of the step is the optimizer's counter at the fit's start
plus the calls made; the variant also returns the step it made, and a
guess that was wrong is corrected for the next ones. A step the loss
scaler skipped (mixed precision) is not recorded: the update that follows
carries its number and is recorded instead. The weights of step 0 are taken from the state Keras's loop
hands the first execution.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

import numpy as np

from kerasdbg import _replay
from kerasdbg.capture.requests import Request

PREFIX = "tensors/"
"""The prefix of the step's records that hold the tensors."""


class TensorRequest(Request):
    """What a `StepRecorder` asks JAX's capture for.

    Args:
        steps: the optimizer steps (>= 1) to record.
        record: which of `RECORDABLE`.
        layers: qualified layer names whose outputs are recorded.
        consumer: called with `{step: {kind: value}}` (`TraceWriter.record`'s
            arguments) for the steps read since the last call.
        include, exclude: regular expressions on variable paths.
        strict: a failure raises instead of warning.
        initial: record the weights before the first step as step 0.
        start: the optimizer's step counter at the fit's start.
    """

    def __init__(self, steps: Sequence[int], record: Sequence[str], layers: Sequence[str],
                 consumer, include=None, exclude=None, strict: bool = False,
                 initial: bool = False, start: int = 0):
        super().__init__("tensors", consumer=consumer, include=include, exclude=exclude,
                         strict=strict, owner="StepRecorder")
        self.steps = tuple(sorted(steps))
        self.record = tuple(record)
        self.layers = list(layers) if "layer_outputs" in record else []
        self.handed: set = set()
        self.initial = initial
        self.initial_handed = not initial
        self.next_step = start + 1  # the host's guess of the next call's step
        self.first = start + 1  # the fit's first step: earlier ones are out of reach
        self.passed = start  # the latest step a recorded call was seen to make
        self.paths: List[str] = []
        self.variables: list = []
        self.why: Optional[str] = None  # why no variable is recorded (`unselected`)
        self.warned: set = set()

    def graph_key(self):
        """None: a fit with a `StepRecorder` traces its step again."""
        return None

    @property
    def complete(self) -> bool:
        return len(self.handed) == len(self.steps) and self.initial_handed

    def wanted(self) -> bool:
        """Whether the next call may make a step to record (not yet recorded).

        The host's guess (the fit's first step plus the calls made) is
        corrected when the records are read, once per execution; in between
        it runs ahead of the actual step wherever the loss scaler skipped an
        update (the counter stays), never behind. So from its guessed call
        on, a step is recorded by every call until one is seen to make it."""
        return any(self.passed < s <= self.next_step and s >= self.first
                   for s in self.steps if s not in self.handed)

    def called(self) -> None:
        """One call of the step made (the guess moves on)."""
        self.next_step += 1

    def bind(self, variables, paths) -> None:
        """The variables it records (at trace time, from the first apply)."""
        self.variables, self.paths = list(variables), list(paths)
        self.why = None

    def unselected(self, names: str, paths: List[str]) -> None:
        """At trace time: the step applied no variable this request selects
        (`names`: the optimizers that applied, `paths`: their variables)."""
        self.variables, self.paths = [], []
        listing = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8
                                          else "")
        self.why = (f"none of the variables that {names} applied matches "
                    f"include={self.include!r}, exclude={self.exclude!r}: {listing}")

    # ----------------------------------------------------------- on host
    def take_initial(self, model, trainable_values) -> None:
        """Step 0: the weights Keras's loop hands the first execution."""
        if self.initial_handed:
            return
        self.initial_handed = True
        values = {id(v): value for v, value in zip(model.trainable_variables, trainable_values)}
        weights = {}
        for variable, path in _selected(model, self):
            if id(variable) in values:
                weights[path] = np.array(values[id(variable)])
        if weights:
            self.consumer({0: {"weights": weights}})

    def take(self, guessed: int, records: Dict[str, object]) -> None:
        """The tensors of one recorded step, from the host's copy of its records."""
        step = int(records[PREFIX + "step"])
        if step != guessed:
            self.next_step += step - guessed  # the guess was off: corrected from here on
        if bool(records.get(PREFIX + "skipped", False)):
            # The loss scaler skipped this update and the counter did not
            # move: the next call makes this step again, recorded then.
            self.next_step -= 1
            return
        self.passed = max(self.passed, step)
        if step not in self.steps or step in self.handed:
            return
        if self.why is not None and "unselected" not in self.warned:
            self.warned.add("unselected")
            message = f"StepRecorder records nothing this fit: {self.why}."
            if self.strict:
                raise ValueError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        tensors: Dict[str, object] = {}
        if "loss" in self.record and PREFIX + "loss" in records:
            tensors["loss"] = np.asarray(records[PREFIX + "loss"])
        if "learning_rate" in self.record and PREFIX + "learning_rate" in records:
            tensors["learning_rate"] = np.asarray(records[PREFIX + "learning_rate"])
        for kind in ("gradients", "weights"):
            if kind in self.record and PREFIX + kind in records:
                tensors[kind] = {p: np.asarray(a) for p, a in
                                 zip(self.paths, records[PREFIX + kind]) if a is not None}
        outputs = records.get(PREFIX + "layer_outputs")
        if outputs:
            tensors["layer_outputs"] = {name: np.asarray(value) for name, value in outputs.items()}
        self.handed.add(step)
        if self.complete:
            # Nothing left to read at once: the other requests may be read late.
            self.deferred = True
        self.consumer({step: tensors})


def _selected(model, request: TensorRequest):
    """`(variable, path)` of the model's trainable float variables the request selects."""
    from kerasdbg.capture import keras_objects
    from kerasdbg.capture.requests import unique_paths

    variables = list(model.trainable_variables)
    return [(v, p) for v, p in zip(variables, unique_paths(variables))
            if request.selects(p) and keras_objects.is_float(v)]


def layer_outputs(model, request: TensorRequest, state, data) -> Optional[dict]:
    """In the step: the outputs of the request's layers for the step's batch,
    with the weights the step started from (`state`), by a replay under a
    `StatelessScope` (its writes thrown away). None when there is nothing
    to replay on."""
    import jax.numpy as jnp
    import keras
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.trainers.data_adapters import data_adapter_utils

    if not request.layers:
        return None
    x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
    if x is None:
        return None
    wanted = set(request.layers)
    outputs: Dict[str, object] = {}

    def on_output(name, value):
        if name in wanted and name not in outputs:
            floats = [t for t in keras.tree.flatten(value)
                      if hasattr(t, "dtype") and jnp.issubdtype(t.dtype, jnp.floating)]
            if floats:
                outputs[name] = floats[0]

    mapping = list(zip(model.trainable_variables, state[0])) + \
        list(zip(model.non_trainable_variables, state[1]))
    with StatelessScope(state_mapping=mapping):
        _replay.call_layer_by_layer(model, x, True, on_output)
    return {name: outputs[name] for name in request.layers if name in outputs}


__all__ = ["PREFIX", "TensorRequest", "layer_outputs"]
