"""TensorFlow's implementation of the array functions `kerasdbg.stats` uses.

Each name is what `kerasdbg.quantities.ops` hands out. Everything here runs
eagerly, in a `tf.function`, under XLA and in a replica context.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.framework import ops as _tf_ops

try:  # TensorFlow's own test of an XLA context; without it, the plain forms
    from tensorflow.python.ops import control_flow_util as _control_flow
except ImportError:  # pragma: no cover - a TensorFlow that moved it
    _control_flow = None

float32, float64, int32, int64, bool_ = tf.float32, tf.float64, tf.int32, tf.int64, tf.bool

abs = tf.abs  # noqa: A001 - the array function's own name
cast = tf.cast
clip_by_value = tf.clip_by_value
concat = tf.concat
cond = tf.cond
constant = tf.constant
equal = tf.equal
fill = tf.fill
floor = tf.floor
floormod = tf.math.floormod
gather = tf.gather
is_finite = tf.math.is_finite
is_inf = tf.math.is_inf
is_nan = tf.math.is_nan
less_equal = tf.less_equal
logical_and = tf.logical_and
logical_not = tf.logical_not
logical_or = tf.logical_or
l2_loss = tf.nn.l2_loss
maximum = tf.maximum
minimum = tf.minimum
name_scope = tf.name_scope
ones_like = tf.ones_like
reduce_all = tf.reduce_all
reduce_any = tf.reduce_any
reduce_max = tf.reduce_max
reduce_min = tf.reduce_min
reduce_sum = tf.reduce_sum
reshape = tf.reshape
scatter_update = tf.tensor_scatter_nd_update
segment_max = tf.math.unsorted_segment_max
segment_min = tf.math.unsorted_segment_min
segment_sum = tf.math.unsorted_segment_sum
shape = tf.shape
size = tf.size
sort = tf.sort
sqrt = tf.sqrt
square = tf.square
stack = tf.stack
stop_gradient = tf.stop_gradient
transpose = tf.transpose
unstack = tf.unstack
where = tf.where
zeros = tf.zeros
zeros_like = tf.zeros_like


def dense(tensor):
    """A tensor (a sparse gradient, `tf.IndexedSlices`, as the dense tensor
    it stands for, duplicated indices summed; a variable, read)."""
    if isinstance(tensor, tf.IndexedSlices):
        return tf.convert_to_tensor(tensor)
    return tf.convert_to_tensor(tensor)


def num_elements(tensor):
    """The static number of elements, or None when a dimension is unknown."""
    return tensor.shape.num_elements()


def is_float(tensor) -> bool:
    """Whether the tensor holds float32 or float64 (others are cast to float32)."""
    return tensor.dtype in (tf.float32, tf.float64)


def padded_rows(x, index, offsets, sizes, pieces=None):
    """`[len(sizes), width]`: the pieces `x[offsets[i]:offsets[i] + sizes[i]]`
    of a flat vector, each padded with zeros to `index`'s width: one gather
    of `x` with a 0 appended, by the constant `index` (positions past a
    piece read the 0), one op whatever the number of pieces (`pieces`, the
    flat tensors of `x`, are not needed)."""
    padded = tf.concat([x, tf.zeros([1], x.dtype)], 0)
    return tf.gather(padded, index)


def _xla_context() -> bool:
    """Whether ops made now are compiled by XLA (a `jit_compile` function or
    one it calls); never eagerly."""
    return (_control_flow is not None and not tf.executing_eagerly()
            and _control_flow.GraphOrParentsInXlaContext(_tf_ops.get_default_graph()))


@functools.lru_cache(maxsize=None)
def _accelerated() -> bool:
    """Whether this machine has a GPU or a TPU TensorFlow can use."""
    return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))


def _xla_on_cpu() -> bool:
    """Whether ops made now are compiled by XLA's CPU compiler: in an XLA
    context, on a machine with no GPU or TPU (where XLA compiles for those,
    a reduction is one kernel and an accelerator may round a float32 product
    to TensorFloat-32)."""
    return _xla_context() and not _accelerated()


def xla_form() -> tuple:
    """`(XLA compiles the ops made now, for a CPU)`: what decides the form
    the ops below take, for a cache of traced functions to key on."""
    xla = _xla_context()
    return (xla, xla and not _accelerated())


def stacked_elements() -> int:
    """The largest tensor whose sums and counts are taken as the rows of one
    stack of its terms (`stats._raw_stacked`), where XLA compiles the ops
    made now (it fuses the stack with its terms; `reduce_sums` takes its
    rows as one product on a CPU): up to 4,096 elements, as fast as a
    reduction a term and in fewer kernels; beyond, slower on a CPU (the
    float64 product's stack is written out: 16,384 elements 0.49 against
    0.38 ms, 262,144 1.74 against 1.30 ms). None in a graph TensorFlow runs
    op by op, which would write the stack out."""
    return 1 << 12 if _xla_context() else 0


def counts_in_one_sum() -> bool:
    """Whether the statistics take a row's NaN and finite counts as one
    integer sum (`stats._Segments._counts`): here, no; the float masks join
    the other sums (`reduce_sums`: under XLA's CPU compiler one
    matrix-vector product for all)."""
    return False


def reduce_sums(terms, axis):
    """The sums of same-shaped `terms` along `axis`, in their dtype.

    Under XLA's CPU compiler, the rows of 2-D float terms of one static
    shape (`axis=1`) are summed together as one float64 matrix-vector
    product with ones: one kernel for every term and row, where that
    compiler makes each float reduction of more than 32 elements a chain of
    partial sums (a kernel per level: three for the 4,096-wide rows of the
    statistics' padded matrices); the float64 accumulation rounds once, to
    the terms' dtype (a sum too large for it is inf, as a reduction in it
    makes it). Otherwise one reduction each."""
    terms = [tf.convert_to_tensor(t) for t in terms]
    shape = terms[0].shape if terms else None
    if (axis != 1 or shape is None or shape.rank != 2 or not shape.is_fully_defined()
            or any(t.shape != shape or not t.dtype.is_floating for t in terms)
            or not _xla_on_cpu()):
        return [tf.reduce_sum(t, axis=axis) for t in terms]
    rows = tf.concat([tf.cast(t, tf.float64) for t in terms], 0)
    sums = tf.linalg.matvec(rows, tf.ones([shape[1]], tf.float64))
    return [tf.cast(s, t.dtype) for s, t in zip(tf.split(sums, len(terms)), terms)]


def all_finite(x):
    """Whether every element of the flat vector `x` is finite (a boolean
    scalar).

    Under XLA's CPU compiler a float vector of more than 32 elements (its
    length known when traced) takes its dot product with zeros, finite
    exactly when every element is (a NaN or an infinity times 0 is NaN): one
    kernel, where that compiler makes the reduction of the elements' tests a
    chain of partial reductions (a kernel per level). Otherwise one
    reduction."""
    x = tf.convert_to_tensor(x)
    size = x.shape[0] if x.shape.rank == 1 else None
    if size is None or size <= 32 or not x.dtype.is_floating or not _xla_on_cpu():
        return tf.reduce_all(tf.math.is_finite(x))
    # float16 and bfloat16 widened: their largest value times 0 is 0 in float32.
    dtype = x.dtype if x.dtype in (tf.float32, tf.float64) else tf.float32
    return tf.math.is_finite(tf.tensordot(tf.cast(x, dtype), tf.zeros([size], dtype), 1))


# More values than this are stacked as they are (the selects grow with the
# square of their number).
STACK_SELECTS = 64


def stack_small(values, axis=0):
    """`tf.stack(values, axis)` of a few tensors of one dtype and static
    shape (a statistics table's columns, a step's row of scalars).

    Under XLA, as selects on a broadcast position instead of a
    concatenation: XLA's CPU compiler fuses no computed operand into a
    concatenation (each is a kernel of its own, a slice or a cast of one
    element), and fuses the selects with their operands into one kernel.
    Elsewhere (eagerly, or in a graph that XLA does not compile, where each
    select would be an op to run), and for more than `STACK_SELECTS` values,
    `tf.stack`."""
    values = [tf.convert_to_tensor(v) for v in values]
    shape, dtype = values[0].shape, values[0].dtype
    rank = shape.rank + 1 if shape.rank is not None else None
    if (not 2 <= len(values) <= STACK_SELECTS or rank is None or not -rank <= axis < rank
            or not shape.is_fully_defined()
            or any(v.shape != shape or v.dtype != dtype for v in values)
            or not _xla_context()):
        return tf.stack(values, axis)
    axis = axis % rank
    out_shape = shape[:axis].concatenate([len(values)]).concatenate(shape[axis:])
    position = tf.reshape(tf.range(len(values)), [len(values) if i == axis else 1
                                                  for i in range(rank)])
    out = tf.broadcast_to(tf.expand_dims(values[0], axis), out_shape)
    for j, value in enumerate(values[1:], 1):
        out = tf.where(tf.equal(position, j), tf.expand_dims(value, axis), out)
    return out
