"""`kerasdbg.calibrate` and `LearnedRange`: ranges learned from a healthy run.

One healthy run of a small MLP (SGD, taps after its two ReLU layers, 80 steps, every step
recorded) is calibrated on; another seed (other initial weights, other data order) must be
quiet, online (`StopOnRule`) and offline (`check_run`); three broken runs must fire at the
step of their fault, online and offline alike: a learning rate 100 times larger from step 30,
the first layer's kernel zeroed before step 30, inputs 100 times too large from step 1. The
expected ranges and the expected first step out of range are computed with NumPy and pandas
from the recorded values, not by the code under test.
"""

import json
import math
import warnings

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.rules import LearnedRange, RuleWarning

FIRST_STEPS, MARGIN, CLEARANCE, ROUNDING = 10, 10.0, 2.0, 1e3
EPOCHS, BATCH = 5, 8  # 16 steps an epoch, 80 steps
FAULT_STEP = 30
RNG = np.random.default_rng(0)
X = RNG.normal(size=(128, 8)).astype("float32")
Y = (np.tanh(X @ RNG.normal(size=(8, 1))) + 0.1 * RNG.normal(size=(128, 1))).astype("float32")
PAIRS = [("gradients", "l2_norm"), ("weights", "l2_norm"), ("weights", "update_ratio"),
         ("activations", "dead_fraction"), ("activations", "zero_fraction")]
FRACTIONS = ("dead_fraction", "zero_fraction")


def _model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu", name="hidden"),
        keras.layers.Dense(16, activation="relu", name="hidden2"),
        keras.layers.Dense(1, name="out"),
    ], name="mlp")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return kerasdbg.insert_taps(model, layers=["hidden", "hidden2"])


class _Fault(keras.callbacks.Callback):
    """Before optimizer step `step`: the learning rate times 100, or the first
    layer's kernel zeroed."""

    def __init__(self, kind, step):
        super().__init__()
        self.kind, self.step = kind, step

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) + 1 != self.step:
            return
        if self.kind == "learning_rate":
            self.model.optimizer.learning_rate.assign(self.model.optimizer.learning_rate * 100.0)
        else:
            kernel = self.model.get_layer("hidden").kernel
            kernel.assign(np.zeros(kernel.shape, "float32"))


def _unnamed_model(seed):
    """`_model` as most code writes it: every name Keras's, numbered in the
    process's order of creation (`sequential_3`, `dense_7`, `dense_7_tap`...)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return kerasdbg.insert_taps(model, layers=[layer.name for layer in model.layers[:2]])


def _fit(log_dir, seed, extra=(), x=X, make=_model):
    """A run recorded at every step into `log_dir`, with `extra` callbacks."""
    recorders = [GradientStatistics(log_dir, every_n_steps=1, stats=["l2_norm"]),
                 WeightStatistics(log_dir, every_n_steps=1, stats=["l2_norm", "update_ratio"]),
                 ActivationStatistics(log_dir)]
    make(seed).fit(x, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
                     callbacks=[*extra, *recorders])


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """`(log directory, rules)` of the healthy run calibrated on (seed 1)."""
    log_dir = str(tmp_path_factory.mktemp("healthy"))
    _fit(log_dir, seed=1)
    return log_dir, kerasdbg.calibrate(log_dir)


# ------------------------------------------------------ the independent reference
def _table(log_dir, collection, statistic):
    """steps x tensors of one recorded statistic (NaN where not recorded)."""
    table = kerasdbg.load_run(log_dir).scalar_table(f"^{collection}/.+/{statistic}$")
    table.columns = [c[len(collection) + 1:-len(statistic) - 1] for c in table.columns]
    return table


def _values(log_dir, collection, statistic):
    """What the rule compares: the recorded values; an update ratio over the
    largest norm recorded up to the step before, when that step's norm is recorded."""
    table = _table(log_dir, collection, statistic)
    if statistic != "update_ratio":
        return table
    norms = _table(log_dir, "weights", "l2_norm")
    norms = norms.where(np.isfinite(norms))
    before, peak = (frame.reindex(table.index - 1).set_axis(table.index)
                    for frame in (norms, norms.cummax()))
    return (table * before / np.maximum(before, peak)).where(before > 0, table)


