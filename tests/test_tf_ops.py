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
# The dot products are XLA's CPU compiler's forms; where XLA compiles for a
# GPU or TPU the plain reductions stay.
ON_CPU = not (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))


def _entry_ops(function, *args):
    """The instructions of the jit-compiled function's optimized entry computation."""
    text = function.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    return re.findall(r"= \S+ ([a-z-]+)\(", text[text.index("ENTRY"):])


@pytest.mark.parametrize("mode", list(MODES))
def test_row_sums_of_several_terms_equal_numpy_rounded_once(mode):
    terms = [RNG.normal(size=(5, 4096)).astype("float32") * 10 ** e for e in (0, 3, -3)]
    terms.append(np.where(RNG.random((5, 4096)) < 0.5, 1.0, 0.0).astype("float32"))
    sums = MODES[mode](lambda *ts: ops.reduce_sums(list(ts), axis=1))(*terms)
    # Under XLA's CPU compiler: float64 sums, rounded once; else float32 reductions.
    once = mode == "jit" and ON_CPU
    for got, term in zip(sums, terms):
        assert got.dtype == tf.float32
        exact = term.astype(np.float64).sum(axis=1)
        if once:
            np.testing.assert_array_equal(got.numpy(), exact.astype(np.float32))
        else:
            scale = np.abs(term).astype(np.float64).sum(axis=1)
            assert (np.abs(got.numpy() - exact) <= 1e-6 * scale).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_sum_beyond_float32_is_inf_as_a_float32_reduction_makes_it(mode):
    big = np.full((2, 64), 3e37, np.float32)
    big[1] = 1.0
    got = MODES[mode](lambda t: ops.reduce_sums([t], axis=1))(big)[0].numpy()
    assert np.isinf(got[0]) and got[1] == 64.0


def test_the_row_sums_are_one_dot_under_xlas_cpu_compiler():
    terms = [tf.constant(RNG.normal(size=(3, 4096)).astype("float32")) for _ in range(3)]
    function = tf.function(lambda *ts: ops.reduce_sums(list(ts), axis=1), jit_compile=True)
    found = _entry_ops(function, *terms)
    assert found.count("dot") == (1 if ON_CPU else 0), found
    if ON_CPU:
        plain = tf.function(lambda *ts: [tf.reduce_sum(t, 1) for t in ts], jit_compile=True)
        # XLA's CPU compiler makes each plain reduction a chain of partial sums.
        assert _entry_ops(plain, *terms).count("fusion") > found.count("fusion") + 3
    # Eagerly and in a graph XLA does not compile: a reduction each.
    graph = tf.function(lambda *ts: ops.reduce_sums(list(ts), axis=1)) \
        .get_concrete_function(*terms).graph
    kinds = [op.type for op in graph.get_operations()]
    assert kinds.count("Sum") == 3 and "MatMul" not in kinds, kinds


def test_row_sums_of_terms_of_other_shapes_or_integers_are_reductions_each():
    floats = [tf.ones([2, 64]), tf.ones([3, 64])]
    integers = [tf.ones([2, 64], tf.int64) * (2 ** 53 + 1)] * 2
    for terms in (floats, integers):
        function = tf.function(lambda *ts: ops.reduce_sums(list(ts), axis=1), jit_compile=True)
        assert "dot" not in _entry_ops(function, *terms)
        for got, term in zip(function(*terms), terms):
            np.testing.assert_array_equal(got.numpy(), term.numpy().sum(axis=1))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_all_finite_says_whether_every_element_is(mode, dtype):
    function = MODES[mode](ops.all_finite)
    largest = tf.as_dtype(dtype).max
    cases = {
        "finite": np.ones(1000),
        "large finite": np.r_[np.full(500, largest), np.full(500, -largest)],
        "one nan": np.r_[np.ones(999), np.nan],
        "one inf": np.r_[np.inf, np.ones(999)],
        "one -inf": np.r_[np.ones(500), -np.inf, np.ones(499)],
        "short with nan": np.array([1.0, np.nan]),
        "short": np.array([1.0, 2.0]),
    }
    for name, values in cases.items():
        tensor = tf.cast(tf.constant(values, tf.float64), dtype)
        assert bool(function(tensor)) == bool(np.isfinite(values).all()), name


def test_all_finite_is_a_dot_under_xlas_cpu_compiler():
    x = tf.constant(np.ones(6922, np.float32))
    found = _entry_ops(tf.function(ops.all_finite, jit_compile=True), x)
    assert ("dot" in found) == ON_CPU, found
    if ON_CPU:
        assert "reduce-window" not in " ".join(found), found
        plain = tf.function(lambda v: tf.reduce_all(tf.math.is_finite(v)), jit_compile=True)
        assert len(_entry_ops(plain, x)) > len(found)


def test_all_finite_of_a_large_vector_holds_no_constant_of_its_size():
    """The zeros are made in the program, not written into the graph (a
    model's gradients would have been copied into it as constants)."""
    spec = tf.TensorSpec([1 << 22], tf.float32)
    for jit in (True, False):
        graph = tf.function(ops.all_finite, jit_compile=jit).get_concrete_function(spec).graph
        assert graph.as_graph_def().ByteSize() < 20_000, jit


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


@pytest.mark.parametrize("mode", list(MODES))
def test_stack_small_refuses_what_tf_stack_refuses(mode):
    refused = {
        "shapes": lambda: ops.stack_small([tf.ones([2]), tf.zeros([3])]),
        "dtypes": lambda: ops.stack_small([tf.ones([2]), tf.zeros([2], tf.int32)]),
        "axis": lambda: ops.stack_small([tf.ones([2]), tf.zeros([2])], axis=2),
    }
    for name, make in refused.items():
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError, TypeError)):
            MODES[mode](make)()
            pytest.fail(name)


def test_stack_small_under_xla_stacks_unknown_shapes_and_many_values_as_tf_stack():
    spec = tf.TensorSpec([None], tf.float32)
    unknown = tf.function(lambda a, b: ops.stack_small([a, b]), jit_compile=True,
                          input_signature=[spec, spec])
    got = unknown(tf.constant([1.0, 2.0, 3.0]), tf.constant([4.0, 5.0, 6.0])).numpy()
    np.testing.assert_array_equal(got, [[1, 2, 3], [4, 5, 6]])
    many = [tf.constant(float(i)) for i in range(ops.STACK_SELECTS + 1)]
    function = tf.function(lambda *vs: ops.stack_small([v * 2 for v in vs]), jit_compile=True)
    np.testing.assert_array_equal(function(*many).numpy(), 2 * np.arange(len(many)))
    assert "concatenate" in _entry_ops(function, *many)


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
