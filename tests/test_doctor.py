"""doctor: each check fires on the mistake it names and stays quiet without it."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from kerasdbg.doctor import Finding, doctor
from tests.conftest import make_strategy

X = np.ones((64, 6), "float32")
Y = np.zeros((64,), "int32")


def _checks(**kwargs):
    return [f.check for f in doctor(verbose=False, **kwargs)]


def _data(batch=16, drop=True, labels=Y, prefetch=True):
    data = tf.data.Dataset.from_tensor_slices((X, labels)).batch(batch, drop_remainder=drop)
    return data.prefetch(2) if prefetch else data


def _model(bn=False, units=128, spe=1, jit=False, strategy="default", compile_=True):
    with make_strategy(strategy).scope():
        layers = [keras.Input((6,), name="x"), keras.layers.Dense(units, name="dense")]
        if bn:
            layers.append(keras.layers.BatchNormalization(name="bn"))
        model = keras.Sequential(layers + [keras.layers.Dense(128, name="head")], name="net")
        if compile_:
            model.compile("sgd", "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def test_dynamic_batch_dimension_under_xla_or_tpu():
    assert "dynamic batch dimension" in _checks(data=_data(drop=False), target="xla")
    tpu = doctor(data=_data(drop=False), target="tpu", verbose=False)
    assert tpu[0].severity == "error" and tpu[0].check == "dynamic batch dimension"
    assert "dynamic batch dimension" in _checks(model=_model(jit=True), data=_data(drop=False))
    assert "dynamic batch dimension" not in _checks(data=_data(drop=True), target="xla")
    assert "dynamic batch dimension" not in _checks(data=_data(drop=False), target="cpu")


def test_tpu_input_dtypes():
    found = doctor(data=_data(labels=Y.astype("int64")), target="tpu", verbose=False)
    finding = next(f for f in found if f.check == "TPU input dtype")
    assert finding.what == "the dataset yields int64 tensors" and finding.severity == "error"
    assert "TPU input dtype" in _checks(
        data=tf.data.Dataset.from_tensor_slices(np.zeros((8, 3), "uint8")).batch(4, True).prefetch(1),
        target="tpu")
    assert "TPU input dtype" not in _checks(data=_data(), target="tpu")
    assert "TPU input dtype" not in _checks(data=_data(labels=Y.astype("int64")), target="gpu")


def test_tpu_batch_multiple_of_8_per_replica_and_widths_of_128():
    found = doctor(model=_model(units=100), data=_data(batch=12), target="tpu", verbose=False)
    by_check = {f.check: f for f in found}
    assert by_check["batch size"].what == (
        "the global batch is 12, not a multiple of 8 x 1 replicas = 8")
    assert "use a global batch that is a multiple of 8, e.g. 16" in by_check["batch size"].fix
    assert by_check["feature width"].what == "layer widths not a multiple of 128: dense=100"
    clean = _checks(model=_model(units=256), data=_data(batch=16), target="tpu")
    assert "batch size" not in clean and "feature width" not in clean
    assert "batch size" not in _checks(data=_data(batch=12), target="gpu")


def test_batch_normalization_with_a_small_per_replica_batch():
    found = doctor(model=_model(bn=True, strategy="mirrored"), data=_data(batch=16, drop=False),
                   verbose=False)
    finding = next(f for f in found if f.check == "BatchNormalization batch")
    assert "1 BatchNormalization layer(s) (bn) see 8 examples per replica (global batch 16 / 2)" \
        in finding.what
    assert "BatchNormalization batch" not in _checks(model=_model(bn=True), data=_data(batch=64))
    assert "BatchNormalization batch" not in _checks(model=_model(bn=False), data=_data(batch=8))


def test_steps_per_execution_1_on_several_replicas():
    found = doctor(model=_model(strategy="mirrored"), verbose=False)
    finding = next(f for f in found if f.check == "steps_per_execution")
    assert finding.what == "steps_per_execution is 1 under MirroredStrategy (2 replica(s))"
    assert "steps_per_execution" not in _checks(model=_model(strategy="mirrored", spe=8))
    assert "steps_per_execution" not in _checks(model=_model())


def _expensive(x):
    return tf.image.resize(tf.reshape(x, [1, 6, 1]), [12, 12])


def test_portability_findings_are_info_while_the_target_is_unknown():
    data = _data(batch=12, drop=False, labels=Y.astype("int64"))
    found = doctor(model=_model(units=100), data=data, verbose=False)
    by_check = {f.check: f for f in found}
    assert sorted(by_check) == ["TPU input dtype", "batch size", "dynamic batch dimension",
                                "feature width"]
    assert {f.severity for f in found} == {"info"}
    assert by_check["TPU input dtype"].why == (
        "if the run moves to XLA or a TPU: TPUs do not take int64, uint8, string or float64 inputs")
    assert by_check["batch size"].what == (
        "the global batch is 12, not a multiple of 8 x 1 replicas = 8")
    # A known target gives them their severity; "cpu" and "gpu" none.
    tpu = {f.check: f.severity for f in doctor(model=_model(units=100), data=data,
                                               target="tpu", verbose=False)}
    assert tpu == {"dynamic batch dimension": "error", "TPU input dtype": "error",
                   "batch size": "warning", "feature width": "info",
                   "steps_per_execution": "warning"}
    xla = {f.check: f.severity for f in doctor(model=_model(units=100, jit=True), data=data,
                                               verbose=False)}
    # XLA known (a GPU, say), a TPU only possible: its own findings stay "info".
    assert xla == {"dynamic batch dimension": "warning", "TPU input dtype": "info",
                   "batch size": "info", "feature width": "info"}
    found = doctor(data=data, target="xla", verbose=False)
    assert next(f for f in found if f.check == "TPU input dtype").why.startswith(
        "if the run moves to a TPU: ")
    assert _checks(model=_model(units=100), data=data, target="cpu") == []
    assert _checks(model=_model(units=100), data=data, target="gpu") == []


def test_tf_data_order():
    source = tf.data.Dataset.from_tensor_slices(X)
    assert _checks(data=source.batch(8, True)) == ["tf.data prefetch"]
    assert _checks(data=source.batch(8, True).prefetch(1)) == []
    late_map = source.batch(8, True).map(
        lambda x: tf.image.resize(tf.reshape(x, [8, 6, 1, 1]), [12, 12]))
    found = doctor(data=late_map.prefetch(1), verbose=False)
    assert [f.check for f in found] == ["tf.data map after batch"]
    assert "its function runs ResizeBilinear" in found[0].what
    # A cheap map after batch (vectorized) is the recommended form.
    assert _checks(data=source.batch(8, True).map(lambda x: x * 2.0).prefetch(1)) == []
    late_shuffle = source.map(_expensive).shuffle(16).batch(8, True).prefetch(1)
    assert _checks(data=late_shuffle) == ["tf.data shuffle after map"]
    assert _checks(data=source.shuffle(16).map(_expensive).batch(8, True).prefetch(1)) == []


def test_sum_over_batch_size_loss_in_a_custom_loop_under_replicas():
    strategy = make_strategy("mirrored")
    found = doctor(strategy=strategy, loss=keras.losses.MeanSquaredError(), verbose=False)
    assert [f.check for f in found] == ["loss reduction in a custom loop"]
    assert "2 times too large" in found[0].why
    assert _checks(strategy=strategy, loss=keras.losses.MeanSquaredError(reduction="none")) == []
    assert _checks(loss=keras.losses.MeanSquaredError()) == []


def test_keras_mirrored_combinations():
    found = doctor(model=_model(strategy="mirrored", spe=4), strategy=None, verbose=False)
    assert found == []  # ReductionToOneDevice (the workaround) with spe 4
    with make_strategy("mirrored", collective=True).scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse", steps_per_execution=4)
    found = doctor(model=model, verbose=False)
    # (Dense(3): a width not a multiple of 128, an "info" while the target is unknown.)
    assert [f.check for f in found] == ["Keras: MirroredStrategy + steps_per_execution",
                                        "feature width"]
    assert "You must feed a value for placeholder tensor" in found[0].why
    assert "ReductionToOneDevice" in found[0].fix
    assert "kerasdbg.compat.fix_multi_worker_fit()" in found[0].fix
    # With the fix in place Keras's fit runs there: no finding.
    from kerasdbg.backends.tensorflow import multi_worker_fit

    multi_worker_fit.fix_multi_worker_fit()
    try:
        assert [f.check for f in doctor(model=model, verbose=False)] == ["feature width"]
    finally:
        multi_worker_fit.undo_multi_worker_fit()
    found = doctor(model=_model(strategy="mirrored", spe=2, jit=True), verbose=False)
    assert [f.check for f in found] == ["Keras: MirroredStrategy + jit_compile"]
    assert "Trying to access resource" in found[0].why
    assert "Keras: MirroredStrategy + jit_compile" not in _checks(model=_model(jit=True))


def test_keras_multi_worker_on_one_worker_and_parameter_server():
    """In a separate process: creating these strategies configures collectives for good.
    On one worker Keras's fit works under MultiWorkerMirroredStrategy: no finding
    (several workers: tests/test_multi_worker.py)."""
    code = (
        "import tensorflow as tf\n"
        "from kerasdbg.doctor import doctor\n"
        "mw = tf.distribute.MultiWorkerMirroredStrategy()\n"
        "print([f.check for f in doctor(strategy=mw, verbose=False)])\n"
        "ps = tf.distribute.experimental.ParameterServerStrategy.__new__(\n"
        "    tf.distribute.experimental.ParameterServerStrategy)\n"
        "found = doctor(strategy=ps, verbose=False)\n"
        "print([f.check for f in found], found[0].why)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=True)
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "[]"
    assert lines[1] == ("['Keras: ParameterServerStrategy'] Keras 3 fit does not support it "
                        "(its trainer has no ClusterCoordinator)")


def test_a_healthy_set_up_has_no_finding(capsys):
    found = doctor(model=_model(), data=_data())
    assert found == [] and "kerasdbg doctor: no problem found" in capsys.readouterr().out


def test_findings_print_as_a_table_and_convert_to_pandas(capsys):
    found = doctor(data=_data(drop=False, prefetch=False, labels=Y.astype("int64")), target="tpu")
    out = capsys.readouterr().out
    assert out.startswith("kerasdbg doctor: 3 finding(s)\n1. [ERROR] dynamic batch dimension")
    assert "   fix: end the pipeline with `.prefetch(tf.data.AUTOTUNE)`" in out
    frame = found.to_frame()
    assert list(frame.columns) == list(Finding._fields)
    assert frame.severity.tolist() == ["error", "error", "warning"]


@pytest.mark.parametrize("kwargs,error,match", [
    ({"model": "net"}, TypeError, "`model` must be a keras.Model or None"),
    ({"data": [1, 2]}, TypeError, "`data` must be a tf.data.Dataset or None"),
    ({"strategy": "mirrored"}, TypeError, "`strategy` must be a tf.distribute.Strategy"),
    ({"target": "fpga"}, ValueError, "`target` must be one of 'auto', 'cpu', 'gpu', 'xla', 'tpu'. "
     "Received: target='fpga'"),
    ({"verbose": 1}, TypeError, "`verbose` must be a bool"),
], ids=["model", "data", "strategy", "target", "verbose"])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        doctor(**kwargs)
