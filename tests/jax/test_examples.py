"""The JAX versions of the keras.io ports (tests/jax/examples.py) with every JAX instrument.

Runs on the JAX backend only (`KERAS_BACKEND=jax`, see tests/conftest.py). Each port with
GradientStatistics, WeightStatistics and StopOnRule against plain Keras:

- the healthy run trains bitwise as a plain `fit` (every port is seeded, its Dropout and
  random draws included, so two plain runs are bitwise equal), is described once per
  optimizer step (per optimizer for the GAN), its gradient norms those that a class-level
  wrapper of the optimizer's `stateless_apply`, written here, saw in the plain `fit`; no
  verdict and no kerasdbg warning;
- a NaN planted in one batch stops the run at that step, with the model, its
  non-trainable state and the optimizers' variables of a plain `fit` of the batches before
  it.

The matrix, to keep these under three minutes on two busy cores (a fit of these ports takes
seconds, mostly tracing): the VAE at spe 4 with jit, the GAN (two optimizers in a
stateless step) at spe 1 and 4 with jit, the transformer at spe 4 with jit, the convnet
at spe 1 with jit.
"""

import re
import warnings

import jax
import keras
import numpy as np
import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from tests.jax import examples


STEPS = 12
BAD = 5  # the faulty step: under spe 4, the first of the second execution, 3 frozen after it
OURS = r"(kerasdbg|StopOnRule|GradientStatistics|WeightStatistics)\b"


def _config(spe, jit):
    return f"spe{spe}-{'jit' if jit else 'nojit'}"


# Without jit_compile Keras's JAX trainer runs the step op by op: a 12-step fit of the
# convolutional ports then takes minutes on two busy cores (the GAN at spe 4: six), and the
# transformer's two cases two and a half (of the suite's 40-minute budget). The ports
# without jit are tests/jax/test_ports_timer_recorder.py's transformer and
# tests/jax/test_taps.py's GAN; the statistics without jit are tests/jax/test_capture.py's.
CASES = [pytest.param(name, spe, jit, id=f"{name}-{_config(spe, jit)}")
         for name, spe, jit in (("vae", 4, True), ("gan", 1, True), ("gan", 4, True),
                                ("transformer", 4, True), ("convnet", 1, True))]


def fit(port, x=None, y=None, sample_weight=None, callbacks=()):
    return port.model.fit(port.x if x is None else x, port.y if y is None else y,
                          sample_weight=sample_weight, batch_size=port.batch_size, epochs=1,
                          shuffle=False, verbose=0, callbacks=list(callbacks))


class StateBefore(keras.callbacks.Callback):
    """The JAX trainer's state after train step `BAD - 1` (the end of an execution at
    spe 1 and 4), copied to NumPy before the next step donates it."""

    def __init__(self):
        super().__init__()
        self.state = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == BAD - 2:
            state = self.model._jax_state
            self.state = {key: [np.array(v) for v in state[key]]
                          for key in ("trainable_variables", "non_trainable_variables",
                                      "optimizer_variables")}


_PLAIN = {}


def plain_run(name, spe, jit, sample_weight=None):
    """A plain `fit` of the port (once per case, shared by the tests): its logs, every
    variable after it, its state after step `BAD - 1`, and the l2 norm of each gradient
    every optimizer's `stateless_apply` received, in order, from a class-level wrapper:
    {attribute: [[norm per variable] per apply]}."""
    key = (name, spe, jit)
    if key in _PLAIN:
        return _PLAIN[key]
    port = examples.make(name, STEPS, spe, jit)
    seen = {id(o): [] for o in port.optimizers.values()}
    classes = {type(o) for o in port.optimizers.values()}
    originals = {cls: cls.stateless_apply for cls in classes}
    own = {cls: vars(cls).get("stateless_apply") for cls in classes}  # None: inherited

    def wrap(original):
        def stateless_apply(self, optimizer_variables, grads, trainable_variables):
            key = id(self)
            jax.debug.callback(
                lambda *g: seen[key].append([np.linalg.norm(np.asarray(a, np.float64))
                                             for a in g]), *grads, ordered=True)
            return original(self, optimizer_variables, grads, trainable_variables)

        return stateless_apply

    before = StateBefore()
    for cls, original in originals.items():
        cls.stateless_apply = wrap(original)
    try:
        history = fit(port, sample_weight=with_nan(port)[2], callbacks=[before]).history
    finally:
        for cls in classes:  # the classes as they were
            if own[cls] is None:
                del cls.stateless_apply
            else:
                cls.stateless_apply = own[cls]
    jax.effects_barrier()
    _PLAIN[key] = (history, [np.asarray(v) for v in examples.all_weights(port)], before.state,
                   {attribute: seen[id(o)] for attribute, o in port.optimizers.items()})
    return _PLAIN[key]


