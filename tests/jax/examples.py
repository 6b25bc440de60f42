"""JAX versions of the keras.io ports of `tests/examples/ports.py`, written as a JAX user
writes them.

The TensorFlow ports override `train_step` with `tf.GradientTape`; on Keras's JAX backend a
custom step is stateless, as the keras.io guide "Customizing what happens in fit() with JAX"
writes it: `train_step(self, state, data)` receives `(trainable_variables,
non_trainable_variables, optimizer_variables, metrics_variables)` as arrays, takes the
gradients with `jax.value_and_grad` of a function of them (`stateless_call` of the
sub-models), applies them with `optimizer.stateless_apply`, updates its `Mean` trackers with
`stateless_update_state`, and returns the logs and the new state.

- `vae`: "Variational AutoEncoder", its losses computed by hand in a stateless step, the
  `Sampling` layer's draws from its SeedGenerator carried in the non-trainable state.
- `gan`: "DCGAN to generate face images", two optimizers in one stateless step. Keras 3.15's
  JAX trainer carries the variables of `model.optimizer` only
  (`keras/src/backend/jax/trainer.py`: `_get_jax_state` builds the state from
  `self.optimizer.variables`, and `jax_state_sync` writes `optimizer_variables` back to
  them alone), and keras.io shows no way: its JAX guide's steps apply one optimizer, and its
  GAN examples use TensorFlow's `GradientTape`. What the trainer does carry is every non-trainable
  variable the model tracks. So the discriminator's optimizer is `model.optimizer` (the
  state's `optimizer_variables`) and the generator's optimizer, built before `fit`, has
  its variables tracked by the model (a list attribute), which puts them in the state's
  `non_trainable_variables`; the step passes them to `g_optimizer.stateless_apply` and
  returns its new ones there. The latent vectors and the label noise come from the model's
  SeedGenerator inside a `keras.StatelessScope` over the non-trainable state.
- `transformer`, `convnet`: Keras's own `train_step`, the builders of ports.py as they are
  (they hold no TensorFlow code).

Only factories live here, no tests: `make(name, ...)` returns a compiled model and data for
exactly `steps` train steps, as `ports.make` does. Every draw is seeded (`seed`): the
weights, the data, and the SeedGenerators of Dropout, `Sampling` and the GAN, whose states
the JAX trainer carries in the non-trainable state, so that two runs of a port are bitwise
equal.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import keras
from keras import ops

from tests.examples import ports

PORTS = ("vae", "gan", "transformer", "convnet")

BATCH = ports.BATCH


class Port(NamedTuple):
    """A compiled model ready for `fit(x, y, batch_size=batch_size)`."""

    name: str
    model: keras.Model
    x: object
    y: object
    batch_size: int
    optimizers: dict  # {attribute name: optimizer} of every optimizer the train step applies
    names: dict  # {attribute name: the name kerasdbg's records give the optimizer}


def _positions(everything, part):
    """Where each of `part`'s variables is in `everything` (the model's list)."""
    index = {id(v): i for i, v in enumerate(everything)}
    return [index[id(v)] for v in part]


def _take(values, positions):
    return [values[i] for i in positions]


def _put(values, positions, new):
    values = list(values)
    for i, value in zip(positions, new):
        values[i] = value
    return values


def _update_trackers(trackers, metrics_variables, values):
    """Each `Mean` tracker updated with its value, statelessly: (logs, new variables)."""
    logs, new_variables, start = {}, [], 0
    for tracker, value in zip(trackers, values):
        own = metrics_variables[start:start + len(tracker.variables)]
        start += len(tracker.variables)
        own = tracker.stateless_update_state(own, value)
        logs[tracker.name] = tracker.stateless_result(own)
        new_variables += list(own)
    return logs, new_variables


# --- vae: "Variational AutoEncoder" ---------------------------------------------------------

class VAE(keras.Model):
    """Reconstruction and KL losses computed by hand in a stateless `train_step`."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")
        # Keras's JAX `fit` cannot build a model that has no `call` ("Unable to
        # automatically build the model"); its sub-models are built.
        self.built = True

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, data):
        enc_t = _positions(self.trainable_variables, self.encoder.trainable_variables)
        dec_t = _positions(self.trainable_variables, self.decoder.trainable_variables)
        enc_n = _positions(self.non_trainable_variables, self.encoder.non_trainable_variables)
        dec_n = _positions(self.non_trainable_variables, self.decoder.non_trainable_variables)
        (z_mean, z_log_var, z), encoder_state = self.encoder.stateless_call(
            _take(trainable_variables, enc_t), _take(non_trainable_variables, enc_n), data,
            training=True)
        reconstruction, decoder_state = self.decoder.stateless_call(
            _take(trainable_variables, dec_t), _take(non_trainable_variables, dec_n), z,
            training=True)
        non_trainable_variables = _put(non_trainable_variables, enc_n, encoder_state)
        non_trainable_variables = _put(non_trainable_variables, dec_n, decoder_state)
        reconstruction_loss = ops.mean(
            ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
        total_loss = reconstruction_loss + kl_loss
        return total_loss, (reconstruction_loss, kl_loss, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = \
            state
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (total_loss, (reconstruction_loss, kl_loss, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, data)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        logs, metrics_variables = _update_trackers(
            self.metrics, metrics_variables, (total_loss, reconstruction_loss, kl_loss))
        # As in the example: the tracker is named "total_loss", its log key is "loss".
        logs = {"loss": logs["total_loss"], "reconstruction_loss": logs["reconstruction_loss"],
                "kl_loss": logs["kl_loss"]}
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      metrics_variables)


def _vae(steps, seed, compile_kwargs):
    # ports.py's encoder (with its seeded `Sampling` layer) and decoder, as they are.
    tensorflow_port, _, x, _ = ports._vae(steps, seed, {})
    model = VAE(tensorflow_port.encoder, tensorflow_port.decoder)
    model.compile(optimizer=keras.optimizers.Adam(), **compile_kwargs)
    return model, {"optimizer": model.optimizer}, {"optimizer": "optimizer"}, x, None


# --- gan: "DCGAN to generate face images" ---------------------------------------------------

class GAN(keras.Model):
    """Discriminator and generator trained in turn in one stateless step, one
    `stateless_apply` of each optimizer per step."""

    def __init__(self, discriminator, generator, latent_dim, seed=1337):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True  # (as VAE's: the sub-models are built)

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        # The JAX trainer's state carries `model.optimizer`'s variables: the
        # discriminator's optimizer is `model.optimizer`.
        super().compile(optimizer=d_optimizer, **kwargs)
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        # `stateless_apply` needs a built optimizer, over exactly what it updates.
        d_optimizer.build(self.discriminator.trainable_variables)
        g_optimizer.build(self.generator.trainable_variables)
        # Tracked by the model, the generator's optimizer's variables travel in
        # the state's `non_trainable_variables`, and `fit` writes them back.
        self.g_optimizer_variables = list(g_optimizer.variables)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def _draw(self, non_trainable_variables, batch_size):
        """Two latent batches and the label noise from the model's SeedGenerator,
        its new state put back in the non-trainable state."""
        mapping = list(zip(self.non_trainable_variables, non_trainable_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
            noise = keras.random.uniform((2 * batch_size, 1), seed=self.seed_generator)
            misleading_latent = keras.random.normal((batch_size, self.latent_dim),
                                                    seed=self.seed_generator)
        state = self.seed_generator.state
        position = _positions(self.non_trainable_variables, [state])
        non_trainable_variables = _put(non_trainable_variables, position,
                                       [scope.get_current_value(state)])
        return latent, noise, misleading_latent, non_trainable_variables

    def discriminator_loss(self, d_trainable, d_state, generated_images, real_images, labels):
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        predictions, d_state = self.discriminator.stateless_call(
            d_trainable, d_state, combined_images, training=True)
        return self.loss_fn(labels, predictions), d_state

    def generator_loss(self, g_trainable, g_state, d_trainable, d_state, latent):
        generated_images, g_state = self.generator.stateless_call(
            g_trainable, g_state, latent, training=True)
        predictions, d_state = self.discriminator.stateless_call(
            d_trainable, d_state, generated_images, training=True)
        misleading_labels = ops.zeros((ops.shape(latent)[0], 1))  # "all real"
        return self.loss_fn(misleading_labels, predictions), (g_state, d_state)

    def train_step(self, state, real_images):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = \
            state
        d_t = _positions(self.trainable_variables, self.discriminator.trainable_variables)
        g_t = _positions(self.trainable_variables, self.generator.trainable_variables)
        d_n = _positions(self.non_trainable_variables, self.discriminator.non_trainable_variables)
        g_n = _positions(self.non_trainable_variables, self.generator.non_trainable_variables)
        g_o = _positions(self.non_trainable_variables, self.g_optimizer_variables)
        batch_size = ops.shape(real_images)[0]
        latent, noise, misleading_latent, non_trainable_variables = self._draw(
            non_trainable_variables, batch_size)

        generated_images, g_state = self.generator.stateless_call(
            _take(trainable_variables, g_t), _take(non_trainable_variables, g_n), latent,
            training=True)
        # Fake is 1, real is 0, with noise on the labels (the example's "important trick").
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))],
                                 axis=0) + 0.05 * noise
        (d_loss, d_state), d_grads = jax.value_and_grad(self.discriminator_loss, has_aux=True)(
            _take(trainable_variables, d_t), _take(non_trainable_variables, d_n),
            generated_images, real_images, labels)
        d_trainable, optimizer_variables = self.d_optimizer.stateless_apply(
            optimizer_variables, d_grads, _take(trainable_variables, d_t))

        # Only the generator's weights move here, although the loss runs through both.
        (g_loss, (g_state, d_state)), g_grads = jax.value_and_grad(
            self.generator_loss, has_aux=True)(
            _take(trainable_variables, g_t), g_state, d_trainable, d_state, misleading_latent)
        g_trainable, g_optimizer_variables = self.g_optimizer.stateless_apply(
            _take(non_trainable_variables, g_o), g_grads, _take(trainable_variables, g_t))

        trainable_variables = _put(_put(trainable_variables, d_t, d_trainable), g_t,
                                   g_trainable)
        non_trainable_variables = _put(_put(_put(non_trainable_variables, d_n, d_state), g_n,
                                            g_state), g_o, g_optimizer_variables)
        logs, metrics_variables = _update_trackers(self.metrics, metrics_variables,
                                                   (d_loss, g_loss))
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      metrics_variables)


