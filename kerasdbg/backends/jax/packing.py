"""The records of a jitted step, packed into two arrays for the host.

kerasdbg's JAX step returns its records as a dict of small arrays (a loss,
a step number, a row of statistics per request, ...). Each output array of
a jitted function costs the host a little on every call (an array object
made, later a transfer of its own), and a step returns a dozen or more: on
a GPU, where a small model's step takes a millisecond, that is a cost of the
order of the step. `packed` wraps the step so that its records leave it as
two arrays (the floating-point values, the integers and booleans), and
`unpack` gives the host the same dict back, after one transfer;
`fetch_columns` gives a read's steps back as one array per record.

The layout (which key, where, what shape and dtype) is known when the step
is traced; each call's records carry the layout of the trace that made them
(a step traced again, for a last partial batch, has its own).
"""

from __future__ import annotations

import functools
from typing import Dict, List, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

PACKED = "packed/arrays"
"""The key of the packed arrays in a step's records (with `LAYOUT`)."""
LAYOUT = "packed/layout"

LARGEST = 1 << 14
"""Arrays with more elements stay as they are (a `StepRecorder`'s tensors):
copying them into the packed array would cost more than their own output."""


class _Entry(NamedTuple):
    group: int  # 0: floating point, 1: integer or boolean
    start: int
    end: int
    shape: Tuple[int, ...]
    dtype: np.dtype


class Layout:
    """Where each packed record is. Not a pytree: `jax.device_get` leaves it as it is."""

    def __init__(self, treedef, entries: List, kept: List[int]):
        self.treedef = treedef
        self.entries = entries  # per leaf: an `_Entry`, or None for a kept leaf
        self.kept = kept  # the positions of the leaves left as they are


class _Holder:
    layout = None


def _group(dtype) -> int:
    dtype = np.dtype(dtype)
    return 0 if np.issubdtype(dtype, np.floating) else 1


def pack(records: Dict[str, object]):
    """In the step: `records` as `(packed arrays, layout)`; the arrays are
    `(floats, integers, *kept leaves)`."""
    leaves, treedef = jax.tree_util.tree_flatten(records)
    arrays = [jnp.asarray(leaf) for leaf in leaves]
    groups: List[List] = [[], []]
    sizes = [0, 0]
    entries, kept, kept_arrays = [], [], []
    for position, array in enumerate(arrays):
        if array.size > LARGEST:
            entries.append(None)
            kept.append(position)
            kept_arrays.append(array)
            continue
        group = _group(array.dtype)
        entries.append(_Entry(group, sizes[group], sizes[group] + array.size,
                              tuple(array.shape), np.dtype(array.dtype)))
        sizes[group] += array.size
        groups[group].append(array)
    float_type = jnp.result_type(*[a.dtype for a in groups[0]]) if groups[0] else jnp.float32
    float_type = jnp.promote_types(float_type, jnp.float32)
    int_type = jnp.int32
    if any(np.dtype(a.dtype).itemsize > 4 for a in groups[1]):
        int_type = jnp.int64
    floats = jnp.concatenate([jnp.reshape(a, [-1]).astype(float_type) for a in groups[0]]) \
        if groups[0] else jnp.zeros([0], float_type)
    integers = jnp.concatenate([jnp.reshape(a, [-1]).astype(int_type) for a in groups[1]]) \
        if groups[1] else jnp.zeros([0], int_type)
    return (floats, integers, *kept_arrays), Layout(treedef, entries, kept)


def packed(step):
    """`step(state, carry, data) -> (logs, state, carry, records)` whose
    records leave it packed; the records a call returns are
    `{PACKED: arrays, LAYOUT: layout}` (see `unpack`)."""
    holder = _Holder()

    def inner(state, carry, data):
        logs, state, carry, records = step(state, carry, data)
        arrays, holder.layout = pack(records)
        return logs, state, carry, arrays

    def call(jitted, state, carry, data):
        logs, state, carry, arrays = jitted(state, carry, data)
        return logs, state, carry, {PACKED: arrays, LAYOUT: holder.layout}

    return inner, call


def _leaves(layout: Layout, floats, integers, kept: dict, lead: Tuple[int, ...] = ()) -> list:
    """The leaves of `layout`'s records cut from the packed `floats` and
    `integers` (NumPy), with `lead` axes before each record's shape (the
    steps of a read: `floats` is then one row per step)."""
    groups = (floats, integers)
    leaves = []
    for position, entry in enumerate(layout.entries):
        if entry is None:
            leaves.append(kept[position])
            continue
        values = groups[entry.group][..., entry.start:entry.end]
        leaves.append(values.astype(entry.dtype).reshape(lead + entry.shape))
    return leaves


