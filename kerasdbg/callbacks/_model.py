"""The model a kerasdbg callback instruments, read without a state sync."""

from __future__ import annotations


class ModelWithoutSync:
    """Mixin of kerasdbg's callbacks: `self.model` is the model `set_model`
    gave, without the state sync that `keras.callbacks.Callback.model` does
    on the JAX backend.

    During an epoch Keras's JAX trainer keeps the live variables in its own
    state. `Callback.model` writes that state back into every variable of the
    model (`jax_state_sync`) at each access, and the next step takes it back:
    about a millisecond per step for a small model, for every access in a
    batch hook (a 3-layer MLP whose plain step took 0.47 ms on CPU took
    1.46 ms with `GradientStatistics` and `WeightStatistics`, most of it in
    those syncs). kerasdbg's callbacks never read the model's variables
    during an epoch: the capture reads what it needs in the step, and
    `kerasdbg.capture.keras_objects.current_value` reads the live state.
    Keras syncs the state itself before `on_epoch_end` and at the end of
    `fit`.
    """

    @property
    def model(self):
        return self._model
