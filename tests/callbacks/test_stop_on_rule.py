"""StopOnRule: per-step loss, freezing on a fault, the actions, and online = offline."""

import os
import re
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.rules import (
    AllZero, DeadReLU, ExplodingTensor, LossNotDecreasing, NonFiniteLoss, RuleFired, RuleWarning,
    UnchangedTensor, VanishingGradient, WeightUpdateRatio,
)
from kerasdbg.records.verdicts import no_verdict, verdict_rows
from kerasdbg.rules import FreezeOnFault, NaNSource
from tests import frozen_steps
from tests.examples import ports
from tests.conftest import make_strategy, matrix, only_upstream_failure

BATCH, STEPS, FAULT = 4, 10, 7
RNG = np.random.default_rng(11)
X = RNG.normal(size=(BATCH * STEPS, 3)).astype("float32")
Y = RNG.normal(size=(BATCH * STEPS, 1)).astype("float32")


def _with_batch(step, value):
    """X with one sample of optimizer step `step` (1-based) set to `value`.

    The sample is the first of the batch: under MirroredStrategy only the
    first replica sees it, so the other replica's loss stays finite.
    """
    x = X.copy()
    x[(step - 1) * BATCH] = value
    return x


def _model(strategy_name="default", spe=1, jit=False, optimizer="adam", batchnorm=False):
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(5)
        layers = [keras.Input((3,)), keras.layers.Dense(4, name="d"), keras.layers.Dense(1, name="o")]
        if batchnorm:
            # The moving statistics of "bn" change in the forward pass, before
            # the step is known to be faulty: they must be frozen too. (No
            # bias before it: its gradient would be float noise, which Adam
            # turns into steps of the learning rate's size.)
            layers[1:2] = [keras.layers.Dense(4, use_bias=False, name="d"),
                           keras.layers.BatchNormalization(name="bn")]
        model = keras.Sequential(layers, name="m")
        chosen = keras.optimizers.Adam(0.01) if optimizer == "adam" else keras.optimizers.SGD(0.05)
        model.compile(chosen, "mse", steps_per_execution=spe, jit_compile=jit)
    return model


def _fit(model, x, callbacks, steps=STEPS, epochs=1):
    return model.fit(x[:steps * BATCH], Y[:steps * BATCH], batch_size=BATCH, epochs=epochs,
                     shuffle=False, verbose=0, callbacks=callbacks)


