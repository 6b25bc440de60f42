"""Rebuilds a Keras model call by call, sharing its layers and weights.

`insert_taps`, `strip_debug_layers` and `MultiOutputModel` all need the same
thing: the model's graph replayed on fresh inputs, with a say over each layer
call (add a layer after it, skip it, expose its output). A `Replay` subclass
overrides the hooks; nested Functional and Sequential models are rebuilt only
where `descend` says so, and are otherwise called as they are.
"""

from __future__ import annotations

import re
import warnings
from typing import Dict, List, Set, Tuple

import keras

from kerasdbg import _keras_graph

Path = Tuple[str, ...]


def is_graph_model(layer) -> bool:
    """Whether kerasdbg can see inside `layer` (a Functional or Sequential model)."""
    return isinstance(layer, keras.Sequential) or _keras_graph.is_functional(layer)


def walk(model, path: Path = ()):
    """Yields `(path, layer)` for every layer of `model`, nested models included.

    `path` is the tuple of names of the models that hold the layer; input
    layers come first in each model.
    """
    layers = _sequential_layers(model) if isinstance(model, keras.Sequential) else model.layers
    for layer in layers:
        yield path, layer
        if is_graph_model(layer):
            yield from walk(layer, path + (layer.name,))


def _sequential_layers(model) -> List[keras.layers.Layer]:
    inputs = [_keras_graph.producing_layer(x) for x in _model_inputs(model)] if model.built else []
    return inputs + list(model.layers)


def _model_inputs(model) -> list:
    try:
        return list(model.inputs)
    except (AttributeError, ValueError):
        return []


def _model_outputs(model) -> list:
    try:
        return list(model.outputs)
    except (AttributeError, ValueError):
        return []


def output_names(model) -> List[str]:
    """The names Keras gives the model's outputs (losses and logs use them)."""
    names = list(getattr(model, "output_names", None) or [])
    return names or [_keras_graph.producing_layer(x).name for x in _model_outputs(model)]


def fresh_input(keras_tensor):
    """A new `keras.Input` like `keras_tensor`, named after its input layer."""
    return keras.Input(
        batch_shape=keras_tensor.shape, dtype=keras_tensor.dtype,
        name=_keras_graph.producing_layer(keras_tensor).name,
    )


def qualified_name(path: Path, layer) -> str:
    """`outer/inner/layer` for a layer of a nested model, else the layer's name."""
    return "/".join(path + (layer.name,))


def recordable_layers(model) -> List[str]:
    """Qualified names of the layers whose outputs a replay can record
    (`StepRecorder`): every layer of a Functional or Sequential model but
    its inputs."""
    if not is_graph_model(model):
        return []
    return [qualified_name(path, layer) for path, layer in walk(model)
            if not isinstance(layer, keras.layers.InputLayer)]


