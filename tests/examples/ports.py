"""Miniature ports of keras.io examples: the training code people actually write.

kerasdbg's instruments have to cope with models trained the ways keras.io teaches, not only
with `compile(loss=...)` and the standard `train_step`: two optimizers in one custom
`train_step`, several applies of one optimizer per step, losses computed by hand, a
`compute_loss` override, sub-models, a subclassed model built lazily inside `fit`, gradient
accumulation and clipping. Each port keeps the structure of one keras.io example (its
`compile`, `train_step` and metrics) with widths of a few units and synthetic data of the
right shapes, so that a 12-step fit takes seconds on a CPU, mostly tracing:

- `gan`: "DCGAN to generate face images" (GAN overriding `Model.train_step`)
- `wgan_gp`: "WGAN-GP overriding `Model.train_step`"
- `vae`: "Variational AutoEncoder"
- `contrastive`: "Semi-supervised image classification using contrastive pretraining with
  SimCLR"
- `distillation`: "Knowledge Distillation"
- `transformer`: "Text classification with Transformer"
- `convnet`: "Image classification from scratch"
- `subclassed`, `subclassed_custom_step`: the subclassed `keras.Model` of "Making new layers
  and models via subclassing", and the low-level `train_step` of "Customizing what happens
  in `fit()` with TensorFlow"
- `accumulation`, `clipping`: a functional MLP with the optimizer arguments of the
  "Optimizers" API page (`gradient_accumulation_steps`, `global_clipnorm`, `clipnorm`,
  `clipvalue`)

Only factories live here, no tests: `make(name, ...)` returns a compiled model and data for
exactly `steps` train steps (`steps * batch_size` rows). The ports stay as faithful as plain
Keras allows, including where plain Keras fails: under `MirroredStrategy`, `fit` cannot build
the models that have no `call` (`gan`, `wgan_gp`, `vae`, `contrastive`), and gradient
accumulation fails inside its `cond` (keras-team/keras#20582).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple

import keras
import numpy as np
from keras import layers, ops

if keras.config.backend() == "tensorflow":
    import tensorflow as tf
else:
    # tests/jax/examples.py reuses the models these ports build (not their
    # TensorFlow train steps) on the JAX backend, where TensorFlow may be absent.
    tf = None

PORTS = ("gan", "wgan_gp", "vae", "contrastive", "distillation", "transformer", "convnet",
         "subclassed", "subclassed_custom_step", "accumulation", "clipping")

BATCH = 8


class Port(NamedTuple):
    """A compiled model ready for `fit(x, y, batch_size=batch_size)`, and what a test needs
    to know about it."""

    name: str
    model: keras.Model
    x: object
    y: object
    batch_size: int
    optimizers: dict  # {attribute name: optimizer} of every optimizer the train step applies
    functional: bool  # `model` itself is a Functional or Sequential model
    deterministic: bool  # False when the train step draws random numbers (Dropout, noise)
    has_dropout: bool


# --- gan: "DCGAN to generate face images" ---------------------------------------------------

class GAN(keras.Model):
    """Discriminator and generator trained in turn, one apply of each optimizer per step."""

    def __init__(self, discriminator, generator, latent_dim, seed=1337):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(latent)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        # Fake is 1, real is 0, with noise on the labels (the example's "important trick").
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))],
                                 axis=0)
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)

        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))  # "all real"
        # Only the generator's weights move here, although the loss runs through both.
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def _gan(steps, seed, compile_kwargs):
    latent_dim = 8
    inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(4, 4, strides=2, padding="same")(inputs)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    h = layers.Conv2D(8, 4, strides=2, padding="same")(h)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    h = layers.Flatten()(h)
    h = layers.Dropout(0.2)(h)
    discriminator = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h),
                                name="discriminator")

    latent = keras.Input((latent_dim,))
    h = layers.Dense(2 * 2 * 8)(latent)
    h = layers.Reshape((2, 2, 8))(h)
    h = layers.Conv2DTranspose(8, 4, strides=2, padding="same")(h)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    h = layers.Conv2DTranspose(4, 4, strides=2, padding="same")(h)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    generator = keras.Model(latent, layers.Conv2D(1, 5, padding="same", activation="sigmoid")(h),
                            name="generator")

    model = GAN(discriminator, generator, latent_dim, seed=1337 + seed)
    model.compile(d_optimizer=keras.optimizers.Adam(1e-4), g_optimizer=keras.optimizers.Adam(1e-4),
                  loss_fn=keras.losses.BinaryCrossentropy(), **compile_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(steps * BATCH, 8, 8, 1)).astype("float32")  # images in [0, 1]
    return model, {"d_optimizer": model.d_optimizer, "g_optimizer": model.g_optimizer}, x, None


# --- wgan_gp: "WGAN-GP overriding `Model.train_step`" ---------------------------------------

def discriminator_loss(real_img, fake_img):
    """Wasserstein critic loss; the gradient penalty is added in `train_step`."""
    return ops.mean(fake_img) - ops.mean(real_img)


def generator_loss(fake_img):
    return -ops.mean(fake_img)


class WGAN(keras.Model):
    """`d_steps` critic applies, each with a gradient penalty, then one generator apply."""

    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3,
                 gp_weight=10.0, seed=1337):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight
        self.seed_generator = keras.random.SeedGenerator(seed)

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        """(|grad of the critic at an interpolated image| - 1)^2, by a nested tape."""
        # A normal draw, as in the example (the paper draws it uniformly in [0, 1]).
        alpha = keras.random.normal((batch_size, 1, 1, 1), seed=self.seed_generator)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = ops.sqrt(ops.sum(ops.square(grads), axis=[1, 2, 3]))
        return ops.mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = ops.shape(real_images)[0]

        # A Python loop: `d_steps` applies of d_optimizer are traced into one train step.
        for _ in range(self.d_steps):
            latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                fake_images = self.generator(latent, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables))

        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            generated_images = self.generator(latent, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        # Plain tensors, no trackers: the last critic loss and the generator loss.
        return {"d_loss": d_loss, "g_loss": g_loss}


def _upsample_block(x, filters, activation):
    x = layers.UpSampling2D((2, 2))(x)
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    return activation(x)


def _wgan_gp(steps, seed, compile_kwargs):
    latent_dim = 8
    inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(4, 5, strides=2, padding="same")(inputs)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    h = layers.Conv2D(8, 5, strides=2, padding="same")(h)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    h = layers.Dropout(0.3)(h)
    h = layers.Flatten()(h)
    h = layers.Dropout(0.2)(h)
    discriminator = keras.Model(inputs, layers.Dense(1)(h), name="discriminator")

    noise = keras.Input((latent_dim,))
    # The generator has BatchNormalization (moving statistics updated in the train step).
    h = layers.Dense(4 * 4 * 8, use_bias=False)(noise)
    h = layers.BatchNormalization()(h)
    h = layers.LeakyReLU(negative_slope=0.2)(h)
    h = layers.Reshape((4, 4, 8))(h)
    h = _upsample_block(h, 1, layers.Activation("tanh"))
    generator = keras.Model(noise, h, name="generator")

    model = WGAN(discriminator, generator, latent_dim, discriminator_extra_steps=3,
                 seed=1337 + seed)
    model.compile(
        d_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
        d_loss_fn=discriminator_loss, g_loss_fn=generator_loss, **compile_kwargs,
    )
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, size=(steps * BATCH, 8, 8, 1)).astype("float32")  # tanh range
    return model, {"d_optimizer": model.d_optimizer, "g_optimizer": model.g_optimizer}, x, None


# --- vae: "Variational AutoEncoder" ---------------------------------------------------------

class Sampling(layers.Layer):
    """z = z_mean + exp(z_log_var / 2) * epsilon, epsilon drawn from a SeedGenerator."""

    def __init__(self, seed=1337, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch, dim = ops.shape(z_mean)[0], ops.shape(z_mean)[1]
        epsilon = keras.random.normal((batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """Reconstruction and KL losses computed by hand in `train_step` (no `compute_loss`)."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        # As in the example: the tracker is named "total_loss", its log key is "loss".
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def _vae(steps, seed, compile_kwargs):
    latent_dim = 2
    encoder_inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    h = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(h)
    h = layers.Flatten()(h)
    h = layers.Dense(8, activation="relu")(h)
    z_mean = layers.Dense(latent_dim, name="z_mean")(h)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(h)
    z = Sampling(seed=1337 + seed)([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input((latent_dim,))
    h = layers.Dense(2 * 2 * 8, activation="relu")(latent_inputs)
    h = layers.Reshape((2, 2, 8))(h)
    h = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(h)
    h = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(h)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(h)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(), **compile_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(steps * BATCH, 8, 8, 1)).astype("float32")  # pixels in [0, 1]
    return model, {"optimizer": model.optimizer}, x, None


# --- contrastive: "Semi-supervised image classification using contrastive pretraining with
# SimCLR" ------------------------------------------------------------------------------------

class RandomNoiseFlip(layers.Layer):
    """Stands in for the example's flip/translate/zoom/colour augmentations: a random
    horizontal flip per image and Gaussian noise, drawn from a SeedGenerator so that a run
    is repeatable; identity at inference, like the example's `RandomColorAffine`."""

    def __init__(self, noise, seed, **kwargs):
        super().__init__(**kwargs)
        self.noise = noise
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, images, training=True):
        if not training:
            return images
        batch = ops.shape(images)[0]
        flip = keras.random.uniform((batch, 1, 1, 1), seed=self.seed_generator) < 0.5
        images = ops.where(flip, ops.flip(images, axis=2), images)
        return images + self.noise * keras.random.normal(ops.shape(images),
                                                         seed=self.seed_generator)