def instrumented_fit(port, callbacks, **kwargs):
    """`fit` with kerasdbg's callbacks, and kerasdbg's warnings during it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(port, callbacks=callbacks, **kwargs)
    ours = [str(w.message) for w in caught if re.match(OURS, str(w.message))]
    return history, ours


def assert_same_variables(expected, actual, skip=()):
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual)):
        if i not in skip:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"variable {i}")


def per_optimizer(history, port, name):
    """The rows of `history` that describe optimizer `name` of `port`."""
    if len(port.optimizers) == 1:
        assert "optimizer" not in history.columns
        return history
    return history[history.optimizer == port.names[name]]


def trainable_paths(port, name):
    optimizer = port.optimizers[name]
    return [v.path for v in optimizer._trainable_variables]


def faults(stop):
    """StopOnRule's fault verdicts. The others may only be information that says it is
    none, as on TensorFlow: biases whose gradient is zero by construction (the convnet's
    before BatchNormalization, the attention's key bias: the softmax is shift-invariant)."""
    for verdict in stop.verdicts:
        if verdict.severity != "fault":
            assert verdict.rule == "VanishingGradient" and "not a fault" in verdict.reason, \
                verdict
            assert all(t.endswith("bias") for t in verdict.tensors), verdict
    return [v for v in stop.verdicts if v.severity == "fault"]


def with_nan(port):
    """The port's data with a NaN in batch `BAD`: in the images, or (the transformer's
    inputs are token ids) in the sample weights. Also the sample weights (None or ones) a
    plain fit of the clean batches must use, the same graph."""
    x = port.x.copy()
    row = (BAD - 1) * port.batch_size + 3
    if x.dtype.kind == "f":
        x[row] = np.nan
        return x, None, None
    sample_weight = np.ones(len(x), "float32")
    clean = sample_weight.copy()
    sample_weight[row] = np.nan
    return x, sample_weight, clean


@pytest.mark.parametrize("name, spe, jit", CASES)
def test_a_healthy_port_trains_bitwise_plain_recorded_once_per_optimizer_step(name, spe, jit):
    plain_history, plain_weights, _, applied = plain_run(name, spe, jit)

    port = examples.make(name, STEPS, spe, jit)
    gradients, weights, stop = GradientStatistics(), WeightStatistics(), StopOnRule()
    history, ours = instrumented_fit(port, [gradients, weights, stop],
                                     sample_weight=with_nan(port)[2])

    assert ours == []
    assert faults(stop) == []
    assert history.history == plain_history
    assert_same_variables(plain_weights, examples.all_weights(port))
    for optimizer in port.optimizers.values():
        assert "stateless_apply" not in vars(optimizer)

    for attribute in port.optimizers:
        norms = applied[attribute]
        assert len(norms) == STEPS, attribute
        paths = trainable_paths(port, attribute)
        for recorder in (gradients, weights):
            rows = per_optimizer(recorder.history, port, attribute)
            assert rows.step.tolist() == list(range(1, STEPS + 1)), (attribute, recorder)
        rows = per_optimizer(gradients.history, port, attribute).set_index("step")
        for step in (1, BAD, STEPS):
            for path, norm in zip(paths, norms[step - 1]):
                np.testing.assert_allclose(rows.loc[step, f"{path}/l2_norm"], norm, rtol=2e-5,
                                           atol=1e-7, err_msg=f"{attribute} {path} step {step}")
    if len(port.optimizers) > 1:
        assert set(gradients.history.optimizer) == set(port.names.values())


@pytest.mark.parametrize("name, spe, jit", CASES)
def test_a_nan_in_one_batch_stops_the_port_at_its_step_with_the_weights_before_it(
        name, spe, jit, read_every_execution):
    # Read after every execution: the stop comes after the NaN's execution
    # (at the next read otherwise: tests/jax/test_read_interval.py).
    state = plain_run(name, spe, jit)[2]

    port = examples.make(name, STEPS, spe, jit)
    x, sample_weight, _ = with_nan(port)
    gradients, weights, stop = GradientStatistics(), WeightStatistics(), StopOnRule()
    _, ours = instrumented_fit(port, [gradients, weights, stop], x=x,
                               sample_weight=sample_weight)

    assert ours == []
    assert faults(stop), stop.verdicts
    assert {v.step for v in faults(stop)} == {BAD}, stop.verdicts
    model = port.model
    # No optimizer counts a frozen step, the fault's own included: every variable, the
    # step counters too, is the plain run's on the batches before the fault.
    for optimizer in port.optimizers.values():
        assert int(np.asarray(optimizer.iterations.value)) == BAD - 1

    def compare(expected, variables):
        assert_same_variables(expected, [v.value for v in variables])

    compare(state["trainable_variables"], model.trainable_variables)
    # BatchNormalization's moving statistics, the SeedGenerators' states and (the GAN)
    # the generator's optimizer's variables.
    compare(state["non_trainable_variables"], model.non_trainable_variables)
    compare(state["optimizer_variables"], model.optimizer.variables)
    for attribute in port.optimizers:
        rows = per_optimizer(gradients.history, port, attribute)
        assert rows.step.is_unique
        assert rows.step.min() == 1 and rows.step.max() >= BAD, rows.step.tolist()
        columns = [f"{path}/l2_norm" for path in trainable_paths(port, attribute)]
        assert np.isfinite(rows[rows.step < BAD][columns].to_numpy()).all()