def unpack(records: Dict[str, object]) -> Dict[str, object]:
    """On the host, after `jax.device_get`: the records `pack` packed, with
    any other key of `records` (values the host added) as it is."""
    if PACKED not in records:
        return records
    arrays, layout = records[PACKED], records[LAYOUT]
    leaves = _leaves(layout, np.asarray(arrays[0]), np.asarray(arrays[1]),
                     dict(zip(layout.kept, arrays[2:])))
    out = jax.tree_util.tree_unflatten(layout.treedef, leaves)
    out.update(_host_keys(records))
    return out


def _arrays(records: Dict[str, object]) -> list:
    """The device arrays of one step's records."""
    if PACKED in records:
        return [a for a in records[PACKED] if isinstance(a, jax.Array)]
    return [a for a in jax.tree_util.tree_leaves(records) if isinstance(a, jax.Array)]


@functools.lru_cache(maxsize=None)
def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def start_transfer(steps: List[Dict[str, object]]) -> None:
    """At an execution's end: starts copying its steps' records to the host
    without waiting (`copy_to_host_async`), so that a later read finds them
    there. Nothing to do where the device is the host's memory (CPU)."""
    if _on_cpu():
        return
    for records in steps:
        for array in _arrays(records):
            try:
                array.copy_to_host_async()
            except Exception:  # noqa: BLE001 - the read copies it then
                return


def ready(records: Dict[str, object]) -> bool:
    """Whether the device computed every array of these records (a read of
    them does not wait for the device)."""
    return all(array.is_ready() for array in _arrays(records))


class Steps:
    """The records of consecutive steps of one layout, read as columns: each
    record's values of every step as one array whose first axis is the
    steps (`columns`, the records' dict with those arrays), and the values
    the host added to a step's records (`extras`, one dict per step)."""

    __slots__ = ("count", "columns", "extras")

    def __init__(self, count: int, columns: Dict[str, object], extras: List[dict]):
        self.count = count
        self.columns = columns
        self.extras = extras

    def __contains__(self, key: str) -> bool:
        return key in self.columns

    def step(self, index: int) -> Dict[str, object]:
        """The records of the step at `index` (of these steps), as `unpack`
        gives one step's."""
        out = jax.tree_util.tree_map(lambda column: column[index], self.columns)
        out.update(self.extras[index])
        return out


def _host_keys(records: Dict[str, object]) -> dict:
    return {k: v for k, v in records.items() if k not in (PACKED, LAYOUT)}


def _packed_columns(group: List[Dict[str, object]]) -> Steps:
    layout = group[0][LAYOUT]
    arrays = [[np.asarray(a) for a in records[PACKED]] for records in group]
    stacked = [np.stack(column) for column in zip(*arrays)]
    leaves = _leaves(layout, stacked[0], stacked[1], dict(zip(layout.kept, stacked[2:])),
                     (len(group),))
    columns = jax.tree_util.tree_unflatten(layout.treedef, leaves)
    return Steps(len(group), columns, [_host_keys(records) for records in group])


def _plain_columns(group: List[Dict[str, object]], host: tuple) -> Steps:
    arrays = [{k: v for k, v in records.items() if k not in host} for records in group]
    columns = jax.tree_util.tree_map(lambda *values: np.stack([np.asarray(v) for v in values]),
                                     *arrays)
    return Steps(len(group), columns,
                 [{k: v for k, v in records.items() if k in host} for records in group])


def fetch_columns(steps: List[Dict[str, object]], host: tuple = ()) -> List[Steps]:
    """On the host: the records of `steps` (in their order) as `Steps`, one
    per run of consecutive steps with the same layout: one NumPy array per
    record and run, not one per record and step (the values `unpack` gives
    one step at a time). A step's packed arrays are read directly (on a CPU
    about a microsecond an array, where `jax.device_get` costs ten); records
    of a step run without `jit_compile` go through `jax.device_get`. The
    keys in `host` (values the host adds to a step's records) and every key
    the host added to packed records are a step's `extras`."""
    out: List[Steps] = []
    group: List[Dict[str, object]] = []
    key = None

    def close():
        if group:
            out.append(_packed_columns(group) if PACKED in group[0]
                       else _plain_columns(group, host))

    for records in steps:
        if PACKED in records:
            this = ("packed", id(records[LAYOUT]))
        else:
            records = jax.device_get(records)
            this = ("plain", jax.tree_util.tree_structure(
                {k: v for k, v in records.items() if k not in host}))
        if this != key:
            close()
            group, key = [], this
        group.append(records)
    close()
    return out


__all__ = ["pack", "packed", "unpack", "fetch_columns", "Steps", "ready",
           "start_transfer", "Layout", "PACKED", "LAYOUT"]