def _expected_ranges(log_dir, collection, statistic):
    """`(later, whole)`: {tensor: (low, high)} as the docstring of `calibrate` says."""
    table = _values(log_dir, collection, statistic)
    finite_max = table.where(np.isfinite(table)).max()
    # Zero up to rounding: a scale whose largest value is 0, a variable a sibling dwarfs.
    keep = (table.max() > 0) | (statistic in FRACTIONS)
    if collection != "activations":
        layers = [name.rpartition("/")[0] for name in table.columns]
        keep &= ~(finite_max * ROUNDING < finite_max.groupby(layers).transform("max"))
    ranges = ({}, {})
    for name in table.columns[keep.values]:
        values = table[name].dropna()
        low, high = values.min(), values.max()
        clear = len(values) > 1 and np.isfinite(high) and low > 0 and low >= CLEARANCE * (high - low)
        later = values[values.index > FIRST_STEPS]
        for out, part in zip(ranges, (later if len(later) else values, values)):
            out[name] = (part.min() if clear else None,
                         part.max() if np.isfinite(part.max()) else None)
    return ranges


def _widened(statistic, low, high):
    low = -np.inf if low is None else low / MARGIN
    if high is None:
        return low, np.inf
    return low, (1 - (1 - high) / MARGIN if statistic in FRACTIONS else high * MARGIN)


def _first_out_of_range(calibrated, checked):
    """{(collection, statistic): (first step out of range, tensors out then)}."""
    found = {}
    for collection, statistic in PAIRS:
        later, whole = _expected_ranges(calibrated, collection, statistic)
        table = _values(checked, collection, statistic)
        for step, row in table.iterrows():
            ranges = whole if step <= FIRST_STEPS else later
            out = sorted(name for name, value in row.items() if name in ranges
                         and not np.isnan(value)
                         and not (_widened(statistic, *ranges[name])[0] <= value
                                  <= _widened(statistic, *ranges[name])[1]))
            if out:
                found[(collection, statistic)] = (int(step), out)
                break
    return found


def _assert_same_ranges(got, expected):
    assert set(got) == set(expected)
    for name, bounds in expected.items():
        for mine, theirs in zip(got[name], bounds):
            assert (mine is None) == (theirs is None), (name, got[name], bounds)
            if theirs is not None:
                np.testing.assert_allclose(mine, theirs, rtol=1e-9, atol=0)


def _pair_of(verdict):
    collection, statistic = verdict.reason.split(": ", 1)[1].split(" ")[:2]
    return collection, statistic


# ------------------------------------------------------------------ calibration
def test_the_ranges_are_those_of_the_recorded_values(healthy):
    log_dir, rules = healthy
    assert [(r.collection, r.statistic) for r in rules] == PAIRS  # no saturated tap
    for rule in rules:
        later, whole = _expected_ranges(log_dir, rule.collection, rule.statistic)
        _assert_same_ranges(rule.ranges, later)
        _assert_same_ranges(rule.first_ranges, whole)
        assert (rule.first_steps, rule.margin, rule.every_step) == (FIRST_STEPS, MARGIN, True)
    # What the docstring promises for this model: the kernels' norms have a lower bound,
    # the zero-initialised biases, the gradients and the update ratios none, and the
    # biases' first update ratios (from zero: inf) leave the first steps unbounded above.
    weights, gradients, ratios = rules[1], rules[0], rules[2]
    assert all(weights.ranges[f"mlp/{layer}/kernel"][0] > 0 for layer in ("hidden", "out"))
    assert all(weights.ranges[f"mlp/{layer}/bias"][0] is None for layer in ("hidden", "out"))
    assert all(low is None for low, _ in gradients.ranges.values())
    assert all(low is None for low, _ in ratios.ranges.values())
    assert ratios.first_ranges["mlp/hidden/bias"][1] is None
    assert ratios.ranges["mlp/hidden/bias"][1] is not None


