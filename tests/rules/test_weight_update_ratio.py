"""WeightUpdateRatio on a healthy network with normalization layers, whose first
updates are out of range, and on a learning rate that is too large.

Measured with GradientTape (32x32 inputs, batch 4, SGD 0.01, default initializers):
`keras.applications.ResNet50(weights=None)` has update ratios up to 306 at its first
step (conv1_conv/kernel; median 0.24, 4 variables above 10) and at most 6.9 from the
second step on; MobileNetV2 up to 30 at the first step (depthwise kernels, 9 above 10),
at most 2 after. A full application takes minutes on a CPU with the instruments, so the
test below trains a small network of the same kind (strided convolutions, each followed
by BatchNormalization, down to 2x2), whose reference measures the same thing: the first
update of a variable out of range, every later one in range.
"""

import keras
import numpy as np
import tensorflow as tf

import kerasdbg
from kerasdbg.callbacks import GradientStatistics, StopOnRule, WeightStatistics
from kerasdbg.offline import can_check, recorded_pairs
from kerasdbg.rules import WeightUpdateRatio, default_rules

BATCH, STEPS = 4, 4


def _strided_bn_net(learning_rate=0.01):
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    # A kernel at a small initial scale before BatchNormalization, whose output does
    # not depend on it: its gradient grows as the scale shrinks, so its first update
    # is hundreds of times the kernel on any CPU (not only the biases' float noise).
    h = layers.Conv2D(8, 7, strides=2, padding="same", use_bias=False, name="conv1_conv",
                      kernel_initializer=keras.initializers.RandomNormal(stddev=1e-3))(inputs)
    h = layers.ReLU()(layers.BatchNormalization(name="conv1_bn")(h))
    for b in range(4):
        for r in range(3):
            h = layers.Conv2D(16, 3, strides=2 if r == 0 else 1, padding="same",
                              name=f"b{b}_{r}_conv")(h)
            h = layers.ReLU()(layers.BatchNormalization(name=f"b{b}_{r}_bn")(h))
    outputs = layers.Dense(10, activation="softmax", name="predictions")(
        layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs, name="strided_bn")
    model.compile(keras.optimizers.SGD(learning_rate), "sparse_categorical_crossentropy")
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.uniform(-1, 1, (BATCH * STEPS, 32, 32, 3)).astype("float32"),
            rng.integers(0, 10, BATCH * STEPS))


def _reference_ratios():
    """Per step, ||update|| / ||weights before|| of each variable that was not zero."""
    keras.utils.set_random_seed(0)
    model = _strided_bn_net()
    x, y = _data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    steps = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        before = [v.numpy().copy() for v in model.trainable_variables]
        with tf.GradientTape() as tape:
            loss = loss_fn(y[rows], model(x[rows], training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(gradients, model.trainable_variables)
        steps.append({v.path: np.linalg.norm(v.numpy() - b) / np.linalg.norm(b)
                      for v, b in zip(model.trainable_variables, before)
                      if np.linalg.norm(b) > 0})
    return steps


def _recorders(tmp_path):
    """The statistics callbacks, for `check_run` (StopOnRule writes only step/ and epoch/)."""
    return [GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path))]


def _faults(verdicts):
    return [(v.rule, v.step) for v in verdicts if v.severity == "fault"]


def test_the_first_update_of_a_normalized_network_out_of_range_is_not_a_fault(tmp_path):
    ratios = _reference_ratios()
    first = {}  # each variable's first finite ratio (biases start at zero: from step 2)
    for step, row in enumerate(ratios, start=1):
        for path, ratio in row.items():
            first.setdefault(path, (step, ratio))
    spikes = {path for path, (_, ratio) in first.items() if ratio > 10}
    assert spikes, first  # the situation: a first update more than 10 times the weights
    later = [ratio for step, row in enumerate(ratios, start=1) for path, ratio in row.items()
             if first[path][0] < step]
    assert max(later) < 10
    keras.utils.set_random_seed(0)
    model = _strided_bn_net()
    stop = StopOnRule(log_dir=str(tmp_path), verbose=False)
    model.fit(*_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[stop, *_recorders(tmp_path)])
    assert _faults(stop.verdicts) == []
    run = kerasdbg.load_run(str(tmp_path))
    present = recorded_pairs(run.tags())
    rules = [rule for rule in default_rules() if can_check(rule, present)]
    assert any(isinstance(rule, WeightUpdateRatio) for rule in rules)
    assert _faults(kerasdbg.check_run(run, rules)) == []


def test_a_learning_rate_too_large_fires_at_the_second_update_online_and_offline(tmp_path):
    keras.utils.set_random_seed(0)
    model = _strided_bn_net(learning_rate=50.0)
    stop = StopOnRule(WeightUpdateRatio(), log_dir=str(tmp_path), verbose=False)
    model.fit(*_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[stop, *_recorders(tmp_path)])
    assert _faults(stop.verdicts) == [("WeightUpdateRatio", 2)]
    assert all(ratio > 10 for ratio in stop.verdicts[0].values.values())
    offline = kerasdbg.check_run(str(tmp_path), [WeightUpdateRatio()])
    assert [(v.step, v.reason) for v in offline] == [(2, stop.verdicts[0].reason)]