def _weights_after(strategy_name, steps, batches=None, optimizer="adam", batchnorm=False):
    """Plain Keras fit on the first `steps` batches (or the given batch indices)."""
    model = _model(strategy_name, optimizer=optimizer, batchnorm=batchnorm)
    index = np.concatenate([np.arange(b * BATCH, (b + 1) * BATCH)
                            for b in (batches if batches is not None else range(steps))])
    model.fit(X[index], Y[index], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def _assert_weights(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ freeze on fault
@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_a_nan_step_freezes_the_weights_within_the_execution(strategy_name, spe, jit):
    model = _model(strategy_name, spe, jit, batchnorm=True)
    stop = StopOnRule([NonFiniteLoss(), ExplodingTensor()], verbose=False)
    with only_upstream_failure(strategy_name, jit):
        _fit(model, _with_batch(FAULT, np.nan), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [
        ("NonFiniteLoss", FAULT), ("ExplodingTensor", FAULT), ("NaNSource", FAULT)]
    # The weights, BatchNormalization's moving statistics included, are those
    # of a plain fit on the steps before the fault, although with spe=4 steps
    # 7 and 8 ran in the same execution.
    expected = _weights_after(strategy_name, FAULT - 1, batchnorm=True)
    _assert_weights(model.get_weights(), expected)
    bn = model.get_layer("bn")
    assert np.all(np.isfinite(bn.moving_mean.numpy())) and np.any(bn.moving_mean.numpy() != 0)
    if strategy_name == "mirrored":
        for variable in model.trainable_variables:
            first, second = model.distribute_strategy.experimental_local_results(variable.value)
            np.testing.assert_array_equal(first.numpy(), second.numpy())
        # Keras updates the moving statistics per replica (each from its own
        # half batch); each replica gets its own back.
        reference = _model(strategy_name, batchnorm=True)
        _fit(reference, X, [], steps=FAULT - 1)
        for mine, plain in zip(bn.non_trainable_variables,
                               reference.get_layer("bn").non_trainable_variables):
            for a, b in zip(model.distribute_strategy.experimental_local_results(mine.value),
                            reference.distribute_strategy.experimental_local_results(plain.value)):
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_without_freezing_the_nan_reaches_the_weights():
    model = _model()
    stop = StopOnRule(NonFiniteLoss(), freeze_on_fault=False, verbose=False)
    _fit(model, _with_batch(FAULT, np.nan), [stop])
    assert stop.verdicts[0].step == FAULT
    assert not np.all(np.isfinite(model.get_layer("d").kernel.numpy()))


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_a_gradient_norm_above_the_limit_freezes_and_is_reported(strategy_name):
    model = _model(strategy_name, spe=4)
    stop = StopOnRule(NonFiniteLoss(), max_gradient_norm=1e3, verbose=False)
    _fit(model, _with_batch(5, 1e5), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("FreezeOnFault", 5)]
    assert "gradient norm above 1000" in stop.verdicts[0].reason
    _assert_weights(model.get_weights(), _weights_after(strategy_name, 4))


# --------------------------------------------------------------- the loss
@pytest.mark.parametrize("strategy_name, spe", [
    pytest.param(s, n, id=f"{s}-spe{n}") for s in ("default", "mirrored") for n in (1, 4)])
def test_the_loss_of_every_step_matches_gradient_tape(tmp_path, strategy_name, spe):
    model = _model(strategy_name, spe, optimizer="sgd")
    weights = [w.copy() for w in model.get_weights()]
    _fit(model, X, [StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path), verbose=False)])
    recorded = kerasdbg.load_run(str(tmp_path)).scalars("step/loss")
    assert recorded.step.tolist() == list(range(1, STEPS + 1))

    # Independently: the same network and plain SGD, with GradientTape.
    variables = [tf.Variable(w) for w in weights]
    expected = []
    for step in range(STEPS):
        x, y = X[step * BATCH:(step + 1) * BATCH], Y[step * BATCH:(step + 1) * BATCH]
        with tf.GradientTape() as tape:
            hidden = x @ variables[0] + variables[1]
            loss = tf.reduce_mean(tf.square(hidden @ variables[2] + variables[3] - y))
        for variable, grad in zip(variables, tape.gradient(loss, variables)):
            variable.assign_sub(0.05 * grad)
        expected.append(float(loss))
    np.testing.assert_allclose(recorded.value, expected, rtol=1e-5)


# ------------------------------------------------------------------ actions
def test_raise_carries_the_verdict_and_leaves_a_plain_model(tmp_path, read_every_execution):
    # Read after every execution: the raise comes right after the fault's
    # execution (tests/test_read_interval.py: at the next read otherwise).
    model = _model(spe=4)
    recorder = GradientStatistics(str(tmp_path), stats=["nan_count"])
    with pytest.raises(RuleFired, match="NonFiniteLoss at step 7: the loss is nan") as caught:
        _fit(model, _with_batch(FAULT, np.nan), [StopOnRule(NonFiniteLoss(), action="raise",
                                                            verbose=False), recorder])
    assert caught.value.verdicts[0].step == FAULT
    # The other recorders' events are on disk although no on_train_end ran.
    norms = kerasdbg.load_run(str(tmp_path)).scalars("gradients/global_norm")
    assert norms.step.tolist() == list(range(1, 9))
    assert "apply" not in vars(model.optimizer) and "compute_loss" not in vars(model)
    before = model.get_layer("d").kernel.numpy().copy()
    _fit(model, X, [], steps=2)  # a plain fit afterwards trains
    assert not np.allclose(model.get_layer("d").kernel.numpy(), before)


def test_warn_skips_the_frozen_steps_and_training_goes_on(read_every_execution):
    # Read after every execution: the freeze lasts until the fault's
    # execution ends (docs/rules.md: until the next read otherwise).
    model = _model(spe=4)
    stop = StopOnRule(NonFiniteLoss(), action="warn", verbose=False)
    with pytest.warns(RuleWarning, match="NonFiniteLoss at step 7"):
        _fit(model, _with_batch(FAULT, np.nan), [stop])
    # Steps 7 and 8 (the rest of that execution) were frozen, and not counted
    # (Adam's bias correction goes on from step 6); 9 and 10 trained.
    assert int(model.optimizer.iterations.numpy()) == STEPS - 2
    _assert_weights(model.get_weights(),
                    _weights_after("default", None, batches=[0, 1, 2, 3, 4, 5, 8, 9]))


def test_warn_says_each_verdict_once_as_a_diagnosis_not_a_failure(capsys):
    """With "warn" a verdict is a RuleWarning (a DiagnosisWarning, never the
    RuntimeWarning of a kerasdbg failure), and is not printed as well."""
    model = _model(optimizer="sgd")
    stop = StopOnRule(NonFiniteLoss(), action="warn", verbose=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, _with_batch(FAULT, np.nan), [stop])
    said = [w for w in caught if "NonFiniteLoss at step 7" in str(w.message)]
    assert len(said) == 1 and said[0].category is RuleWarning
    assert issubclass(RuleWarning, kerasdbg.rules.DiagnosisWarning)
    assert not issubclass(RuleWarning, RuntimeWarning)
    assert "NonFiniteLoss at step 7" not in capsys.readouterr().out


def test_a_gan_without_a_single_loss_is_guarded_through_each_of_its_losses(tmp_path, capsys):
    """The keras.io GAN returns d_loss and g_loss, no `loss`: NonFiniteLoss
    watches both, says so once as information (no RuntimeWarning), and its
    verdict names the loss that went NaN (d_loss: the NaN is in the real
    images, which only the discriminator's loss sees), online and offline."""
    from tests.examples import ports

    port = ports.make("gan", steps=STEPS)
    x = port.x.copy()
    x[(FAULT - 1) * port.batch_size] = np.nan
    stop = StopOnRule(NonFiniteLoss(), log_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        port.model.fit(x, batch_size=port.batch_size, epochs=1, shuffle=False, verbose=0,
                       callbacks=[stop])
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                and "StopOnRule" in str(w.message)]
    printed = capsys.readouterr().out
    said = "the train step returns no single loss; NonFiniteLoss watches each of its losses"
    assert printed.count(said) == 1, printed
    assert stop.loss_source == "the train step's 'd_loss', 'g_loss'"
    faults = [v for v in stop.verdicts if v.rule == "NonFiniteLoss"]
    assert [(v.step, v.tensors) for v in faults] == [(FAULT, ("step/d_loss",))]
    assert faults[0].reason == (f"NonFiniteLoss at step {FAULT}: the loss d_loss is nan "
                                "(no single loss: d_loss, g_loss watched)")
    # The independent reader: what TensorBoard holds for the two losses.
    run = kerasdbg.load_run(str(tmp_path))
    d_loss = run.scalars("step/d_loss").set_index("step").value
    g_loss = run.scalars("step/g_loss").set_index("step").value
    assert np.isnan(d_loss[FAULT]) and np.isfinite(d_loss.loc[:FAULT - 1]).all()
    assert np.isfinite(g_loss[FAULT])
    # Offline, the same verdict at the same step.
    offline = kerasdbg.check_run(str(tmp_path), [NonFiniteLoss()])
    assert [(v.step, v.reason) for v in offline] == [(FAULT, faults[0].reason)]


def test_a_callable_action_gets_the_verdicts_and_the_model():
    seen = []
    model = _model()
    stop = StopOnRule(NonFiniteLoss(), action=lambda verdicts, m: seen.append((verdicts, m)),
                      verbose=False)
    _fit(model, _with_batch(FAULT, np.nan), [stop])
    assert len(seen) == 1 and seen[0][1] is model
    assert [(v.rule, v.step) for v in seen[0][0]] == [("NonFiniteLoss", FAULT),
                                                      ("NaNSource", FAULT)]


def test_stop_spares_the_last_backup_and_saves_no_faulty_checkpoint(tmp_path, capsys):
    backup = str(tmp_path / "backup")
    checkpoints = str(tmp_path / "ckpt_{epoch}.weights.h5")

    def batches():
        for epoch in range(3):
            for step in range(STEPS):
                x = X[step * BATCH:(step + 1) * BATCH].copy()
                if epoch == 1 and step == 3:
                    x[:] = np.nan
                yield x, Y[step * BATCH:(step + 1) * BATCH]

    model = _model()
    saved = {}

    class Remember(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            saved[epoch] = model.get_weights()

    restore = keras.callbacks.BackupAndRestore(backup)
    checkpoint = keras.callbacks.ModelCheckpoint(checkpoints, save_weights_only=True)
    stop = StopOnRule(NonFiniteLoss())
    model.fit(batches(), steps_per_epoch=STEPS, epochs=3, verbose=0, shuffle=False,
              callbacks=[Remember(), stop, restore, checkpoint])
    assert "kerasdbg: NonFiniteLoss at step 14: the loss is nan" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["backup", "ckpt_1.weights.h5"]
    # The backup is the state after the first epoch, and it was not deleted.
    restored = _model()
    restored.load_weights(os.path.join(backup, "latest.weights.h5"))
    _assert_weights(restored.get_weights(), saved[0])
    # The frozen weights are those before step 14, still finite.
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    for callback in (restore, checkpoint):
        assert not any(hook.startswith("on_") for hook in vars(callback))


def test_a_second_stop_on_rule_neither_reports_nor_lifts_the_freeze_of_the_first(tmp_path):
    """One StopOnRule freezes at the NaN and goes on (callable action); another,
    without freeze_on_fault, warns at the same step. The freeze stays: every
    step from the fault on is skipped, and only the first reports it."""
    model = _model(optimizer="sgd")
    freezing = StopOnRule(NonFiniteLoss(), action=lambda verdicts, m: None, log_dir=str(tmp_path),
                          verbose=False)
    warning = StopOnRule(NonFiniteLoss(), action="warn", freeze_on_fault=False,
                         log_dir=str(tmp_path), verbose=False)
    with pytest.warns(RuleWarning, match="NonFiniteLoss at step 7"):
        _fit(model, _with_batch(FAULT, np.nan), [freezing, warning])
    assert int(model.optimizer.iterations.numpy()) == FAULT - 1  # the frozen steps uncounted
    assert [v.rule for v in freezing.verdicts] == ["NonFiniteLoss", "NaNSource"]
    assert [v.rule for v in warning.verdicts] == ["NonFiniteLoss", "NaNSource"]
    _assert_weights(model.get_weights(), _weights_after("default", FAULT - 1, optimizer="sgd"))
    # Both record step/loss in one log directory; each step is written once.
    losses = kerasdbg.load_run(str(tmp_path)).scalars("step/loss")
    assert losses.step.tolist() == list(range(1, STEPS + 1))


# --------------------------------------------------------- TensorBoard text
def test_verdicts_are_written_as_text_at_their_step(tmp_path):
    model = _model(spe=4)
    stop = StopOnRule([NonFiniteLoss(), ExplodingTensor()], log_dir=str(tmp_path), verbose=False)
    _fit(model, _with_batch(FAULT, np.nan), [stop])
    texts = kerasdbg.load_run(str(tmp_path)).texts("rules/verdicts")
    assert texts.step.tolist() == [FAULT]
    rows = verdict_rows(texts.text[0])
    assert [(r["rule"], r["step"]) for r in rows] == [
        ("NonFiniteLoss", 7), ("ExplodingTensor", 7), ("NaNSource", 7)]
    assert rows[0]["tensors"] == ["step/loss"]
    assert rows[1]["tensors"] == ["m/d/bias", "m/d/kernel", "m/o/bias", "m/o/kernel"]
    assert rows[2]["tensors"][0] == "input_layer"
    assert [r["reason"] for r in rows] == [v.reason for v in stop.verdicts]  # read back whole


def test_the_verdict_text_of_many_fits_holds_the_newest_and_counts_the_rest(tmp_path,
                                                                            monkeypatch):
    """A training of many short fits, a verdict in each: each write holds the
    newest `VERDICT_TEXT_LIMIT` verdicts (3 here) and a line counting the
    earlier ones, which the earlier writes hold; nothing else grows."""
    from kerasdbg.records import verdicts as verdicts_module
    from kerasdbg.rules import Rule

    class Always(Rule):
        def check(self, step, record):
            return self.verdict(step, "always", {})

    monkeypatch.setattr(verdicts_module, "VERDICT_TEXT_LIMIT", 3)
    model = _model()
    for _ in range(5):
        stop = StopOnRule([Always()], log_dir=str(tmp_path), action="warn", verbose=False)
        with pytest.warns(kerasdbg.rules.RuleWarning, match="Always at step"):
            _fit(model, X, [stop], steps=1)
    texts = kerasdbg.load_run(str(tmp_path)).texts("rules/verdicts").sort_values("step")
    assert texts.step.tolist() == [1, 2, 3, 4, 5]
    last = texts.text.iloc[-1]
    assert [r["step"] for r in verdict_rows(last)] == [3, 4, 5]
    assert "(2 earlier verdicts of this run: in the texts of earlier steps)" in last
    assert [r["step"] for r in verdict_rows(texts.text.iloc[2])] == [1, 2, 3]


# ----------------------------------------------------------------- console
def _batchnorm_model():
    """Dense layers with a bias, each followed by BatchNormalization: their
    biases' gradients are zero by construction (SGD does not move them)."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4, name="d1"),
        keras.layers.BatchNormalization(name="bn1"), keras.layers.Dense(4, name="d2"),
        keras.layers.BatchNormalization(name="bn2"), keras.layers.Dense(1, name="o")], name="m")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def test_a_healthy_fit_prints_no_verdict_and_its_notes_in_one_line(tmp_path, capsys, monkeypatch):
    """The biases before BatchNormalization are noted (information, not faults):
    one console line for the fit, no verdict line; the text ends "No verdict"."""
    from kerasdbg.capture import progress

    monkeypatch.setattr(progress, "AFTER", 1e6)  # no progress line in this test
    model = _batchnorm_model()
    with tf.GradientTape() as tape:  # the first step's gradients, independently
        loss = model.compute_loss(X[:BATCH], Y[:BATCH], model(X[:BATCH], training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    zero = sorted(v.path for v, g in zip(model.trainable_variables, grads)
                  if np.mean(np.abs(tf.convert_to_tensor(g).numpy())) < 1e-7)
    # The biases before a BatchNormalization, and bn1's beta (bn2 removes the shift).
    assert zero == ["m/bn1/beta", "m/d1/bias", "m/d2/bias"]
    stop = StopOnRule([VanishingGradient(), NonFiniteLoss()], log_dir=str(tmp_path))
    capsys.readouterr()
    _fit(model, X, [stop])
    _fit(model, X, [stop], steps=2)  # notes are said once per training
    printed = capsys.readouterr().out.splitlines()
    notes = [line for line in printed if line.startswith("kerasdbg: information, not faults")]
    assert len(notes) == 1, printed
    head, _, named = notes[0].partition("VanishingGradient, at step 1: zero by construction: ")
    noted = sorted(named.split(", "))
    # Only tensors whose gradient GradientTape finds below the threshold (never a
    # false alarm); at least two, counted in the line.
    assert len(noted) >= 2 and set(noted) <= set(zero), (noted, zero)
    assert head == f"kerasdbg: information, not faults ({len(noted)} tensors): "
    assert [line for line in printed if line not in notes] == [], printed
    last = kerasdbg.load_run(str(tmp_path)).texts("rules/verdicts").text.iloc[-1]
    assert no_verdict(last) == [
        "No verdict: VanishingGradient, NonFiniteLoss, FreezeOnFault, NaNSource ran over "
        f"steps {STEPS + 1}-{STEPS + 2} and none fired (the notes above are information)."]
    assert sorted(t for r in verdict_rows(last) for t in r["tensors"]) == noted
    assert {r["severity"] for r in verdict_rows(last)} == {"info"}


@pytest.mark.parametrize("action", ["stop", "raise", "warn", "callable"])
def test_a_fault_verdict_is_said_exactly_once(capsys, action, read_every_execution):
    """A `kerasdbg:` line, or with "warn" a RuleWarning alone, attributed to
    the line that called fit (this file), never to kerasdbg's own."""
    model = _model(optimizer="sgd")
    called = []
    stop = StopOnRule(NonFiniteLoss(), verbose=True,
                      action=(lambda verdicts, model: called.append(verdicts))
                      if action == "callable" else action)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuleFired) if action == "raise" else _nothing():
            _fit(model, _with_batch(FAULT, np.nan), [stop])
    said = f"NonFiniteLoss at step {FAULT}: the loss is nan"
    warned = [w for w in caught if said in str(w.message)]
    printed = capsys.readouterr().out
    assert printed.count(said) + len(warned) == 1, (printed, warned)
    if action == "warn":
        assert warned[0].category is RuleWarning and warned[0].filename == __file__
    else:
        assert f"kerasdbg: {said}\n" in printed


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_verdict_printed_under_keras_progress_bar_starts_a_line_of_its_own(
        capsys, read_every_execution):
    """verbose=1: Keras's bar leaves its line unfinished after each batch (it
    redraws it after a carriage return); the verdict's line starts a fresh
    line below the bar of the batch before the fault, and the bar goes on."""
    model = _model(optimizer="sgd")
    model.fit(_with_batch(FAULT, np.nan), Y, batch_size=BATCH, epochs=1, shuffle=False,
              verbose=1, callbacks=[StopOnRule(NonFiniteLoss(), verbose=True)])
    printed = capsys.readouterr().out
    said = f"kerasdbg: NonFiniteLoss at step {FAULT}: the loss is nan"
    before, found, after = printed.partition(said)
    assert found and before.endswith("\n") and after.startswith("\n"), printed
    # What a terminal shows of the line above: the bar's last drawing (after its
    # last carriage return), of a batch before the fault (it draws at most every
    # 0.05 s); below the verdict the bar draws again and ends its line.
    shown = [re.sub(r"\x1b\[[0-9;]*m", "", text.rpartition("\n")[2].rpartition("\r")[2])
             for text in (before[:-1], after.rstrip("\n"))]
    drawn = [re.match(rf" ?(\d+)/{STEPS} ━+ ", line) for line in shown]
    assert all(drawn) and int(drawn[0][1]) < FAULT, shown
    assert after.endswith("\n") and said not in after, repr(after)


def test_a_long_first_step_says_so_and_how_long_it_took(capsys, monkeypatch):
    """After `progress.AFTER` seconds of the first execution, one line says
    what is traced (the model's trainable variables and taps, counted here
    from the model), and one how long it took; later steps say nothing."""
    from kerasdbg.capture import progress

    monkeypatch.setattr(progress, "AFTER", 0.0)
    model = _model(optimizer="sgd")
    _fit(model, X, [StopOnRule(NonFiniteLoss(), verbose=False)], epochs=2)
    captured = capsys.readouterr()
    assert "kerasdbg" not in captured.out  # stderr: stdout stays the user's
    printed = [line for line in captured.err.splitlines() if line.startswith("kerasdbg")]
    variables = len(model.trainable_variables)
    assert printed[0] == ("kerasdbg: tracing and compiling the instrumented train step of 'm' "
                          f"({variables} trainable variables, 0 taps) ...")
    assert re.fullmatch(r"kerasdbg: traced and compiled; the first step took \d+\.\d s",
                        printed[1]), printed
    assert len(printed) == 2, printed


def test_the_progress_line_counts_the_taps_activation_statistics_finds():
    """The progress line counts taps by their marks (the capture imports no
    layer): as many as `ActivationStatistics` finds, in nested models and
    structures too."""
    from kerasdbg.callbacks.activation_statistics import find_taps
    from kerasdbg.capture import progress
    from kerasdbg.layers import TapLayer

    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
                              TapLayer(name="inner_tap")], name="inner")
    inputs = keras.Input((4,))
    both = TapLayer(name="pair_tap")({"x": inner(inputs), "y": keras.layers.Dense(3)(inputs)})
    model = keras.Model(inputs, keras.layers.Add()([both["x"], both["y"]]), name="m")
    model = kerasdbg.insert_taps(model, layers="add")
    assert progress._taps(model) == len(find_taps(model)) == 4, [t.name for t in find_taps(model)]
    assert progress.describe(model) == "'m' (4 trainable variables, 4 taps)"


