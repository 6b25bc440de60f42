"""TensorFlow's implementation of the array functions `kerasdbg.stats` uses.

Each name is what `kerasdbg.quantities.ops` hands out. Everything here runs
eagerly, in a `tf.function`, under XLA and in a replica context.
"""

from __future__ import annotations

import tensorflow as tf

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


def reduce_sums(terms, axis):
    """The sums of same-shaped `terms` along `axis` (one reduction each)."""
    return [tf.reduce_sum(t, axis=axis) for t in terms]
