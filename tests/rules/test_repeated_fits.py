"""One verdict for a training, however many `fit` calls it takes (issue 32, review b).

The first-step allowances (a tensor failing at the training's first step only, as a
zero-initialised output layer makes every other gradient) and the rules' memory of
the tensors they saw belong to the training, not to each `fit`: a loop of short fits
watched by one `StopOnRule`, or by a new one at each fit, gets the verdicts that
`kerasdbg check` gives on the whole run. The situations are measured here with
GradientTape and NumPy, never read from kerasdbg.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.offline import can_check, recorded_pairs
from kerasdbg.rules import AllZero, Rule, VanishingGradient, WeightUpdateRatio, default_rules

SAMPLES = 8
FITS = 6
RNG = np.random.default_rng(3)
X = RNG.normal(size=(SAMPLES, 8)).astype("float32")
Y = RNG.normal(size=(SAMPLES, 1)).astype("float32")


def _dead_from_the_start():
    """A ReLU layer whose bias is -100: no gradient reaches it or the layers before
    it, from the first step on (a persistent fault, most variables)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="a")(inputs)
    h = keras.layers.Dense(16, activation="relu", name="dead",
                           bias_initializer=keras.initializers.Constant(-100.0))(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h), name="m")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _dies_later():
    """A healthy branch beside one that a later fit kills (its ReLU bias set to
    -100): then a minority of the gradients are exactly 0, which is a fault since
    they were not at the first steps."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    a = keras.layers.Dense(16, activation="tanh", name="a")(inputs)
    b = keras.layers.Dense(16, activation="relu", name="b")(a)
    p = inputs
    for k in range(4):
        p = keras.layers.Dense(16, activation="tanh", name=f"p{k}")(p)
    merged = keras.layers.Concatenate()([b, p])
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(merged), name="m")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _zero_gradients(model):
    """The variables whose gradient is exactly 0 on the data, by GradientTape."""
    with tf.GradientTape() as tape:
        loss = model.compute_loss(X, Y, model(X, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    return {v.path for v, g in zip(model.trainable_variables, gradients)
            if not np.any(tf.convert_to_tensor(g).numpy())}


def _faults(verdicts):
    return [(v.rule, v.step) for v in verdicts if v.severity == "fault"]


def _first(faults):
    """Each rule's first firing step (offline reports only that one; online, each
    fit that a verdict stopped says it again)."""
    first = {}
    for rule, step in faults:
        first[rule] = min(step, first.get(rule, step))
    return first


def _offline(log_dir):
    run = kerasdbg.load_run(log_dir)
    present = recorded_pairs(run.tags())
    rules = [rule for rule in default_rules() if can_check(rule, present)]
    return _faults(kerasdbg.check_run(run, rules))


def _train(model, log_dir, how, before_fit=None):
    """FITS fits of one step each; `how`: one StopOnRule for all, or a new one each."""
    shared = StopOnRule(log_dir=log_dir, verbose=False, action="stop")
    online = []
    for fit in range(FITS):
        if before_fit is not None:
            before_fit(fit)
        stop = shared if how == "one_instance" else StopOnRule(
            log_dir=log_dir, verbose=False, action="stop")
        model.fit(X, Y, batch_size=SAMPLES, epochs=1, shuffle=False, verbose=0,
                  callbacks=[stop, GradientStatistics(log_dir), WeightStatistics(log_dir)])
        online += _faults(stop.verdicts)
    return online


HOWS = ["one_instance", "new_instance_each_fit"]


@pytest.mark.parametrize("how", HOWS)
def test_a_fault_from_the_first_step_fires_in_a_loop_of_one_step_fits(tmp_path, how):
    model = _dead_from_the_start()
    dead = {"a/kernel", "a/bias", "dead/kernel", "dead/bias", "out/kernel"}
    assert _zero_gradients(model) == dead  # the situation, before any step
    online = _train(model, str(tmp_path), how)
    assert _zero_gradients(model) == dead  # and after the last
    # Each fit had one step: the allowance of the training's first step was the
    # first fit's only, so the fault fires at the second step, as offline.
    first = _first(online)
    assert first["VanishingGradient"] == first["AllZero"] == 2, online
    assert first == _first(_offline(str(tmp_path))), online


@pytest.mark.parametrize("how", HOWS)
def test_a_fault_that_starts_in_a_later_fit_fires_as_offline(tmp_path, how):
    model = _dies_later()
    assert _zero_gradients(model) == set()

    def kill(fit):
        if fit == 3:  # before the fourth fit, whose step is the fourth
            model.get_layer("b").bias.assign(np.full(16, -100.0, "float32"))

    online = _train(model, str(tmp_path), how, before_fit=kill)
    zero = _zero_gradients(model)
    assert zero == {"a/kernel", "a/bias", "b/kernel", "b/bias"}
    assert 2 * len(zero) < len(model.trainable_variables)  # a minority
    offline = _offline(str(tmp_path))
    # Seen healthy at the first steps, exactly 0 from step 4: a fault (not "zero by
    # construction", which a rule starting afresh at the fourth fit took it for).
    assert _first(offline)["AllZero"] == 4, offline
    assert _first(online) == _first(offline), (online, offline)


def test_a_new_training_starts_afresh():
    """A new optimizer (compile) is a new training: its first step has its allowance."""
    model = _dead_from_the_start()
    stop = StopOnRule(rules=[VanishingGradient(), AllZero(collections=["gradients"]),
                             WeightUpdateRatio()],
                      verbose=False)
    model.fit(X, Y, batch_size=SAMPLES, epochs=1, verbose=0, callbacks=[stop])
    assert _faults(stop.verdicts) == []  # step 1: the allowance
    model.compile(keras.optimizers.SGD(0.01), "mse")  # a new optimizer, from step 1
    model.fit(X, Y, batch_size=SAMPLES, epochs=1, verbose=0, callbacks=[stop])
    assert _faults(stop.verdicts) == []
    model.fit(X, Y, batch_size=SAMPLES, epochs=1, verbose=0, callbacks=[stop])
    assert _first(_faults(stop.verdicts)) == {
        "VanishingGradient": 2, "AllZero": 2, "WeightUpdateRatio": 2}


def test_the_allowance_is_the_first_steps_not_the_first_seen():
    # A rule that first sees a training at step 7 (a callback attached later, a run
    # read from there) gives no first-step allowance.
    record = {"gradients/m/a/kernel/mean_abs": 0.0, "gradients/m/a/kernel/zero_fraction": 1.0,
              "weights/m/a/kernel/update_ratio": 0.0}
    assert VanishingGradient().check(1, record) is None
    assert VanishingGradient().check(7, record).tensors == ("m/a/kernel",)
    zero = {"gradients/m/a/kernel/zero_fraction": 1.0}
    assert AllZero().check(1, zero) is None
    assert AllZero().check(7, zero).tensors == ("m/a/kernel",)
    assert AllZero().check(7, {"activations/t/zero_fraction": 1.0}).tensors == ("t",)
    large = {"weights/m/a/kernel/update_ratio": 50.0}
    assert WeightUpdateRatio().check(1, large) is None
    assert WeightUpdateRatio().check(7, large).tensors == ("m/a/kernel",)


class _Locked(Rule):
    """A custom rule whose memory cannot be copied (it holds a lock)."""

    requires = (("step", "loss"),)

    def reset(self):
        self._lock = threading.Lock()

    def check(self, step, record):
        return None


def test_a_memory_that_cannot_be_kept_is_said_and_training_goes_on():
    model = _dead_from_the_start()
    stop = StopOnRule(rules=[_Locked()], verbose=False)
    with pytest.warns(RuntimeWarning, match="could not carry its rules' memory from one fit to "
                      "the next of this training; they start afresh at each fit. Cause: "
                      "TypeError: cannot pickle '_thread.lock'"):
        model.fit(X, Y, batch_size=SAMPLES, epochs=2, verbose=0, callbacks=[stop])
    assert int(model.optimizer.iterations.numpy()) == 2
    strict = StopOnRule(rules=[_Locked()], verbose=False, strict=True)
    with pytest.raises(RuntimeError, match="StopOnRule could not carry its rules' memory .* "
                       "Cause: TypeError: cannot pickle '_thread.lock'"):
        model.fit(X, Y, batch_size=SAMPLES, epochs=1, verbose=0, callbacks=[strict])


class _LossAbove(Rule):
    """A user's rule whose configuration is not in `get_config` (the base's `{}`)."""

    requires = (("step", "loss"),)

    def __init__(self, limit):
        self.limit = limit
        self.reset()

    def reset(self):
        self._losses = []

    def check(self, step, record):
        loss = record.get("step/loss")
        if loss is not None:
            self._losses.append(loss)
        if loss is not None and loss > self.limit:
            return self.verdict(step, f"loss {loss:.3g} > {self.limit}", {"step/loss": loss})
        return None


def test_the_next_fit_takes_the_rules_memory_never_their_configuration():
    # Second review: the memory was every attribute of the rule, so a user's rule
    # whose configuration is not in get_config took the last fit's limit.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    first = StopOnRule([_LossAbove(0.01)], action="warn", verbose=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[first])
    assert [v.rule for v in first.verdicts][:1] == ["_LossAbove"]
    rule = _LossAbove(1000.0)
    second = StopOnRule([rule], action="warn", verbose=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[second])
    assert second.verdicts == [] and rule.limit == 1000.0
    # ... while what `reset` makes, its memory, goes on from the last fit: the
    # first fit's one loss (a rule that fired is not asked again) and four.
    assert len(rule._losses) == 5
