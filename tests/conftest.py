"""Shared test set-up: two logical CPUs, the execution matrix, NumPy references."""

import contextlib
import faulthandler
import gc
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's oneDNN kernels off: with the two logical CPUs below sharing one
# thread pool, they make plain Keras under MirroredStrategy differ run to run
# in the last bit (measured on a loaded 2-core machine: a distillation port's
# weights after one fit, 6 of 7 fits 3e-08 from the first; 0 of 7 with
# oneDNN off, and 0 of 7 on the default strategy either way), and the tests
# compare a plain fit with an instrumented one bitwise. Set before TensorFlow
# is imported; an explicit setting is kept.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# The backend is an axis of the matrix, one process per backend (Keras fixes
# it at import): `KERAS_BACKEND=jax pytest` runs tests/jax/ on JAX, with two
# CPU devices for keras.distribution (set before JAX starts); any other run
# is TensorFlow's and leaves tests/jax/ out. `./run.sh test` runs both.
BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND == "jax":
    # Deterministic ops: on a GPU, XLA's default kernels (atomics, autotuned
    # convolution algorithms) make plain Keras itself differ run to run in
    # the last bits, and the tests compare a plain fit with an instrumented
    # one bitwise. No effect on CPU.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=2"
                               " --xla_gpu_deterministic_ops=true").strip()
    # Full float32 matrix products: a GPU's default (TF32) rounds them to about
    # 1e-3, beyond the tolerance of the NumPy references. No effect on CPU.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
TESTS = os.path.dirname(os.path.abspath(__file__))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if BACKEND == "jax":
    # The JAX run needs no TensorFlow (a JAX user's install has none); the
    # TensorFlow helpers below are for the TensorFlow run only.
    tf = None
else:
    import tensorflow as tf  # noqa: E402

    # Two replicas on one CPU for MirroredStrategy: must happen before TensorFlow
    # initialises its devices, so here, at import, once for the whole session.
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )

import keras  # noqa: E402

from kerasdbg.capture import reads as _reads  # noqa: E402

READ_INTERVAL = 1e6
"""The read interval of the tests (`kerasdbg.set_read_interval`): longer than
any test's fit, so the host reads after the first execution, when a ring is
full and at the epoch's and the fit's end: the same steps on a busy machine
as on an idle one (the default's 0.1 s of training makes where a stop lands
depend on the machine's speed). The time-based default is tested on its own
(tests/test_read_interval.py, and the killed-run child that keeps it)."""
_reads.set_read_interval(READ_INTERVAL)

MIRRORED_JIT_ERROR = (
    "Trying to access resource .../replica_1/... located in device CPU:1 from device "
    "CPU:0 (Keras/TF: MirroredStrategy with jit_compile=True fails with plain Keras fit "
    "too: tests/test_keras_limitations.py)"
)


# The exact failures of plain Keras behind the strict xfails (tests/test_keras_limitations.py).
MIRRORED_JIT_PATTERN = (
    r"Trying to access resource \S*/replica_1/\S* \(defined @ [^)]*\) "
    r"located in device \S*CPU:1 from device \S*CPU:0"
)
MIRRORED_COLLECTIVE_PATTERN = (
    r"You must feed a value for placeholder tensor '\S*while/cond/Placeholder(_\d+)?' with dtype int32"
)


@contextlib.contextmanager
def only_upstream_failure(strategy_name: str, jit: bool, collective: bool = False):
    """Lets through only the known Keras error of a combination Keras cannot run.

    Any other InvalidArgumentError becomes an AssertionError, so a strict xfail
    (raises=InvalidArgumentError) cannot hide a failure of kerasdbg's own.
    """
    pattern = None
    if strategy_name == "mirrored" and jit:
        pattern = MIRRORED_JIT_PATTERN
    elif strategy_name == "mirrored" and collective:
        pattern = MIRRORED_COLLECTIVE_PATTERN
    try:
        yield
    except tf.errors.InvalidArgumentError as error:
        if pattern is not None and re.search(pattern, str(error)):
            raise
        raise AssertionError(f"not the known Keras failure of this combination: {error}") from error


_COLLECTIVE_STRATEGY = []


