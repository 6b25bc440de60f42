"""Every callback, rule and debug layer deep-copies and pickles (issue 32, item 3).

KerasTuner deep-copies each callback for every trial and refuses one that
cannot be copied; Ray and multiprocessing pickle them. Each public class is
copied fresh, after a `fit`, and after a `fit` that raised, and the copy is
then used in a `fit` of its own and must record. The classes come from the
packages' `__all__`, so a new one is covered without editing this file
(a class that needs constructor arguments fails here until it has an entry
in `ARGUMENTS`, and a callback until it has a check in `RECORDS`).
"""

import copy
import os
import pickle

import keras
import numpy as np
import pytest

import kerasdbg.callbacks
import kerasdbg.layers
import kerasdbg.rules
from kerasdbg.rules import Rule

SAMPLES, BATCH = 8, 4
STEPS = SAMPLES // BATCH  # one epoch


def _public(package, base):
    names = [n for n in package.__all__
             if isinstance(getattr(package, n), type) and issubclass(getattr(package, n), base)]
    assert names, package.__name__
    return names


CALLBACKS = _public(kerasdbg.callbacks, keras.callbacks.Callback)
RULES = _public(kerasdbg.rules, Rule)
LAYERS = _public(kerasdbg.layers, keras.layers.Layer)


class FiresAtStep(Rule):
    """Fires at one step, to see that a copied `StopOnRule` acts."""

    def __init__(self, step: int = 2):
        self.step = step

    def check(self, step, record):
        if step == self.step:
            return self.verdict(step, "the step came", {"step/loss": record.get("step/loss", 0.0)})
        return None

    def get_config(self):
        return {"step": self.step}


# Constructor arguments of the classes that need some (`tmp` is a directory).
ARGUMENTS = {
    "GradientStatistics": lambda tmp: {"log_dir": str(tmp / "logs")},
    "WeightStatistics": lambda tmp: {"log_dir": str(tmp / "logs")},
    "ActivationStatistics": lambda tmp: {"log_dir": str(tmp / "logs")},
    "StepTimer": lambda tmp: {"log_dir": str(tmp / "logs"), "warmup": 0},
    "StopOnRule": lambda tmp: {"rules": [FiresAtStep(2), kerasdbg.rules.NonFiniteLoss(),
                                         kerasdbg.rules.UnchangedTensor()],
                               "action": "stop", "log_dir": str(tmp / "logs"), "verbose": False},
    "StepRecorder": lambda tmp: {"path": str(tmp / "trace.npz"), "steps": STEPS},
    "TensorVariance": lambda tmp: {"max_threshold": 1e6},
    "LearnedRange": lambda tmp: {"collection": "gradients", "statistic": "l2_norm",
                                 "ranges": {"m/d/kernel": (None, 1.0)}, "margin": 1.0},
    "PrintLayer": lambda tmp: {"output_stream": str(tmp / "print.txt"), "summarize": 1},
    "TapLayer": lambda tmp: {"activation": "relu"},
}


def _make(package, name, tmp):
    cls = getattr(package, name)
    try:
        return cls(**ARGUMENTS.get(name, lambda _: {})(tmp))
    except (TypeError, ValueError) as error:
        pytest.fail(f"{name} needs constructor arguments: add them to ARGUMENTS ({error})")


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(SAMPLES, 3)).astype("float32"),
            rng.normal(size=(SAMPLES, 1)).astype("float32"))


def _model(middle=None):
    """Dense -> a tap -> [middle] -> Dense; `middle` a debug layer or None."""
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    h = kerasdbg.layers.TapLayer(activation="relu", name="tap")(h)
    if middle is not None:
        h = middle(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


class Boom(Exception):
    pass


def _raise_at_second_batch(batch, logs):
    if batch == 1:
        raise Boom("injected at the second batch")


def _fit(model, callbacks=(), fail=False):
    x, y = _data()
    callbacks = list(callbacks)
    if fail:
        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_end=_raise_at_second_batch))
        with pytest.raises(Boom, match="injected"):
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)
        return
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def _copies(instance):
    """A deep copy, a pickled-and-loaded copy and a shallow copy."""
    return {
        "deepcopy": copy.deepcopy(instance),
        "pickle": pickle.loads(pickle.dumps(instance)),
        "copy": copy.copy(instance),
    }


