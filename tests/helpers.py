"""A small MLP, its data, an independent reference of its SGD training, and a
deliberately broken train step (replicas that drift apart)."""

import keras
import numpy as np
import tensorflow as tf

from tests.blockers import WITHOUT_TENSORFLOW  # noqa: F401 - the tests import it from here

LEARNING_RATE = 0.05
BATCH = 8
RNG = np.random.default_rng(42)
X = RNG.normal(size=(80, 6)).astype("float32")
Y = RNG.normal(size=(80, 3)).astype("float32")


def make_mlp(activation="relu"):
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5, activation=activation, name="hidden"),
         keras.layers.Dense(3, name="out")]
    )


def reference_training(initial, steps, x=X, y=Y, batch=BATCH, lr=LEARNING_RATE, activation="relu"):
    """Plain TF forward pass, GradientTape gradients and a NumPy SGD update.

    Returns, per step, the gradients, the weights before and after the update,
    the loss and the two layers' outputs.
    """
    weights = [np.array(w, np.float32) for w in initial]
    batches = len(x) // batch
    out = []
    for step in range(steps):
        i = step % batches
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        tvars = [tf.Variable(w) for w in weights]
        with tf.GradientTape() as tape:
            hidden = xb @ tvars[0] + tvars[1]
            hidden = tf.nn.relu(hidden) if activation == "relu" else hidden
            output = hidden @ tvars[2] + tvars[3]
            loss = tf.reduce_mean(tf.square(output - yb))
        grads = [g.numpy() for g in tape.gradient(loss, tvars)]
        after = [w - np.float32(lr) * g for w, g in zip(weights, grads)]
        out.append({"grads": grads, "before": weights, "after": after, "loss": float(loss),
                    "hidden": hidden.numpy(), "out": output.numpy()})
        weights = after
    return out


class PerReplicaUpdates(keras.Model):
    """A custom train step that, from step `broken_from` on, updates each
    replica's copy with its own replica's gradient (no all-reduce)."""

    broken_from = 1

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        context = tf.distribute.get_replica_context()
        reduced = context.all_reduce("MEAN", grads)
        self.steps_done.assign_add(1)
        broken = self.steps_done >= self.broken_from
        for v, g, r in zip(self.trainable_variables, grads, reduced):
            v.assign_sub(0.1 * tf.where(broken, g, r))
        return {"loss": loss}


def traced_functions(model, full=None) -> list:
    """The `tf.function`s the model's current train function calls (found
    through its closures): the traced train step's, to look at its graph;
    where kerasdbg runs two variants, the one `full` names (by default the
    every-step one where it was made). See `bench/tf_step_program.py`."""
    return tf_step_program().functions_of(model, full)


def tf_step_program():
    """bench/tf_step_program.py as a module (what tests count programs with)."""
    import importlib.util
    import pathlib
    import sys

    module = sys.modules.get("kerasdbg_bench_tf_step_program")
    if module is None:
        path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "tf_step_program.py"
        spec = importlib.util.spec_from_file_location("kerasdbg_bench_tf_step_program", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module