def make_strategy(name: str, collective: bool = False):
    """The strategies of the execution matrix, by name.

    With `collective`, the one MirroredStrategy of this process that keeps
    the default (collective) all-reduce: each new such strategy numbers its
    collectives from the same instance keys, and TensorFlow fails a
    collective whose dtype differs from the one a former strategy ran at
    that key ("Collective instance 100 expected type 0 and data_type 2 but
    got type 0 and data_type 1"; plain Keras too: a float64 model's fit, then
    a float32 one's on a new strategy)."""
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if name == "mirrored":
        devices = ["/cpu:0", "/cpu:1"]
        if collective:
            if not _COLLECTIVE_STRATEGY:
                _COLLECTIVE_STRATEGY.append(tf.distribute.MirroredStrategy(devices))
            return _COLLECTIVE_STRATEGY[0]
        # Keras fails MirroredStrategy + steps_per_execution > 1 with the default
        # collective all-reduce (keras-team/keras#19246); ReductionToOneDevice works.
        return tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    raise ValueError(name)


RULE_MATRIX = [
    pytest.param(s, spe, id=f"{s}-spe{spe}") for s in ("default", "mirrored") for spe in (1, 4)
]
"""The (strategy, steps_per_execution) cases of the rule trainings."""


def repeated_batch(seed: int, batch: int, steps: int, features: int):
    """`(x, y)`: one random batch repeated `steps` times, so that with a
    learning rate of 0 every step has the same loss."""
    rng = np.random.default_rng(seed)
    x = np.tile(rng.normal(size=(batch, features)).astype("float32"), (steps, 1))
    y = np.tile(rng.normal(size=(batch, 1)).astype("float32"), (steps, 1))
    return x, y


def matrix():
    """(strategy, steps_per_execution, jit_compile) cases with readable ids."""
    cases = []
    for strategy in ("default", "one_device", "mirrored"):
        for spe in (1, 4):
            for jit in (False, True):
                marks = ()
                if strategy == "mirrored" and jit:
                    marks = pytest.mark.xfail(
                        strict=True, raises=tf.errors.InvalidArgumentError,
                        reason=MIRRORED_JIT_ERROR,
                    )
                cases.append(
                    pytest.param(strategy, spe, jit, marks=marks,
                                 id=f"{strategy}-spe{spe}-{'jit' if jit else 'nojit'}")
                )
    return cases


def reference_stats(array) -> dict:
    """The statistics of kerasdbg.stats, computed independently with NumPy."""
    a = np.asarray(array, dtype=np.float64).ravel()
    finite = a[np.isfinite(a)]
    n = a.size
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {
            # NaN when an element is NaN, else inf when one is infinite.
            "l2_norm": float(np.nan if np.isnan(a).any() else np.inf if np.isinf(a).any()
                             else np.sqrt(np.sum(finite ** 2))),
            "mean": float(np.mean(finite)) if finite.size else np.nan,
            "std": float(np.std(finite)) if finite.size else np.nan,
            "min": float(np.min(finite)) if finite.size else np.nan,
            "max": float(np.max(finite)) if finite.size else np.nan,
            "mean_abs": float(np.mean(np.abs(finite))) if finite.size else np.nan,
            "zero_fraction": float(np.sum(a == 0) / n) if n else np.nan,
            "nan_count": float(np.sum(np.isnan(a))),
            "inf_count": float(np.sum(np.isinf(a))),
        }
    return out


def assert_stats_close(actual: dict, expected: dict, scale: float, where: str = ""):
    """Compares statistics with rtol 1e-5 and an atol relative to the tensor's scale.

    `scale` is the magnitude of the tensor's elements (e.g. its max |x|): float32
    sums of mixed-sign values have absolute errors of that order times ~1e-7.
    """
    for name, want in expected.items():
        got = actual[name]
        atol = 1e-6 * scale if name in ("mean", "std", "min", "max", "mean_abs", "l2_norm") else 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=f"{where} {name}")


@pytest.fixture
def mixed_precision():
    """Sets the mixed_float16 policy for one test and restores the previous one."""
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    yield
    keras.mixed_precision.set_dtype_policy(previous)


