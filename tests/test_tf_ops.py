"""TensorFlow's array functions that take another form under XLA
(`kerasdbg.backends.tensorflow.ops`): the same values eagerly, in a graph
and jit-compiled, against NumPy; and the form each takes in XLA's program."""

import re

import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.backends.tensorflow import ops

MODES = {
    "eager": lambda f: f,
    "graph": lambda f: tf.function(f),
    "jit": lambda f: tf.function(f, jit_compile=True),
}
RNG = np.random.default_rng(11)


def _entry_ops(function, *args):
    """The instructions of the jit-compiled function's optimized entry computation."""
    text = function.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    return re.findall(r"= \S+ ([a-z-]+)\(", text[text.index("ENTRY"):])


@pytest.mark.parametrize("mode", list(MODES))
def test_row_sums_of_several_terms_equal_numpy_rounded_once(mode):
    terms = [RNG.normal(size=(5, 4096)).astype("float32") * 10 ** e for e in (0, 3, -3)]
    terms.append(np.where(RNG.random((5, 4096)) < 0.5, 1.0, 0.0).astype("float32"))
    sums = MODES[mode](lambda *ts: ops.reduce_sums(list(ts), axis=1))(*terms)
    for got, term in zip(sums, terms):
        assert got.dtype == tf.float32
        want = term.astype(np.float64).sum(axis=1).astype(np.float32)
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-7)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_sum_beyond_float32_is_inf_as_a_float32_reduction_makes_it(mode):
    big = np.full((2, 64), 3e37, np.float32)
    big[1] = 1.0
    got = MODES[mode](lambda t: ops.reduce_sums([t], axis=1))(big)[0].numpy()
    assert np.isinf(got[0]) and got[1] == 64.0


def test_the_row_sums_are_one_dot_under_xla():
    terms = [tf.constant(RNG.normal(size=(3, 4096)).astype("float32")) for _ in range(3)]
    function = tf.function(lambda *ts: ops.reduce_sums(list(ts), axis=1), jit_compile=True)
    found = _entry_ops(function, *terms)
    assert found.count("dot") == 1, found
    plain = tf.function(lambda *ts: [tf.reduce_sum(t, 1) for t in ts], jit_compile=True)
    # XLA's CPU compiler makes each plain reduction a chain of partial sums.
    assert _entry_ops(plain, *terms).count("fusion") > found.count("fusion") + 3


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_all_finite_says_whether_every_element_is(mode, dtype):
    function = MODES[mode](ops.all_finite)
    cases = {
        "finite": np.ones(1000),
        "large finite": np.r_[np.full(500, np.finfo(dtype).max),
                              np.full(500, -np.finfo(dtype).max)],
        "one nan": np.r_[np.ones(999), np.nan],
        "one inf": np.r_[np.inf, np.ones(999)],
        "one -inf": np.r_[np.ones(500), -np.inf, np.ones(499)],
        "short with nan": np.array([1.0, np.nan]),
        "short": np.array([1.0, 2.0]),
    }
    for name, values in cases.items():
        values = values.astype(dtype)
        assert bool(function(tf.constant(values))) == bool(np.isfinite(values).all()), name


def test_all_finite_is_a_dot_under_xla():
    x = tf.constant(np.ones(6922, np.float32))
    found = _entry_ops(tf.function(ops.all_finite, jit_compile=True), x)
    assert "dot" in found and "reduce-window" not in " ".join(found), found
    plain = tf.function(lambda v: tf.reduce_all(tf.math.is_finite(v)), jit_compile=True)
    assert len(_entry_ops(plain, x)) > len(found)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_stack_small_equals_tf_stack(mode, axis):
    columns = [RNG.normal(size=(3,)).astype("float64") for _ in range(9)]
    columns[4][1] = np.nan
    columns[6][0] = -np.inf
    got = MODES[mode](lambda *cs: ops.stack_small(list(cs), axis=axis))(*columns).numpy()
    np.testing.assert_array_equal(got, np.stack(columns, axis=axis))
    scalars = [np.int64(i * 7) for i in range(39)]
    got = MODES[mode](lambda *ss: ops.stack_small(list(ss)))(*scalars).numpy()
    np.testing.assert_array_equal(got, np.stack(scalars))


def test_stack_small_is_a_plain_stack_for_mixed_or_unknown_shapes():
    assert ops.stack_small([tf.ones([2]), tf.zeros([2])]).numpy().tolist() == [[1, 1], [0, 0]]
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        ops.stack_small([tf.ones([2]), tf.zeros([3])])


def test_stack_small_fuses_its_operands_under_xla():
    """39 scalars cast to float64: one fusion, no concatenation, where
    `tf.stack` makes a kernel of each cast and a concatenation."""
    values = [tf.constant(float(i)) for i in range(39)]

    def row(function):
        return tf.function(lambda *vs: function([tf.cast(v * 2, tf.float64) for v in vs]),
                           jit_compile=True)

    fused = _entry_ops(row(ops.stack_small), *values)
    stacked = _entry_ops(row(tf.stack), *values)
    assert "concatenate" not in fused and fused.count("fusion") == 1, fused
    assert stacked.count("fusion") + stacked.count("concatenate") > 10, stacked