def test_a_first_step_that_raises_is_not_said_to_have_compiled(capsys, monkeypatch):
    """A train step whose trace raises (after the progress line, here at 0 s
    and a 0.5 s trace): the closing line says the fit ended during the first
    step, not that it was traced and compiled."""
    from kerasdbg.capture import progress

    class Failing(keras.Sequential):
        def train_step(self, data):
            time.sleep(0.5)
            raise ValueError("a broken train step")

    monkeypatch.setattr(progress, "AFTER", 0.0)
    model = Failing([keras.Input((4,)), keras.layers.Dense(1)], name="m")
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="a broken train step"):
        model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0,
                  callbacks=[StopOnRule(NonFiniteLoss(), verbose=False)])
    printed = [line for line in capsys.readouterr().err.splitlines()
               if line.startswith("kerasdbg")]
    assert printed[0].startswith("kerasdbg: tracing and compiling"), printed
    assert re.fullmatch(r"kerasdbg: the fit ended \d+\.\d s into its first step, before the "
                        r"step completed", printed[1]), printed
    assert len(printed) == 2, printed


# ------------------------------------------------------ online = offline
@pytest.mark.parametrize("strategy_name, spe", [
    pytest.param(s, n, id=f"{s}-spe{n}") for s in ("default", "mirrored") for n in (1, 4)])
