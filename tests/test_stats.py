"""kerasdbg.stats against NumPy, eagerly, in tf.function and under XLA."""

import numpy as np
import pytest
import tensorflow as tf

from kerasdbg import stats as stats_lib
from tests.conftest import assert_stats_close, reference_stats

RNG = np.random.default_rng(0)

CASES = {
    "normal": RNG.normal(size=(7, 5)).astype("float32"),
    "with_zeros": np.where(RNG.random((50,)) < 0.3, 0, RNG.normal(size=(50,))).astype("float32"),
    "batchnorm_gamma": (1.0 + 1e-4 * RNG.normal(size=(64,))).astype("float32"),
    "constant": np.full((4, 4), 3.0, "float32"),
    "nan_and_inf": np.array([1.0, np.nan, -2.0, np.inf, 0.0, -np.inf, np.nan], "float32"),
    "all_nan": np.full((3,), np.nan, "float32"),
    "overflowing_sum": np.array([3e38, 3e38, -1.0], "float32"),
    "single": np.array([-2.5], "float32"),
    "float64": RNG.normal(size=(6,)).astype("float64"),
    "int": np.array([0, 3, -4, 0], "int32"),
    "empty": np.zeros((0, 3), "float32"),
    # Large tensors, each reduced on its own: a spread, a mean far above the
    # spread (the centered second pass), NaN among many values.
    "large_with_zeros": np.where(RNG.random((300, 400)) < 0.1, 0,
                                 RNG.normal(0.1, 2.0, size=(300, 400))).astype("float32"),
    "large_offset": (1.0 + 1e-3 * RNG.normal(size=(70_000,))).astype("float32"),
    "large_with_nan": np.where(RNG.random((70_000,)) < 1e-4, np.nan,
                               RNG.normal(size=(70_000,))).astype("float32"),
}

MODES = {
    "eager": lambda f: f,
    "function": lambda f: tf.function(f),
    "xla": lambda f: tf.function(f, jit_compile=True),
}


def in_float32(name: str, expected: dict) -> dict:
    """`expected` as the one pass in float32 gives it: the sums of
    "overflowing_sum" ([3e38, 3e38, -1]) overflow float32 and read as
    infinite (its counts say no element is: `masked_statistics` is exact)."""
    if name != "overflowing_sum":
        return expected
    return dict(expected, l2_norm=np.inf, mean=np.inf, std=np.inf, mean_abs=np.inf)


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_statistics_match_numpy(mode):
    names = list(CASES)
    arrays = [CASES[n] for n in names]
    compute = MODES[mode](lambda *ts: stats_lib.tensor_statistics(list(ts)))
    table = compute(*[tf.constant(a) for a in arrays]).numpy()
    assert table.shape == (len(arrays), len(stats_lib.STATISTICS))
    for name, array, row in zip(names, arrays, table):
        expected = reference_stats(array)
        if name == "empty":
            expected = dict(expected, l2_norm=0.0)
        finite = np.asarray(array, np.float64)[np.isfinite(np.asarray(array, np.float64))]
        scale = float(np.max(np.abs(finite))) if finite.size else 1.0
        assert_stats_close(dict(zip(stats_lib.STATISTICS, row)), in_float32(name, expected),
                           scale, name)


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("together", [True, False], ids=["together", "alone"])
def test_the_norm_statistics_take_their_own_path_and_match_numpy(mode, together):
    """l2 norm and NaN/Inf counts only (the every-step default): one sum of
    squares per tensor (`Sum(Square)` or `L2Loss` by size) beside two counts;
    every case, with others and alone."""
    names = list(CASES) + ["large_l2_loss", "indexed_slices"]
    arrays = dict(CASES, large_l2_loss=RNG.normal(size=(stats_lib.SQUARES_BY_L2_LOSS,)).astype(
        "float32"))
    stats = ("inf_count", "l2_norm", "nan_count")
    compute = MODES[mode](lambda *ts: stats_lib.tensor_statistics(list(ts), stats))
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 0]),
                              tf.constant([3, 2]))
    dense = {"indexed_slices": np.array([[4.0, 6.0], [0, 0], [0, 0]], "float32")}

    def tensor(name):
        return slices if name == "indexed_slices" else tf.constant(arrays[name])

    if together:
        rows = compute(*[tensor(n) for n in names]).numpy()
    else:
        rows = [compute(tensor(n)).numpy()[0] for n in names]
    for name, row in zip(names, rows):
        array = dense.get(name, arrays.get(name))
        expected = reference_stats(array)
        if name == "empty":
            expected = dict(expected, l2_norm=0.0)
        expected = in_float32(name, expected)
        got = dict(zip(stats, row))
        for statistic in stats:
            np.testing.assert_allclose(got[statistic], expected[statistic], rtol=1e-5,
                                       err_msg=f"{name} {statistic}")


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_each_finite_tensor_alone_takes_the_fast_path_and_matches_numpy(mode):
    """Each finite tensor alone: its statistics from its own reductions."""
    compute = MODES[mode](lambda t: stats_lib.tensor_statistics([t]))
    for name, array in CASES.items():
        if not np.all(np.isfinite(array)) or array.size == 0 or name == "overflowing_sum":
            continue
        row = compute(tf.constant(array)).numpy()[0]
        scale = float(np.max(np.abs(array)))
        assert_stats_close(dict(zip(stats_lib.STATISTICS, row)), reference_stats(array), scale,
                           name)


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("stats", [stats_lib.STATISTICS, ("l2_norm", "nan_count", "inf_count")],
                         ids=["all", "norms"])