def test_another_healthy_run_is_quiet_online_and_offline(healthy, tmp_path):
    log_dir, rules = healthy
    stop = StopOnRule(rules, log_dir=str(tmp_path), verbose=False, strict=True)
    _fit(str(tmp_path), seed=2, extra=[stop])
    assert _first_out_of_range(log_dir, str(tmp_path)) == {}  # the reference agrees
    assert stop.verdicts == []
    assert kerasdbg.check_run(str(tmp_path), rules) == []


@pytest.mark.parametrize("fault, step", [
    ("learning_rate", FAULT_STEP), ("zeroed_weights", FAULT_STEP), ("input_scale", 1)],
    ids=["learning-rate-x100-from-step-30", "kernel-zeroed-before-step-30",
         "inputs-x100-from-step-1"])
def test_a_broken_run_fires_at_the_step_of_its_fault(healthy, tmp_path, fault, step,
                                                     read_every_execution):
    """Every update ratio and norm is recorded at every step (`every_step`), so the first
    verdict is at the planted step itself; "stop" ends the fit there (read after every
    execution), and the offline check of its records gives the same verdicts."""
    log_dir, rules = healthy
    stop = StopOnRule(rules, action="stop", log_dir=str(tmp_path), verbose=False, strict=True)
    extra = [stop] if fault == "input_scale" else [stop, _Fault(fault, step)]
    _fit(str(tmp_path), seed=3, extra=extra, x=X * 100.0 if fault == "input_scale" else X)
    online = [(v.rule, v.step, v.reason, v.tensors, v.severity) for v in stop.verdicts]
    offline = [(v.rule, v.step, v.reason, v.tensors, v.severity)
               for v in kerasdbg.check_run(str(tmp_path), rules)]
    assert online and online == offline
    assert {v[1] for v in online} == {step}, online
    expected = _first_out_of_range(log_dir, str(tmp_path))
    assert {_pair_of(v): (v.step, sorted(v.tensors)) for v in stop.verdicts} == expected
    if fault == "learning_rate":
        assert ("weights", "update_ratio") in expected
    if fault == "zeroed_weights":
        assert "mlp/hidden/kernel" in expected[("weights", "l2_norm")][1]
        assert "mlp/hidden/kernel" in expected[("weights", "update_ratio")][1]  # inf


def test_margin_and_first_steps_are_taken(healthy, tmp_path_factory):
    log_dir, _ = healthy
    rules = kerasdbg.calibrate(kerasdbg.load_run(log_dir), margin=2.5, first_steps=0,
                               every_step=False)
    assert {(r.margin, r.first_steps, r.first_ranges, r.every_step) for r in rules} == {
        (2.5, 0, None, False)}
    # Without the first steps apart, the later ranges are the whole run's.
    _, whole = _expected_ranges(log_dir, "gradients", "l2_norm")
    _assert_same_ranges(rules[0].ranges, whole)


