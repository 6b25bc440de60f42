"""What every kerasdbg callback that writes records shares."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import uuid
import warnings
import weakref
from typing import Callable, Optional

import keras
import numpy as np

from kerasdbg import capture as _capture
from kerasdbg.sinks import events as _events
from kerasdbg.sinks import workers as _workers
from kerasdbg.capture import keras_objects
from kerasdbg.callbacks._copies import CopiedAsNew
from kerasdbg.callbacks._model import ModelWithoutSync


def selected(name: str, include: Optional[str], exclude: Optional[str]) -> bool:
    """Whether `name` passes the `include` / `exclude` regular expressions."""
    return (include is None or re.search(include, name) is not None) and (
        exclude is None or re.search(exclude, name) is None
    )


def open_writer(callback, log_dir: str, strict: bool,
                strategy=None) -> Optional[_events.EventWriter]:
    """The shared event writer of `<log_dir>/train`, with `callback` attached
    to it for this fit (release it with `release_writer`). A directory that
    cannot be written (no permission, a full disk) gives a writer that
    failed: the failure is said once, in one warning naming every callback
    of the fit that writes there, and the callbacks keep their records in
    Python only; training goes on. `strict` raises a `RecordingError`
    instead, whose cause is the error of the system.

    Under a multi-worker `strategy`, None on a worker other than the chief
    (`<log_dir>/worker_<i>/train` with per-worker output): the records are
    the same on every worker and one writer is enough."""
    owner = type(callback).__name__
    log_dir = _workers.directory(log_dir, strategy, owner)
    if log_dir is None:
        return None
    path = os.path.join(log_dir, "train")
    try:
        path = run_of(callback.model, log_dir)
        writer = _events.writer_for(path, key=callback)
        writer.attach(callback, owner, strict)
        if callback.model is not None:
            # A fit that raises runs no on_train_end: the writer forgets the
            # callback then, or a later fit would answer for it (strict).
            _capture.on_fit_end(callback.model, (callback, "writer"),
                                lambda: writer.forget(callback))
        return writer
    except _events.RecordingError:
        raise
    except Exception as error:  # noqa: BLE001 - tf.errors of every kind
        if strict:
            raise _events.RecordingError([owner], _events.EVENTS, path, error) from error
        warnings.warn(
            f"{owner} cannot write TensorBoard events to {path!r} (`log_dir`): "
            f"{type(error).__name__}: {error}. It keeps its records in Python only; "
            "training goes on.", RuntimeWarning, stacklevel=3)
        return None


# model -> a token naming it in run markers (a model is never compared by value).
_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# model -> (the fit's callback list, weakly; the fingerprint): computed once per fit.
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _token(model) -> str:
    try:
        token = _TOKENS.get(model)
        if token is None:
            token = _TOKENS[model] = uuid.uuid4().hex
        return token
    except TypeError:  # not weakly referable
        return f"id{id(model)}"


def _resuming(callbacks) -> bool:
    """Whether a `BackupAndRestore` of this fit will restore a backup (after
    this callback's `on_train_begin`, when it comes later in the list)."""
    for callback in getattr(callbacks, "callbacks", None) or ():
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            if os.path.exists(str(getattr(callback, "_weights_path", ""))):
                return True
    return False


def _fingerprint(model) -> str:
    """Of the model's weights and its optimizers' configurations."""
    digest = hashlib.sha256()
    for variable in model.weights:
        value = keras_objects.host_value(variable)
        digest.update(f"{variable.path}{value.shape}{value.dtype}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    for name, optimizer in keras_objects.find_optimizers(model):
        try:
            config = optimizer.get_config()
        except Exception:  # noqa: BLE001 - an optimizer of the user's own
            config = {}
        digest.update(json.dumps([name, type(optimizer).__name__, config], sort_keys=True,
                                 default=lambda o: type(o).__name__).encode())
    return digest.hexdigest()[:32]


def run_of(model, log_dir: str) -> str:
    """The run directory of `model`'s training under `log_dir`
    (`_events.run_directory`): `<log_dir>/train`, or `<log_dir>/train-<k>`
    when that holds another training, said once (printed, as information)."""
    if model is None:
        return os.path.join(log_dir, "train")
    steps = [int(keras_objects.host_value(keras_objects.raw_iterations(o)))
             for _, o in keras_objects.find_optimizers(model)]
    step = max(steps) if steps else 0
    callbacks = keras_objects.running_callbacks(model)
    fresh = step == 0 and not _resuming(callbacks)
    fingerprint = None
    if fresh:
        cached = _FINGERPRINTS.get(model) if callbacks is not None else None
        if cached is not None and cached[0]() is callbacks:
            fingerprint = cached[1]
        else:
            fingerprint = _fingerprint(model)
            if callbacks is not None:
                _FINGERPRINTS[model] = (weakref.ref(callbacks), fingerprint)
    training = _events.Training(model=_token(model), name=str(getattr(model, "name", "")),
                                fresh=fresh, fingerprint=fingerprint)
    path, note = _events.run_directory(log_dir, training)
    if note and _workers.writes(getattr(model, "distribute_strategy", None)):
        print(f"kerasdbg: {note}", file=sys.stdout, flush=True)
    return path


def release_writer(callback, writer: Optional[_events.EventWriter]) -> None:
    """Ends `callback`'s fit on `writer`: flushes it, and says a failure
    that was not said yet."""
    if writer is not None:
        if callback.model is not None:
            _capture.cancel_fit_end(callback.model, (callback, "writer"))
        writer.flush()
        writer.detach(callback)


class RecordingCallback(ModelWithoutSync, CopiedAsNew, keras.callbacks.Callback):
    """Base of the callbacks that hand records to a writer and to `history`.

    Subclasses keep `log_dir` (or another `destination`) and `strict` as
    attributes and return their constructor arguments from `get_config`.
    """

    log_dir: Optional[str] = None
    strict: bool = False

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)

    def _open_writer(self) -> Optional[_events.EventWriter]:
        """The shared writer of `<log_dir>/train`, or None without a log dir
        or when it cannot be opened (a warning says why, unless `strict`)."""
        self._failed = False
        if self.log_dir is None:
            return None
        return open_writer(self, self.log_dir, self.strict,
                           getattr(self.model, "distribute_strategy", None))

    @property
    def destination(self) -> Optional[str]:
        """Where the records go, for messages."""
        return self.log_dir

    def _guarded(self, write: Callable[..., None], *args, **kwargs) -> None:
        """Runs `write(*args, **kwargs)`; a failure warns once and training goes on."""
        try:
            write(*args, **kwargs)
        except _events.RecordingError:
            raise  # a shared writer failed and a callback writing there is strict
        except Exception as error:  # noqa: BLE001 - the sink must not stop fit
            if self.strict:
                raise _events.RecordingError(
                    [type(self).__name__], "its records to", str(self.destination),
                    error) from error
            if not getattr(self, "_failed", False):
                self._failed = True
                where = f" to {self.destination}" if self.destination else ""
                warnings.warn(
                    f"{type(self).__name__} could not record: it could not write its "
                    f"records{where}; training goes on. Cause: {type(error).__name__}: {error}",
                    RuntimeWarning,
                    stacklevel=3,
                )