def test_finite_tensors_together_take_the_fast_path_and_match_numpy(mode, stats):
    """Every finite case in one call: the small ones (up to
    `stats_lib.SEGMENTED` elements) are reduced together per dtype, by
    segment reductions of one concatenation, the others one by one; each
    row still matches NumPy, in the order given."""
    names = [n for n, a in CASES.items() if np.all(np.isfinite(a)) and n != "overflowing_sum"]
    names += ["small_too"]
    arrays = dict(CASES, small_too=RNG.normal(3.0, 0.5, size=(stats_lib.SEGMENTED,)).astype(
        "float32"))
    compute = MODES[mode](lambda *ts: stats_lib.tensor_statistics(list(ts), stats))
    table = compute(*[tf.constant(arrays[n]) for n in names]).numpy()
    for name, row in zip(names, table):
        array = arrays[name]
        expected = reference_stats(array)
        if name == "empty":
            expected = dict(expected, l2_norm=0.0)
        scale = float(np.max(np.abs(array))) if array.size else 1.0
        got = dict(zip(stats, row))
        assert_stats_close(got, {s: expected[s] for s in stats}, scale, name)


def test_small_tensors_are_reduced_together():
    """Thirty small tensors (10 to 39 elements: one padded matrix, 64 wide):
    each sum a statistic needs taken once over the matrix, not per tensor,
    and no segment reduction (a scatter). In a graph XLA does not compile,
    one reduction each (under XLA's CPU compiler, the sums are one
    matrix-vector product: tests/test_tf_ops.py)."""
    tensors = [tf.constant(RNG.normal(size=(10 + i,)).astype("float32")) for i in range(30)]
    # finite, nan, sum, sumsq, abs_sum, zeros and the centered sum; the sum of squares.
    for stats, sums in ((stats_lib.STATISTICS, 7), (("l2_norm",), 1)):
        graph = tf.function(lambda *ts: stats_lib.tensor_statistics(list(ts), stats)) \
            .get_concrete_function(*tensors).graph
        ops = [op.type for op in graph.get_operations()]
        assert not [op for op in ops if op.startswith("UnsortedSegment")], stats
        assert ops.count("GatherV2") == 1, stats
        assert ops.count("Sum") + ops.count("L2Loss") == sums, stats
        assert ops.count("Min") == ops.count("Max") == (sums > 1), stats


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_quantiles_match_numpy_percentile_of_the_finite_elements(mode):
    names = list(CASES)
    arrays = [CASES[n] for n in names]
    quantiles = list(stats_lib.QUANTILES)
    compute = MODES[mode](lambda *ts: stats_lib.tensor_statistics(list(ts), quantiles + ["max"]))
    table = compute(*[tf.constant(a) for a in arrays]).numpy()
    for name, array, row in zip(names, arrays, table):
        values = np.asarray(array, np.float64).ravel()
        finite = values[np.isfinite(values)]
        expected = (np.percentile(finite, [5, 50, 95]) if finite.size
                    else np.full(3, np.nan))
        np.testing.assert_allclose(row[:3], expected, rtol=1e-6, err_msg=name)
    assert stats_lib.ALL_STATISTICS == stats_lib.STATISTICS + ("p05", "p50", "p95")