_TESTS_SINCE_FULL_COLLECTION = [0]
FULL_COLLECTION_EVERY = 25


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Frees each test's models, graphs and strategies before the next one, cheaply.

    In one long process TensorFlow keeps some graphs of every `fit` alive (plain Keras
    too: about 18 per fit of a small MLP), and each garbage collection walks all of them:
    without this, later tests slow down many times over. After each test the survivors
    are frozen (`gc.freeze()`: out of the collector's way; reference counting still frees
    them); every `FULL_COLLECTION_EVERY` tests they are unfrozen and collected, so that
    cycles that died since (a model, its graphs) do not pile up.

    A test that failed (or xfailed) leaves its traceback in `sys.last_traceback`
    for post-mortem debugging, and its frames hold the test's model and its
    tf.data iterators: frozen, they would die at a later full collection, where
    TensorFlow's iterator destructor waits for the pipeline's autotuning thread
    (a stack dump showed it in `Model::OptimizeLoop`, on a timed wait): full
    collections of 35-80 s were seen. They are dropped here, so such a test's objects go with it.
    """
    yield
    # A test that set the read interval set it for itself.
    _reads.set_read_interval(READ_INTERVAL)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    keras.backend.clear_session()
    _TESTS_SINCE_FULL_COLLECTION[0] += 1
    if _TESTS_SINCE_FULL_COLLECTION[0] >= FULL_COLLECTION_EVERY:
        _TESTS_SINCE_FULL_COLLECTION[0] = 0
        gc.unfreeze()
    gc.collect()
    gc.freeze()


# A native crash (segfault) kills a test worker: pytest-xdist reports the test,
# and the worker's Python stacks go to its stderr, of which CI shows only the
# end. Each worker also writes them to a file; the run's summary prints them.
_CRASH_DIR = "KERASDBG_TEST_CRASH_DIR"


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if _CRASH_DIR not in os.environ:
            os.environ[_CRASH_DIR] = tempfile.mkdtemp(prefix="kerasdbg-test-crashes-")
            config.stash[_crash_dir_key] = os.environ[_CRASH_DIR]
        return
    directory = os.environ.get(_CRASH_DIR)
    if directory and os.path.isdir(directory):
        stream = open(os.path.join(directory, f"{worker}-{os.getpid()}.txt"), "w")
        config.stash[_crash_file_key] = stream
        faulthandler.enable(file=stream, all_threads=True)


_crash_dir_key = pytest.StashKey[str]()
# Frames of pytest, pluggy, xdist and execnet: the same in every stack.
_RUNNER_FRAME = re.compile(r'/(_pytest|pluggy|xdist|execnet)/|File "<string>"')
_crash_file_key = pytest.StashKey[object]()


def pytest_terminal_summary(terminalreporter, config):
    directory = config.stash.get(_crash_dir_key, None)
    if directory is None:
        return
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as stream:
            text = stream.read()
        if text.strip():
            # The module list at the end says nothing about the crash.
            text = text.split("\nExtension modules:")[0]
            lines = [line for line in text.splitlines() if not _RUNNER_FRAME.search(line)]
            terminalreporter.write_sep("=", f"native crash in test worker {name[:-4]}")
            terminalreporter.write_line("\n".join(lines))


def pytest_collection_modifyitems(session, config, items):
    """Asked for tests/jax/ on another backend: say so, never run nothing quietly."""
    jax_dir = os.path.join(TESTS, "jax")
    asked = [os.path.abspath(a.split("::")[0]) for a in config.args]
    if BACKEND != "jax" and any(a == jax_dir or a.startswith(jax_dir + os.sep) for a in asked):
        raise pytest.UsageError(
            f"tests/jax/ runs on the JAX backend; Keras runs on {BACKEND!r} here. Run it with "
            "KERAS_BACKEND=jax (./run.sh test runs both backends).")


def pytest_ignore_collect(collection_path, config):
    """tests/jax/ on the JAX backend, the rest on TensorFlow (see BACKEND)."""
    path = os.path.abspath(str(collection_path))
    if path == TESTS or not path.startswith(TESTS + os.sep):
        return None
    on_jax = os.path.relpath(path, TESTS).split(os.sep)[0] == "jax"
    if BACKEND == "jax":
        return None if on_jax else True
    return True if on_jax else None


def pytest_unconfigure(config):
    stream = config.stash.get(_crash_file_key, None)
    if stream is not None:
        faulthandler.disable()
        stream.close()
    directory = config.stash.get(_crash_dir_key, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(_CRASH_DIR, None)


@pytest.fixture
def read_every_execution():
    """The host reads the records after every execution (`set_read_interval(0)`):
    for a test of what happens right after a verdict's execution (a stop, an
    unfreeze), which the default interval puts at a later read."""
    _reads.set_read_interval(0)
    yield
    _reads.set_read_interval(READ_INTERVAL)