PHASES = ("fresh", "after_fit", "after_failed_fit")


# ---------------------------------------------------------------- callbacks
def _steps_recorded(name, callback, tmp):
    """The optimizer steps the callback recorded, read from what it holds."""
    if name in ("GradientStatistics", "WeightStatistics"):
        return callback.history["step"].tolist()
    if name == "ActivationStatistics":
        return sorted(set(callback.history["step"].tolist()))
    if name == "StepTimer":
        return callback.history["step"].tolist()
    if name == "StopOnRule":
        return [v.step for v in callback.verdicts if v.rule == "FiresAtStep"]
    if name == "StepRecorder":
        with np.load(callback.path) as trace:
            return sorted({int(k.rpartition("@")[2]) for k in trace.files if k.startswith("loss@")})
    pytest.fail(f"add to RECORDS in {__file__} what {name} records")


RECORDS = {
    "GradientStatistics": list(range(1, STEPS + 1)),
    "WeightStatistics": list(range(1, STEPS + 1)),
    "ActivationStatistics": list(range(1, STEPS + 1)),
    "StepTimer": list(range(1, STEPS + 1)),
    "StopOnRule": [2],  # FiresAtStep(2)
    "StepRecorder": list(range(1, STEPS + 1)),
}


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("name", CALLBACKS)
def test_callback_copies_are_fresh_instruments_that_record(tmp_path, name, phase):
    original = _make(kerasdbg.callbacks, name, tmp_path)
    config = original.get_config()
    if phase != "fresh":
        _fit(_model(), [original], fail=phase == "after_failed_fit")
    before = _steps_recorded(name, original, tmp_path) if phase == "after_fit" else None

    for how, duplicate in _copies(original).items():
        assert type(duplicate) is type(original), how
        assert duplicate is not original
        assert duplicate.get_config() == config, how
        # Nothing of a run comes along: no model, and records start empty.
        assert duplicate.model is None, how
        if name != "StepRecorder":  # its records are the file it writes
            assert _steps_recorded(name, duplicate, tmp_path) == [], how
        # The copy of a copy is as good.
        copy.deepcopy(duplicate)
        pickle.dumps(duplicate)

    duplicate = copy.deepcopy(original)
    if name == "StepRecorder" and os.path.exists(original.path):
        os.remove(original.path)
    _fit(_model(), [duplicate])
    assert _steps_recorded(name, duplicate, tmp_path) == RECORDS[name]
    if before is not None and name != "StepRecorder":
        # The copy's fit is not the original's.
        assert _steps_recorded(name, original, tmp_path) == before
    # A copy that ran copies again.
    pickle.loads(pickle.dumps(duplicate))
    assert copy.deepcopy(duplicate).get_config() == config


def test_a_copied_stop_on_rule_gets_copies_of_its_rules(tmp_path):
    rule = FiresAtStep(2)
    original = kerasdbg.callbacks.StopOnRule(rules=[rule], action="stop", verbose=False)
    deep, shallow = copy.deepcopy(original), copy.copy(original)
    assert deep.rules[0] is not rule and deep.rules[0].get_config() == {"step": 2}
    assert shallow.rules[0] is rule  # copy.copy passes the same arguments


def test_a_list_changed_after_construction_does_not_change_a_copy():
    rules = [FiresAtStep(2)]
    original = kerasdbg.callbacks.StopOnRule(rules=rules, action="stop", verbose=False)
    rules.append(FiresAtStep(3))
    assert len(original.rules) == 1
    assert len(copy.deepcopy(original).rules) == 1


def test_a_lambda_action_deep_copies_but_cannot_be_pickled():
    original = kerasdbg.callbacks.StopOnRule(action=lambda verdicts, model: None)
    assert copy.deepcopy(original).action is original.action
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(original)


