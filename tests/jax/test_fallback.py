"""A train step kerasdbg's JAX capture cannot follow: the fit goes on as
plain Keras, bitwise, and the instruments say once that they record nothing
more (never the user's fit to break)."""

import warnings

import jax
import keras
import numpy as np
import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule

BATCH, STEPS = 16, 6
RNG = np.random.default_rng(5)
X = RNG.normal(size=(BATCH * STEPS, 4)).astype("float32")
Y = X[:, :1] * 2.0


class ApplyInsideCond(keras.Model):
    """The keras.io JAX guide's train step, with the update inside `lax.cond`
    (skipped when the loss is not finite): the gradients the optimizer gets
    are tracers of the branch, not of the step."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_fn(trainable, non_trainable):
            prediction, non_trainable = self.stateless_call(trainable, non_trainable, x)
            return keras.ops.mean((prediction - y) ** 2), non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable)

        def apply(operands):
            optimizer_variables, grads, trainable = operands
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable)
            return trainable, optimizer_variables

        def skip(operands):
            optimizer_variables, _, trainable = operands
            return trainable, optimizer_variables

        trainable, optimizer_variables = jax.lax.cond(
            jax.numpy.isfinite(loss), apply, skip, (optimizer_variables, grads, trainable))
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def make(spe, jit):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))
    model = ApplyInsideCond(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.05), steps_per_execution=spe, jit_compile=jit)
    return model


@pytest.mark.parametrize("spe, jit", [(1, True), (4, True), (1, False)])
def test_a_train_step_applying_inside_lax_cond_trains_as_plain_keras_and_is_said(spe, jit):
    plain = make(spe, jit)
    plain.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0)
    model = make(spe, jit)
    gradients = GradientStatistics()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[gradients, StopOnRule(verbose=False)])
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    said = [str(w.message) for w in caught if "could not run its step" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "GradientStatistics, StopOnRule" in said[0]
    assert gradients.history.empty
    # The model is as kerasdbg found it: a plain fit after this one records nothing odd.
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0)
    plain.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
