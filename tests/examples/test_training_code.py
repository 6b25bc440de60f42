"""Every instrument on the training code people write: the keras.io ports of `ports.py`.

One case per port and execution configuration, two fits each (shared by every check):

- a plain `fit` of the first `FAULT - 1` train steps, the reference;
- a `fit` of `STEPS` train steps with every instrument (gradient and weight statistics,
  `StopOnRule` with its default rules, taps where the model is functional), a NaN planted
  in the batch of train step `FAULT`, and every optimizer's `apply` wrapped by the test
  (`capture.py`) to see independently what it receives.

Checks: the recorded gradient norms equal the captured ones (and, for the deterministic
ports, those of a GradientTape replay); every scalar the train step returns is recorded
once per train step as `step/<name>` (and `step/loss` is the replay's loss where there is
one); no rule fires before the fault, only information
on tensors that are zero by construction; the NaN is caught at its step; the weights at
the end are bitwise those of the plain reference (the faulty step never reached them);
nothing of kerasdbg is left in the model.
"""

import functools
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.backends.tensorflow import multi_worker_fit
from kerasdbg.backends.tensorflow import optimizer_routing as routing
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.rules import GradientNormSpike, LogitGrowth, LossSpike
from tests.conftest import make_strategy
from tests.examples import ports
from tests.examples.capture import capture_applies

STEPS, FAULT = 26, 25
CONFIGS = [("default", 1, False), ("default", 1, True), ("default", 4, True),
           ("mirrored", 1, False), ("mirrored_collective", 4, False)]
"""Every level of each axis (strategy, steps_per_execution, jit_compile) and every pair
of levels of two axes that Keras runs (MirroredStrategy with jit_compile fails with plain
Keras: tests/test_keras_limitations.py) is a cell here: steps_per_execution 4 without
jit_compile runs under MirroredStrategy's collective all-reduce. (The default strategy at
steps_per_execution 4 without jit_compile, the product's one cell more, left out for the
suite's time: 11 ports of about 20 s; the instruments' own tests run the whole product.)

("mirrored_collective", 4): MirroredStrategy's default (collective) all-reduce with
steps_per_execution 4, which Keras fails (keras-team/keras#19246) unless
`kerasdbg.compat.fix_multi_worker_fit()` is in place: both fits run with it, on the
process's one collective strategy (`make_strategy`)."""
ACCUMULATION_MIRRORED = (
    "Keras: gradient accumulation under MirroredStrategy fails in its cond: 'merge_call called "
    "while defining a new graph or a tf.function' (keras-team/keras#20582)")
COLLECTIVE_LOOP = ("gan", "wgan_gp", "contrastive")
"""The ports whose own train step (two optimizers applied in it) still runs a collective
inside a `tf.cond` of its graph: the steps loop of `fix_multi_worker_fit` removes Keras's
`tf.cond` around the step, not one inside it, and plain Keras then fails the same way."""
COLLECTIVE_LOOP_ERROR = "You must feed a value for placeholder tensor"
# The models with no `call`: under a strategy, Keras builds the model before `fit` by calling
# it; marking them built is the usual workaround.
NO_CALL = ("gan", "wgan_gp", "vae", "contrastive")
# What the train step returns, and so where `step/loss` comes from.
NO_LOSS = ("gan", "wgan_gp", "contrastive")
OURS = r"(kerasdbg|StopOnRule|GradientStatistics|WeightStatistics|ActivationStatistics)\b"


def _cases():
    cases = []
    for name in ports.PORTS:
        for strategy, spe, jit in CONFIGS:
            marks = ()
            if name == "accumulation" and strategy.startswith("mirrored"):
                marks = pytest.mark.xfail(strict=True, raises=RuntimeError,
                                          reason=ACCUMULATION_MIRRORED)
            elif name in COLLECTIVE_LOOP and strategy == "mirrored_collective":
                marks = pytest.mark.xfail(
                    strict=True, raises=tf.errors.InvalidArgumentError, reason=(
                        f"Keras: a collective in a tf.cond of the train step, in a "
                        f"steps_per_execution loop: '{COLLECTIVE_LOOP_ERROR} "
                        ".../while/body/.../cond/else/.../cond/Placeholder' (keras-team/keras#19246)"))
            cases.append(pytest.param(
                name, strategy, spe, jit, marks=marks,
                id=f"{name}-{strategy}-spe{spe}-{'jit' if jit else 'nojit'}"))
    return cases


