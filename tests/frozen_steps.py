"""A NaN planted in one batch: the steps it freezes leave the optimizer as it was.

Shared by the TensorFlow tests (tests/callbacks/test_stop_on_rule.py) and
the JAX ones (tests/jax/test_faults.py); nothing here imports a backend.

`StopOnRule` freezes the weights at the faulty step and stops training at
the host's next read, so the steps between run frozen. Each of them, the
fault's own included, must leave every optimizer variable as it was
(`iterations` too: it drives the learning-rate schedule and Adam's bias
correction), so that after the fit the model and its optimizer equal a
plain Keras fit on the batches before the fault, bitwise; and the records
of those steps say they were frozen.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

import kerasdbg
from kerasdbg.callbacks import GradientStatistics, StopOnRule

BATCH, STEPS, FAULT = 4, 40, 3
_rng = np.random.default_rng(21)
X = _rng.normal(size=(BATCH * STEPS, 3)).astype("float32")
Y = _rng.normal(size=(BATCH * STEPS, 1)).astype("float32")


def with_nan(x: np.ndarray, step: int = FAULT, batch: int = BATCH) -> np.ndarray:
    """`x` with the first sample of optimizer step `step` (1-based) NaN."""
    x = np.array(x, copy=True)
    x[(step - 1) * batch] = np.nan
    return x


def make_model(optimizer: str = "adam", spe: int = 1, jit_compile="auto", scope=None
               ) -> keras.Model:
    with scope or contextlib.nullcontext():
        return _make_model(optimizer, spe, jit_compile)


def _make_model(optimizer, spe, jit_compile):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu", name="d"),
                              keras.layers.Dense(1, name="o")], name="m")
    chosen = {"adam": lambda: keras.optimizers.Adam(0.01),
              "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
              "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)}[optimizer]()
    model.compile(chosen, "mse", steps_per_execution=spe, jit_compile=jit_compile)
    return model


def values(variables) -> list:
    return [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in variables]


def assert_same(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"{what} {k}")


def assert_optimizer_as_before(model, plain, optimizers=("optimizer",)) -> None:
    """Every weight and every variable of each named optimizer (`iterations`
    first) of `model` equal `plain`'s, bitwise."""
    assert_same(values(model.trainable_variables), values(plain.trainable_variables), "weights")
    for name in optimizers:
        mine, theirs = getattr(model, name), getattr(plain, name)
        assert int(keras.ops.convert_to_numpy(mine.iterations)) == \
            int(keras.ops.convert_to_numpy(theirs.iterations)), name
        assert_same(values(mine.variables), values(theirs.variables), name)


def check_mlp(optimizer: str, spe: int, jit_compile="auto", log_dir=None, strategy=None
              ) -> None:
    """The MLP with `optimizer`, a NaN in batch `FAULT` of 40, `StopOnRule()`
    (`strategy`: a function making the `tf.distribute` strategy to build in)."""
    scope = (lambda: None) if strategy is None else (lambda: strategy().scope())
    model = make_model(optimizer, spe, jit_compile, scope())
    stop = StopOnRule(log_dir=log_dir, verbose=False)
    gradients = GradientStatistics()
    model.fit(with_nan(X), Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[stop, gradients])
    assert (stop.verdicts[0].rule, stop.verdicts[0].step) == ("NonFiniteLoss", FAULT)
    plain = make_model(optimizer, spe, jit_compile, scope())
    plain.fit(X[:(FAULT - 1) * BATCH], Y[:(FAULT - 1) * BATCH], batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0)
    assert_optimizer_as_before(model, plain)
    # The frozen steps are recorded, numbered on, and say they were frozen.
    recorded = gradients.history.step.tolist()
    assert recorded[:FAULT] == [1, 2, 3] and recorded == list(range(1, len(recorded) + 1))
    if log_dir is not None:
        frozen = kerasdbg.load_run(log_dir).scalars("step/frozen")
        assert frozen.step.tolist() == recorded
        assert frozen.value.tolist() == [0.0] * (FAULT - 1) + [1.0] * (len(recorded) - FAULT + 1)
    # A second fit, the data mended, trains on from where the plain fit stands.
    for fitted in (model, plain):
        fitted.fit(X[:2 * BATCH], Y[:2 * BATCH], batch_size=BATCH, epochs=1, shuffle=False,
                   verbose=0)
    assert_optimizer_as_before(model, plain)


def check_model(make, x, y, batch: int, optimizers, loss=None) -> None:
    """`make()`'s model fitted on `x` with a NaN in batch `FAULT`, with
    `StopOnRule(loss=loss)`, against a plain fit of `make()` on the batches
    before it: the weights and every optimizer named in `optimizers`."""
    model = make()
    stop = StopOnRule(loss=loss, verbose=False)
    model.fit(with_nan(x, batch=batch), y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[stop])
    faults = [v for v in stop.verdicts if v.severity == "fault"]
    assert faults, stop.verdicts
    plain = make()
    before = (FAULT - 1) * batch
    plain.fit(x[:before], None if y is None else y[:before], batch_size=batch, epochs=1,
              shuffle=False, verbose=0)
    assert_optimizer_as_before(model, plain, optimizers)