def _gan(steps, seed, compile_kwargs):
    # ports.py's discriminator (Dropout, seeded) and generator, as they are.
    tensorflow_port, _, x, _ = ports._gan(steps, seed, {})
    model = GAN(tensorflow_port.discriminator, tensorflow_port.generator,
                tensorflow_port.latent_dim, seed=1337 + seed)
    model.compile(d_optimizer=keras.optimizers.Adam(1e-4), g_optimizer=keras.optimizers.Adam(1e-4),
                  loss_fn=keras.losses.BinaryCrossentropy(), **compile_kwargs)
    optimizers = {"d_optimizer": model.d_optimizer, "g_optimizer": model.g_optimizer}
    # kerasdbg names `model.optimizer` "optimizer" (the same object as `d_optimizer`).
    return model, optimizers, {"d_optimizer": "optimizer", "g_optimizer": "g_optimizer"}, x, None


# --- transformer, convnet: Keras's own train_step --------------------------------------------

def _from_ports(name):
    def factory(steps, seed, compile_kwargs):
        model, optimizers, x, y = ports._FACTORIES[name][0](steps, seed, compile_kwargs)
        return model, optimizers, {"optimizer": "optimizer"}, x, y

    return factory


_FACTORIES = {"vae": _vae, "gan": _gan, "transformer": _from_ports("transformer"),
              "convnet": _from_ports("convnet")}


def make(name: str, steps: int = 12, steps_per_execution: int = 1, jit_compile: bool = True,
         seed: int = 0) -> Port:
    """The port `name`, compiled with `steps_per_execution` and `jit_compile`, with data for
    `steps` train steps of `BATCH` rows. The same `seed` gives the same weights, data and
    SeedGenerator states."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown port {name!r}; one of {PORTS}")
    keras.utils.set_random_seed(seed)
    compile_kwargs = {"steps_per_execution": steps_per_execution, "jit_compile": jit_compile}
    model, optimizers, names, x, y = _FACTORIES[name](steps, seed, compile_kwargs)
    return Port(name, model, x, y, BATCH, optimizers, names)


def all_weights(port: Port) -> list:
    """Every variable a step changes, as NumPy arrays: the model's weights (the
    non-trainable ones and the SeedGenerators' states included) and every optimizer's
    variables."""
    values = [v.value for v in port.model.variables]
    for optimizer in port.optimizers.values():
        values += [v.value for v in optimizer.variables]
    return [jnp.asarray(v) for v in values]