def _make(name, strategy_name, spe, jit):
    strategy = None if strategy_name == "default" else make_strategy(
        "mirrored", collective=strategy_name == "mirrored_collective")
    port = ports.make(name, steps=STEPS, steps_per_execution=spe, jit_compile=jit,
                      strategy=strategy)
    if strategy is not None and name in NO_CALL:
        port.model.built = True
        if name == "contrastive":
            with strategy.scope():
                port.model.encoder.build((None, 16, 16, 3))
    return port


def _rows(data, batches):
    """The first `batches` batches of `data` (arrays, nested in tuples)."""
    if data is None:
        return None
    if isinstance(data, tuple):
        return tuple(_rows(d, batches) for d in data)
    return data[:batches * ports.BATCH]


def _with_nan(port):
    """`(x, y, sample_weight)` with train step FAULT's batch non-finite: a NaN in the
    float inputs, or a NaN sample weight where the inputs are token ids."""
    rows = slice((FAULT - 1) * port.batch_size, FAULT * port.batch_size)
    x = port.x
    if port.name == "transformer":
        weights = np.ones(len(x), "float32")
        weights[rows] = np.nan
        return x, port.y, weights
    if isinstance(x, tuple):  # contrastive: (unlabeled, labeled)
        unlabeled = x[0].copy()
        unlabeled[rows] = np.nan
        return (unlabeled,) + x[1:], port.y, None
    x = x.copy()
    x[rows] = np.nan
    return x, port.y, None


def _float_weights(model):
    return [v for v in model.weights
            if keras.backend.standardize_dtype(v.dtype).startswith("float")]


def _fault_step(name):
    # WGAN-GP applies its critic three times per train step: the NaN batch reaches the
    # critic's first apply of train step FAULT.
    return 3 * (FAULT - 1) + 1 if name == "wgan_gp" else FAULT


@functools.lru_cache(maxsize=None)
def _replay(name):
    """`(norms, losses)` of train steps 1..FAULT-1 of the deterministic ports, from a
    GradientTape replay written here: the model's forward pass, its loss (Keras's
    `compute_loss`, or the port's own), and an optimizer of the same configuration.
    `norms` holds the per-variable gradient norms of each step."""
    port = ports.make(name, steps=STEPS)
    model = port.model
    optimizer = model.optimizer.__class__.from_config(model.optimizer.get_config())
    norms, losses = [], []
    x, y = port.x, port.y
    for step in range(FAULT - 1):
        rows = slice(step * port.batch_size, (step + 1) * port.batch_size)
        xb, yb = tf.constant(x[rows]), tf.constant(y[rows])
        with tf.GradientTape() as tape:
            y_pred = model(xb, training=True)
            if name == "subclassed_custom_step":
                loss = tf.reduce_mean(tf.square(yb - y_pred))
            else:
                loss = model.compute_loss(x=xb, y=yb, y_pred=y_pred)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        norms.append([float(np.linalg.norm(g.numpy().astype(np.float64))) for g in grads])
        losses.append(float(loss))
        optimizer.apply(grads, variables)
    return norms, losses


@pytest.fixture
def keras_fix(request):
    """`fix_multi_worker_fit()` in place for the "mirrored_collective" cases."""
    if request.node.callspec.params["strategy_name"] != "mirrored_collective":
        yield
        return
    multi_worker_fit.fix_multi_worker_fit()
    try:
        yield
    finally:
        multi_worker_fit.undo_multi_worker_fit()


