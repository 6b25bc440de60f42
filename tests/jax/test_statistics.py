"""The in-graph statistics on JAX, jitted as a step computes them, against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kerasdbg import stats as stats_lib
from kerasdbg.backends.jax import ops as jax_ops
from tests.conftest import assert_stats_close, reference_stats

RNG = np.random.default_rng(7)


def tensors_with_faults():
    """Small tensors reduced together (one 4,096-wide padded matrix and a
    narrower one), each with its own mix of NaN, Inf and zeros, and one tensor
    large enough to be reduced alone."""
    out = []
    for size in (4096, 4096, 4096, 600, 64, 10, 9000):
        out.append(RNG.normal(size=size).astype("float32"))
    out[0][:] = np.inf  # every element infinite, the widest row: the count's upper bound
    out[0][::2] = -np.inf
    out[1][:] = np.nan
    out[2][[5, 17, 4000]] = [np.nan, np.inf, -np.inf]
    out[2][100:110] = 0.0
    out[3][[0, 1]] = [np.nan, np.nan]
    out[3][2:9] = np.inf
    out[4][3] = 0.0
    out[6][[8, 8999]] = [np.nan, -np.inf]
    return out


def test_the_counts_of_packed_rows_come_from_one_integer_sum_and_match_numpy():
    assert jax_ops.counts_in_one_sum()
    tensors = tensors_with_faults()
    table = np.asarray(jax.jit(lambda ts: stats_lib.tensor_statistics(ts, stats_lib.STATISTICS))(
        [jnp.asarray(t) for t in tensors]))
    for i, tensor in enumerate(tensors):
        got = dict(zip(stats_lib.STATISTICS, table[i]))
        scale = float(np.max(np.abs(tensor[np.isfinite(tensor)]), initial=1.0))
        assert_stats_close(got, reference_stats(tensor), scale, where=f"tensor {i}")


def test_the_change_of_each_tensor_is_taken_on_the_packed_tensors_and_matches_numpy():
    after = tensors_with_faults()[2:] + [RNG.normal(size=(64, 64)).astype("float32")]
    before = [a + RNG.normal(size=a.shape).astype("float32") * 0.01 for a in after]
    before[-1] = after[-1].copy()  # unchanged: a norm of exactly 0

    def norms(after, before):
        packed = stats_lib.Packed.of(after)
        return stats_lib.tensor_statistics(packed.less(stats_lib.Packed.of(before)),
                                           ["l2_norm", "nan_count", "inf_count"])

    got = np.asarray(jax.jit(norms)([jnp.asarray(a) for a in after],
                                    [jnp.asarray(b) for b in before]))
    for i, (a, b) in enumerate(zip(after, before)):
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, as in float32
            want = reference_stats(a.astype(np.float64) - b.astype(np.float64))
        np.testing.assert_allclose(got[i, 1:], [want["nan_count"], want["inf_count"]],
                                   err_msg=f"tensor {i}")
        np.testing.assert_allclose(got[i, 0], want["l2_norm"], rtol=1e-5, err_msg=f"tensor {i}")
    assert got[-1, 0] == 0.0


@pytest.mark.parametrize("width", [64, 4096])
def test_a_row_of_every_kind_of_element_is_counted_exactly(width):
    row = np.zeros(width, np.float32)
    row[: width // 2] = np.nan
    row[width // 2: width - 1] = np.inf
    table = np.asarray(jax.jit(lambda t: stats_lib.tensor_statistics(
        [t, t[:7]], ["nan_count", "inf_count", "zero_fraction"]))(jnp.asarray(row)))
    np.testing.assert_array_equal(table[0], [width // 2, width // 2 - 1, 1.0 / width])
    np.testing.assert_array_equal(table[1], [7, 0, 0.0])