def _get_augmenter(noise, seed):
    return keras.Sequential(
        [keras.Input((16, 16, 3)), layers.Rescaling(1 / 255), RandomNoiseFlip(noise, seed)])


def _get_encoder(width):
    # No Input, as in the example: the encoder is built by its first call in `train_step`.
    return keras.Sequential(
        [
            layers.Conv2D(width, kernel_size=3, strides=2, activation="relu"),
            layers.Conv2D(width, kernel_size=3, strides=2, activation="relu"),
            layers.Flatten(),
            layers.Dense(width, activation="relu"),
        ],
        name="encoder",
    )


class ContrastiveModel(keras.Model):
    """Encoder + projection head trained with NT-Xent on two augmented views
    (contrastive_optimizer), and a linear probe on the frozen features (probe_optimizer),
    in one `train_step`."""

    def __init__(self, width=8, num_classes=4, temperature=0.1, seed=0):
        super().__init__()
        self.temperature = temperature
        self.contrastive_augmenter = _get_augmenter(0.2, seed=1337 + seed)
        self.classification_augmenter = _get_augmenter(0.05, seed=7331 + seed)
        self.encoder = _get_encoder(width)
        self.projection_head = keras.Sequential(
            [keras.Input((width,)), layers.Dense(width, activation="relu"), layers.Dense(width)],
            name="projection_head",
        )
        self.linear_probe = keras.Sequential(
            [keras.Input((width,)), layers.Dense(num_classes)], name="linear_probe")

    def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
        super().compile(**kwargs)
        self.contrastive_optimizer = contrastive_optimizer
        self.probe_optimizer = probe_optimizer
        self.probe_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.contrastive_loss_tracker = keras.metrics.Mean(name="c_loss")
        self.contrastive_accuracy = keras.metrics.SparseCategoricalAccuracy(name="c_acc")
        self.probe_loss_tracker = keras.metrics.Mean(name="p_loss")
        self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="p_acc")

    @property
    def metrics(self):
        return [self.contrastive_loss_tracker, self.contrastive_accuracy,
                self.probe_loss_tracker, self.probe_accuracy]

    def contrastive_loss(self, projections_1, projections_2):
        """NT-Xent: temperature-scaled cosine similarities as logits, symmetrised."""
        projections_1 = ops.normalize(projections_1, axis=1)
        projections_2 = ops.normalize(projections_2, axis=1)
        similarities = ops.matmul(projections_1, ops.transpose(projections_2)) / self.temperature
        # The two views of one image are each other's "class".
        contrastive_labels = ops.arange(ops.shape(projections_1)[0])
        self.contrastive_accuracy.update_state(contrastive_labels, similarities)
        self.contrastive_accuracy.update_state(contrastive_labels, ops.transpose(similarities))
        loss_1_2 = keras.losses.sparse_categorical_crossentropy(
            contrastive_labels, similarities, from_logits=True)
        loss_2_1 = keras.losses.sparse_categorical_crossentropy(
            contrastive_labels, ops.transpose(similarities), from_logits=True)
        return (loss_1_2 + loss_2_1) / 2

    def train_step(self, data):
        # The example zips an unlabeled and a labeled dataset; here x is the pair of image
        # batches and y the labels, so that plain `fit(x, y)` with arrays feeds it.
        (unlabeled_images, labeled_images), labels = data

        images = ops.concatenate((unlabeled_images, labeled_images), axis=0)
        augmented_images_1 = self.contrastive_augmenter(images, training=True)
        augmented_images_2 = self.contrastive_augmenter(images, training=True)
        with tf.GradientTape() as tape:
            features_1 = self.encoder(augmented_images_1, training=True)
            features_2 = self.encoder(augmented_images_2, training=True)
            projections_1 = self.projection_head(features_1, training=True)
            projections_2 = self.projection_head(features_2, training=True)
            contrastive_loss = self.contrastive_loss(projections_1, projections_2)
        weights = self.encoder.trainable_weights + self.projection_head.trainable_weights
        gradients = tape.gradient(contrastive_loss, weights)
        self.contrastive_optimizer.apply_gradients(zip(gradients, weights))
        self.contrastive_loss_tracker.update_state(contrastive_loss)

        preprocessed_images = self.classification_augmenter(labeled_images, training=True)
        with tf.GradientTape() as tape:
            # The encoder in inference mode: the probe alone learns from the labels.
            features = self.encoder(preprocessed_images, training=False)
            class_logits = self.linear_probe(features, training=True)
            probe_loss = self.probe_loss(labels, class_logits)
        gradients = tape.gradient(probe_loss, self.linear_probe.trainable_weights)
        self.probe_optimizer.apply_gradients(
            zip(gradients, self.linear_probe.trainable_weights))
        self.probe_loss_tracker.update_state(probe_loss)
        self.probe_accuracy.update_state(labels, class_logits)
        return {m.name: m.result() for m in self.metrics}