def test_the_same_model_built_again_is_judged_by_place_not_by_the_numbers_keras_adds(
        tmp_path, read_every_execution):
    """A model built again in one process has Keras's next names (`sequential_1`,
    `dense_3`, ...): a healthy run of it is quiet online and offline, and a broken one
    gets its verdict at the fault's step, on its own tensors' names."""
    calibrated, healthy_dir, broken_dir = (str(tmp_path / n) for n in ("a", "b", "c"))
    _fit(calibrated, seed=1, make=_unnamed_model)
    rules = kerasdbg.calibrate(calibrated)
    assert {r.collection for r in rules} == {"gradients", "weights", "activations"}
    stop = StopOnRule(rules, log_dir=healthy_dir, verbose=False, strict=True)
    _fit(healthy_dir, seed=2, extra=[stop], make=_unnamed_model)
    tensors = [{t for t in kerasdbg.load_run(d).tags() if t.startswith(("gradients/",
                                                                       "activations/"))
                and t != "gradients/global_norm"} for d in (calibrated, healthy_dir)]
    assert tensors[0] and not tensors[0] & tensors[1], sorted(tensors[0] & tensors[1])
    assert stop.verdicts == []  # neither a fault nor "none is one it was calibrated on"
    assert kerasdbg.check_run(healthy_dir, rules) == []

    stop = StopOnRule(rules, action="stop", log_dir=broken_dir, verbose=False, strict=True)
    _fit(broken_dir, seed=3, extra=[stop, _Fault("learning_rate", FAULT_STEP)],
         make=_unnamed_model)
    offline = kerasdbg.check_run(broken_dir, rules)
    assert [(v.rule, v.step, v.tensors) for v in stop.verdicts] == \
        [(v.rule, v.step, v.tensors) for v in offline]
    assert {v.step for v in offline} == {FAULT_STEP}
    assert {v.severity for v in offline} == {"fault"}
    broken_tags = set(kerasdbg.load_run(broken_dir).tags())
    assert all(any(f"/{name}/" in tag for tag in broken_tags)
               for v in offline for name in v.tensors)


# ------------------------------------------------------------------- the rule alone
def test_tensors_named_by_other_numbers_are_matched_in_keras_order_of_creation():
    # dense_9 before dense_10 (not their string order); the model's own name numbered too.
    rule = LearnedRange("gradients", "l2_norm", {"m/dense_9/kernel": (None, 1.0),
                                                 "m/dense_10/kernel": (None, 100.0)})
    record = {"gradients/m_1/dense_11/kernel/l2_norm": 5.0,
              "gradients/m_1/dense_12/kernel/l2_norm": 50.0}
    assert rule.check(1, record) is None
    assert rule.take_notes() == []
    verdict = rule.check(2, {**record, "gradients/m_1/dense_11/kernel/l2_norm": 50.0})
    assert verdict.tensors == ("m_1/dense_11/kernel",)
    # A family with another number of tensors is another model: not matched.
    other = LearnedRange("gradients", "l2_norm", {"m/dense/kernel": (None, 1.0)})
    assert other.check(1, record) is None
    [note] = other.take_notes()
    assert "none of the recorded tensors is one it was calibrated on" in note.reason


def test_the_margin_widens_scales_by_a_factor_and_fractions_on_both_sides():
    scale = LearnedRange("weights", "l2_norm", {"k": (2.0, 4.0)}, margin=4.0)
    assert scale.widened((2.0, 4.0)) == (0.5, 16.0)
    assert scale.check(20, {"weights/k/l2_norm": 0.51}) is None
    assert scale.check(21, {"weights/k/l2_norm": 15.9}) is None
    verdict = scale.check(22, {"weights/k/l2_norm": 0.4})
    assert (verdict.step, verdict.tensors, verdict.values) == (22, ("k",), {"k": 0.4})
    assert verdict.reason == ("LearnedRange at step 22: weights l2_norm outside its calibrated "
                              "range (margin 4): k=0.4 < 0.5")
    fraction = LearnedRange("activations", "dead_fraction", {"tap": (0.2, 0.6)}, margin=4.0)
    assert fraction.widened((0.2, 0.6)) == pytest.approx((0.05, 0.9))
    assert fraction.check(5, {"activations/tap/dead_fraction": 0.89}) is None
    assert fraction.check(6, {"activations/tap/dead_fraction": 0.95}).values == {"tap": 0.95}
    # None: that side is not checked; NaN is left to the non-finite rules; inf is out.
    open_ended = LearnedRange("gradients", "l2_norm", {"k": (None, None), "b": (None, 1.0)})
    assert open_ended.check(3, {"gradients/k/l2_norm": 1e30, "gradients/b/l2_norm": 0.0,
                                "gradients/x/l2_norm": 1e30}) is None
    assert open_ended.check(4, {"gradients/b/l2_norm": math.nan}) is None
    assert open_ended.check(5, {"gradients/b/l2_norm": math.inf}).values == {"b": math.inf}


