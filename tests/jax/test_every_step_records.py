"""Every step a fit recorded comes back from every sink, at the steps the
default schedule names, on JAX (the shared checks and the NumPy
references: tests/every_step_records.py; TensorFlow: tests/)."""

import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from tests import every_step_records as case
from tests.jax import examples


@pytest.fixture(scope="module")
def weights():
    return case.reference()


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
@pytest.mark.parametrize("which", case.INSTRUMENTS)
def test_a_long_fit_reads_back_every_recorded_step_from_every_sink(which, spe, weights):
    case.check(which, spe, weights)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_the_same_with_jit_compile_off(spe, weights):
    case.check("all", spe, weights, jit_compile=False)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_two_optimizers_have_every_step_from_every_sink(tmp_path, spe):
    """The DCGAN port's stateless step applies two optimizers: each one's
    records are layouts of their own in every read, each global norm at each
    of 60 steps (the 50th a scheduled one) in every sink."""
    steps = 60
    port = examples.make("gan", steps=steps, steps_per_execution=spe)
    log_dir = str(tmp_path)
    port.model.fit(port.x, port.y, batch_size=port.batch_size, epochs=1, shuffle=False, verbose=0,
                   callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir),
                              StopOnRule(log_dir=log_dir, loss="d_loss")])
    recorded, _ = case.read_back(log_dir)
    every = list(range(1, steps + 1))
    case.assert_schedule(recorded, every, list(range(1, 11)) + [50])
    for name in port.names.values():
        assert sorted(recorded[f"gradients/{name}/global_norm"]) == every, name