def test_mixed_finite_and_nonfinite_tensors_each_get_exact_stats():
    # One non-finite tensor sends every tensor through the masked path; the
    # finite ones must not change.
    clean = RNG.normal(size=(100,)).astype("float32")
    dirty = np.array([np.nan, 1.0], "float32")
    together = stats_lib.tensor_statistics([tf.constant(clean), tf.constant(dirty)]).numpy()
    alone = stats_lib.tensor_statistics([tf.constant(clean)]).numpy()
    np.testing.assert_allclose(together[0], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_indexed_slices_describe_the_dense_gradient(mode):
    values = tf.constant(RNG.normal(size=(4, 3)).astype("float32"))
    indices = tf.constant([1, 5, 1, 7])  # a duplicate index is summed
    slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([10, 3]))
    dense = np.zeros((10, 3))
    for i, row in zip(indices.numpy(), values.numpy()):
        dense[i] += row
    compute = MODES[mode](lambda v, i: stats_lib.tensor_statistics(
        [tf.IndexedSlices(v, i, dense_shape=tf.constant([10, 3]))]))
    row = compute(values, indices).numpy()[0]
    assert_stats_close(dict(zip(stats_lib.STATISTICS, row)), reference_stats(dense), 3.0)
    assert slices.values.shape == (4, 3)


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_tensors_of_unknown_size_match_numpy(mode):
    # Taps see a batch dimension unknown at trace time: no static element
    # count, so no one-pass variance and no float32 count.
    arrays = [CASES["normal"], CASES["batchnorm_gamma"].reshape(8, 8),
              CASES["large_offset"].reshape(700, 100)]
    signature = [tf.TensorSpec([None, None], tf.float32)] * len(arrays)
    compute = MODES[mode](lambda *ts: stats_lib.tensor_statistics(list(ts)))
    table = tf.function(compute, input_signature=signature)(*arrays).numpy()
    for array, row in zip(arrays, table):
        assert_stats_close(dict(zip(stats_lib.STATISTICS, row)), reference_stats(array),
                           float(np.max(np.abs(array))))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_zero_fraction_is_exact_where_a_float32_count_would_not_be(mode):
    size = (1 << 24) + 7  # a float32 sum of a 0/1 mask is exact below 2**24 elements
    array = np.ones(size, "float32")
    array[::3] = 0.0
    zeros = len(array[::3])
    compute = MODES[mode](lambda t: stats_lib.tensor_statistics([t], ["zero_fraction"]))
    fraction = compute(tf.constant(array)).numpy()[0, 0]
    assert round(fraction * size) == zeros
    assert fraction == zeros / size


def test_a_sum_that_overflows_float32_reads_as_infinite_and_masked_statistics_is_exact():
    """The one pass sums in the tensor's precision: beyond float32's range a
    sum reads as infinite, with counts that say no element is;
    `masked_statistics` sums in float64."""
    x = tf.constant([3e38, -3e38, 1.0], tf.float32)  # the plain sum is finite
    stats = ["mean", "mean_abs", "l2_norm", "inf_count", "nan_count"]
    row = stats_lib.tensor_statistics([x], stats).numpy()[0]
    np.testing.assert_allclose(row, [1 / 3, np.inf, np.inf, 0, 0], rtol=1e-6)
    exact = stats_lib.masked_statistics([x], stats).numpy()[0]
    np.testing.assert_allclose(exact, [1 / 3, (6e38 + 1) / 3, np.sqrt(18e76 + 1), 0, 0],
                               rtol=1e-6)


def test_subset_of_statistics_in_requested_order():
    x = tf.constant([3.0, -4.0, 0.0])
    row = stats_lib.tensor_statistics([x], ["zero_fraction", "l2_norm", "max"]).numpy()[0]
    np.testing.assert_allclose(row, [1 / 3, 5.0, 3.0], rtol=1e-6)


def test_no_tensors_or_no_statistics_give_an_empty_table():
    assert stats_lib.tensor_statistics([], ["mean"]).shape == (0, 1)
    assert stats_lib.tensor_statistics([tf.constant([1.0]), tf.constant([2.0])], []).shape == (2, 0)


def test_unknown_statistic_is_refused():
    with pytest.raises(ValueError, match=r"`stats` must name statistics from .*Received: stats=\['median'\]"):
        stats_lib.tensor_statistics([tf.constant([1.0])], ["median"])


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_histograms_match_numpy(mode):
    arrays = [
        RNG.normal(size=(200,)).astype("float32"),
        np.array([1.0, np.nan, 2.0, np.inf, 2.0], "float32"),
        np.full((5,), 7.0, "float32"),
        np.full((2,), np.nan, "float32"),
    ]
    compute = MODES[mode](lambda *ts: stats_lib.histograms(list(ts), bins=8))
    counts, ranges = compute(*[tf.constant(a) for a in arrays])
    counts, ranges = counts.numpy(), ranges.numpy()
    for array, row, (low, high) in zip(arrays[:2], counts, ranges):
        finite = array[np.isfinite(array)].astype(np.float64)
        want, _ = np.histogram(finite, bins=8, range=(finite.min(), finite.max()))
        np.testing.assert_array_equal(row, want)
        assert (low, high) == (finite.min(), finite.max())
    np.testing.assert_array_equal(counts[2], [5, 0, 0, 0, 0, 0, 0, 0])
    assert np.isnan(ranges[3]).all() and counts[3].sum() == 0


def test_every_statistic_a_user_can_ask_for_is_listed_in_stats():
    from kerasdbg import stats as stats_lib
    from kerasdbg.callbacks import weight_statistics
    from kerasdbg.callbacks.gradient_statistics import GradientStatistics
    from kerasdbg.layers import tap_layer

    asked = (set(GradientStatistics.allowed_stats)
             | set(weight_statistics.ALLOWED_WEIGHT_STATISTICS) | set(tap_layer.HEALTH))
    assert asked == set(stats_lib.EVERY_STATISTIC)
    assert len(stats_lib.EVERY_STATISTIC) == len(set(stats_lib.EVERY_STATISTIC))
    for name in ("update_ratio", "distance_from_start", "dead_fraction", "saturated_fraction"):
        assert f"`{name}`" in stats_lib.__doc__
