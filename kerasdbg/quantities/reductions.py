"""The reductions every capture shares: one global norm and one finite test.

The gradient norm a rule judges, the norm a `max_gradient_norm` freeze
compares, and the norm written as `gradients/global_norm` are the same
number, computed here; the fault test and the NaN localisation ask
`all_finite`. Both are written against
`kerasdbg.quantities.ops`, so any backend's capture computes them in its
compiled step.
"""

from __future__ import annotations

from typing import Sequence

from kerasdbg import stats as stats_lib
from kerasdbg.quantities import ops as B


def global_norm(l2_norms: "stats_lib.TensorLike") -> "stats_lib.Tensor":
    """The norm of several tensors together, from their own L2 norms.

    Args:
        l2_norms: a float64 vector of per-tensor L2 norms (`tensor_statistics
            (..., ["l2_norm"])[:, 0]`), or a sequence of such vectors.

    Returns:
        A float64 scalar: `sqrt(sum(norm ** 2))`; 0 for no tensor.

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.quantities.reductions import global_norm
        >>> float(global_norm(np.array([3.0, 4.0])))
        5.0
    """
    if isinstance(l2_norms, (list, tuple)):
        parts = [B.reshape(B.cast(n, B.float64), [-1]) for n in l2_norms]
        l2_norms = B.concat(parts, 0) if parts else B.zeros([0], B.float64)
    return B.sqrt(B.reduce_sum(B.square(B.cast(l2_norms, B.float64))))


def norm_of(tensors: Sequence) -> "stats_lib.Tensor":
    """The global norm of `tensors` (dense, or sparse gradients as the dense
    tensors they stand for), in float64."""
    present = [t for t in tensors if t is not None]
    if not present:
        return B.constant(0.0, B.float64)
    return global_norm(stats_lib.tensor_statistics(present, ["l2_norm"])[:, 0])


def all_finite(tensors) -> "stats_lib.Tensor":
    """Whether every element of `tensors` (a sequence, a `stats.Packed`, or
    one tensor) is finite, as a boolean scalar, in one read of each.

    The tensors are packed (`stats.Packed`: the small ones concatenated per
    dtype), so that the test takes a few vectors, not one input per tensor:
    one reduction of each, and no condition (on a GPU a condition in a
    compiled step makes the host wait for the device).

    Examples:
        >>> import numpy as np
        >>> from kerasdbg.quantities.reductions import all_finite
        >>> bool(all_finite([np.ones(3, np.float32), np.array([np.nan], np.float32)]))
        False
    """
    if not isinstance(tensors, (list, tuple, stats_lib.Packed)):
        tensors = [tensors]
    if not len(tensors):
        return B.constant(True)
    vectors = (tensors if isinstance(tensors, stats_lib.Packed)
               else stats_lib.Packed.of([B.dense(t) for t in tensors])).vectors
    if not vectors:
        return B.constant(True)
    if len(vectors) == 1:
        return B.all_finite(vectors[0])
    return B.reduce_all(B.stack([B.all_finite(v) for v in vectors]))