def test_first_ranges_judge_the_first_steps():
    rule = LearnedRange("gradients", "l2_norm", {"k": (None, 1.0)},
                        first_ranges={"k": (None, 100.0)}, first_steps=3, margin=2.0)
    assert rule.check(3, {"gradients/k/l2_norm": 150.0}) is None
    assert rule.check(4, {"gradients/k/l2_norm": 150.0}).step == 4


def test_an_update_ratio_is_taken_over_the_largest_norm_so_far():
    """A bias passing near zero: ||update|| / ||before|| is 20, over the largest norm 0.2."""
    rule = LearnedRange("weights", "update_ratio", {"m/b": (None, 0.5)}, margin=1.0)
    assert rule.requires == (("weights", "update_ratio"), ("weights", "l2_norm"))
    assert rule.check(11, {"weights/m/b/l2_norm": 2.0, "weights/m/b/update_ratio": 0.1}) is None
    assert rule.check(12, {"weights/m/b/l2_norm": 0.01, "weights/m/b/update_ratio": 0.4}) is None
    assert rule.check(13, {"weights/m/b/l2_norm": 0.2, "weights/m/b/update_ratio": 20.0}) is None
    # Without the norm of the step before, the ratio is read as recorded.
    assert rule.check(15, {"weights/m/b/update_ratio": 20.0}).values == {"m/b": 20.0}


def test_a_model_with_other_names_is_said_once_as_information():
    rule = LearnedRange("gradients", "l2_norm", {"mlp/d/kernel": (None, 1.0)})
    assert rule.check(1, {"gradients/sequential_1/d/kernel/l2_norm": 5.0}) is None
    [note] = rule.take_notes()
    assert note.severity == "info" and note.step == 1
    assert note.reason == (
        "LearnedRange at step 1: gradients l2_norm: none of the recorded tensors is one it "
        "was calibrated on (mlp/d/kernel), so it checks nothing (a model with other names?); "
        "recorded: sequential_1/d/kernel=5")
    rule.check(2, {"gradients/sequential_1/d/kernel/l2_norm": 5.0})
    assert rule.take_notes() == []


# ------------------------------------------------------------------ configuration
def test_get_config_round_trips_and_stop_on_rule_saves_the_rules(healthy):
    log_dir, rules = healthy
    for rule in rules:
        config = json.loads(json.dumps(rule.get_config()))
        again = LearnedRange.from_config(config)
        assert again.get_config() == rule.get_config()
    stop = StopOnRule.from_config(json.loads(json.dumps(StopOnRule(rules).get_config())))
    assert [r.get_config() for r in stop.rules] == [r.get_config() for r in rules]
    assert all(type(r) is LearnedRange for r in stop.rules)


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs, error, match", [
    ({"collection": "grads"}, ValueError,
     r"LearnedRange: `collection` must be one of 'gradients', 'weights', 'activations'. "
     r"Received: collection='grads'"),
    ({"statistic": "update_ratio"}, ValueError,
     r"`statistic` must be one of 'l2_norm', 'mean_abs', 'std', 'zero_fraction' for collection "
     r"'gradients'. Received: statistic='update_ratio'"),
    ({"ranges": [("k", (0, 1))]}, TypeError,
     r"`ranges` must be a non-empty mapping from tensor names to \(low, high\) pairs of "
     r"numbers >= 0 or None. Received: ranges=\[\('k', \(0, 1\)\)\] of type list"),
    ({"ranges": {}}, ValueError, r"`ranges` must be a non-empty mapping.*Received: ranges=\{\}"),
    ({"ranges": {"k": 1.0}}, TypeError,
     r"`ranges\['k'\]` must be a \(low, high\) pair. Received: ranges\['k'\]=1.0"),
    ({"ranges": {"k": (2.0, 1.0)}}, ValueError,
     r"`ranges\['k'\]` must have low <= high. Received: ranges\['k'\]=\(2.0, 1.0\)"),
    ({"ranges": {"k": (-1.0, 1.0)}}, ValueError,
     r"`ranges\['k'\]` must be a finite number >= 0. Received: ranges\['k'\]=-1.0"),
    ({"first_ranges": {"k": (0.0, "1")}}, TypeError,
     r"`first_ranges\['k'\]` must be a number. Received: first_ranges\['k'\]='1' of type str"),
    ({"first_steps": -1}, ValueError, r"`first_steps` must be a non-negative int. Received: "
                                      r"first_steps=-1"),
    ({"margin": 0.5}, ValueError, r"`margin` must be a finite number >= 1. Received: margin=0.5"),
    ({"every_step": 1}, TypeError, r"`every_step` must be a bool. Received: every_step=1"),
], ids=["collection", "statistic", "ranges-type", "ranges-empty", "bounds-type", "low-above-high",
        "negative-bound", "bound-type", "first-steps", "margin", "every-step"])
