"""In-graph tensor statistics: pure `tensor -> tensor` functions, XLA-safe.

Written against `kerasdbg.quantities.ops` (reductions, elementwise ops,
`cond`, segment sums), not against a framework: this module imports without
TensorFlow, and the capture of any backend computes the same statistics.

These run inside the train step, every recorded step, so they are written to
touch memory as few times as possible and to hold no condition (on a GPU a
condition in a compiled step makes the host wait for the device): one masked
pass of reductions over each tensor (or group of small tensors) gives every
statistic, the NaN/Inf counts with the finite-only moments, in the tensor's
own precision (a sum beyond float32's range, such as the squares of values
above 1.8e19, reads as infinite while the counts say no element is).
`masked_statistics` computes the same in float64, for a caller that wants
them exact whatever the magnitudes. The definitions:

- `l2_norm` is NaN when an element is NaN, else infinite when one is
  infinite: an explosion never reads as a small norm;
- the other moments (`mean`, `std`, `min`, `max`, `mean_abs`) are taken over
  the finite elements only; non-finite ones are counted in `nan_count` and
  `inf_count`;
- `zero_fraction` is the fraction of all elements that are exactly zero;
- the quantiles `p05`, `p50`, `p95` (not computed unless asked for: they sort
  the tensor) are those of the finite elements, interpolated linearly as
  `numpy.percentile` does;
- a tensor with no finite element has NaN for those other moments; an empty
  tensor has `l2_norm` 0, NaN moments and `zero_fraction` NaN.

Beyond these (`ALL_STATISTICS`), `WeightStatistics` records the statistics of
the updates, `update_ratio` and `distance_from_start` (`UPDATE_STATISTICS`),
and taps after an activation the fractions `dead_fraction` and
`saturated_fraction` (`HEALTH_STATISTICS`). `EVERY_STATISTIC` lists them all.

`tf.IndexedSlices` (e.g. the gradient of an `Embedding`) are described as the
dense tensor they stand for, duplicated indices summed, as the optimizer sees
them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from kerasdbg.quantities import ops as B

STATISTICS = (
    "l2_norm",
    "mean",
    "std",
    "min",
    "max",
    "mean_abs",
    "zero_fraction",
    "nan_count",
    "inf_count",
)
"""Names of the statistics that `tensor_statistics` computes by default, in order."""
QUANTILES = {"p05": 0.05, "p50": 0.50, "p95": 0.95}
"""Quantile statistics, computed only when asked for (they sort each tensor)."""
ALL_STATISTICS = STATISTICS + tuple(QUANTILES)
"""Every statistic `tensor_statistics` can compute."""
UPDATE_STATISTICS = ("update_ratio", "distance_from_start")
"""Statistics of the weights' updates, which `WeightStatistics` records (by
default) besides those of `ALL_STATISTICS`: `update_ratio`, ||w_after -
w_before|| / ||w_before|| of a step's update (0 when nothing moved, inf when a
zero tensor moved), and `distance_from_start`, ||w_after - w_start|| since the
`fit()` began."""
HEALTH_STATISTICS = ("dead_fraction", "saturated_fraction")
"""Fractions (0-1) of units that `TapLayer(activation=...)` records after an
activation: dead ReLU units, saturated tanh or sigmoid units."""
EVERY_STATISTIC = ALL_STATISTICS + UPDATE_STATISTICS + HEALTH_STATISTICS
"""Every statistic a user can ask for anywhere in kerasdbg, by name: the
tensor statistics (`GradientStatistics`, `WeightStatistics`, `TapLayer`,
`PrintLayer`), the update statistics (`WeightStatistics`) and the taps' health
fractions.

Examples:
    >>> from kerasdbg import stats
    >>> len(stats.EVERY_STATISTIC), stats.EVERY_STATISTIC[-4:]
    (16, ('update_ratio', 'distance_from_start', 'dead_fraction', 'saturated_fraction'))
