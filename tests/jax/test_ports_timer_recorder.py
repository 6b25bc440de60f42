"""`StepTimer` and `StepRecorder` on the JAX versions of the keras.io ports (tests/jax/examples.py).

Each port with both callbacks against its plain `fit` (`tests.jax.test_examples.plain_run`,
shared with those tests): training bitwise plain, one timer row per execution, and the
recorded gradients' norms those that a class-level wrapper of the optimizer's
`stateless_apply` saw in the plain `fit`; the weights recorded at the last step are the plain
fit's final weights. No kerasdbg warning. The GAN's train step applies two optimizers: the
recorder records the first one whose variables it selects.
"""

import re

import numpy as np
import pytest

from kerasdbg.callbacks import StepRecorder, StepTimer
from tests.jax import examples
from tests.jax.test_examples import (
    BAD, STEPS, assert_same_variables, instrumented_fit, plain_run, trainable_paths, with_nan,
)

OURS = r"(kerasdbg|StepTimer|StepRecorder)\b"
RECORDED = [1, BAD, STEPS]
CASES = [pytest.param(name, spe, jit, id=f"{name}-spe{spe}-{'jit' if jit else 'nojit'}")
         for name, spe, jit in (("vae", 4, True), ("gan", 1, True), ("transformer", 1, False),
                                ("convnet", 1, True))]


@pytest.mark.parametrize("name, spe, jit", CASES)
def test_a_port_is_timed_and_recorded_and_trains_bitwise_plain(tmp_path, name, spe, jit):
    plain_history, plain_weights, _, applied = plain_run(name, spe, jit)
    port = examples.make(name, STEPS, spe, jit)
    timer = StepTimer()
    path = str(tmp_path / "trace.npz")
    recorder = StepRecorder(path, steps=RECORDED, record=["gradients", "weights"])
    history, caught = instrumented_fit(port, [timer, recorder], sample_weight=with_nan(port)[2])
    ours = [m for m in caught if re.match(OURS, m)]
    assert ours == []
    assert history.history == plain_history
    assert_same_variables(plain_weights, examples.all_weights(port))

    assert timer.history.step.tolist() == list(range(spe, STEPS + 1, spe))
    assert timer.history.examples.tolist() == [float(port.batch_size * spe)] * (STEPS // spe)

    trace = np.load(path)
    names = sorted({k.split("/", 1)[1].rpartition("@")[0] for k in trace.files
                    if k.startswith("gradients/")})
    attribute = next(a for a in port.optimizers if sorted(trainable_paths(port, a)) == names)
    paths = trainable_paths(port, attribute)
    for step in RECORDED:
        for path_, norm in zip(paths, applied[attribute][step - 1]):
            np.testing.assert_allclose(np.linalg.norm(trace[f"gradients/{path_}@{step}"]),
                                       norm, rtol=2e-5, atol=1e-7,
                                       err_msg=f"{attribute} {path_} step {step}")
    final = {v.path: np.asarray(v.value) for v in port.model.trainable_variables}
    for path_ in paths:
        np.testing.assert_array_equal(trace[f"weights/{path_}@{STEPS}"], final[path_])