def test_online_and_offline_checks_of_a_run_agree(tmp_path, strategy_name, spe):
    def rules():
        return [NonFiniteLoss(), ExplodingTensor(), VanishingGradient(), DeadReLU(),
                AllZero(), UnchangedTensor(), WeightUpdateRatio(),
                LossNotDecreasing(num_steps=2)]

    log_dir = str(tmp_path)
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((3,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ], name="mlp")
        model.compile(keras.optimizers.SGD(0.5), "mse", steps_per_execution=spe)
        tapped = kerasdbg.insert_taps(model, layers=["hidden"])
    stop = StopOnRule(rules(), action="warn", freeze_on_fault=False, log_dir=log_dir,
                      verbose=False)
    recorders = [GradientStatistics(log_dir), WeightStatistics(log_dir),
                 ActivationStatistics(log_dir)]
    x = _with_batch(6, 50.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        tapped.fit(x, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                   callbacks=[stop, *recorders])
    online = [(v.rule, v.step, v.reason) for v in stop.verdicts]
    offline = [(v.rule, v.step, v.reason)
               for v in kerasdbg.check_run(log_dir, rules() + [NaNSource()])]
    assert len(online) >= 3 and "NaNSource" in {rule for rule, _, _ in online}
    assert online == offline


def _subclassed():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = keras.layers.Dense(1, name="dense")

        def call(self, x):
            return self.dense(x)

    model = Net()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


@pytest.mark.parametrize("case, strategy_name, spe", [
    ("nan_input", "default", 1), ("nan_input", "mirrored", 4), ("inf_input", "default", 4),
    ("norm_limit", "default", 1), ("norm_limit", "mirrored", 4), ("nested", "default", 4),
    ("subclassed", "default", 1)])
def test_freeze_and_nan_source_verdicts_are_the_same_offline(tmp_path, capsys, case,
                                                            strategy_name, spe):
    """FreezeOnFault and NaNSource are rules: `check_run` on the run's log
    directory gives what StopOnRule said online, step, text and tensors."""
    log_dir = str(tmp_path)
    limit = 1e3 if case == "norm_limit" else None
    if case == "nested":
        model, x = _nested_model(strategy_name, spe), X
    elif case == "subclassed":
        model, x = _subclassed(), _with_batch(3, np.nan)
    else:
        model = _model(strategy_name, spe)
        x = _with_batch(FAULT, {"nan_input": np.nan, "inf_input": np.inf, "norm_limit": 1e5}[case])
    stop = StopOnRule(NonFiniteLoss(), max_gradient_norm=limit, log_dir=log_dir, verbose=False)
    _fit(model, x, [stop])
    online = [(v.rule, v.step, v.reason, v.tensors, v.severity) for v in stop.verdicts]
    assert {"FreezeOnFault", "NaNSource"} & {v[0] for v in online}
    # FreezeOnFault() reads the limit the run froze on from the run.
    offline = kerasdbg.check_run(log_dir, [NonFiniteLoss(), FreezeOnFault(), NaNSource()])
    assert [(v.rule, v.step, v.reason, v.tensors, v.severity) for v in offline] == online
    # The command line's default rules read the same run the same way.
    from kerasdbg import cli

    capsys.readouterr()
    assert cli.main(["check", log_dir]) == 1
    printed = capsys.readouterr().out.splitlines()
    for rule, _, reason, _, severity in online:
        assert (reason if severity == "fault" else f"(info) {reason}") in printed, printed


# ------------------------------------------------------------------ errors
def test_bad_arguments_are_refused_with_the_received_value():
    with pytest.raises(TypeError, match="`rules` must be a kerasdbg.rules.Rule"):
        StopOnRule("NonFiniteLoss")
    with pytest.raises(ValueError, match=r"at least one rule. Received: rules=\[\]"):
        StopOnRule([])
    with pytest.raises(ValueError, match="`action` must be one of 'stop', 'raise', 'warn', 'skip', 'rollback' or a "
                                         "callable. Received: action='halt'"):
        StopOnRule(NonFiniteLoss(), action="halt")
    with pytest.raises(TypeError, match="`action` must be one of 'stop', 'raise', 'warn', 'skip', 'rollback' or a "
                                        "callable. Received: action=42 of type int"):
        StopOnRule(NonFiniteLoss(), action=42)
    with pytest.raises(ValueError, match="needs freeze_on_fault=True"):
        StopOnRule(NonFiniteLoss(), freeze_on_fault=False, max_gradient_norm=10.0)
    with pytest.raises(TypeError, match="`suspend` must hold keras.callbacks.Callback classes"):
        StopOnRule(NonFiniteLoss(), suspend=["BackupAndRestore"])
    with pytest.raises(ValueError, match="`start_step`"):
        StopOnRule(NonFiniteLoss(), start_step=-1)


def test_a_rule_on_activations_needs_taps():
    model = _model()
    message = (r"StopOnRule: DeadReLU reads activations/<name>/dead_fraction, which cannot be "
               r"recorded for model 'm', so it has nothing to read and will not fire.*insert_taps")
    stop = StopOnRule(DeadReLU())
    with pytest.warns(RuntimeWarning, match=message):
        _fit(model, X, [stop])
    assert stop.verdicts == []
    with pytest.raises(ValueError, match=message):
        _fit(model, X, [StopOnRule(DeadReLU(), strict=True)])
    assert "train_step" not in vars(model)  # nothing left behind
    _fit(model, X, [], steps=1)


def test_start_step_leaves_out_the_earlier_steps():
    model = _model()
    stop = StopOnRule(NonFiniteLoss(), start_step=8, freeze_on_fault=False, verbose=False)
    _fit(model, _with_batch(FAULT, np.nan), [stop])
    # Step 7 is not evaluated; the weights went NaN, so step 8's loss is NaN.
    assert [v.step for v in stop.verdicts] == [8]


# ---------------------------------------------------------- NaN localisation
class _Log(keras.layers.Layer):
    """log(x): NaN for negative inputs, the planted source of NaN."""

    def call(self, x):
        return keras.ops.log(x)


def _nested_model(strategy_name, spe):
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((3,), name="x")
        hidden = keras.layers.Dense(4, activation="relu", name="d1")(inputs)
        block = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d2"),
                                  _Log(name="log")], name="block")
        outputs = keras.layers.Dense(1, name="o")(block(hidden))
        model = keras.Model(inputs, outputs, name="net")
        model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=spe)
    return model


