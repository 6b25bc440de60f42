"""Every step a fit recorded comes back from every sink, at the steps the
default schedule names, on TensorFlow (the shared checks and the NumPy
references: tests/every_step_records.py; JAX: tests/jax/)."""

import keras
import numpy as np
import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from tests import every_step_records as case
from tests.examples import ports
from tests.examples.capture import capture_applies


@pytest.fixture(scope="module")
def weights():
    return case.reference()


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
@pytest.mark.parametrize("which", case.INSTRUMENTS)
def test_a_long_fit_reads_back_every_recorded_step_from_every_sink(which, spe, weights):
    case.check(which, spe, weights)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_the_same_with_jit_compile_on(spe, weights):
    case.check("all", spe, weights, jit_compile=True)


OPTIMIZERS = ports.CycleGAN.OPTIMIZERS


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_four_optimizers_have_every_step_from_every_sink(tmp_path, spe):
    """Each optimizer's records are layouts of their own in every read: each
    global norm at each of 60 steps (the 50th a scheduled one), equal to the
    norm of what its `apply` received."""
    steps = 60
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 4, 4)).astype("float32")
    y = rng.normal(size=(steps * 4, 4)).astype("float32")
    keras.utils.set_random_seed(1)
    model = ports.CycleGAN()
    model.compile(steps_per_execution=spe)
    model(x[:1])
    log_dir = str(tmp_path)
    with capture_applies() as capture:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir),
                             StopOnRule(log_dir=log_dir, loss="g_loss")])
    recorded, _ = case.read_back(log_dir)
    every = list(range(1, steps + 1))
    case.assert_schedule(recorded, every, list(range(1, 11)) + [50])
    for name in OPTIMIZERS:
        norms = [np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in call.values()))
                 for call in capture.gradients(getattr(model, name))]
        assert len(norms) == steps
        got = recorded[f"gradients/{name}/global_norm"]
        assert sorted(got) == every, name
        np.testing.assert_allclose([got[s] for s in every], norms, rtol=2e-5, err_msg=name)


def test_the_full_statistics_come_at_a_scheduled_step_a_loss_scaler_made_again(mixed_precision):
    case.assert_full_statistics_at_a_redone_scheduled_step()
