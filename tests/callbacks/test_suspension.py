"""Other callbacks silenced for the rest of a fit, called directly; the fit
in which `StopOnRule` stops and spares the backups is in
tests/callbacks/test_stop_on_rule.py."""

import keras

from kerasdbg.callbacks._suspension import SUSPENDED_HOOKS, silence


class _Counting(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append("on_train_batch_end")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append("on_epoch_end")

    def on_train_end(self, logs=None):
        self.calls.append("on_train_end")


def test_a_silenced_callback_skips_the_rest_of_the_fit_and_hears_the_next():
    callback = _Counting()
    silence(callback)
    silence(callback)  # twice in a fit: still one set of shadows
    callback.on_train_batch_end(0)
    callback.on_epoch_end(0)
    callback.on_train_end()
    assert callback.calls == []
    assert not set(SUSPENDED_HOOKS) & set(vars(callback))
    callback.on_train_batch_end(0)
    callback.on_epoch_end(0)
    callback.on_train_end()
    assert callback.calls == ["on_train_batch_end", "on_epoch_end", "on_train_end"]
