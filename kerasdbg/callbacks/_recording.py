"""What every kerasdbg callback that writes records shares."""

from __future__ import annotations

import os
import re
import warnings
from typing import Callable, Optional

import keras

from kerasdbg import _events, _workers
from kerasdbg.callbacks._copies import CopiedAsNew


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
        writer = _events.writer_for(path, key=callback)
        writer.attach(callback, owner, strict)
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


def release_writer(callback, writer: Optional[_events.EventWriter]) -> None:
    """Ends `callback`'s fit on `writer`: flushes it, and says a failure
    that was not said yet."""
    if writer is not None:
        writer.flush()
        writer.detach(callback)


class RecordingCallback(CopiedAsNew, keras.callbacks.Callback):
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