class Replay:
    """Replays a Functional or Sequential model on new inputs.

    Hooks, called once per layer call in graph order:

    - `on_input(layer, path, tensor)` for each input, returns the tensor fed on;
    - `skip(layer, path)`: when true, the call is replaced by its first input;
    - `after_call(layer, path, outputs)` returns what flows on;
    - `descend(model, path)`: rebuild a nested model (else call it as it is).

    `expose(name, tensor)` during a hook makes `tensor` an extra output, carried
    out of nested models; `rebuild` returns the outputs and these extras.
    """

    def on_input(self, layer, path: Path, tensor):
        return tensor

    def skip(self, layer, path: Path) -> bool:
        return False

    def after_call(self, layer, path: Path, outputs):
        return outputs

    def descend(self, model, path: Path) -> bool:
        return True

    def __init__(self):
        self._frames: List[Dict[str, object]] = []
        self._rebuilt: Dict[int, keras.Model] = {}

    def expose(self, name: str, tensor) -> None:
        frame = self._frames[-1]
        key, index = name, 1
        while key in frame:
            key, index = f"{name}_{index}", index + 1
        frame[key] = tensor

    # ------------------------------------------------------------ rebuild
    def rebuild(self, model, path: Path = ()):
        """Returns `(inputs, outputs, extras)` of `model` replayed on new inputs."""
        self._frames.append({})
        try:
            if isinstance(model, keras.Sequential):
                inputs, outputs = self._sequential(model, path)
            else:
                inputs, outputs = self._functional(model, path)
            return inputs, outputs, self._frames[-1]
        finally:
            self._frames.pop()

    def model(self, model, path: Path = (), name=None) -> keras.Model:
        """The rebuilt model; its outputs are `(outputs, extras)` when there are extras."""
        inputs, outputs, extras = self.rebuild(model, path)
        rebuilt = keras.Model(
            inputs, (outputs, dict(extras)) if extras else outputs, name=name or model.name,
        )
        rebuilt._kerasdbg_extras = bool(extras)
        names = output_names(model)
        if not extras and len(names) == len(rebuilt.output_names):
            # A tap after an output layer would otherwise rename the output
            # (loss dicts and logs use these names).
            rebuilt.output_names = names
        return rebuilt

    def _fresh_inputs(self, structure, path: Path):
        fresh = keras.tree.map_structure(fresh_input, structure)
        fed = [
            self.on_input(_keras_graph.producing_layer(old), path, new)
            for old, new in zip(keras.tree.flatten(structure), keras.tree.flatten(fresh))
        ]
        return fresh, fed

    def _sequential(self, model, path: Path):
        originals = _model_inputs(model)
        if not model.built or len(originals) != 1:
            raise ValueError(
                f"Sequential model `{model.name}` is not built, so its graph is "
                "unknown. Start it with `keras.Input(shape)` or call it on data first."
            )
        fresh, fed = self._fresh_inputs(originals[0], path)
        x = fed[0]
        for layer in model.layers:
            x = self._call(layer, path, (x,), {})
        return fresh, x

    def _functional(self, model, path: Path):
        fresh, fed = self._fresh_inputs(model.input, path)
        outputs = _keras_graph.run_graph(
            model, fed, lambda layer, *args, **kwargs: self._call(layer, path, args, kwargs)
        )
        return fresh, outputs

    def _call(self, layer, path: Path, args, kwargs):
        if self.skip(layer, path):
            return args[0]
        inner = path + (layer.name,)
        if is_graph_model(layer) and self.descend(layer, inner):
            if id(layer) not in self._rebuilt:
                # A nested model called twice stays one (shared) model.
                self._rebuilt[id(layer)] = self.model(layer, inner)
            nested = self._rebuilt[id(layer)]
            outputs = nested(*args, **kwargs)
            if nested._kerasdbg_extras:
                outputs, extras = outputs
                for key, value in extras.items():
                    self.expose(key, value)
        else:
            outputs = layer(*args, **kwargs)
        return self.after_call(layer, path, outputs)


def call_layer_by_layer(model, inputs, training, on_output, path: Path = ()):
    """Runs a Functional or Sequential `model` on real tensors, layer call by
    layer call, and calls `on_output(qualified name, outputs)` after each one
    (first for each input, with the input layer's name), in graph order.

    Nested graph models are run the same way; `training` is passed to the
    layers that take it, as Keras does. Returns the model's outputs.
    """

    def call(layer, args, kwargs, path=path):
        if is_graph_model(layer):
            outputs = call_layer_by_layer(layer, args[0], training, on_output,
                                          path + (layer.name,))
        elif is_debug_layer(layer):
            # An identity: a replay neither records nor counts the batch again.
            outputs = args[0]
        else:
            if _keras_graph.takes_training(layer):
                kwargs = dict(kwargs, training=training)
            outputs = layer(*args, **kwargs)
        on_output(qualified_name(path, layer), outputs)
        return outputs

    if not path:
        # Under a scope of kerasdbg's own: a layer's scope is its name, which
        # Keras accepts inside a model's scope but TensorFlow refuses at the
        # root of a graph ("'_d' is not a valid root scope name").
        with keras.name_scope("kerasdbg_replay"):
            return _call_graph(model, inputs, on_output, path, call)
    return _call_graph(model, inputs, on_output, path, call)


def _call_graph(model, inputs, on_output, path: Path, call):
    if isinstance(model, keras.Sequential):
        originals = _model_inputs(model)
        if originals:
            on_output(qualified_name(path, _keras_graph.producing_layer(originals[0])), inputs)
        x = inputs
        for layer in model.layers:
            x = call(layer, (x,), {})
        return x
    for tensor, flat in zip(model.inputs, _keras_graph.standardize_inputs(model, inputs)):
        on_output(qualified_name(path, _keras_graph.producing_layer(tensor)), flat)
    return _keras_graph.run_graph_on_data(
        model, inputs, lambda layer, *args, **kwargs: call(layer, args, kwargs))