def test_bad_rule_arguments_are_refused(kwargs, error, match):
    arguments = {"collection": "gradients", "statistic": "l2_norm", "ranges": {"k": (0.0, 1.0)},
                 **kwargs}
    with pytest.raises(error, match=match):
        LearnedRange(**arguments)


def test_a_fraction_above_one_is_refused():
    with pytest.raises(ValueError, match=r"`ranges\['t'\]` must be a finite number >= 0 and "
                                         r"<= 1. Received: ranges\['t'\]=1.5"):
        LearnedRange("activations", "dead_fraction", {"t": (0.0, 1.5)})


def test_bad_calibrate_arguments_are_refused(healthy, tmp_path):
    log_dir, _ = healthy
    with pytest.raises(TypeError, match=r"calibrate: `log_dir` must be a log directory \(str or "
                                        r"os.PathLike\) or a kerasdbg.reader.Run. Received: "
                                        r"log_dir=3 of type int"):
        kerasdbg.calibrate(3)
    with pytest.raises(ValueError, match=r"calibrate: `margin` must be a finite number >= 1. "
                                         r"Received: margin=0.9"):
        kerasdbg.calibrate(log_dir, margin=0.9)
    with pytest.raises(ValueError, match=r"calibrate: `first_steps` must be a non-negative int"):
        kerasdbg.calibrate(log_dir, first_steps=-2)
    with pytest.raises(TypeError, match=r"calibrate: `every_step` must be a bool"):
        kerasdbg.calibrate(log_dir, every_step="yes")
    with pytest.raises(TypeError, match=r"calibrate: `run` must be the name of a run of the "
                                        r"directory \(a non-empty str\). Received: run=None"):
        kerasdbg.calibrate(log_dir, run=None)
    with pytest.raises(FileNotFoundError, match="`log_dir` is not a directory"):
        kerasdbg.calibrate(str(tmp_path / "absent"))
    with pytest.raises(KeyError, match="no scalars tag matches"):
        kerasdbg.calibrate(log_dir, run="validation")


def test_a_run_without_the_statistics_is_refused(tmp_path):
    """`StopOnRule(log_dir=...)` alone writes the step/ and epoch/ values, no statistics."""
    model = _model(1)
    stop = StopOnRule(kerasdbg.rules.NonFiniteLoss(), log_dir=str(tmp_path), verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        model.fit(X[:16], Y[:16], batch_size=BATCH, epochs=1, verbose=0, callbacks=[stop])
    with pytest.raises(ValueError, match=r"calibrate: run 'train' of .* holds none of the "
                                         r"statistics it learns ranges of: "
                                         r"gradients/<name>/l2_norm, .*Record them with "
                                         r"GradientStatistics"):
        kerasdbg.calibrate(str(tmp_path))