"""

DEFAULT_HISTOGRAM_BINS = 30

TensorLike = Any
"""A tensor of the backend (TensorFlow: a `tf.Tensor`, `tf.Variable` or `tf.IndexedSlices`)."""
Tensor = Any


def _flat(tensor: TensorLike) -> Tensor:
    tensor = B.stop_gradient(B.dense(tensor))
    if not B.is_float(tensor):
        tensor = B.cast(tensor, B.float32)
    return B.reshape(tensor, [-1])


def _count(mask: Tensor) -> Tensor:
    size = B.num_elements(mask)
    if size is not None and size < 2**31:
        # Exact in int32, and half the memory traffic of a float64 cast
        # (measured on 23.5 M elements: 15.5 ms against 23.6 ms).
        return B.cast(B.reduce_sum(B.cast(mask, B.int32)), B.float64)
    return B.reduce_sum(B.cast(mask, B.float64))


def _quantiles(x: Tensor, n: Tensor, stats: Tuple[str, ...]) -> dict:
    """The quantiles in `stats` of the `n` smallest elements of `x` (the
    finite ones, when non-finite elements were replaced by +inf), NaN when n is 0."""
    wanted = [s for s in stats if s in QUANTILES]
    if not wanted:
        return {}
    ordered = B.sort(x)
    n = B.cast(n, B.float64)
    last = B.maximum(n - 1.0, 0.0)
    out = {}
    for name in wanted:
        position = QUANTILES[name] * last
        low = B.floor(position)
        high = B.minimum(low + 1.0, last)
        below = B.cast(B.gather(ordered, B.cast(low, B.int32)), B.float64)
        above = B.cast(B.gather(ordered, B.cast(high, B.int32)), B.float64)
        value = below + (position - low) * (above - below)
        out[name] = B.where(n > 0, value, B.constant(np.nan, B.float64))
    return out


# The reductions `_raw` takes of each tensor, from which `_finish` derives
# every statistic but the quantiles, for all tensors at once: over the finite
# elements (the others count as 0 in the sums), the counts of the finite and
# of the NaN elements (the infinite ones are the rest).
_RAW = ("sum", "sumsq", "centered", "min", "max", "abs_sum", "zeros", "finite", "nan")


def _needs(stats: Tuple[str, ...]) -> set:
    """The `_RAW` reductions that `stats` need."""
    needs = set()
    if {"mean", "std"} & set(stats):
        needs.add("sum")
    if "std" in stats:
        needs.add("centered")
    if "l2_norm" in stats:
        needs.add("sumsq")
    for name in ("min", "max"):
        if name in stats:
            needs.add(name)
    if "mean_abs" in stats:
        needs.add("abs_sum")
    if "zero_fraction" in stats:
        needs.add("zeros")
    if needs - {"zeros", "sumsq"} or set(QUANTILES) & set(stats) \
            or {"nan_count", "inf_count"} & set(stats):
        needs.add("finite")
    if {"nan_count", "inf_count"} & set(stats):
        needs.add("nan")
    return needs


def _raw(x: Tensor, stats: Tuple[str, ...]) -> Tensor:
    """The `_RAW` reductions of `x` that `stats` need (0 for the others),
    as a float64 vector: one masked pass (two with `std`, whose centered sum
    needs the mean first), in `x`'s precision.

    Only the reductions happen here, per tensor; the arithmetic that turns
    them into statistics runs once over all tensors' rows (`_finish`).
    """
    needs = _needs(stats)
    size = B.num_elements(x)
    if size is not None and 0 < size <= min(B.stacked_elements(), STACKED_ELEMENTS) \
            and x.dtype in (B.float32, B.float64):
        return _raw_stacked(x, needs)
    finite = B.is_finite(x)
    zero = B.zeros([], x.dtype)
    xz = B.where(finite, x, zero)
    raw, counts = {}, {}
    if "finite" in needs:
        counts["finite"] = _count(finite)
    if "nan" in needs:
        counts["nan"] = _count(B.is_nan(x))
    if "sum" in needs:
        raw["sum"] = B.reduce_sum(xz)
    if "centered" in needs:
        mean = raw["sum"] / B.maximum(B.cast(counts["finite"], x.dtype), 1)
        raw["centered"] = _sum_of_squares(B.where(finite, x - mean, zero))
    if "sumsq" in needs:
        # Of every element: NaN when one is NaN, else infinite when one is.
        raw["sumsq"] = _sum_of_squares(x)
    if "min" in needs:
        raw["min"] = B.reduce_min(B.where(finite, x, B.constant(np.inf, x.dtype)))
    if "max" in needs:
        raw["max"] = B.reduce_max(B.where(finite, x, B.constant(-np.inf, x.dtype)))
    if "abs_sum" in needs:
        raw["abs_sum"] = B.reduce_sum(B.abs(xz))
    if "zeros" in needs:
        counts["zeros"] = _count(B.equal(x, 0))
    row = [B.cast(raw[r], B.float64) if r in raw else counts[r] if r in counts
           else B.zeros([], B.float64) for r in _RAW]
    return B.stack(row)


STACKED_ELEMENTS = 1 << 24
"""The largest tensor `_raw_stacked` takes: its counts are float32 sums,
exact up to 2**24."""


def _raw_stacked(x: Tensor, needs: set) -> Tensor:
    """`_raw` of one float32 (or float64) tensor where the backend's compiler
    fuses a reduction with the terms stacked before it, up to the size it
    gives (`ops.stacked_elements`):
    the sums and counts are the rows of one `[terms, size]` stack summed
    along its rows, the minimum and the maximum one minimum of two rows (the
    maximum as the minimum of the negated values), and the centered sum a
    second pass. A tap's activation then takes 9 fusions, not 22 (XLA's
    CPU compiler, a `[64, 64]` ReLU output: one reduction a term and a mask
    written out before each count); the counts are exact below
    `STACKED_ELEMENTS`."""
    finite = B.is_finite(x)
    zero = B.zeros([], x.dtype)
    xz = B.where(finite, x, zero)
    terms = {}
    if "sum" in needs:
        terms["sum"] = xz
    if "sumsq" in needs:
        terms["sumsq"] = B.square(x)  # NaN / inf when one element is
    if "abs_sum" in needs:
        terms["abs_sum"] = B.abs(xz)
    if "zeros" in needs:
        terms["zeros"] = B.cast(B.equal(x, 0), x.dtype)
    if "finite" in needs:
        terms["finite"] = B.cast(finite, x.dtype)
    if "nan" in needs:
        terms["nan"] = B.cast(B.is_nan(x), x.dtype)
    raw = {}
    if terms:
        raw = dict(zip(terms, B.unstack(B.reduce_sums([B.stack(list(terms.values()))], axis=1)[0],
                                        num=len(terms), axis=0)))
    if "centered" in needs:
        mean = raw["sum"] / B.maximum(raw["finite"], 1)
        raw["centered"] = B.reduce_sum(B.square(B.where(finite, x - mean, zero)))
    extremes = [name for name in ("min", "max") if name in needs]
    if extremes:
        inf = B.constant(np.inf, x.dtype)
        rows = {"min": B.where(finite, x, inf), "max": B.where(finite, -x, inf)}
        lows = B.unstack(B.reduce_min(B.stack([rows[n] for n in extremes]), axis=1),
                         num=len(extremes), axis=0)
        for name, low in zip(extremes, lows):
            raw[name] = low if name == "min" else -low
    # Stacked in the tensor's dtype, then cast once (a cast each is a kernel each
    # where XLA does not fuse them into the stack).
    return B.cast(B.stack([raw.get(r, zero) for r in _RAW]), B.float64)


SEGMENTED = 1 << 12
"""Tensors of at most this many elements are reduced together, per dtype:
one concatenation and one segment reduction per statistic instead of
reductions per tensor. A model's biases and normalization parameters (161 of
ResNet50's 214 weights) then add a few graph ops instead of a dozen each,
and their bytes are few enough for the copy to cost nothing."""


def plan(sizes: Sequence[Any], dtypes: Sequence[Any]) -> Tuple[Tuple[tuple, tuple], ...]:
    """The groups of a `Packed` of tensors with these element counts (None:
    unknown) and dtypes: `((positions, sizes), ...)`, ordered by their first
    position. The tensors of 1 to `SEGMENTED` elements are grouped per dtype;
    any other non-empty tensor is a group of its own; an empty one is in none.

    Examples:
        >>> from kerasdbg import stats
        >>> stats.plan([8, 64, 0, 100000, 8], ["float32"] * 5)
        (((0, 1, 4), (8, 64, 8)), ((3,), (100000,)))
    """
    small: dict = {}
    groups = []
    for i, (size, dtype) in enumerate(zip(sizes, dtypes)):
        if size == 0:
            continue
        if size is not None and size <= SEGMENTED:
            key = str(dtype)
            if key not in small:
                small[key] = ([], [])
                groups.append(small[key])
            small[key][0].append(i)
            small[key][1].append(size)
        else:
            groups.append(([i], [size]))
    return tuple((tuple(positions), tuple(counts)) for positions, counts in groups)


class Packed:
    """Tensors as a few flat vectors: what the statistics of many tensors take.

    A graph whose conditions and function calls take one input per tensor
    grows, in trace time and in the work of TensorFlow's graph optimizer,
    with the number of tensors times the number of such ops; packed, a
    model's 2,000 small weights are one vector per dtype. The small tensors
    (`SEGMENTED`) are concatenated per dtype, in order, each other tensor is
    flattened on its own (no copy), an empty one has no vector (see
    `plan`). `len()` is the number of tensors, `layout` what a cache of
    traced functions keys on (with the vectors' shapes and dtypes).

    Args:
        vectors: one flat vector per group of `groups`.
        groups: `plan(...)` of the tensors.
        count: the number of tensors.

    Examples:
        >>> import tensorflow as tf
        >>> from kerasdbg.stats import Packed
        >>> packed = Packed.of([tf.ones([2, 2]), tf.zeros([0]), tf.fill([3], 2.0)])
        >>> len(packed), packed.groups, packed.vectors[0].numpy()
        (3, (((0, 2), (4, 3)),), array([1., 1., 1., 1., 2., 2., 2.], dtype=float32))
    """

    def __init__(self, vectors: Sequence[Tensor], groups: Tuple[Tuple[tuple, tuple], ...],
                 count: int):
        self.vectors = list(vectors)
        self.groups = tuple(groups)
        self.count = count
        self.flats: Optional[list] = None  # the flat tensors, when `of` packed them here
        self.terms: Optional[tuple] = None  # `(a, b)` of a pack made by `a.less(b)`

    @classmethod
    def of(cls, tensors: Sequence[TensorLike]) -> "Packed":
        """The tensors (dense, floating point, cut from the gradient: as
        `flat_tensors`) packed."""
        if isinstance(tensors, Packed):
            return tensors
        flats = flat_tensors(tensors)
        groups = plan([B.num_elements(x) for x in flats], [x.dtype for x in flats])
        vectors = [flats[positions[0]] if len(positions) == 1
                   else B.concat([flats[i] for i in positions], 0)
                   for positions, _ in groups]
        packed = cls(vectors, groups, len(flats))
        # The tensors the vectors were made of, where a reduction reads them
        # better one by one (`_Segments`); a compiler drops a concatenation
        # nothing reads.
        packed.flats = flats
        return packed

    def __len__(self) -> int:
        return self.count

    @property
    def layout(self) -> tuple:
        return (self.groups, self.count)

    @property
    def order(self) -> list:
        """The positions of the non-empty tensors, in the vectors' order."""
        return [i for positions, _ in self.groups for i in positions]

    def pieces(self) -> list:
        """Each non-empty tensor's flat values, in `order` (slices)."""
        out = []
        for vector, (positions, sizes) in zip(self.vectors, self.groups):
            if len(positions) == 1:
                out.append(vector)
                continue
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            out += [vector[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]
        return out

    def zip_with(self, other: "Packed", function) -> "Packed":
        """`function(a, b)` of each pair of vectors of two packs of one layout."""
        return Packed([function(a, b) for a, b in zip(self.vectors, other.vectors)],
                      self.groups, self.count)

    def less(self, other: "Packed") -> "Packed":
        """The tensors of this pack less those of `other` (a pack of one
        layout and dtypes, both made by `of`). A reduction of a group of
        small tensors subtracts the padded matrices of the two packs (one
        kernel, fused with the reduction), not each tensor apart (a kernel
        per tensor, which does not fuse with the matrix).

        Examples:
            >>> import numpy as np
            >>> from kerasdbg.stats import Packed, tensor_statistics
            >>> after = Packed.of([np.float32([3, 4]), np.float32([1])])
            >>> before = Packed.of([np.float32([0, 0]), np.float32([1])])
            >>> np.asarray(tensor_statistics(after.less(before), ["l2_norm"]))[:, 0]
            array([5., 0.])
        """
        out = self.zip_with(other, lambda a, b: a - b)
        out.terms = (self, other)
        return out

    @staticmethod
    def joined(packs: Sequence["Packed"]) -> "Packed":
        """The tensors of several packs as one pack (positions one after the other)."""
        vectors, groups, count = [], [], 0
        for pack in packs:
            vectors += pack.vectors
            groups += [(tuple(count + i for i in positions), sizes)
                       for positions, sizes in pack.groups]
            count += pack.count
        return Packed(vectors, groups, count)


class _Segments:
    """Small tensors of one dtype, concatenated in one vector, reduced each
    as a row of a few zero-padded matrices.

    The tensors are grouped in a few size classes (`_size_classes`): each
    class is one zero-padded `[tensors, width]` matrix made from the vector
    (`ops.padded_rows`: one copy, or one gather), and the sums a
    statistic needs are taken along its rows together (`ops.reduce_sums`:
    one pass on JAX). So the kernels do not grow with the number
    of tensors, and no reduction is a scatter (a segment sum, which XLA runs
    element by element on a CPU).
    """

    def __init__(self, x: Tensor, pieces: Optional[list], sizes: Sequence[int],
                 less: Optional[tuple] = None):
        self.k = len(sizes)
        self.x = x
        self.pieces = pieces  # the tensors concatenated in `x`, where known
        # `(vector, pieces)` of tensors to subtract from these (`Packed.less`).
        self.less = less
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        end = int(offsets[-1])  # the appended 0
        # Per class: (index [k_c, width], valid [k_c, width], pads [k_c], offsets, sizes).
        self.classes = []
        order = []
        for width, members in _size_classes(sizes):
            index = np.full((len(members), width), end, np.int32)
            for row, i in enumerate(members):
                index[row, :sizes[i]] = np.arange(offsets[i], offsets[i + 1])
            valid = index < end
            self.classes.append((index, valid, width - valid.sum(1),
                                 [int(offsets[i]) for i in members],
                                 [int(sizes[i]) for i in members], members))
            order += members
        # Rows come out class by class: back to the tensors' order.
        self.back = np.argsort(np.asarray(order, np.int64)).astype(np.int32)

    def raw(self, stats: Tuple[str, ...]) -> Tensor:
        """`_raw` of each tensor, as `[k, len(_RAW)]` (always two passes for
        the variance: the tensors are small)."""
        needs = _needs(stats)
        blocks = []
        for index, valid, pads, starts, counts, members in self.classes:
            matrix = self._matrix(self.x, self.pieces, index, starts, counts, members)
            if self.less is not None:
                matrix = matrix - self._matrix(*self.less, index, starts, counts, members)
            blocks.append(self._rows(matrix, valid, pads, needs))
        rows = blocks[0] if len(blocks) == 1 else B.concat(blocks, 0)
        if len(self.classes) > 1:
            rows = B.gather(rows, self.back)
        return rows

    @staticmethod
    def _matrix(x, pieces, index, starts, counts, members) -> Tensor:
        pieces = None if pieces is None else [pieces[i] for i in members]
        return B.padded_rows(x, index, starts, counts, pieces)

    @staticmethod
    def _counts(m: Tensor, finite: Tensor, dtype) -> dict:
        """The finite and the NaN elements of each row of `m` (the padding
        counted finite), from one integer sum per row: a NaN counts 1, an
        infinite element `_INFINITE` (a row has fewer elements), so the sum
        holds both counts; one reduction that fuses with its test, where two
        float sums of masks each write the mask first."""
        width = int(m.shape[1])
        code = B.where(B.is_nan(m), B.constant(1, B.int32),
                       B.where(finite, B.constant(0, B.int32),
                               B.constant(_INFINITE, B.int32)))
        total = B.cast(B.reduce_sum(code, axis=1), B.float64)
        infinite = B.floor(total / _INFINITE)
        nan = total - infinite * _INFINITE
        return {"nan": B.cast(nan, dtype), "finite": B.cast(width - nan - infinite, dtype)}

    @staticmethod
    def _rows(m: Tensor, valid: np.ndarray, pads: np.ndarray, needs: set) -> Tensor:
        """The `_RAW` rows of the tensors of one padded matrix `m` (a padding
        element is 0: neutral to the sums; the counts take the padding off)."""
        dtype = m.dtype
        finite = B.is_finite(m)
        zero = B.zeros([], dtype)
        xz = B.where(finite, m, zero)
        terms = {}
        together = B.counts_in_one_sum()
        if not together and "finite" in needs:
            terms["finite"] = B.cast(finite, dtype)  # exact: a row is small
        if not together and "nan" in needs:
            terms["nan"] = B.cast(B.is_nan(m), dtype)
        if "sum" in needs:
            terms["sum"] = xz
        if "sumsq" in needs:
            terms["sumsq"] = B.square(m)  # NaN / inf as `_raw`'s
        if "abs_sum" in needs:
            terms["abs_sum"] = B.abs(xz)
        if "zeros" in needs:
            terms["zeros"] = B.cast(B.equal(m, 0), dtype)
        raw = dict(zip(terms, B.reduce_sums(list(terms.values()), axis=1)))
        if together and {"finite", "nan"} & needs:
            raw.update(_Segments._counts(m, finite, dtype))
        pads = B.constant(pads.astype(np.float64), dtype)
        for name in ("finite", "zeros"):
            if name in raw:
                raw[name] = raw[name] - pads
        if {"centered", "min", "max"} & needs:
            real = B.logical_and(finite, B.constant(valid))
        if "centered" in needs:
            mean = raw["sum"] / B.maximum(raw["finite"], 1)
            deviation = B.where(real, m - B.reshape(mean, [-1, 1]), zero)
            raw["centered"] = B.reduce_sum(B.square(deviation), axis=1)
        if "min" in needs:
            raw["min"] = B.reduce_min(B.where(real, m, B.constant(np.inf, dtype)), axis=1)
        if "max" in needs:
            raw["max"] = B.reduce_max(B.where(real, m, B.constant(-np.inf, dtype)), axis=1)
        zeros = B.zeros([len(valid)], dtype)
        return B.cast(B.stack_small([raw.get(r, zeros) for r in _RAW], axis=1), B.float64)


_INFINITE = 1 << 13
"""What an infinite element adds to a row's count (`_Segments._counts`):
more than a padded row's elements (at most `SEGMENTED` rounded up to a power
of two), and the sum of a row stays within int32."""
assert _INFINITE > SEGMENTED and _INFINITE * SEGMENTED < 2**31


def _size_classes(sizes: Sequence[int]) -> list:
    """`[(width, [tensor positions]), ...]`: the small tensors' padded
    matrices, as few as the padding allows: from the largest tensor down, a
    class of the next power of two of its size takes every tensor at least
    an eighth of that wide (so a class pads at most eightfold).

    Examples:
        >>> from kerasdbg.stats import _size_classes
        >>> _size_classes([2048, 64, 4096, 64, 640, 10])
        [(4096, [0, 2, 4]), (64, [1, 3, 5])]
    """
    left = sorted(range(len(sizes)), key=lambda i: -int(sizes[i]))
    classes = []
    while left:
        width = 1 << max(int(sizes[left[0]]) - 1, 0).bit_length()
        members = [i for i in left if int(sizes[i]) * 8 >= width]
        left = [i for i in left if int(sizes[i]) * 8 < width]
        classes.append((width, sorted(members)))
    return classes


def _reduced(packed: Packed, single, segmented) -> Tuple[Tensor, list]:
    """`(rows, sizes)`: float64 rows of the non-empty tensors, in
    `packed.order`, `single(x)` for a tensor alone, `segmented(segments)`
    (one row per tensor) for a group of small ones (`_Segments`); and their
    element counts (a tensor where not known)."""
    blocks, sizes = [], []
    for group, (vector, (positions, counts)) in enumerate(zip(packed.vectors, packed.groups)):
        if len(positions) > 1:
            def of(pack):  # the vector and pieces of this group in `pack`
                pieces = None if pack.flats is None else [pack.flats[i] for i in positions]
                return pack.vectors[group], pieces

            if packed.terms is None:
                segments = _Segments(*of(packed), counts)
            else:
                first, second = packed.terms
                segments = _Segments(*of(first), counts, less=of(second))
            blocks.append(B.reshape(segmented(segments), [len(counts), -1]))
            sizes += list(counts)
        else:
            blocks.append(B.reshape(single(vector), [1, -1]))
            sizes.append(counts[0] if counts[0] is not None else B.size(vector))
    return (blocks[0] if len(blocks) == 1 else B.concat(blocks, 0)), sizes


def _placed(rows: Tensor, packed: Packed, empty: Tensor) -> Tensor:
    """`[len(packed), width]`: the `rows` (in `packed.order`) at their
    tensors' positions, the row `empty` at the empty tensors'."""
    order = packed.order
    if order == list(range(packed.count)):
        return rows
    where = {i: k for k, i in enumerate(order)}
    if len(order) < packed.count:
        rows = B.concat([rows, B.reshape(empty, [1, -1])], 0)
    return B.gather(rows, [where.get(i, len(order)) for i in range(packed.count)])


def _finish(raw: Tensor, sizes: Sequence[Any], stats: Tuple[str, ...]) -> Tensor:
    """The `[k, len(stats)]` statistics of k tensors of `sizes` elements (a
    tensor where not known) from their `[k, len(_RAW)]` `_RAW` rows
    (quantile columns 0)."""
    column = dict(zip(_RAW, B.unstack(raw, num=len(_RAW), axis=1)))
    if all(isinstance(size, int) for size in sizes):
        n = B.constant(sizes, B.float64)
    else:
        n = B.stack([B.cast(size, B.float64) for size in sizes])
    finite, nans = column["finite"], column["nan"]
    nan = B.constant(np.nan, B.float64)
    none_finite = B.equal(finite, 0)

    def extreme(name):
        return B.where(none_finite, nan, column[name])

    # Over the finite elements (0 / 0: NaN where none is finite).
    # Only the statistics asked for become graph ops (trace time grows with them).
    out = {
        "l2_norm": lambda: B.sqrt(column["sumsq"]),
        "mean": lambda: column["sum"] / finite,
        "std": lambda: B.sqrt(column["centered"] / finite),
        "min": lambda: extreme("min"),
        "max": lambda: extreme("max"),
        "mean_abs": lambda: column["abs_sum"] / finite,
        "zero_fraction": lambda: column["zeros"] / n,
        "nan_count": lambda: nans,
        "inf_count": lambda: n - finite - nans,
    }
    zero = B.zeros_like(n)
    return B.stack_small([out[s]() if s in out else zero for s in stats], axis=1)


def _nonfinite_norm(x: Tensor, norm: Tensor) -> Tensor:
    """`norm` of `x`, made NaN when `x` holds a NaN, else inf when an inf."""
    nan = B.reduce_any(B.is_nan(x))
    inf = B.reduce_any(B.is_inf(x))
    return B.where(nan, B.constant(np.nan, B.float64),
                    B.where(inf, B.constant(np.inf, B.float64), norm))


def _masked(x: Tensor, stats: Tuple[str, ...]) -> Tensor:
    """Float64 statistics over the finite elements; exact, but more passes."""
    x = B.cast(x, B.float64)
    finite = B.is_finite(x)
    n_finite = _count(finite)
    # Scalars broadcast in `tf.where`: no tensor-sized fill in the graph.
    xz = B.where(finite, x, B.constant(0.0, B.float64))
    nan = B.constant(np.nan, B.float64)
    none_finite = B.equal(n_finite, 0)
    mean = B.reduce_sum(xz) / n_finite if {"mean", "std"} & set(stats) else None

    def std():
        dev = B.where(finite, x - mean, B.constant(0.0, B.float64))
        return B.sqrt(B.reduce_sum(B.square(dev)) / n_finite)

    def extreme(reduce, fill):
        value = reduce(B.where(finite, x, B.constant(fill, B.float64)))
        return B.where(none_finite, nan, value)

    # Only the statistics asked for become graph ops (trace time grows with them).
    out = {
        "mean": lambda: mean,
        "l2_norm": lambda: _nonfinite_norm(x, B.sqrt(B.reduce_sum(B.square(xz)))),
        "std": std,
        "min": lambda: extreme(B.reduce_min, np.inf),
        "max": lambda: extreme(B.reduce_max, -np.inf),
        "mean_abs": lambda: B.reduce_sum(B.abs(xz)) / n_finite,
        "zero_fraction": lambda: _count(B.equal(x, 0)) / B.cast(B.size(x), B.float64),
        "nan_count": lambda: _count(B.is_nan(x)),
        "inf_count": lambda: _count(B.is_inf(x)),
    }
    quantiles = {}
    if any(s in QUANTILES for s in stats):
        quantiles = _quantiles(
            B.where(finite, x, B.constant(np.inf, B.float64)), n_finite, stats)
    return B.stack([quantiles[s] if s in quantiles else out[s]() for s in stats])


def _masked_rows(packed: Packed, stats: Tuple[str, ...]) -> Tensor:
    """`[len(packed), len(stats)]` masked statistics of the non-empty
    tensors, with `_empty_row` for the empty ones; one tensor (a tap's
    activation) takes `_masked`, whose graph is about half the size."""
    if len(packed.order) == 1:
        table = B.reshape(_masked(packed.vectors[0], stats), [1, len(stats)])
    else:
        table = _masked_all(packed, stats)
    return _placed(table, packed, _empty_row(stats))


def _masked_all(packed: Packed, stats: Tuple[str, ...]) -> Tensor:
    """`_masked` of every non-empty tensor of `packed`, in its `order`, as
    `[k, len(stats)]`.

    One concatenation and segment reductions: the graph does not grow with
    the number of tensors. This branch runs only when some value is not
    finite, but it is traced and, under XLA, compiled at every trace.
    """
    k = len(packed.order)
    x = B.concat([B.cast(v, B.float64) for v in packed.vectors], 0)
    # The segment ids of a group of small tensors are a constant (their
    # elements are few); a large tensor's are one fill (`tf.repeat` gives XLA
    # indices of the wrong length), not a constant the size of the tensor.
    ids, sizes, first = [], [], 0
    for vector, (positions, counts) in zip(packed.vectors, packed.groups):
        if len(positions) > 1:
            ids.append(B.constant(np.repeat(np.arange(first, first + len(counts),
                                                      dtype=np.int32), counts)))
            sizes += list(counts)
        else:
            ids.append(B.fill(B.shape(vector), first))
            sizes.append(counts[0] if counts[0] is not None else B.size(vector))
        first += len(positions)
    ids = ids[0] if len(ids) == 1 else B.concat(ids, 0)
    sizes = B.constant(sizes, B.int32) if all(isinstance(n, int) for n in sizes) else B.stack(
        [B.cast(n, B.int32) for n in sizes])
    flats = packed.pieces

    def total(values):
        return B.segment_sum(values, ids, k)

    finite = B.is_finite(x)
    n_finite = total(B.cast(finite, B.float64))
    xz = B.where(finite, x, B.constant(0.0, B.float64))
    nan = B.constant(np.nan, B.float64)
    mean = total(xz) / n_finite if {"mean", "std"} & set(stats) else None

    def nonfinite(name):
        test = B.is_nan if name == "nan" else B.is_inf
        return total(B.cast(test(x), B.float64))

    def l2_norm():
        norm = B.sqrt(total(B.square(xz)))
        return B.where(nonfinite("nan") > 0, nan,
                        B.where(nonfinite("inf") > 0, B.constant(np.inf, B.float64), norm))

    def std():
        dev = B.where(finite, x - B.gather(mean, ids), B.constant(0.0, B.float64))
        return B.sqrt(total(B.square(dev)) / n_finite)

    def extreme(reduce, fill):
        value = reduce(B.where(finite, x, B.constant(fill, B.float64)), ids, k)
        return B.where(B.equal(n_finite, 0), nan, value)

    out = {
        "mean": lambda: mean,
        "l2_norm": l2_norm,
        "std": std,
        "min": lambda: extreme(B.segment_min, np.inf),
        "max": lambda: extreme(B.segment_max, -np.inf),
        "mean_abs": lambda: total(B.abs(xz)) / n_finite,
        "zero_fraction": lambda: total(B.cast(B.equal(x, 0), B.float64)) / B.cast(
            sizes, B.float64),
        "nan_count": lambda: nonfinite("nan"),
        "inf_count": lambda: nonfinite("inf"),
    }
    columns = {s: out[s]() for s in stats if s in out}
    wanted = [s for s in stats if s in QUANTILES]
    if wanted:
        rows = []
        for f in flats():
            f = B.cast(f, B.float64)
            ok = B.is_finite(f)
            rows.append(_quantiles(B.where(ok, f, B.constant(np.inf, B.float64)),
                                   _count(ok), stats))
        for name in wanted:
            columns[name] = B.stack([row[name] for row in rows])
    return B.stack([columns[s] for s in stats], axis=1)


NORM_STATISTICS = ("l2_norm", "nan_count", "inf_count")
"""The statistics of the lean path: one reduction per tensor gives them all
when it is finite (the counts are then 0)."""

SQUARES_BY_L2_LOSS = 1 << 18
"""From this many elements on, the sum of squares is taken by `L2Loss` (one
pass, no temporary); below it, `Sum(Square(x))` is faster on CPU (measured:
102,400 elements, 2.7 us against 16.6 us per tensor; 1 M, 69 us against 38 us)."""


def _sum_of_squares(x: Tensor) -> Tensor:
    size = B.num_elements(x)
    if size is not None and size >= SQUARES_BY_L2_LOSS:
        return 2.0 * B.l2_loss(x)
    return B.reduce_sum(B.square(x))


def _norms(packed: Packed, stats: Tuple[str, ...]) -> Tensor:
    """`tensor_statistics` for `NORM_STATISTICS` only: one pass per tensor
    (or per group of small ones), the sum of squares beside the counts of the
    finite and the NaN elements."""
    raw, sizes = _reduced(packed, lambda x: _raw(x, stats),
                          lambda segments: segments.raw(stats))
    return _placed(_finish(raw, sizes, stats), packed, _empty_row(stats))


def _empty_values(stats: Tuple[str, ...]) -> list:
    zero_stats = ("l2_norm", "nan_count", "inf_count")  # the rest NaN
    return [0.0 if s in zero_stats else np.nan for s in stats]


def _empty_row(stats: Tuple[str, ...]) -> Tensor:
    return B.constant(_empty_values(stats), B.float64)


def _empty_rows(stats: Tuple[str, ...], count: int) -> Tensor:
    return B.constant(np.tile(np.asarray(_empty_values(stats), np.float64), (count, 1))
                      .reshape(count, len(stats)), B.float64)


def tensor_statistics(
    tensors: Sequence[TensorLike], stats: Sequence[str] = STATISTICS
) -> Tensor:
    """Computes statistics of each tensor, in-graph, in one fused step.

    Safe under XLA (`jit_compile=True`), inside `tf.function`, in a replica
    context and eagerly. Non-float tensors are cast to float32. See the module
    docstring for how non-finite and empty tensors are described.

    Args:
        tensors: the tensors (or `tf.IndexedSlices`) to describe, or a
            `Packed` of them.
        stats: names from `ALL_STATISTICS`, in the order of the output
            columns. Defaults to `STATISTICS` (all but the quantiles).

    Returns:
        A float64 tensor of shape `[len(tensors), len(stats)]`.

    Examples:
        >>> import tensorflow as tf
        >>> from kerasdbg.stats import tensor_statistics
        >>> tensor_statistics([tf.constant([3.0, -4.0, 0.0])],
        ...                   ["l2_norm", "min", "zero_fraction"]).numpy().round(3)
        array([[ 5.   , -4.   ,  0.333]])
    """
    stats = _checked(stats)
    if not len(tensors) or not stats:
        return B.zeros([len(tensors), len(stats)], B.float64)
    return fast_statistics(Packed.of(tensors), stats)[0]


def _checked(stats: Sequence[str]) -> Tuple[str, ...]:
    stats = tuple(stats)
    unknown = [s for s in stats if s not in ALL_STATISTICS]
    if unknown:
        raise ValueError(
            f"tensor_statistics: `stats` must name statistics from "
            f"{', '.join(ALL_STATISTICS)}. Received: stats={list(stats)!r}"
        )
    return stats


def flat_tensors(tensors: Sequence[TensorLike]) -> list:
    """The tensors as `fast_statistics` and `masked_statistics` take them:
    dense, floating point, flattened, cut from the gradient."""
    return [_flat(t) for t in tensors]


def fast_statistics(packed: Any, stats: Sequence[str]) -> Tuple[Tensor, Any]:
    """`(table, True)`: `tensor_statistics` of the tensors of `packed` (a
    `Packed`, or tensors to pack), one masked pass each, with no condition;
    the second value, always True, is kept for the captures that once chose
    between this and `masked_statistics` on it."""
    stats = _checked(stats)
    packed = Packed.of(packed)
    if set(stats) <= set(NORM_STATISTICS):
        with B.name_scope("kerasdbg_norms"):
            if not packed.order:
                return B.zeros([len(packed), len(stats)], B.float64), True
            return _norms(packed, stats), True
    if not packed.order:
        return _empty_rows(stats, len(packed)), True
    with B.name_scope("kerasdbg_statistics"):
        raw, sizes = _reduced(packed, lambda x: _raw(x, stats),
                              lambda segments: segments.raw(stats))
        fast = _finish(raw, sizes, stats)
        wanted = [s for s in stats if s in QUANTILES]
        if wanted:
            rows = []
            for x in packed.pieces():
                finite = B.is_finite(x)
                rows.append(_quantiles(B.where(finite, x, B.constant(np.inf, x.dtype)),
                                       _count(finite), stats))
            fast = B.scatter_update(
                B.transpose(fast),
                [[stats.index(s)] for s in wanted],
                B.stack([B.stack([row[s] for row in rows]) for s in wanted]),
            )
            fast = B.transpose(fast)
        return _placed(fast, packed, _empty_row(stats)), True


def masked_statistics(packed: Any, stats: Sequence[str]) -> Tensor:
    """`tensor_statistics` of the tensors of `packed` (a `Packed`, or
    tensors to pack) by the masked float64 path: right whatever the values,
    at more passes over memory (see `fast_statistics`)."""
    stats = _checked(stats)
    packed = Packed.of(packed)
    if not packed.order:
        return _empty_rows(stats, len(packed))
    with B.name_scope("kerasdbg_masked_statistics"):
        return _masked_rows(packed, stats)


def histograms(
    tensors: Sequence[TensorLike], bins: int = DEFAULT_HISTOGRAM_BINS
) -> Tuple[Tensor, Tensor]:
    """Bins each tensor's finite values into equal-width bins, in-graph.

    The bins of a tensor span its finite minimum to maximum (a constant tensor
    gets one zero-width range, all counts in the first bin). Non-finite values
    are left out. Uses only XLA-compatible ops (no `tf.histogram_fixed_width`).

    Args:
        tensors: the tensors (or `tf.IndexedSlices`) to bin.
        bins: number of bins. Defaults to `30`, as TensorBoard.

    Returns:
        `(counts, ranges)`: float64 tensors of shapes `[len(tensors), bins]`
        and `[len(tensors), 2]` (finite min and max; NaN when none is finite).

    Examples:
        >>> import tensorflow as tf
        >>> from kerasdbg.stats import histograms
        >>> counts, ranges = histograms([tf.constant([0.0, 1.0, 1.0, 4.0])], bins=4)
        >>> counts.numpy(), ranges.numpy()
        (array([[1., 2., 0., 1.]]), array([[0., 4.]]))
    """
    all_counts, all_ranges = [], []
    with B.name_scope("kerasdbg_histograms"):
        for tensor in tensors:
            x = _flat(tensor)
            if B.num_elements(x) == 0:
                all_counts.append(B.zeros([bins], B.float64))
                all_ranges.append(B.constant([np.nan, np.nan], B.float64))
                continue
            finite = B.is_finite(x)
            low = B.reduce_min(B.where(finite, x, B.fill(B.shape(x), B.constant(np.inf, x.dtype))))
            high = B.reduce_max(B.where(finite, x, B.fill(B.shape(x), B.constant(-np.inf, x.dtype))))
            width = high - low
            scaled = B.where(
                finite & (width > 0), (x - low) / width * bins, B.zeros_like(x)
            )
            index = B.clip_by_value(B.cast(B.floor(scaled), B.int32), 0, bins - 1)
            index = B.where(finite, index, bins)
            counts = B.segment_sum(
                B.ones_like(x, B.float64), index, bins + 1
            )[:bins]
            none_finite = B.logical_not(B.reduce_any(finite))
            nan = B.constant(np.nan, B.float64)
            bounds = B.stack([B.cast(low, B.float64), B.cast(high, B.float64)])
            all_counts.append(counts)
            all_ranges.append(B.where(none_finite, B.stack([nan, nan]), bounds))
        return B.stack(all_counts), B.stack(all_ranges)