class SelectionReplay(Replay):
    """A replay that acts after the layers of `selected` (see `select_layers`).

    It descends only into nested models that hold a selected layer, and
    treats a selected input layer like a layer call (its tensor goes through
    `after_call`).
    """

    def __init__(self, selected: Set[Tuple[Path, int]]):
        super().__init__()
        self.selected = selected

    def is_selected(self, layer, path: Path) -> bool:
        return (path, id(layer)) in self.selected

    def descend(self, model, path: Path) -> bool:
        return any(p[: len(path)] == path for p, _ in self.selected)

    def on_input(self, layer, path: Path, tensor):
        return self.after_call(layer, path, tensor)


def check_graph_model(owner: str, model) -> None:
    """Raises unless `model` is a Functional or Sequential model."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"{owner}: `model` must be a keras.Model. Received: {type(model).__name__}")
    if not is_graph_model(model):
        raise TypeError(
            f"{owner}: `model` must be a Functional or Sequential model; the graph of "
            f"the subclassed model `{model.name}` ({type(model).__name__}) is not "
            "visible. Put `kerasdbg.layers.TapLayer` calls in its `call()` instead."
        )


def is_debug_layer(layer) -> bool:
    """Whether `layer` is one of kerasdbg's debug layers (`TapLayer`,
    `PrintLayer`), by the class attribute they set (the capture does not
    import the layers)."""
    return bool(getattr(type(layer), "kerasdbg_debug_layer", False))


def select_layers(owner: str, model, layers, argument: str = "layers") -> Set[Tuple[Path, int]]:
    """`(path, id(layer))` of the layers that `layers` selects (see `insert_taps`).

    `argument` is the name of the user's argument, for the errors.
    """
    entries = list(walk(model))

    def tappable(layer) -> bool:
        return not is_debug_layer(layer)

    if layers is None:
        chosen = [
            (path, layer) for path, layer in entries
            if tappable(layer) and not isinstance(layer, keras.layers.InputLayer)
            and not is_graph_model(layer)
        ]
    elif isinstance(layers, str):
        try:
            pattern = re.compile(layers)
        except re.error as error:
            raise ValueError(
                f"{owner}: `{argument}` is not a valid regular expression ({error}). "
                f"Received: {argument}={layers!r}"
            ) from None
        chosen = [
            (path, layer) for path, layer in entries
            if tappable(layer) and (
                pattern.search(layer.name) or pattern.search(qualified_name(path, layer))
            )
        ]
    elif isinstance(layers, (list, tuple)) and all(isinstance(item, str) for item in layers):
        available = {}
        for path, layer in entries:
            available.setdefault(layer.name, []).append((path, layer))
            if path:
                available.setdefault(qualified_name(path, layer), []).append((path, layer))
        unknown = [item for item in layers if item not in available]
        if unknown:
            raise ValueError(
                f"{owner}: no layer named {', '.join(repr(item) for item in unknown)} in "
                f"`{model.name}`. Layers: {_listing(entries)}"
            )
        chosen = [entry for item in layers for entry in available[item]]
    elif callable(layers):
        chosen = [(path, layer) for path, layer in entries if tappable(layer) and layers(layer)]
    else:
        raise TypeError(
            f"{owner}: `{argument}` must be None, a regular expression, a list of layer names "
            f"or a callable `layer -> bool`. Received: {argument}={layers!r}"
        )
    if not chosen:
        raise ValueError(
            f"{owner}: `{argument}` selects no layer of `{model.name}`. Received: "
            f"{argument}={layers!r}. Layers: {_listing(entries)}"
        )
    return {(path, id(layer)) for path, layer in chosen}


def _listing(entries) -> str:
    return ", ".join(qualified_name(path, layer) for path, layer in entries)


def copy_compile(original: keras.Model, rebuilt: keras.Model) -> keras.Model:
    """Compiles `rebuilt` like `original` (sharing the optimizer), if it was compiled."""
    if not getattr(original, "compiled", False):
        return rebuilt
    try:
        config = keras.saving.deserialize_keras_object(original.get_compile_config())
        config["optimizer"] = original.optimizer
        rebuilt.compile(**config)
    except Exception as error:  # noqa: BLE001 - e.g. an unregistered custom loss
        warnings.warn(
            f"kerasdbg: `{original.name}` is compiled but its compile() arguments could "
            f"not be copied ({type(error).__name__}: {error}); compile the new model "
            "yourself.",
            stacklevel=3,
        )
    return rebuilt
