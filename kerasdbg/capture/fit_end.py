"""Whatever way a `fit` ends, what kerasdbg changed on the model is put back.

Keras calls no callback when `fit` raises (no `on_train_end`), so every
`Model.fit` of the backend's trainer is wrapped once
(`keras_objects.wrap_fit`): the cleanups registered for the model while the
fit ran (`on_fit_end`) run as it returns or unwinds, KeyboardInterrupt
included.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable

from kerasdbg.capture import keras_objects

_CLEANUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def on_fit_end(model, key, cleanup: Callable[[], None], last: bool = False) -> None:
    """Runs `cleanup()` when the running `fit` of `model` ends, however it
    ends, unless `cancel_fit_end(model, key)` came first. The cleanups run in
    the order they were registered, those registered with `last=True` after
    all the others (a wrapper given back after whatever restores what it
    wraps)."""
    install()
    _CLEANUPS.setdefault(model, {})[key] = (cleanup, last)


def cancel_fit_end(model, key) -> None:
    """Forgets the cleanup `on_fit_end(model, key, ...)` registered, if any."""
    cleanups = _CLEANUPS.get(model)
    if cleanups is not None:
        cleanups.pop(key, None)


def _after_fit(model) -> None:
    cleanups = _CLEANUPS.pop(model, None) if model in _CLEANUPS else None
    if cleanups is None:
        return
    ordered = [(key, cleanup) for key, (cleanup, last) in cleanups.items() if not last] + \
        [(key, cleanup) for key, (cleanup, last) in cleanups.items() if last]
    for key, cleanup in ordered:
        try:
            cleanup()
        except Exception as error:  # noqa: BLE001 - the fit's own outcome comes first
            warnings.warn(f"kerasdbg could not restore the model after fit ({key}): "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)


def install() -> None:
    """Wraps the trainer's `fit` (idempotent). Called when `kerasdbg.capture`
    is imported, before any callback of kerasdbg exists: the `fit` that
    first uses one has resolved `Model.fit` before its callbacks run."""
    keras_objects.wrap_fit(_after_fit)
