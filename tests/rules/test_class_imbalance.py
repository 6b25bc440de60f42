"""ClassImbalance on trainings with known label counts: the exact firing step, online and offline."""

import warnings

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import StopOnRule
from kerasdbg.rules import ClassImbalance, RuleWarning
from tests.conftest import make_strategy

BATCH, STEPS, SAMPLES = 16, 12, 64
CENTERS = np.array([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], "float32")
MATRIX = [
    pytest.param(s, spe, id=f"{s}-spe{spe}") for s in ("default", "mirrored") for spe in (1, 4)
]


def _data(labels, centers_of=None):
    """Points around the center of each label (or of `centers_of`)."""
    rng = np.random.default_rng(0)
    where = labels if centers_of is None else centers_of
    noise = rng.normal(size=(len(labels), 4)).astype("float32") * 0.5
    return CENTERS[where] + noise, labels


def _run(tmp_path, x, y, strategy_name, spe, one_hot=False):
    """Online and offline verdicts (rule, step) of ClassImbalance(samples=64)."""
    log_dir = str(tmp_path)
    with make_strategy(strategy_name).scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="clf")
        loss = keras.losses.CategoricalCrossentropy(from_logits=True) if one_hot else \
            keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(keras.optimizers.Adam(0.3), loss, steps_per_execution=spe)
    stop = StopOnRule(ClassImbalance(samples=SAMPLES), action="warn", log_dir=log_dir,
                      verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        model.fit(x, keras.utils.to_categorical(y, 3) if one_hot else y, batch_size=BATCH,
                  epochs=1, shuffle=False, verbose=0, callbacks=[stop])
    offline = kerasdbg.check_run(log_dir, [ClassImbalance(samples=SAMPLES)])
    return stop.verdicts, offline


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_a_class_never_seen_fires_once_enough_labels_were_seen(tmp_path, strategy_name, spe,
                                                               read_every_execution):
    # The class totals are read with the records (at each read): read after
    # every execution, the rule fires at its step whatever the machine's speed.
    # Each batch: 15 labels of class 0, one of class 1, none of class 2.
    labels = np.where(np.arange(BATCH * STEPS) % BATCH == 0, 1, 0)
    online, offline = _run(tmp_path, *_data(labels), strategy_name, spe)
    assert [(v.step, v.reason) for v in online] == [(v.step, v.reason) for v in offline]
    assert [v.step for v in online] == [SAMPLES // BATCH]
    assert online[0].reason.endswith("class counts differ infinitely (more than 10): "
                                     "0=60, 1=4, 2=0")


@pytest.mark.parametrize("strategy_name, spe", MATRIX)
def test_a_class_left_behind_fires_after_the_warm_up(tmp_path, strategy_name, spe,
                                                     read_every_execution):
    # The class totals are read with the records (at each read): read after
    # every execution, the rule fires at its step whatever the machine's speed.
    # Per batch 7 x class 0, 7 x class 1, 2 x class 2 (3.5-fold: not an
    # imbalance above 10), but class 2's points lie on class 0's center.
    pattern = np.array([0] * 7 + [1] * 7 + [2] * 2)
    labels = np.tile(pattern, STEPS)
    x, y = _data(labels, centers_of=np.where(labels == 2, 0, labels))
    online, offline = _run(tmp_path, x, y, strategy_name, spe)
    assert [(v.step, v.reason) for v in online] == [(v.step, v.reason) for v in offline]
    # First judged once a window of 64 labels follows the first 64.
    assert [v.step for v in online] == [2 * SAMPLES // BATCH]
    assert online[0].tensors == ("2",) and online[0].values["2"] > 0.7
    # The counts recorded at that step are the labels fed so far.
    counts = kerasdbg.load_run(str(tmp_path)).scalars(r"classes/\d/seen")
    at_step = counts[counts.step == 8].set_index("tag").value.to_dict()
    assert at_step == {"classes/0/seen": 56.0, "classes/1/seen": 56.0, "classes/2/seen": 16.0}


@pytest.mark.parametrize("one_hot", [False, True], ids=["sparse", "one_hot"])
def test_balanced_learnable_classes_stay_quiet(tmp_path, one_hot):
    labels = np.tile(np.arange(3), BATCH * STEPS // 3)
    online, offline = _run(tmp_path, *_data(labels), "default", 1, one_hot=one_hot)
    assert online == offline == []
    counts = kerasdbg.load_run(str(tmp_path)).scalars(r"classes/\d/seen")
    last = counts[counts.step == STEPS].set_index("tag").value
    assert last.to_dict() == {f"classes/{k}/seen": BATCH * STEPS / 3 for k in range(3)}


def test_class_imbalance_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"`threshold_misprediction` must be a finite number "
                                         r">= 0 and <= 1. Received: threshold_misprediction=1.5"):
        ClassImbalance(threshold_misprediction=1.5)
    with pytest.raises(TypeError, match="`samples` must be a positive int"):
        ClassImbalance(samples=10.5)
    rule = ClassImbalance(5, 0.5, 100)
    assert ClassImbalance.from_config(rule.get_config()).get_config() == rule.get_config()