@pytest.mark.parametrize("name, strategy_name, spe, jit", _cases())
def test_every_instrument_on_the_port(name, strategy_name, spe, jit, tmp_path, keras_fix):
    reference = _make(name, strategy_name, spe, jit)
    # The same arrays (the sample weights too: they change the graph, and so the kernels
    # and their rounding), up to the batch before the faulty one.
    clean = [_rows(data, FAULT - 1) for data in _with_nan(reference)]
    try:  # plain Keras: where it fails, kerasdbg is not involved
        reference.model.fit(*clean[:2], sample_weight=clean[2], batch_size=reference.batch_size,
                            epochs=1, shuffle=False, verbose=0)
    except RuntimeError as error:
        if name == "accumulation" and strategy_name.startswith("mirrored") \
                and "merge_call" in str(error):
            raise
        raise AssertionError(f"plain Keras failed: {error}") from error
    except tf.errors.InvalidArgumentError as error:
        if name in COLLECTIVE_LOOP and strategy_name == "mirrored_collective" \
                and COLLECTIVE_LOOP_ERROR in str(error):
            raise
        raise AssertionError(f"plain Keras failed: {error}") from error
    expected = [v.numpy() for v in _float_weights(reference.model)]

    port = _make(name, strategy_name, spe, jit)
    model = port.model
    x, y, sample_weight = _with_nan(port)
    trained = kerasdbg.insert_taps(model) if port.functional else model
    grads_cb, weights_cb = GradientStatistics(), WeightStatistics()
    stop = StopOnRule(verbose=False, log_dir=str(tmp_path))
    # The spike rules, with windows far shorter than their defaults (the
    # shorter, the likelier a false alarm: at 8 steps the transformer's norm
    # of step 20, 3.2 x the window's mean, was 6 of its deviations above),
    # skipping in the graph: a spike found on a healthy step would skip it
    # and change the weights.
    spikes = StopOnRule([LossSpike(window=16), GradientNormSpike(window=16), LogitGrowth()],
                        action="skip", verbose=False)
    callbacks = [grads_cb, weights_cb, stop, spikes] + (
        [ActivationStatistics()] if port.functional else [])
    with capture_applies() as capture, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trained.fit(x, y, sample_weight=sample_weight, batch_size=port.batch_size, epochs=1,
                    shuffle=False, verbose=0, callbacks=callbacks)
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and re.match(OURS, str(w.message))]
    assert ours == []
    if name in NO_LOSS:
        # No single loss: NonFiniteLoss watches each loss the train step returns.
        losses = [k for k in sorted(_returned(name)) if k.endswith("_loss")]
        assert stop.loss_source == "the train step's " + ", ".join(map(repr, losses))

    # The weights never saw the faulty step: bitwise those of the plain reference.
    for variable, want in zip(_float_weights(model), expected):
        np.testing.assert_array_equal(variable.numpy(), want, err_msg=variable.path)

    # The NaN is caught at its step; before it, only information, never a fault.
    fault_step = _fault_step(name)
    faults = [v for v in stop.verdicts if v.severity == "fault"]
    assert faults and {v.step for v in faults} == {fault_step}, stop.verdicts
    rules = {v.rule for v in faults}
    # (The loss itself may stay finite: a fused MatMul+BiasAdd+Relu kernel turns NaN into 0.)
    assert "ExplodingTensor" in rules and "NaNSource" in rules
    assert all(v.step <= fault_step for v in stop.verdicts)
    assert [v for v in spikes.verdicts if v.step < fault_step] == []
    assert [s for s in spikes.skipped_steps if s < fault_step] == []
    _check_information(name, stop.verdicts)

    # Every optimizer is described, under its attribute name when there are several.
    history = grads_cb.history
    several = len(port.optimizers) > 1
    assert ("optimizer" in history.columns) == several
    for attribute, optimizer in port.optimizers.items():
        rows = history[history.optimizer == attribute] if several else history
        # The applies of frozen steps run without their update where the freeze
        # skips the update inside Keras's `apply`, else never (a cond around them):
        # the steps before the fault are compared.
        captured = capture.norms(optimizer)
        applies = 3 if name == "wgan_gp" and attribute == "d_optimizer" else 1
        assert len(captured) >= applies * (FAULT - 1), attribute
        captured = captured[:applies * (FAULT - 1)]
        for call in range(len(captured)):
            row = rows[rows.step == call + 1]
            assert len(row) == 1, (attribute, call + 1, rows.step.tolist())
            for path, norm in captured[call].items():
                np.testing.assert_allclose(row[f"{path}/l2_norm"].iloc[0], norm, rtol=1e-5,
                                           atol=1e-7, err_msg=f"{attribute} step {call + 1} {path}")
        if port.deterministic and strategy_name == "default":
            # (Under MirroredStrategy Keras sums the replicas' gradients: a loss
            # written with plain ops, as subclassed_custom_step's, then gives twice
            # the one-device gradient, which the capture shows and the replay does not.)
            # In the order of the model's trainable variables (the replay's model is
            # another instance, with other layer names).
            for call, norms in enumerate(_replay(name)[0]):
                np.testing.assert_allclose(list(captured[call].values()), norms, rtol=1e-4,
                                           atol=1e-7, err_msg=f"replay step {call + 1}")
        # The faulty step's gradient norm is NaN, not a small number.
        faulty = rows[rows.step == fault_step]
        if attribute == next(iter(port.optimizers)) and len(faulty):
            norm_column = "global_norm" if not several else f"{attribute}/global_norm"
            assert np.isnan(faulty[norm_column].iloc[0])
    _check_step_values(name, strategy_name, port, tmp_path)
    weights = weights_cb.history
    assert len(weights) and weights.step.max() <= STEPS * (3 if name == "wgan_gp" else 1)
    if port.functional:
        assert len(callbacks[-1].history)

    # Nothing of kerasdbg is left behind.
    assert "train_step" not in vars(trained) and "compute_loss" not in vars(trained)
    assert not routing.routes_active()


