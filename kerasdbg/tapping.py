"""`insert_taps` and `strip_debug_layers`: add or remove debug layers in a built model."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence, Set, Tuple, Union

import keras

from kerasdbg import _replay
from kerasdbg.layers._debug_layer import DebugLayer, check_backend
from kerasdbg.layers.tap_layer import TapLayer

LayerSelection = Union[None, str, Sequence[str], Callable[[keras.layers.Layer], bool]]
TapSpec = Union[None, keras.layers.Layer, type, Callable[[keras.layers.Layer, str], keras.layers.Layer]]

_ACTIVATIONS = {"relu": "relu", "relu6": "relu", "tanh": "tanh", "sigmoid": "sigmoid"}


def insert_taps(
    model: keras.Model,
    layers: LayerSelection = None,
    tap: TapSpec = None,
    name: Optional[str] = None,
) -> keras.Model:
    """Returns a Functional model with a tap after each selected layer.

    The new model calls the original layers (the weights are shared: training
    one trains the other) and adds, after each output of each selected layer,
    a `TapLayer` (or the layer `tap` makes) named `<layer>_tap`; a layer with
    several outputs (a list, a tuple, a dict) gets one tap per output, named
    by its place in the structure (`<layer>_tap_0`, `<layer>_tap_<key>`). Sequential,
    Functional and nested models are supported; a nested model is rebuilt with
    its taps inside (and keeps its name) only where it holds a selected layer.
    The model's output names are kept, so loss dicts and logs do not change.
    When the model is compiled, the new one is compiled alike and shares its
    optimizer (its step count and slots continue).

    A tap that is a `TapLayer` without an `activation` gets the activation of
    the layer it follows (relu and relu6 → "relu", tanh, sigmoid; also
    `keras.layers.ReLU` and `Activation` layers), for its health fraction.

    Args:
        model: a built Functional or Sequential model.
        layers: which layers to tap. None: every layer that is not an input,
            a model or a debug layer. A string: a regular expression searched
            in each layer's name and in its path `outer/inner/name` (nested
            models and inputs included). A list of names or paths: exactly
            those. A callable `layer -> bool`. Defaults to `None`.
        tap: None for `TapLayer()`; a `TapLayer`/`PrintLayer` instance used as
            a template (its config, with a new name); a layer class called as
            `cls(name=...)`; or a callable `factory(layer, name) -> Layer`.
            Defaults to `None`.
        name: name of the new model. Defaults to the model's name.

    Returns:
        The new model. The original is unchanged.

    Raises:
        TypeError: `model` is not a Keras model whose graph is visible
            (subclassed), or `layers` / `tap` has the wrong type.
        ValueError: a name in `layers` does not exist (the error lists the
            layers), `layers` selects nothing, or the model is not built.
        kerasdbg.errors.UnsupportedBackendError: the taps are kerasdbg's own
            (`tap` None, a `TapLayer` or `PrintLayer`) and Keras runs on a
            backend they do not record on (they record on TensorFlow and JAX; a
            layer of your own is inserted on every backend).

    Examples:
        >>> import keras, numpy as np
        >>> import kerasdbg
        >>> model = keras.Sequential([keras.Input((2,), name="x"),
        ...     keras.layers.Dense(3, activation="relu", name="hidden"),
        ...     keras.layers.Dense(1, name="out")], name="net")
        >>> tapped = kerasdbg.insert_taps(model, layers=["hidden"])
        >>> [layer.name for layer in tapped.layers]
        ['x', 'hidden', 'hidden_tap', 'out']
        >>> tapped.get_layer("hidden_tap").activation
        'relu'
        >>> _ = tapped(np.ones((4, 2)))
        >>> sorted(tapped.get_layer("hidden_tap").latest)[:3]
        ['dead_fraction', 'inf_count', 'max']
    """
    owner = "insert_taps"
    _replay.check_graph_model(owner, model)
    _check_tap(tap)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{owner}: `name` must be a string or None. Received: name={name!r}")
    if tap is None or (isinstance(tap, type) and issubclass(tap, DebugLayer)) \
            or isinstance(tap, DebugLayer):
        check_backend(owner)  # kerasdbg's own taps: one error before any rebuild
    selected = _replay.select_layers(owner, model, layers)
    replay = _TapReplay(selected, tap, _all_names(model))
    with _variables_scope(model):
        return _replay.copy_compile(model, replay.model(model, name=name))


def strip_debug_layers(model: keras.Model, name: Optional[str] = None) -> keras.Model:
    """Returns the model without its `PrintLayer`s and `TapLayer`s.

    Every debug layer is an identity, so the new model computes exactly what
    the original computes, with the same (shared) weights; use it for export
    (`model.export`, SavedModel, `.keras` files without kerasdbg). Nested
    models are rebuilt only where they hold debug layers. A Sequential model
    stays Sequential; a Functional one stays Functional. When the model is
    compiled, the new one is compiled alike and shares its optimizer.

    Args:
        model: a built Functional or Sequential model.
        name: name of the new model. Defaults to the model's name.

    Returns:
        The new model. The original is unchanged.

    Raises:
        TypeError: `model` is not a Keras model whose graph is visible.
        ValueError: the model is not built.

    Examples:
        >>> import keras
        >>> import kerasdbg
        >>> from kerasdbg.layers import TapLayer
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d"),
        ...     TapLayer(name="tap")], name="net")
        >>> [layer.name for layer in kerasdbg.strip_debug_layers(model).layers]
        ['d']
    """
    _replay.check_graph_model("strip_debug_layers", model)
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"strip_debug_layers: `name` must be a string or None. Received: name={name!r}"
        )
    replay = _StripReplay()
    if isinstance(model, keras.Sequential):
        inputs = _replay._model_inputs(model)
        if not model.built or len(inputs) != 1:
            raise ValueError(
                f"strip_debug_layers: Sequential model `{model.name}` is not built. Start "
                "it with `keras.Input(shape)` or call it on data first."
            )
        kept = [_replay.fresh_input(inputs[0])]
        for layer in model.layers:
            if isinstance(layer, DebugLayer):
                continue
            if _replay.is_graph_model(layer) and replay.descend(layer, (layer.name,)):
                layer = replay.model(layer, (layer.name,))
            kept.append(layer)
        stripped = keras.Sequential(kept, name=name or model.name, trainable=model.trainable)
    else:
        stripped = replay.model(model, name=name)
    return _replay.copy_compile(model, stripped)


# ------------------------------------------------------------ replays
class _TapReplay(_replay.SelectionReplay):
    def __init__(self, selected: Set[Tuple[tuple, int]], tap: TapSpec, names: Set[str]):
        super().__init__(selected)
        self._tap = tap
        self._names = set(names)

    def after_call(self, layer, path, outputs):
        if not self.is_selected(layer, path):
            return outputs
        flat = keras.tree.flatten_with_path(outputs)
        base = _replay.qualified_name(path, layer).replace("/", "_") + "_tap"
        tapped = []
        for place, tensor in flat:
            if not isinstance(tensor, keras.KerasTensor):
                tapped.append(tensor)
                continue
            # One tap per output, named by its place in the structure: the
            # key of a dict, the index in a list or tuple (`<layer>_tap_a_0`).
            suffix = "_".join(str(key).replace("/", "_") for key in place)
            tap_name = self._unique(base if len(flat) == 1 else f"{base}_{suffix}")
            tapped.append(_make_tap(self._tap, layer, tap_name)(tensor))
        return keras.tree.pack_sequence_as(outputs, tapped)

    def _unique(self, name: str) -> str:
        candidate, index = name, 1
        while candidate in self._names:
            candidate, index = f"{name}_{index}", index + 1
        self._names.add(candidate)
        return candidate


class _StripReplay(_replay.Replay):
    def skip(self, layer, path) -> bool:
        return isinstance(layer, DebugLayer)

    def descend(self, model, path) -> bool:
        return any(isinstance(layer, DebugLayer) for _, layer in _replay.walk(model))


# ------------------------------------------------------------ helpers
def _check_tap(tap) -> None:
    if tap is None or isinstance(tap, keras.layers.Layer):
        return
    if isinstance(tap, type):
        if issubclass(tap, keras.layers.Layer):
            return
    elif callable(tap):
        return
    raise TypeError(
        "insert_taps: `tap` must be None, a layer instance (a template), a layer class or "
        f"a callable `factory(layer, name) -> Layer`. Received: tap={tap!r}"
    )


def _variables_scope(model):
    """Where the taps' variables are made: beside the model's. On the
    TensorFlow backend, in the model's `tf.distribute` strategy's scope
    (unless one is entered already); elsewhere Keras places new variables
    itself (JAX's `keras.distribution` lays them out when they are made)."""
    strategy = getattr(model, "distribute_strategy", None)  # TensorFlow's trainer only
    if strategy is None:
        return contextlib.nullcontext()
    import tensorflow as tf  # loaded: the model runs on it

    return contextlib.nullcontext() if tf.distribute.has_strategy() else strategy.scope()


def _all_names(model) -> Set[str]:
    return {model.name} | {layer.name for _, layer in _replay.walk(model)}


def _activation(layer) -> Optional[str]:
    if isinstance(layer, keras.layers.ReLU):
        return None if float(layer.negative_slope) else "relu"
    function = getattr(layer, "activation", None)
    name = function if isinstance(function, str) else getattr(function, "__name__", None)
    return _ACTIVATIONS.get(name)


def _make_tap(tap: TapSpec, layer, name: str) -> keras.layers.Layer:
    activation = _activation(layer)
    if tap is None:
        return TapLayer(activation=activation, name=name)
    if isinstance(tap, type):
        kwargs = {"name": name}
        if issubclass(tap, TapLayer):
            kwargs["activation"] = activation
        return tap(**kwargs)
    if isinstance(tap, keras.layers.Layer):
        config = dict(tap.get_config(), name=name)
        if isinstance(tap, TapLayer) and config.get("activation") is None:
            config["activation"] = activation
        return type(tap).from_config(config)
    made = tap(layer, name)
    if not isinstance(made, keras.layers.Layer):
        raise TypeError(
            "insert_taps: the `tap` factory must return a keras layer. "
            f"Received: {made!r} for layer `{layer.name}`"
        )
    if isinstance(made, TapLayer) and made.activation is None and not made.built:
        made.activation = activation
    return made
