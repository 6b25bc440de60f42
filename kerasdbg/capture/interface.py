"""`Capture`: what the shells ask of a backend's capture, and `engine_for`.

Every callback that records per optimizer step talks to the one capture of
its model through this interface; the capture of the model's backend
(`kerasdbg.backends.<name>.engine`) implements it. The backend is Keras's
(`keras.config.backend()`), fixed when Keras is imported; the backend's
module is imported on first use, so nothing here imports a framework.
"""

from __future__ import annotations

import abc
import importlib
from typing import List, Optional

import keras

from kerasdbg.errors import UnsupportedBackendError

CAPTURES = {
    "tensorflow": "kerasdbg.backends.tensorflow.engine",
    "jax": "kerasdbg.backends.jax.engine",
}
"""The module of each backend's capture (its `engine_for(model)`)."""

RECORDS = {
    "tensorflow": None,  # everything
    "jax": {"gradients": "GradientStatistics", "weights": "WeightStatistics",
            "taps": "ActivationStatistics",
            "step": "StopOnRule", "classes": "StopOnRule", "guard": "StopOnRule",
            "rollback": "StopOnRule", "wrap": "StepTimer", "tensors": "StepRecorder"},
}
"""What each backend's capture records, by request kind (None: every kind),
with the instrument that asks for it."""

ELSEWHERE = ("the model tools (insert_taps, strip_debug_layers, MultiOutputModel), "
             "load_run, kerasdbg check and kerasdbg report")
"""What works on a backend without a capture."""


LOSS_FROM_COMPUTE_LOSS = "compute_loss"
LOSS_FROM_METRIC = "the value the train step gives its metric 'loss'"
"""Where a captured `step/loss` comes from (`Capture.loss_origin`): Keras's
`compute_loss`, or a train step's own loss, given to the metric named "loss"
(whose `result()`, the mean since the epoch began, the step returns)."""


class FaultState(abc.ABC):
    """What a capture's `faults` offers the callbacks on every backend:
    `StopOnRule`'s freeze, skip and rollback, on the host between two
    executions.

    Attributes:
        frozen: whether a fault froze the weights (they change no more until
            `unfreeze`).
    """

    frozen: bool

    @abc.abstractmethod
    def snapshot(self):
        """A host copy of what a rollback puts back: the model's and the
        optimizers' state, the steps kerasdbg kept each optimizer from
        counting and the guard's spike windows and flags, but the debug
        layers' counters and buffers (their records go on). A value of the
        backend's own, for `put_back`."""

    @abc.abstractmethod
    def put_back(self, snapshot) -> None:
        """Puts `snapshot` back: the next execution starts from its state."""

    @abc.abstractmethod
    def keep_state(self) -> None:
        """Takes the state as it is now as what a frozen or skipped step
        keeps (after `put_back`)."""

    @abc.abstractmethod
    def unfreeze(self) -> None:
        """Lets the weights change again after a fault froze them."""

    @abc.abstractmethod
    def skip_next(self, batches: int) -> None:
        """Skips the next `batches` train steps whatever they hold."""


