"""What `kerasdbg.doctor` reads of a `tf.data` pipeline (its private chain of
datasets, a map's function, the batch size)."""

from __future__ import annotations

import tensorflow as tf


def dataset_chain(dataset) -> list:
    """The datasets of a `tf.data` pipeline, last transformation first
    (following the private `_input_dataset` of each unary dataset)."""
    chain = []
    while dataset is not None and len(chain) < 1000:
        chain.append(dataset)
        dataset = getattr(dataset, "_input_dataset", None)
    return chain


def map_function_ops(dataset) -> list:
    """The op types of a map dataset's function, or [] for another dataset."""
    function = getattr(dataset, "_map_func", None)
    graph = getattr(getattr(function, "function", None), "graph", None)
    return [op.type for op in graph.get_operations()] if graph is not None else []


def dataset_batch_size(dataset):
    """The batch size of the last `batch` in a `tf.data` pipeline, or None."""
    for d in dataset_chain(dataset):
        size = getattr(d, "_batch_size", None)
        if size is not None:
            try:
                return int(tf.get_static_value(size))
            except (TypeError, ValueError):
                return None
    return None
