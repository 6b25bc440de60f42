"""JAX's implementation of the array functions `kerasdbg.stats` uses.

Each name is what `kerasdbg.quantities.ops` hands out, with the meaning of
TensorFlow's function of that name (`kerasdbg.backends.tensorflow.ops`).
Everything here runs eagerly, under `jax.jit` and on sharded arrays.

Without `jax_enable_x64` JAX has no 64-bit types (a request is truncated
with a warning): `float64` and `int64` are then float32 and int32, and the
statistics are computed in float32 (counts exact up to 2**24 elements).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

_X64 = bool(jax.config.jax_enable_x64)

float32, int32, bool_ = jnp.float32, jnp.int32, jnp.bool_
float64 = jnp.float64 if _X64 else jnp.float32
int64 = jnp.int64 if _X64 else jnp.int32

abs = jnp.abs  # noqa: A001 - the array function's own name
concat = jnp.concatenate
equal = jnp.equal
floor = jnp.floor
floormod = jnp.mod
is_finite = jnp.isfinite
is_inf = jnp.isinf
is_nan = jnp.isnan
less_equal = jnp.less_equal
logical_and = jnp.logical_and
logical_not = jnp.logical_not
logical_or = jnp.logical_or
maximum = jnp.maximum
minimum = jnp.minimum
ones_like = jnp.ones_like
reduce_all = jnp.all
reduce_any = jnp.any
reduce_max = jnp.max
reduce_min = jnp.min
reduce_sum = jnp.sum
reshape = jnp.reshape
sqrt = jnp.sqrt
square = jnp.square
stop_gradient = jax.lax.stop_gradient
transpose = jnp.transpose
zeros_like = jnp.zeros_like


def _dtype(dtype):
    """A dtype JAX has (64-bit ones without x64 are their 32-bit kind)."""
    if dtype is None:
        return None
    dtype = jnp.dtype(dtype)
    if not _X64 and dtype.itemsize == 8:
        return {"f": float32, "i": int32, "u": jnp.uint32, "c": jnp.complex64}[dtype.kind]
    return dtype


def cast(x, dtype):
    return jnp.asarray(x).astype(_dtype(dtype))


def constant(value, dtype=None):
    return jnp.asarray(value, dtype=_dtype(dtype))


def zeros(shape, dtype=float32):
    return jnp.zeros(shape, _dtype(dtype))


def fill(shape, value):
    value = jnp.asarray(value)
    return jnp.full(tuple(int(d) for d in shape), value, value.dtype)


def stack(values, axis=0):
    return jnp.stack([jnp.asarray(v) for v in values], axis=axis)


def unstack(x, num=None, axis=0):
    return [jnp.take(x, i, axis=axis) for i in range(x.shape[axis] if num is None else num)]


def where(condition, x, y):
    return jnp.where(jnp.asarray(condition), x, y)


def clip_by_value(x, low, high):
    return jnp.clip(x, low, high)


def cond(predicate, true_fn, false_fn):
    """`true_fn()` if `predicate` else `false_fn()`: a Python branch when the
    predicate is known, a concrete array this process can read included (a
    step that runs op by op, `jit_compile=False`, would compile both branches
    of a `lax.cond` again at each call), else one `lax.cond`."""
    if isinstance(predicate, (bool, np.bool_)):
        return true_fn() if predicate else false_fn()
    if not isinstance(predicate, jax.core.Tracer) \
            and getattr(predicate, "is_fully_addressable", True):
        return true_fn() if bool(predicate) else false_fn()
    return jax.lax.cond(predicate, true_fn, false_fn)


def gather(params, indices):
    return jnp.take(jnp.asarray(params), jnp.asarray(indices, jnp.int32), axis=0)


def l2_loss(x):
    return jnp.sum(jnp.square(x)) / 2


def name_scope(name):
    del name
    return contextlib.nullcontext()


def scatter_update(tensor, indices, updates):
    """`tensor` with the rows `indices` (`[[i], ...]`) set to `updates`."""
    rows = np.asarray(indices, np.int32).reshape(-1)
    return jnp.asarray(tensor).at[rows].set(jnp.asarray(updates, jnp.asarray(tensor).dtype))


def segment_sum(data, segment_ids, num_segments):
    return jax.ops.segment_sum(data, jnp.asarray(segment_ids), int(num_segments))


def segment_max(data, segment_ids, num_segments):
    return jax.ops.segment_max(data, jnp.asarray(segment_ids), int(num_segments))


def segment_min(data, segment_ids, num_segments):
    return jax.ops.segment_min(data, jnp.asarray(segment_ids), int(num_segments))


def shape(x):
    return jnp.shape(x)


def size(x):
    return jnp.asarray(jnp.size(x), int32)


def sort(x):
    return jnp.sort(x)


def dense(tensor):
    """A tensor (a Keras variable read) as an array."""
    value = getattr(tensor, "value", tensor)
    return jnp.asarray(value)


def num_elements(tensor):
    """The static number of elements."""
    return int(np.prod(jnp.shape(tensor)))


def is_float(tensor) -> bool:
    """Whether the tensor holds float32 or float64 (others are cast to float32)."""
    return jnp.asarray(tensor).dtype in (jnp.dtype(jnp.float32), jnp.dtype(float64))


def padded_rows(x, index, offsets, sizes, pieces=None):
    """`[len(sizes), width]`: the pieces `x[offsets[i]:offsets[i] + sizes[i]]`
    of a flat vector (or the flat `pieces` themselves, where the caller has
    them), each padded with zeros to `index`'s width (`index`, the gather
    `kerasdbg.backends.tensorflow.ops.padded_rows` takes, gives the shape).
    Pads and a stack: XLA makes them one copy (a gather would read element
    by element)."""
    width = index.shape[1]
    if pieces is None:
        pieces = [x[int(o):int(o) + int(n)] for o, n in zip(offsets, sizes)]
    return jnp.stack([jnp.pad(p, (0, width - int(n))) for p, n in zip(pieces, sizes)])


def stacked_elements() -> int:
    """The largest tensor whose sums and counts are taken as the rows of one
    stack of its terms (`stats._raw_stacked`): XLA fuses the stack into the
    reduction (a tap's statistics in 9 fusions, not 22); up to a million
    elements it is as fast as a reduction a term on a CPU, or faster
    (measured: 4,096 elements 23 against 34 us, 65,536 265 against 329 us,
    1,048,576 3.3 ms both)."""
    return 1 << 20


def counts_in_one_sum() -> bool:
    """Whether the statistics take a row's NaN and finite counts as one
    integer sum (`stats._Segments._counts`): here, yes; XLA's CPU compiler
    writes a float mask out before each float sum, where an integer sum
    fuses with its test."""
    return True


def reduce_sums(terms, axis):
    """The sums of same-shaped `terms` along `axis`, one reduction each: XLA
    fuses each term into its reduction, and on a CPU a plain reduction is
    vectorized where a variadic one (one pass for all) is not (measured: 26
    us against about 3 for three sums over 24,576 elements)."""
    return [jnp.sum(t, axis=axis) for t in terms]


def all_finite(x):
    """Whether every element of the flat vector `x` is finite (a boolean scalar)."""
    return jnp.all(jnp.isfinite(x))


def stack_small(values, axis=0):
    """`jnp.stack(values, axis)` (XLA fuses the concatenation with its operands)."""
    return jnp.stack(values, axis)