def _returned(name):
    return {"gan": ("d_loss", "g_loss"), "wgan_gp": ("d_loss", "g_loss"),
            "contrastive": ("c_acc", "c_loss", "p_acc", "p_loss")}[name]


def _check_information(name, verdicts):
    """The tensors reported as zero by construction, where the model has some."""
    info = {t for v in verdicts if v.severity == "info" for t in v.tensors}
    if name == "transformer":
        # The key bias of MultiHeadAttention: the softmax is shift-invariant.
        assert any(re.search(r"multi_head_attention(_\d+)?/key/bias$", t) for t in info), info
    if name == "convnet":
        # The biases of the convolutions that BatchNormalization follows.
        assert any(re.search(r"separable_conv2d(_\d+)?/bias$", t) for t in info), info
    for tensor in info:
        assert tensor.endswith("bias"), (name, tensor)


def _check_step_values(name, strategy_name, port, log_dir):
    """`step/<name>` holds every scalar the train step returns, once per train step (at
    the step of its first apply), finite before the fault; for the deterministic ports,
    `step/loss` is the replay's loss of each step."""
    run = kerasdbg.load_run(str(log_dir))
    first_applies = [3 * t + 1 if name == "wgan_gp" else t + 1 for t in range(FAULT - 1)]
    for returned in _returned(name) if name in NO_LOSS else ("loss",):
        values = run.scalars(f"step/{returned}")
        healthy = values[values.step < _fault_step(name)]
        assert healthy.step.tolist() == first_applies, (returned, values.step.tolist())
        assert np.all(np.isfinite(healthy.value)), (returned, healthy.value.tolist())
        if returned == "loss" and port.deterministic and strategy_name == "default":
            np.testing.assert_allclose(healthy.value, _replay(name)[1], rtol=1e-4,
                                       err_msg="step/loss against the replay's loss")