class Capture(abc.ABC):
    """The capture of one model: one per model, shared by its callbacks.

    The life cycle of a fit, driven by the callbacks: `attach` a request in
    `on_train_begin`, `prepare` at each batch's begin, `collect` at each
    batch's end (and at the end), `detach` in `on_train_end`, `abort` for a
    callback that ends the fit with an exception. The records reach each
    request's `consumer`.

    Attributes:
        requests: the attached requests, in order.
        loss_captured: whether the traced train step computed its loss with
            `compute_loss`, or gave it to its metric named "loss" (so
            `step/loss` is the step's own loss).
        loss_origin: which of the two (`LOSS_FROM_COMPUTE_LOSS`,
            `LOSS_FROM_METRIC`), when `loss_captured`.
        faults: the fault state (the freeze and its reports): a `FaultState`.
    """

    requests: List[object]
    loss_captured: bool
    loss_origin: str = LOSS_FROM_COMPUTE_LOSS
    faults: object

    @abc.abstractmethod
    def attach(self, request) -> None:
        """Adds a request; the first one instruments the train step."""

    @abc.abstractmethod
    def prepare(self) -> None:
        """Readies the instrumented step for the next batch."""

    @abc.abstractmethod
    def collect(self, final: bool = True, batch: Optional[int] = None) -> None:
        """Reads what the steps since the last call recorded and hands it out."""

    @abc.abstractmethod
    def detach(self, request) -> None:
        """Removes a request; the last one restores the model."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Hands out what is recorded and restores the model, at once."""

    @property
    @abc.abstractmethod
    def several_optimizers(self) -> bool:
        """Whether more than one optimizer applied gradients in the train step."""

    times_on_host = False
    """Whether a "wrap" request (`StepTimer`) gets one record per execution
    timed on the host, rather than a function around each step that times
    it in the step's program."""

    @abc.abstractmethod
    def tensor_request(self, steps, record, layers, consumer, *, include=None, exclude=None,
                       strict: bool = False, initial: bool = False, start: int = 0):
        """The request of a `StepRecorder` that records the tensors `record`
        names (of the layers `layers`) at the optimizer steps `steps`, and
        with `initial` the weights before the fit's first step (`start`: the
        step the fit starts after), handed to `consumer`; attached by the
        caller."""

    reads_at_batch_begin = False
    """Whether the callbacks read after an execution at the next batch's
    begin, on the fit's thread, rather than at its batch end: where Keras
    may call the batch ends on a worker thread (its JAX and PyTorch loops,
    when every callback is `async_safe`), so that the loop never waits for
    a batch end, and kerasdbg's callbacks stay `async_safe`."""

    def replica_checker(self):
        """An object whose `spreads()` gives each trainable weight's spread
        across the replicas (`{path: spread}`), or None with one replica;
        asked after the fit's first step (the variables exist then).

        Raises:
            NotImplementedError: the backend compares no replicas.
        """
        raise NotImplementedError(
            f"kerasdbg compares the replicas' weights under a tf.distribute strategy on the "
            f"TensorFlow backend; Keras runs on {backend()!r}")

    def build_before_trace(self) -> None:
        """Builds what the first trace of the train step would otherwise
        build (and so trace twice), where the backend traces so; nothing
        elsewhere."""

    def hold_next_execution(self) -> None:
        """The next execution of this fit runs no step (the model stays as
        the last one left it): for a stop decided at a batch's begin
        (`reads_at_batch_begin`), before the loop runs that batch."""
        raise NotImplementedError(f"{type(self).__name__} reads at the batch ends")


def backend() -> str:
    """The Keras backend the models run on."""
    return keras.config.backend()


def recordable() -> Optional[tuple]:
    """The request kinds the backend's capture records (None: every kind)."""
    kinds = RECORDS.get(backend())
    return None if kinds is None else tuple(kinds)


def supported(owner: str, kind: Optional[str] = None) -> None:
    """Raises `UnsupportedBackendError` naming `owner` when the Keras
    backend has no capture, or one that does not record `kind` (a request
    kind, or what the owner needs, e.g. "taps"); for a constructor or the
    start of `fit`."""
    name = backend()
    if name not in CAPTURES:
        raise UnsupportedBackendError(
            f"{owner} records per optimizer step, which kerasdbg does on the Keras "
            f"backends {', '.join(sorted(CAPTURES))}; Keras runs on {name!r} "
            f"(KERAS_BACKEND). On {name} what works is {ELSEWHERE}.")
    kinds = RECORDS[name]
    if kind is not None and kinds is not None and kind not in kinds:
        raise UnsupportedBackendError(
            f"{owner} works on the TensorFlow backend only so far; Keras runs on {name!r} "
            f"(KERAS_BACKEND). On {name} kerasdbg records with "
            f"{', '.join(dict.fromkeys(kinds.values()))}, and {ELSEWHERE} work.")


_ENGINE_FOR: dict = {}  # backend -> its module's `engine_for`: asked at every batch


def engine_for(model) -> Capture:
    """The capture of `model`, created on first use, of the model's backend."""
    name = backend()
    function = _ENGINE_FOR.get(name)
    if function is None:
        supported("kerasdbg's capture")
        function = _ENGINE_FOR[name] = importlib.import_module(CAPTURES[name]).engine_for
    return function(model)