@pytest.mark.parametrize("strategy_name, spe", [
    pytest.param(s, n, id=f"{s}-spe{n}") for s in ("default", "mirrored") for n in (1, 4)])
def test_the_first_non_finite_layer_and_gradients_are_reported(strategy_name, spe):
    model = _nested_model(strategy_name, spe)
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(model, X, [stop])
    # Independently: the first step's forward pass, layer by layer, in NumPy.
    d1, d2 = model.get_layer("d1"), model.get_layer("block").get_layer("d2")
    h1 = np.maximum(X[:BATCH] @ d1.kernel.numpy() + d1.bias.numpy(), 0)
    h2 = h1 @ d2.kernel.numpy() + d2.bias.numpy()
    assert np.all(np.isfinite(h1)) and np.all(np.isfinite(h2)) and np.any(h2 < 0)
    source = [v for v in stop.verdicts if v.rule == "NaNSource"]
    assert [(v.step, v.tensors[0]) for v in source] == [(1, "block/log")]
    assert set(source[0].tensors[1:]) == {"d1/kernel", "d1/bias", "block/d2/kernel",
                                          "block/d2/bias",
                                          "o/kernel", "o/bias"}


def test_a_non_finite_input_is_reported_as_the_source():
    model = _model(spe=4)
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(model, _with_batch(FAULT, np.inf), [stop])
    assert [(v.rule, v.step) for v in stop.verdicts] == [("NonFiniteLoss", FAULT),
                                                         ("NaNSource", FAULT)]
    assert stop.verdicts[1].reason.startswith(
        "NaNSource at step 7: the first layer whose output held NaN/Inf is 'input_layer")