# -------------------------------------------------------------------- rules
def _rule_records(steps=6):
    """Records of a few steps, in the tags the rules read: constant weights,
    a rising loss, per-class counts and a tap's health."""
    records = []
    for step in range(1, steps + 1):
        record = {"step/loss": 1.0 + 0.1 * step, "epoch/loss": 1.0 + 0.1 * step}
        for collection in ("weights", "gradients"):
            for stat, value in (("l2_norm", 1.5), ("mean", 0.1), ("std", 0.2), ("min", -1.0),
                                ("max", 1.0), ("mean_abs", 0.3), ("zero_fraction", 0.0),
                                ("nan_count", 0.0), ("inf_count", 0.0)):
                record[f"{collection}/m/d/kernel/{stat}"] = value
        record["activations/tap/dead_fraction"] = 1.0
        record["activations/tap/mean"] = 0.0
        records.append((step, record))
    return records


def _run_rule(rule, records):
    rule.reset()
    return [rule.check(step, record) for step, record in records]


@pytest.mark.parametrize("phase", ("fresh", "after_checks", "after_fit", "after_failed_fit"))
@pytest.mark.parametrize("name", RULES)
def test_rule_copies_keep_configuration_and_decide_alike(tmp_path, name, phase):
    rule = _make(kerasdbg.rules, name, tmp_path)
    records = _rule_records()
    if name == "Rule":
        # The base class decides nothing: it says so.
        with pytest.raises(NotImplementedError, match="must implement check"):
            rule.check(1, {})
        records = []
    if phase == "after_checks" and records:
        for step, record in records[:3]:
            rule.check(step, record)
    elif phase in ("after_fit", "after_failed_fit") and name != "Rule":
        callback = kerasdbg.callbacks.StopOnRule(rules=[rule], action="warn", verbose=False)
        import warnings
        with warnings.catch_warnings():
            # A rule may fire on this tiny model, or find nothing to read: what
            # matters here is its state after a fit.
            warnings.simplefilter("ignore", RuntimeWarning)
            _fit(_model(), [callback], fail=phase == "after_failed_fit")

    for how, duplicate in _copies(rule).items():
        assert type(duplicate) is type(rule), how
        assert duplicate.get_config() == rule.get_config(), how
        assert repr(duplicate) == repr(rule), how
        if records and how != "copy":
            # A copy decides as a fresh rule of the same configuration.
            fresh = _make(kerasdbg.rules, name, tmp_path)
            want = [None if v is None else v.reason for v in _run_rule(fresh, records)]
            got = [None if v is None else v.reason for v in _run_rule(duplicate, records)]
            assert got == want, how


def test_a_copied_rule_continues_its_window_until_reset():
    """A rule copy is a plain copy of the object, its window included (a
    runner resets the rules before each run)."""
    rule = kerasdbg.rules.UnchangedTensor(num_steps=3)
    rule.check(1, {"weights/m/d/kernel/l2_norm": 1.5})
    rule.check(2, {"weights/m/d/kernel/l2_norm": 1.5})
    for duplicate in (copy.deepcopy(rule), pickle.loads(pickle.dumps(rule))):
        verdict = duplicate.check(3, {"weights/m/d/kernel/l2_norm": 1.5})
        assert verdict is not None and verdict.step == 3
    assert rule.check(3, {"weights/m/d/kernel/l2_norm": 2.0}) is None  # the original is apart


def test_a_print_layer_copy_with_a_stream_object_prints_to_stderr():
    """As in a saved model: an object stream cannot be saved, and the copy says so."""
    import io

    layer = kerasdbg.layers.PrintLayer(output_stream=io.StringIO(), name="print")
    with pytest.warns(UserWarning, match="cannot be saved; the saved layer prints to stderr"):
        duplicate = copy.deepcopy(layer)
    assert duplicate.output_stream == "stderr"


def test_rule_fired_and_verdicts_pickle():
    """A `RuleFired` raised in a worker process reaches the parent pickled."""
    verdict = kerasdbg.rules.AllZero().check(3, {"weights/m/d/bias/zero_fraction": 1.0})
    error = pickle.loads(pickle.dumps(kerasdbg.rules.RuleFired([verdict])))
    assert error.verdicts == [verdict]
    assert str(error) == verdict.reason
    assert copy.deepcopy(error).verdicts == [verdict]