def _contrastive(steps, seed, compile_kwargs):
    model = ContrastiveModel(width=8, num_classes=4, seed=seed)
    model.compile(contrastive_optimizer=keras.optimizers.Adam(),
                  probe_optimizer=keras.optimizers.Adam(), **compile_kwargs)
    rng = np.random.default_rng(seed)
    rows = steps * BATCH
    unlabeled = rng.uniform(0, 255, size=(rows, 16, 16, 3)).astype("float32")
    labeled = rng.uniform(0, 255, size=(rows, 16, 16, 3)).astype("float32")
    labels = rng.integers(0, 4, rows).astype("int32")
    optimizers = {"contrastive_optimizer": model.contrastive_optimizer,
                  "probe_optimizer": model.probe_optimizer}
    return model, optimizers, (unlabeled, labeled), labels


# --- distillation: "Knowledge Distillation" -------------------------------------------------

class Distiller(keras.Model):
    """The student learns from labels and from the teacher's softened predictions, through a
    `compute_loss` override and Keras's own `train_step`."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3, **kwargs):
        super().compile(optimizer=optimizer, metrics=metrics, **kwargs)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def _distillation(steps, seed, compile_kwargs):
    def convnet(filters, name):
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                layers.Conv2D(filters, 3, strides=2, padding="same"),
                layers.LeakyReLU(negative_slope=0.2),
                layers.MaxPooling2D(2, strides=1, padding="same"),
                layers.Conv2D(2 * filters, 3, strides=2, padding="same"),
                layers.Flatten(),
                layers.Dense(4),
            ],
            name=name,
        )

    teacher = convnet(8, "teacher")
    student = convnet(4, "student")
    # The example trains the teacher first; here it only has to exist, and is frozen so
    # that the distiller's trainable weights are the student's.
    teacher.trainable = False
    model = Distiller(student=student, teacher=teacher)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
        **compile_kwargs,
    )
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(steps * BATCH, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 4, steps * BATCH).astype("int32")
    return model, {"optimizer": model.optimizer}, x, y


# --- transformer: "Text classification with Transformer" -----------------------------------

class TransformerBlock(layers.Layer):
    """Self-attention and a feed-forward network, each with dropout, residual and norm."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned embedding of the position."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