def test_a_subclassed_model_reports_the_gradients_and_says_why_not_the_layer():
    model = _subclassed()
    stop = StopOnRule(NonFiniteLoss(), verbose=False)
    _fit(model, _with_batch(3, np.nan), [stop])
    source = stop.verdicts[-1]
    assert source.rule == "NaNSource" and source.step == 3
    assert "subclassed model 'sub' are not visible" in source.reason
    assert set(source.tensors) == {"sub/dense/kernel", "sub/dense/bias"}


@pytest.mark.parametrize("freeze", [True, False], ids=["freeze", "scaler-skips"])
def test_mixed_precision_nan_loss_is_caught(mixed_precision, freeze):
    model = _model(spe=4)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    stop = StopOnRule(NonFiniteLoss(), freeze_on_fault=freeze, verbose=False)
    _fit(model, _with_batch(FAULT, np.nan), [stop])
    # Steps count applied updates: the scaler skips some of the first batches
    # (scaled gradients overflow), so the NaN batch is the update after those
    # a plain fit applies on the batches before it.
    reference = _model()
    _fit(reference, X, [], steps=FAULT - 1)
    step = int(reference.optimizer.iterations.numpy()) + 1
    assert [(v.rule, v.step) for v in stop.verdicts][0] == ("NonFiniteLoss", step)
    if freeze:
        _assert_weights(model.get_weights(), reference.get_weights())
    # Either way no NaN reached the weights (frozen, or skipped by the scaler).
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