# ------------------------------------------------------------------- layers
def _fit_steps_of(name, layer, print_path, lines_before):
    if name == "TapLayer":
        return layer.history["step"].tolist()
    if name == "PrintLayer":
        with open(print_path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()[lines_before:]
        return [int(line.split(" step ")[1].split()[0]) for line in lines
                if line.startswith("kerasdbg fit ")]
    pytest.fail(f"add to _fit_steps_of in {__file__} what {name} records")


def _lines(path):
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as handle:
        return len(handle.read().splitlines())


def _debug_layer(name, tmp):
    layer = _make(kerasdbg.layers, name, tmp)
    return layer, layer.get_config()


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("name", LAYERS)
def test_layer_copies_work_in_a_model(tmp_path, name, phase):
    layer, config = _debug_layer(name, tmp_path)
    print_path = str(tmp_path / "print.txt")
    if phase != "fresh":
        _fit(_model(layer), fail=phase == "after_failed_fit")
    for how, duplicate in _copies(layer).items():
        # Keras copies a layer, shallow or deep, through its saving format.
        assert type(duplicate) is type(layer), how
        assert duplicate.get_config() == config, how
        assert duplicate is not layer
        if phase != "fresh":
            # The config and the weights (the call counters), not the records.
            assert duplicate.calls is not layer.calls, how
            np.testing.assert_array_equal(duplicate.calls.numpy(), layer.calls.numpy())
            if name == "TapLayer":
                assert len(layer.history) and not len(duplicate.history), how
        model = _model(duplicate)
        lines = _lines(print_path)
        _fit(model)
        assert _fit_steps_of(name, duplicate, print_path, lines) == list(range(1, STEPS + 1)), how


@pytest.mark.parametrize("name", LAYERS)
def test_layer_in_a_cloned_and_a_deep_copied_model(tmp_path, name):
    layer, config = _debug_layer(name, tmp_path)
    print_path = str(tmp_path / "print.txt")
    model = _model(layer)
    _fit(model)
    for how, other in (("clone_model", keras.models.clone_model(model)),
                       ("deepcopy", copy.deepcopy(model)),
                       ("pickle", pickle.loads(pickle.dumps(model)))):
        copied = other.get_layer(layer.name)
        assert copied is not layer and copied.get_config() == config, how
        other.compile(keras.optimizers.SGD(0.01), "mse")  # a fresh optimizer: steps from 1
        lines = _lines(print_path)
        _fit(other)
        assert _fit_steps_of(name, copied, print_path, lines) == list(range(1, STEPS + 1)), how


def test_a_copy_takes_attributes_changed_after_construction(tmp_path):
    # Issue 32, review (f): a copy was rebuilt from the constructor's arguments
    # alone, so `callback.every_n_steps = 5` set afterwards was lost in
    # KerasTuner's deep copy.
    original = kerasdbg.callbacks.GradientStatistics(log_dir=str(tmp_path / "a"))
    original.every_n_steps = 5
    original.log_dir = str(tmp_path / "b")
    for how, duplicate in _copies(original).items():
        assert duplicate.every_n_steps == 5, how
        assert duplicate.log_dir == str(tmp_path / "b"), how
        assert duplicate.get_config()["every_n_steps"] == 5, how
    # An attribute left alone keeps the argument as given (a default rule set
    # stays the default, re-chosen for the copy's model).
    stop = kerasdbg.callbacks.StopOnRule(verbose=False)
    assert copy.deepcopy(stop).default_rules
    stop.action = "warn"
    stop.rules.append(FiresAtStep(3))  # the same list, other contents
    for how, duplicate in _copies(stop).items():
        assert duplicate.action == "warn", how
        assert [r.name for r in duplicate.rules] == [r.name for r in stop.rules], how
        assert how == "copy" or duplicate.rules[-1] is not stop.rules[-1], how
        # Second review: the copy took the list for rules of the user's own, and
        # refused (warned about) the default activation and replica rules on a
        # model without taps and with one replica, where the original leaves them out.
        assert duplicate.default_rules, how
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0,
              callbacks=[copy.deepcopy(stop)])  # a kerasdbg warning fails the test


def test_a_copy_of_an_attribute_set_to_a_bad_value_is_refused():
    original = kerasdbg.callbacks.GradientStatistics()
    original.every_n_steps = 0
    with pytest.raises(ValueError, match="every_n_steps"):
        copy.deepcopy(original)
