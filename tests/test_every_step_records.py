"""Every step a fit recorded comes back from every sink, at the steps the
default schedule names, on TensorFlow (the shared checks and the NumPy
references: tests/every_step_records.py; JAX: tests/jax/)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from tests import every_step_records as case
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


class CycleGAN(keras.Model):
    """The shape of keras.io's CycleGAN `train_step`: two generators and two
    discriminators, each with its own optimizer, all four applied at every
    step from one persistent tape."""

    def __init__(self):
        super().__init__()

        def net(name, out):
            return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                                     keras.layers.Dense(out)], name=name)

        self.gen_G, self.gen_F = net("gen_G", 4), net("gen_F", 4)
        self.disc_X, self.disc_Y = net("disc_X", 1), net("disc_Y", 1)

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.gen_G_optimizer = keras.optimizers.Adam(1e-3)
        self.gen_F_optimizer = keras.optimizers.Adam(1e-3)
        self.disc_X_optimizer = keras.optimizers.Adam(1e-3)
        self.disc_Y_optimizer = keras.optimizers.Adam(1e-3)

    def call(self, x):
        return self.gen_G(x)

    def train_step(self, data):
        real_x, real_y = data
        with tf.GradientTape(persistent=True) as tape:
            fake_y, fake_x = self.gen_G(real_x, training=True), self.gen_F(real_y, training=True)
            cycle = (ops.mean(ops.abs(self.gen_F(fake_y) - real_x)) +
                     ops.mean(ops.abs(self.gen_G(fake_x) - real_y)))
            g_loss = ops.mean((self.disc_Y(fake_y) - 1) ** 2) + cycle
            f_loss = ops.mean((self.disc_X(fake_x) - 1) ** 2) + cycle
            x_loss = ops.mean(self.disc_X(real_x) ** 2) + ops.mean(self.disc_X(fake_x) ** 2)
            y_loss = ops.mean(self.disc_Y(real_y) ** 2) + ops.mean(self.disc_Y(fake_y) ** 2)
        for loss, net, optimizer in ((g_loss, self.gen_G, self.gen_G_optimizer),
                                     (f_loss, self.gen_F, self.gen_F_optimizer),
                                     (x_loss, self.disc_X, self.disc_X_optimizer),
                                     (y_loss, self.disc_Y, self.disc_Y_optimizer)):
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))
        return {"g_loss": g_loss, "f_loss": f_loss}


OPTIMIZERS = ("gen_G_optimizer", "gen_F_optimizer", "disc_X_optimizer", "disc_Y_optimizer")


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
    model = CycleGAN()
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