# ------------------------------------------------------- frozen steps and the optimizer
@pytest.mark.parametrize("strategy_name, spe, jit", matrix())
def test_frozen_steps_leave_every_optimizer_variable_as_it_was(tmp_path, strategy_name, spe, jit):
    with only_upstream_failure(strategy_name, jit):
        frozen_steps.check_mlp("adam", spe, jit, log_dir=str(tmp_path),
                               strategy=lambda: make_strategy(strategy_name))


@pytest.mark.parametrize("optimizer", ["rmsprop", "adamw"])
@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_frozen_steps_leave_other_optimizers_as_they_were(optimizer, spe):
    frozen_steps.check_mlp(optimizer, spe)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
def test_frozen_steps_leave_a_loss_scale_optimizer_as_it_was(mixed_precision, spe):
    frozen_steps.check_mlp("rmsprop", spe)


@pytest.mark.parametrize("spe", [1, 4], ids=["spe1", "spe4"])
@pytest.mark.parametrize("name", ["gan", "wgan_gp", "cyclegan"])
def test_frozen_steps_leave_each_optimizer_of_a_custom_train_step_as_it_was(name, spe):
    """Two optimizers (the DCGAN port), one applied three times a step
    (WGAN-GP's critic), four (CycleGAN's shape): each one's variables, its
    step count included, as after a plain fit on the batches before the NaN."""
    if name == "cyclegan":
        rng = np.random.default_rng(0)
        x = rng.normal(size=(frozen_steps.STEPS * 4, 4)).astype("float32")
        y = rng.normal(size=(frozen_steps.STEPS * 4, 4)).astype("float32")

        def make():
            keras.utils.set_random_seed(1)
            model = ports.CycleGAN()
            model.compile(steps_per_execution=spe)
            model(x[:1])
            return model

        frozen_steps.check_model(make, x, y, 4, ports.CycleGAN.OPTIMIZERS)
        return
    port = ports.make(name, steps=frozen_steps.STEPS, steps_per_execution=spe)
    frozen_steps.check_model(
        lambda: ports.make(name, steps=frozen_steps.STEPS, steps_per_execution=spe).model,
        port.x, port.y, port.batch_size, list(port.optimizers))


def test_stop_on_rule_records_each_epochs_learning_rate_quietly(tmp_path):
    """`epoch/learning_rate` at each epoch's end, a schedule's and a constant one
    (`tests.epoch_records`)."""
    from tests.epoch_records import check_learning_rates

    check_learning_rates(tmp_path)
