"""`doctor` on JAX: the model's checks with the devices of the keras.distribution,
a tf.data pipeline where TensorFlow is installed, the model alone without it."""

import os
import subprocess
import sys
import textwrap

import jax
import keras
from kerasdbg.doctor import doctor

from tests.blockers import WITHOUT_TENSORFLOW


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(bn=True, spe=1, jit=True):
    layers = [keras.Input((6,), name="x"), keras.layers.Dense(128, name="dense")]
    if bn:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    model = keras.Sequential(layers + [keras.layers.Dense(10, name="head")], name="net")
    model.compile("sgd", "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def _checks(**kwargs):
    return [f.check for f in doctor(verbose=False, **kwargs)]


def test_data_parallel_devices_count_as_replicas():
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices("cpu")))
    try:
        found = doctor(_model(spe=1), verbose=False)
        assert [f.check for f in found] == ["steps_per_execution", "feature width"]
        assert found[0].what == "steps_per_execution is 1 under DataParallel (2 devices)"
        assert _checks(model=_model(spe=8)) == ["feature width"]
        # A custom loop's mean loss is the global batch's on JAX (one program over
        # the global batch): no "summed gradient too large" warning.
        assert _checks(model=_model(spe=8), loss=keras.losses.MeanSquaredError()) == \
            ["feature width"]
    finally:
        keras.distribution.set_distribution(None)
    assert _checks(model=_model(spe=1)) == ["feature width"]  # one device: no round trip to save
    assert _checks(model=_model(spe=1), target="cpu") == []


def _run(code: str, without_tensorflow: bool = False) -> str:
    """`code` in a fresh interpreter on JAX with two CPU devices (the JAX run
    imports no TensorFlow: a tf.data pipeline is checked apart); its output."""
    source = (WITHOUT_TENSORFLOW if without_tensorflow else "") + textwrap.dedent(code)
    env = dict(os.environ, KERAS_BACKEND="jax",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_a_tf_data_pipeline_is_checked_against_the_devices():
    """With TensorFlow installed (it made the pipeline): the pipeline's
    checks, the devices of the DataParallel as replicas; a tf.distribute
    strategy and data that is not a tf.data.Dataset are refused."""
    out = _run("""
        import jax, keras, numpy as np, pytest, tensorflow as tf
        from kerasdbg.doctor import doctor
        layers = [keras.Input((6,)), keras.layers.Dense(128), keras.layers.BatchNormalization(),
                  keras.layers.Dense(10, name="head")]
        model = keras.Sequential(layers)
        model.compile("sgd", "mse", steps_per_execution=4, jit_compile=True)
        data = tf.data.Dataset.from_tensor_slices(
            (np.ones((64, 6), "float32"), np.zeros((64, 10), "float32"))).batch(16)
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices("cpu")))
        found = {f.check: f for f in doctor(model, data, verbose=False)}
        assert "see 8 examples per replica (global batch 16 / 2)" in \
            found["BatchNormalization batch"].what
        assert found["dynamic batch dimension"].severity == "warning"  # jit_compile: XLA
        with pytest.raises(ValueError, match=r"doctor: `strategy` is a tf.distribute strategy, "
                           r"for the TensorFlow backend; Keras runs on 'jax'.*strategy=None"):
            doctor(model, strategy=tf.distribute.get_strategy(), verbose=False)
        with pytest.raises(TypeError, match=r"`data` must be a tf.data.Dataset or None.*"
                           r"Received: data of type ndarray"):
            doctor(model, np.ones((4, 6)), verbose=False)
        print(sorted(found))
    """)
    # 16 is a multiple of 8 x 2 devices: no batch size finding.
    assert out == str(sorted(["BatchNormalization batch", "dynamic batch dimension",
                              "feature width", "tf.data prefetch"]))


def test_without_tensorflow_the_model_is_checked():
    out = _run("""
        import sys, keras
        from kerasdbg.doctor import doctor
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(10)])
        model.compile("sgd", "mse", jit_compile=True)
        checks = [f.check for f in doctor(model, target="tpu", verbose=False)]
        assert "tensorflow" not in sys.modules
        print(checks)
    """, without_tensorflow=True)
    assert out == "['steps_per_execution', 'feature width']"
