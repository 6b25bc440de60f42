"""`MultiOutputModel`: a model's outputs plus chosen intermediate activations."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import keras

from kerasdbg import _replay


class _ExposeReplay(_replay.SelectionReplay):
    def after_call(self, layer, path, outputs):
        if self.is_selected(layer, path):
            self.expose(_replay.qualified_name(path, layer), outputs)
        return outputs


@keras.saving.register_keras_serializable(package="kerasdbg")
class MultiOutputModel(keras.Model):
    """Wraps a model so that it also returns chosen intermediate outputs.

    `predict` and calls return `(outputs, intermediates)`: the wrapped model's
    outputs, in their structure, and a dict from layer name (`outer/inner/name`
    for a layer of a nested model) to that layer's output. `fit` and
    `evaluate` train and score the wrapped model's outputs only, with the
    `compile()` losses and metrics written for the wrapped model: the weights
    after `fit` are those that training the wrapped model gives. The layers
    and weights are the wrapped model's own (shared, not copied). When the
    wrapped model is compiled, the wrapper is compiled alike and shares its
    optimizer.

    The intermediates are computed in the same forward pass, so `fit` costs
    what it costs without the wrapper; only `predict` returns more data.

    Args:
        model: a built Functional or Sequential model.
        outputs: the layers whose outputs to expose: None for every layer
            that is not an input, a model or a debug layer; a regular expression
            searched in layer names and paths, a list of names or paths, or a
            callable `layer -> bool` (as `insert_taps`'s `layers`).
        **kwargs: `keras.Model` arguments (`name`, ...). The name defaults to
            `<model name>_multi_output`.

    Raises:
        TypeError: `model` is not a Functional or Sequential model, or
            `outputs` has the wrong type.
        ValueError: a name in `outputs` does not exist (the error lists the
            layers), or `outputs` selects nothing.

    Examples:
        >>> import keras, numpy as np
        >>> import kerasdbg
        >>> model = keras.Sequential([keras.Input((2,)),
        ...     keras.layers.Dense(3, activation="relu", name="hidden"),
        ...     keras.layers.Dense(1, name="out")], name="net")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> wrapped = kerasdbg.MultiOutputModel(model, outputs=["hidden"])
        >>> _ = wrapped.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=1, verbose=0)
        >>> out, intermediates = wrapped.predict(np.ones((4, 2)), verbose=0)
        >>> out.shape, intermediates["hidden"].shape
        ((4, 1), (4, 3))
    """

    def __init__(
        self,
        model: keras.Model,
        outputs: Union[None, str, Sequence[str], Callable[[keras.layers.Layer], bool]],
        **kwargs: Any,
    ):
        owner = type(self).__name__
        _replay.check_graph_model(owner, model)
        kwargs.setdefault("name", f"{model.name}_multi_output")
        super().__init__(**kwargs)
        selected = _replay.select_layers(owner, model, outputs, argument="outputs")
        replay = _ExposeReplay(selected)
        inputs, original, extras = replay.rebuild(model)
        self._graph = keras.Model(inputs, (original, dict(extras)), name=f"{model.name}_graph")
        # Kept out of Keras's tracking: its layers are the graph's layers.
        object.__setattr__(self, "_wrapped", model)
        self.intermediate_names: Tuple[str, ...] = tuple(extras)
        self._selection = [
            _replay.qualified_name(path, layer) for path, layer in _replay.walk(model)
            if (path, id(layer)) in selected
        ]
        self.output_names = _replay.output_names(model)
        self.built = True
        _replay.copy_compile(model, self)

    @property
    def wrapped_model(self) -> keras.Model:
        """The model this one wraps (it shares its layers)."""
        return self._wrapped

    def call(self, inputs, training: Optional[bool] = None):
        return self._graph(inputs, training=training)

    # Losses and metrics see the wrapped model's outputs only.
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(
            x=x, y=y, y_pred=self._original(y_pred), sample_weight=sample_weight,
            training=training,
        )

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, self._original(y_pred), sample_weight=sample_weight)

    @staticmethod
    def _original(y_pred):
        if isinstance(y_pred, (tuple, list)) and len(y_pred) == 2 and isinstance(y_pred[1], dict):
            return y_pred[0]
        return y_pred

    def get_config(self) -> dict:
        model = keras.saving.serialize_keras_object(self._wrapped)
        # The wrapper's own compile config is saved; a second one would load
        # a second optimizer.
        model.pop("compile_config", None)
        return {
            "name": self.name,
            "trainable": self.trainable,
            "model": model,
            "outputs": list(self._selection),
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        return cls(model, **config)