def _transformer(steps, seed, compile_kwargs):
    vocab_size, maxlen, embed_dim, num_heads, ff_dim = 50, 8, 8, 2, 8
    inputs = layers.Input(shape=(maxlen,))
    h = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    h = TransformerBlock(embed_dim, num_heads, ff_dim)(h)
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dropout(0.1)(h)
    h = layers.Dense(8, activation="relu")(h)
    h = layers.Dropout(0.1)(h)
    outputs = layers.Dense(2, activation="softmax")(h)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"],
                  **compile_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab_size, size=(steps * BATCH, maxlen)).astype("int32")
    y = (x < vocab_size // 2).sum(axis=1) > maxlen // 2  # a learnable "sentiment"
    return model, {"optimizer": model.optimizer}, x, y.astype("int32")


# --- convnet: "Image classification from scratch" ------------------------------------------

def _xception_mini(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(8, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # set aside the residual
    for size in (16,):
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x

    x = layers.SeparableConv2D(16, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    units = 1 if num_classes == 2 else num_classes
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(units, activation=None)(x)
    return keras.Model(inputs, outputs)


def _convnet(steps, seed, compile_kwargs):
    model = _xception_mini((16, 16, 3), num_classes=2)
    model.compile(optimizer=keras.optimizers.Adam(3e-4),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")], **compile_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 255, size=(steps * BATCH, 16, 16, 3)).astype("float32")
    y = (x[..., 0].mean(axis=(1, 2)) > 127.5).astype("int32")  # "is it reddish"
    return model, {"optimizer": model.optimizer}, x, y


# --- subclassed, subclassed_custom_step -----------------------------------------------------

class MLP(keras.Model):
    """The common subclassed model: layers in `__init__`, no Input, built inside `fit`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = layers.Dense(8, activation="relu")
        self.d2 = layers.Dense(1)

    def call(self, inputs):
        return self.d2(self.d1(inputs))


class CustomStepMLP(MLP):
    """The low-level custom step: a hand-made loss, `optimizer.apply`, the per-step loss
    returned as is (no tracker)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = ops.mean(keras.losses.mean_squared_error(y, y_pred))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _regression_data(steps, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * BATCH, 6)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2] + 0.1 * rng.normal(size=(steps * BATCH, 1)))
    return x, y.astype("float32")


def _subclassed(steps, seed, compile_kwargs):
    model = MLP()
    model.compile(keras.optimizers.SGD(0.05), "mse", **compile_kwargs)
    return (model, {"optimizer": model.optimizer}) + _regression_data(steps, seed)


def _subclassed_custom_step(steps, seed, compile_kwargs):
    model = CustomStepMLP()
    model.compile(keras.optimizers.SGD(0.05), **compile_kwargs)
    return (model, {"optimizer": model.optimizer}) + _regression_data(steps, seed)


# --- accumulation, clipping ----------------------------------------------------------------

def _functional_mlp():
    inputs = keras.Input((6,))
    h = layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, layers.Dense(1, name="out")(h), name="mlp")


def _accumulation(steps, seed, compile_kwargs, accumulation_steps=4):
    # Every train step applies the optimizer, but the weights (and `optimizer.iterations`)
    # move only every `accumulation_steps` train steps.
    model = _functional_mlp()
    model.compile(keras.optimizers.Adam(1e-2, gradient_accumulation_steps=accumulation_steps),
                  "mse", **compile_kwargs)
    return (model, {"optimizer": model.optimizer}) + _regression_data(steps, seed)


def _clipping(steps, seed, compile_kwargs, kind="global_clipnorm", value=0.5):
    if kind not in ("global_clipnorm", "clipnorm", "clipvalue"):
        raise ValueError(f"kind must be global_clipnorm, clipnorm or clipvalue, not {kind!r}")
    model = _functional_mlp()
    model.compile(keras.optimizers.SGD(0.1, **{kind: value}), "mse", **compile_kwargs)
    return (model, {"optimizer": model.optimizer}) + _regression_data(steps, seed)


# name: (factory, functional, deterministic, has_dropout)
_FACTORIES = {
    "gan": (_gan, False, False, True),
    "wgan_gp": (_wgan_gp, False, False, True),
    "vae": (_vae, False, False, False),
    "contrastive": (_contrastive, False, False, False),
    "distillation": (_distillation, False, True, False),
    "transformer": (_transformer, True, False, True),
    "convnet": (_convnet, True, False, True),
    "subclassed": (_subclassed, False, True, False),
    "subclassed_custom_step": (_subclassed_custom_step, False, True, False),
    "accumulation": (_accumulation, True, True, False),
    "clipping": (_clipping, True, True, False),
}


# --- CycleGAN's shape: four optimizers in one train_step (not a port of its own) ---------

class CycleGAN(keras.Model):
    """The shape of keras.io's CycleGAN `train_step`: two generators and two
    discriminators, each with its own optimizer, all four applied at every
    step from one persistent tape."""

    OPTIMIZERS = ("gen_G_optimizer", "gen_F_optimizer", "disc_X_optimizer", "disc_Y_optimizer")

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


def make(name: str, steps: int = 12, steps_per_execution: int = 1, jit_compile=False,
         strategy=None, seed: int = 0, **options) -> Port:
    """The port `name`, compiled (in `strategy.scope()` if given) with `steps_per_execution`
    and `jit_compile`, with data for `steps` train steps of `BATCH` rows.

    The same `seed` gives the same initial weights, SeedGenerator states and data.
    Options: `clipping` takes `kind` ("global_clipnorm", "clipnorm", "clipvalue") and
    `value`; `accumulation` takes `accumulation_steps`.
    """
    if name not in _FACTORIES:
        raise ValueError(f"unknown port {name!r}; one of {PORTS}")
    factory, functional, deterministic, has_dropout = _FACTORIES[name]
    unknown = set(options) - set(list(inspect.signature(factory).parameters)[3:])
    if unknown:
        raise TypeError(f"port {name!r} takes no option {', '.join(sorted(unknown))}")
    keras.utils.set_random_seed(seed)
    compile_kwargs = {"steps_per_execution": steps_per_execution, "jit_compile": jit_compile}
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model, optimizers, x, y = factory(steps, seed, compile_kwargs, **options)
    return Port(name, model, x, y, BATCH, optimizers, functional, deterministic, has_dropout)
