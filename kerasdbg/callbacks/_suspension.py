"""Other callbacks silenced for the rest of a fit (`StopOnRule`'s "stop").

A callback in `suspend` gets no further `on_train_batch_end`,
`on_epoch_end` or `on_train_end` in the fit: each hook is shadowed on the
instance by a no-op, and the shadow of `on_train_end` (the last hook of a
fit) removes the shadows again, so the callback works as before in the
next fit.
"""

from __future__ import annotations

from typing import Tuple

from kerasdbg.capture import keras_objects

SUSPENDED_HOOKS = ("on_train_batch_end", "on_epoch_end", "on_train_end")


def suspend_others(owner, kinds: Tuple[type, ...]) -> None:
    """Silences every callback of the fit running `owner.model`, other than
    `owner`, that is an instance of one of `kinds`."""
    callbacks = keras_objects.running_callbacks(owner.model)
    if callbacks is None or not kinds:
        return
    for callback in callbacks.callbacks:
        if callback is not owner and isinstance(callback, kinds):
            silence(callback)


def silence(callback) -> None:
    """Turns the callback's remaining hooks of this fit into no-ops.

    Its `on_train_end` (the last hook of a fit) removes the shadows again.
    """

    def nothing(*args, **kwargs):
        return None

    def last(*args, **kwargs):
        for hook in SUSPENDED_HOOKS:
            keras_objects.unpatch(callback, hook)

    for hook in SUSPENDED_HOOKS:
        keras_objects.unpatch(callback, hook)
        keras_objects.patch(callback, hook, last if hook == "on_train_end" else nothing)
