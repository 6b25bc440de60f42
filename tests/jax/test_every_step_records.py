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


def test_the_full_statistics_stay_at_the_scheduled_steps_when_a_loss_scaler_skips(
        mixed_precision):
    """A loss scaler's skips hold the step count, so the host's count of the
    steps runs ahead of them until a read: the full variant runs for the
    calls that may make a scheduled step, and the records keep the full
    statistics at the scheduled steps only (NumPy's schedule, written out)."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    # An initial loss scale that overflows float16 a few times first (the scaler
    # halves it at each skip).
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                    initial_scale=2.0 ** 30)
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96 * 4, 4)).astype("float32") * 100
    y = rng.normal(size=(96 * 4, 1)).astype("float32")
    gradients = GradientStatistics()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[gradients])
    history = gradients.history
    assert history["skipped"].any(), "the test needs the scaler to skip"
    kept = history[~history["skipped"]]
    full = kept["step"][kept.filter(like="/mean").notna().all(axis=1)].tolist()
    scheduled = [s for s in kept["step"].tolist() if s <= 10 or s % 50 == 0]
    assert full == scheduled and 50 in scheduled


def test_the_full_statistics_come_at_a_scheduled_step_a_loss_scaler_made_again(mixed_precision):
    case.assert_full_statistics_at_a_redone_scheduled_step()
