"""The largest logits of a train step: of each `MultiHeadAttention` layer's
attention, and of the model's output.

Growing attention logits precede the divergence of large transformers; the
largest one per step is the signal large-model training logs. Keras's
`MultiHeadAttention` computes its logits inside `_compute_attention`, and
with `ops.dot_product_attention` (its default without dropout) never
materialises them. While a train step is traced, `attention_logits` routes
each such layer's `_compute_attention` (an instance attribute, removed after
the trace: the layer is left as it was found) through a function that runs
it as it is and also computes the largest logit from the same projected
query and key: `max(q k^T / sqrt(key_dim))` over the positions the mask (and
the causal mask) lets through, under `tf.stop_gradient`. That is one more
`q k^T` product per layer and step where Keras used `dot_product_attention`
(in the explicit path, TensorFlow's graph optimizer may merge it with
Keras's own).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List

import keras
import tensorflow as tf


ROUTED = "_compute_attention"
"""The `MultiHeadAttention` method whose arguments are the projected query,
key and value (Keras's documented override point)."""


def attention_layers(model) -> List[keras.layers.MultiHeadAttention]:
    """The model's `MultiHeadAttention` layers (nested ones included), each once."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.MultiHeadAttention)]


def _largest_logit(layer, query, key, value, attention_mask, use_causal_mask):
    """The largest attention logit (float64 scalar) of one call, over the
    positions its masks let through; -inf when there is none."""
    query = tf.stop_gradient(query)
    key = tf.stop_gradient(key)
    scaled = query * tf.cast(layer._inverse_sqrt_key_dim, query.dtype)
    scores = tf.cast(tf.einsum(layer._dot_product_equation, key, scaled), tf.float32)
    keep = None
    if attention_mask is not None:
        keep = tf.cast(attention_mask, tf.bool)
        # The mask is [B, T, S]; the scores [B, N, T, S] (the heads' axis before).
        for _ in range(len(scores.shape) - len(keep.shape)):
            keep = tf.expand_dims(keep, axis=-len(layer._attention_axes) * 2 - 1)
    if use_causal_mask:
        causal = tf.cast(layer._compute_causal_mask(query, value), tf.bool)
        for _ in range(len(scores.shape) - len(causal.shape)):
            causal = tf.expand_dims(causal, axis=-len(layer._attention_axes) * 2 - 1)
        keep = causal if keep is None else tf.logical_and(keep, causal)
    if keep is not None:
        scores = tf.where(keep, scores, tf.constant(-float("inf"), scores.dtype))
    return tf.cast(tf.reduce_max(scores), tf.float64)


_TLS = threading.local()  # `found` of the train step this thread traces
_LOCK = threading.Lock()
_ROUTED: Dict[int, list] = {}
"""id(layer) -> [layer, the instance's own `_compute_attention` or None, how
many traces route it]: the replicas of a `MirroredStrategy` trace their steps
at once, each in its thread, through one route per layer."""


def _route(layer, original):
    """`_compute_attention` run as Keras calls it (a subclass's override of
    the older signature too: the arguments go through untouched), adding the
    largest logit of each call to the tracing thread's `found`."""

    def compute(*args, **kwargs):
        result = original(*args, **kwargs)
        found = getattr(_TLS, "found", None)
        if found is None:  # not inside a train step kerasdbg traces
            return result
        named = dict(zip(("query", "key", "value", "attention_mask", "training",
                          "return_attention_scores", "use_causal_mask"), args))
        named.update(kwargs)
        query, key = named.get("query"), named.get("key")
        if query is not None and key is not None and len(query.shape) == 4 \
                and len(key.shape) == 4:
            found.setdefault(layer.path, []).append(_largest_logit(
                layer, query, key, named.get("value"), named.get("attention_mask"),
                bool(named.get("use_causal_mask", False))))
        return result

    return compute


@contextlib.contextmanager
def attention_logits(model, found: Dict[str, list]):
    """While active (a trace of the train step), every call of each of the
    model's `MultiHeadAttention` layers appends its largest logit to
    `found[<layer path>]`; after the last trace, each layer is as it was."""
    layers = attention_layers(model)
    previous = getattr(_TLS, "found", None)
    _TLS.found = found
    with _LOCK:
        for layer in layers:
            entry = _ROUTED.get(id(layer))
            if entry is None:
                own = vars(layer).get(ROUTED)
                object.__setattr__(layer, ROUTED, _route(layer, getattr(layer, ROUTED)))
                _ROUTED[id(layer)] = [layer, own, 1]
            else:
                entry[2] += 1
    try:
        yield
    finally:
        _TLS.found = previous
        with _LOCK:
            for layer in layers:
                entry = _ROUTED.get(id(layer))
                if entry is None:
                    continue
                entry[2] -= 1
                if entry[2] == 0:
                    del _ROUTED[id(layer)]
                    if entry[1] is not None:
                        object.__setattr__(layer, ROUTED, entry[1])  # the user's own, back
                    elif ROUTED in vars(layer):
                        object.__delattr__(layer, ROUTED)


def largest_output(y_pred):
    """The largest value of the model's float outputs (float64 scalar), or None."""
    tensors = [t for t in tf.nest.flatten(y_pred)
               if tf.is_tensor(t) and t.dtype.is_floating]
    if not tensors:
        return None
    return tf.cast(tf.reduce_max(tf.stack([tf.reduce_max(tf.cast(tf.stop_gradient(t),
                                                                 tf.float32))
                                           for t in tensors])), tf.float64)
