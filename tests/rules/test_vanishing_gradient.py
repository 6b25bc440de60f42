"""VanishingGradient (and the default rules) on a real vanishing gradient and on three
healthy models whose raw gradients look vanished: a zero-initialised output layer (as
keras.io's DDIM), a recommender's large Embedding tables, and instance-norm scales
initialised N(0, 0.02) (as keras.io's CycleGAN).

Each case is a small model that reproduces the situation; what makes it that situation
(gradient magnitudes, update ratios) is measured here with GradientTape and NumPy on a
copy of the model trained the same way, never read from kerasdbg. Each run is then
checked online (StopOnRule's default rules) and offline (`check_run` with the same
default rules), which must agree.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdbg
from kerasdbg import cli
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.offline import can_check, recorded_pairs
from kerasdbg.rules import VanishingGradient, default_rules

BATCH, STEPS = 8, 4
RNG = np.random.default_rng(7)


# --------------------------------------------------------------- the models
def _sigmoid_mlp():
    """Twelve sigmoid layers under SGD: the first layers' gradients vanish."""
    layers = [keras.Input((8,))] + [
        keras.layers.Dense(16, activation="sigmoid", name=f"d{i}") for i in range(12)]
    model = keras.Sequential(layers + [keras.layers.Dense(1, name="out")], name="deep")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = RNG.normal(size=(BATCH * STEPS, 8)).astype("float32")
    return model, x, RNG.normal(size=(BATCH * STEPS, 1)).astype("float32")


def _zero_output():
    """keras.io's DDIM: the output layer starts at zero, so at the first step every
    other gradient is exactly 0 (AdamW, MAE as there)."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="swish", name="h1")(inputs)
    h = keras.layers.Dense(16, activation="swish", name="h2")(h)
    outputs = keras.layers.Dense(8, kernel_initializer="zeros", name="out")(h)
    model = keras.Model(inputs, outputs, name="ddim")
    model.compile(keras.optimizers.AdamW(1e-3), "mae")
    x = RNG.normal(size=(BATCH * STEPS, 8)).astype("float32")
    return model, x, RNG.normal(size=(BATCH * STEPS, 8)).astype("float32")


USERS, ITEMS = 500_000, 200_000


def _recommender():
    """A dot-product recommender: a batch touches 8 of 500,000 user rows, so the mean
    |gradient| over the table is about 1e-8 while the rows it touched learn (Adam)."""
    users = keras.Input((1,), dtype="int32", name="user")
    items = keras.Input((1,), dtype="int32", name="item")
    u = keras.layers.Flatten()(keras.layers.Embedding(USERS, 8, name="user_emb")(users))
    i = keras.layers.Flatten()(keras.layers.Embedding(ITEMS, 8, name="item_emb")(items))
    score = keras.layers.Dot(axes=1)([u, i])
    model = keras.Model([users, items], keras.layers.Activation("sigmoid")(score), name="rec")
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    x = [RNG.integers(0, USERS, (BATCH * STEPS, 1)).astype("int32"),
         RNG.integers(0, ITEMS, (BATCH * STEPS, 1)).astype("int32")]
    return model, x, RNG.integers(0, 2, (BATCH * STEPS, 1)).astype("float32")


def _instance_norm():
    """keras.io's CycleGAN generator in small: convolutions, each followed by an
    instance normalization whose scale starts at N(0, 0.02); the convolutions'
    gradients stay at 1e-9..1e-10 while Adam moves their kernels normally."""
    init = keras.initializers.RandomNormal(0.0, 0.02)
    inputs = keras.Input((16, 16, 3))
    h = inputs
    for k in range(4):
        h = keras.layers.Conv2D(8, 3, padding="same", kernel_initializer=init, use_bias=False,
                                name=f"conv{k}")(h)
        h = keras.layers.GroupNormalization(groups=-1, gamma_initializer=init, name=f"in{k}")(h)
        h = keras.layers.ReLU()(h)
    outputs = keras.layers.Conv2D(3, 3, padding="same", kernel_initializer=init,
                                  activation="tanh", name="out")(h)
    model = keras.Model(inputs, outputs, name="generator")
    model.compile(keras.optimizers.Adam(2e-4, beta_1=0.5), "mae")
    x = RNG.uniform(-1, 1, (BATCH * STEPS, 16, 16, 3)).astype("float32")
    return model, x, RNG.uniform(-1, 1, (BATCH * STEPS, 16, 16, 3)).astype("float32")


LR, WD = 1e-3, 4e-3


def _dead_under_adamw():
    """A ReLU layer whose bias starts at -100 outputs 0 for every input: no gradient
    reaches it or the layers before it (all exactly 0), and AdamW's decoupled weight
    decay alone still moves each of them by lr x wd of itself per step."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="d0")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    h = keras.layers.Dense(16, activation="relu", bias_initializer=keras.initializers.Constant(-100.0),
                           name="dead")(h)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h), name="decayed")
    model.compile(keras.optimizers.AdamW(LR, weight_decay=WD), "mse")
    x = RNG.normal(size=(BATCH * STEPS, 8)).astype("float32")
    return model, x, RNG.normal(size=(BATCH * STEPS, 1)).astype("float32")


def _instance_norm_adamw():
    """The CycleGAN case under AdamW: tiny gradients Adam turns into updates, plus decay."""
    model, x, y = _instance_norm()
    model.compile(keras.optimizers.AdamW(2e-4, beta_1=0.5, weight_decay=WD), "mae")
    return model, x, y


CASES = {"sigmoid_mlp": _sigmoid_mlp, "zero_output": _zero_output,
         "recommender": _recommender, "instance_norm": _instance_norm,
         "dead_under_adamw": _dead_under_adamw, "instance_norm_adamw": _instance_norm_adamw}


# ------------------------------------------------------------ the reference
def _batch(data, step):
    rows = slice((step - 1) * BATCH, step * BATCH)
    return [d[rows] for d in data] if isinstance(data, list) else data[rows]


def _reference(case):
    """Per step and variable, measured on a model of the same seed trained by hand
    with GradientTape: mean |gradient| over the whole tensor and over its non-zero
    elements, and ||update|| / ||weights before||."""
    keras.utils.set_random_seed(0)
    model, x, y = CASES[case]()
    steps = []
    for step in range(1, STEPS + 1):
        xb, yb = _batch(x, step), _batch(y, step)
        before = {v.path: v.numpy().copy() for v in model.trainable_variables}
        with tf.GradientTape() as tape:
            loss = model.compute_loss(xb, yb, model(xb, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(gradients, model.trainable_variables)
        row = {}
        for variable, gradient in zip(model.trainable_variables, gradients):
            g = np.abs(tf.convert_to_tensor(gradient).numpy())
            norm = np.linalg.norm(before[variable.path])
            change = np.linalg.norm(variable.numpy() - before[variable.path])
            row[variable.path] = dict(
                mean=g.mean(), touched=g.sum() / max(np.count_nonzero(g), 1),
                ratio=change / norm if norm > 0 else (0.0 if change == 0 else np.inf))
        steps.append(row)
    return steps


def _fit(case, tmp_path):
    """The case trained with StopOnRule()'s default rules: (callback, offline verdicts)."""
    keras.utils.set_random_seed(0)
    model, x, y = CASES[case]()
    stop = StopOnRule(log_dir=str(tmp_path), verbose=False)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[stop, *_recorders(tmp_path)])
    run = kerasdbg.load_run(str(tmp_path))
    present = recorded_pairs(run.tags())
    rules = [rule for rule in default_rules() if can_check(rule, present)]
    return stop, kerasdbg.check_run(run, rules)


def _recorders(tmp_path):
    """The statistics callbacks, for `check_run` (StopOnRule writes only step/ and epoch/)."""
    return [GradientStatistics(str(tmp_path)), WeightStatistics(str(tmp_path))]


def _faults(verdicts):
    return [(v.rule, v.step, v.tensors) for v in verdicts if v.severity == "fault"]


# ------------------------------------------------------------------ the tests
def test_a_real_vanishing_gradient_fires_where_the_first_layers_stop_changing(tmp_path):
    reference = _reference("sigmoid_mlp")
    # The first layers' gradients vanished and SGD does not move their weights.
    # (With a margin: float32 in the step against float64 here.)
    kernels = {path: r for path, r in reference[1].items() if path.endswith("kernel")}
    vanished = {p for p, r in kernels.items() if r["touched"] < 0.5e-7 and r["ratio"] < 0.5e-8}
    alive = {p for p, r in kernels.items() if r["touched"] > 2e-7 or r["ratio"] > 2e-8}
    assert {"deep/d0/kernel", "deep/d1/kernel", "deep/d2/kernel"} <= vanished
    assert all(reference[0][f"deep/d{i}/kernel"]["ratio"] < 1e-8 for i in range(3))
    assert reference[1]["deep/out/kernel"]["ratio"] > 1e-3  # the last layers learn
    stop, offline = _fit("sigmoid_mlp", tmp_path)
    faults = _faults(stop.verdicts)
    # Judged at step 2: a variable low at its first step only could be a zero output
    # layer's first step.
    # (The weights that do not move are WeightUpdateRatio's too.)
    assert [(rule, step) for rule, step, _ in faults] == [("VanishingGradient", 2),
                                                          ("WeightUpdateRatio", 2)]
    named = {t for t in faults[0][2] if t.endswith("kernel")}
    assert vanished <= named and not named & alive, (named, kernels)
    assert _faults(offline) == faults


def test_a_zero_initialised_output_layer_is_not_a_vanishing_gradient(tmp_path):
    reference = _reference("zero_output")
    # At the first step every gradient but the output layer's is exactly 0 ...
    zero = {p for p, r in reference[0].items() if r["mean"] == 0.0}
    assert zero == {"h1/kernel", "h1/bias", "h2/kernel", "h2/bias"}
    # ... and from the second on, every one is far above the threshold.
    assert all(r["mean"] > 1e-6 for row in reference[1:] for r in row.values())
    stop, offline = _fit("zero_output", tmp_path)
    assert _faults(stop.verdicts) == [] == _faults(offline)
    assert int(stop.model.optimizer.iterations.numpy()) == STEPS


def test_a_tapped_zero_initialised_output_layer_is_not_all_zero(tmp_path):
    """With taps, the output of the zero layer is all zero at the first step only:
    AllZero (a default rule on activations) waits for the next step, as on gradients."""
    keras.utils.set_random_seed(0)
    model, x, y = _zero_output()
    assert not np.any(model(x[:BATCH]))  # the situation, before any step
    tapped = kerasdbg.insert_taps(model)
    tapped.compile(keras.optimizers.AdamW(1e-3), "mae")
    stop = StopOnRule(log_dir=str(tmp_path), verbose=False)
    tapped.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
               callbacks=[stop, *_recorders(tmp_path), ActivationStatistics(str(tmp_path))])
    assert np.any(model(x[:BATCH]))  # and not after it
    assert _faults(stop.verdicts) == []
    run = kerasdbg.load_run(str(tmp_path))
    out = run.scalars("activations/out_tap/zero_fraction").set_index("step").value
    assert out[1] == 1.0 and (out.loc[2:] < 1.0).all()
    present = recorded_pairs(run.tags())
    rules = [rule for rule in default_rules() if can_check(rule, present)]
    assert any(rule.name == "AllZero" for rule in rules)
    assert _faults(kerasdbg.check_run(run, rules)) == []


def test_a_large_embedding_table_a_batch_barely_touches_is_not_vanishing(tmp_path):
    reference = _reference("recommender")
    for row in reference:
        table = row["user_emb/embeddings"]
        # Over the whole table the mean |gradient| is below 1e-7 (the old rule fired),
        # over the rows the batch touched it is not, and Adam moves them.
        assert table["mean"] < 1e-7 < table["touched"]
        assert table["ratio"] > 1e-6
    stop, offline = _fit("recommender", tmp_path)
    assert _faults(stop.verdicts) == [] == _faults(offline)


def test_tiny_gradients_adam_still_turns_into_updates_are_not_vanishing(tmp_path):
    reference = _reference("instance_norm")
    kernels = [f"conv{k}/kernel" for k in range(4)]
    for row in reference:
        for kernel in kernels:
            # Below the threshold at every step, yet Adam moves the kernels.
            assert row[kernel]["mean"] < 1e-7 and row[kernel]["ratio"] > 1e-6, (kernel, row)
    stop, offline = _fit("instance_norm", tmp_path)
    assert _faults(stop.verdicts) == [] == _faults(offline)


def test_under_adamw_a_vanished_gradient_is_a_miss_online_and_offline(tmp_path):
    # Issue 32, review (a): the update ratio of a layer whose gradient vanished is
    # lr x wd under AdamW (decoupled weight decay), above update_threshold=1e-8, and
    # the ratio cannot prove that the gradient's part of the update is below it.
    reference = _reference("dead_under_adamw")
    dead = {"d0/kernel", "d0/bias", "d1/kernel", "d1/bias", "dead/kernel", "dead/bias",
            "out/kernel"}
    for row in reference:
        assert {p for p, r in row.items() if r["mean"] == 0.0} == dead
        for path in dead - {"d0/bias", "d1/bias", "dead/bias"}:  # zero biases stay zero
            # Decay alone: the ratio is lr x wd (up to float32 rounding in the step).
            np.testing.assert_allclose(row[path]["ratio"], LR * WD, atol=2.0 ** -24, rtol=0)
            assert row[path]["ratio"] > 1e-8
    stop, offline = _fit("dead_under_adamw", tmp_path)
    faults = _faults(stop.verdicts)
    assert [f for f in faults if f[0] == "VanishingGradient"] == []
    assert _faults(offline) == faults
    # The decay StopOnRule recorded is the one AdamW applied, read independently.
    events = kerasdbg.load_run(str(tmp_path)).scalars("step/weight_decay_fraction")
    np.testing.assert_allclose(events.value, LR * WD, rtol=1e-6)


def test_a_gradient_adamw_still_turns_into_updates_is_not_vanishing():
    # Issue 32, second review: |ratio - lr x wd| took updates of ~2e-7 of the
    # weights for none. Plain Adam and AdamW give the same (no) verdict.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = rng.normal(size=(256, 1)).astype("float32")
    found = {}
    for name in ("Adam", "AdamW"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, name="a",
                                                                         use_bias=False),
                                  keras.layers.Rescaling(2e-9), keras.layers.Dense(1, name="b")])
        optimizer = getattr(keras.optimizers, name)(1e-3)
        model.compile(optimizer, "mse")
        stop = StopOnRule([VanishingGradient()], action="warn", verbose=False)
        weights = WeightStatistics(every_n_steps=1, stats=["update_ratio"])
        grads = GradientStatistics(every_n_steps=1, stats=["mean_abs"])
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[stop, grads, weights])
        column = [c for c in weights.history.columns if c.endswith("a/kernel/update_ratio")][0]
        gradient = [c for c in grads.history.columns if c.endswith("a/kernel/mean_abs")][0]
        # Tiny gradients that Adam still turns into updates well above 1e-8.
        assert (grads.history[gradient].iloc[1:] < 1e-7).all()
        found[name] = (weights.history[column].iloc[1:].min(), stop.verdicts)
    assert found["Adam"][0] > 1e-8
    assert found["Adam"][1] == [] and found["AdamW"][1] == []


def test_healthy_tiny_gradients_under_adamw_are_not_vanishing(tmp_path):
    reference = _reference("instance_norm_adamw")
    for row in reference:
        for kernel in [f"conv{k}/kernel" for k in range(4)]:
            assert row[kernel]["mean"] < 1e-7 and row[kernel]["ratio"] > 1e-6, (kernel, row)
    stop, offline = _fit("instance_norm_adamw", tmp_path)
    assert _faults(stop.verdicts) == [] == _faults(offline)


def test_the_decay_is_added_to_the_update_ratio():
    low = {"gradients/m/a/kernel/mean_abs": 0.0, "gradients/m/a/kernel/zero_fraction": 1.0,
           "gradients/m/b/kernel/mean_abs": 0.0, "gradients/m/b/kernel/zero_fraction": 1.0}
    decayed = dict(low, **{"weights/m/a/kernel/update_ratio": 4e-6,
                           "weights/m/b/kernel/update_ratio": 4e-6})
    for decay in ({"step/weight_decay_fraction": 4e-6},
                  {"step/g_optimizer/weight_decay_fraction": 1e-6,
                   "step/d_optimizer/weight_decay_fraction": 4e-6}):
        # The decay hides what the gradient did: not judged still (a miss).
        rule = VanishingGradient()
        assert rule.check(1, dict(decayed, **decay)) is None  # the first step
        assert rule.check(2, dict(decayed, **decay)) is None
    # Where the ratio plus the decay (and float32's rounding, 2**-24) stays below
    # the threshold, the ratio proves it.
    small = dict(low, **{"weights/m/a/kernel/update_ratio": 2e-9,
                         "weights/m/b/kernel/update_ratio": 2e-9,
                         "step/weight_decay_fraction": 1e-9})
    rule = VanishingGradient(update_threshold=1e-6)
    assert rule.check(1, small) is None
    assert rule.check(2, small).tensors == ("m/a/kernel", "m/b/kernel")
    # The gradient moved the weights beyond the decay: not vanishing.
    rule = VanishingGradient()
    moved = dict(low, **{"weights/m/a/kernel/update_ratio": 4e-6 + 1e-6,
                         "weights/m/b/kernel/update_ratio": 4e-6 + 1e-6,
                         "step/weight_decay_fraction": 4e-6})
    assert rule.check(1, moved) is None and rule.check(2, moved) is None
    # Without the decay recorded, the ratio as recorded decides (a miss, never a guess).
    rule = VanishingGradient()
    assert rule.check(1, decayed) is None and rule.check(2, decayed) is None


def test_without_update_ratios_the_rule_does_not_judge(tmp_path, capsys):
    # Issue 32, review (c): offline, a run without update ratios (GradientStatistics
    # alone) was judged on the raw gradient, the test item 12 removed online.
    rule = VanishingGradient()
    low = {"gradients/m/a/kernel/mean_abs": 1e-9, "gradients/m/b/kernel/mean_abs": 0.1}
    assert rule.check(1, low) is None and rule.check(2, low) is None
    assert not rule.can_check({("gradients", "mean_abs"), ("gradients", "zero_fraction")})
    keras.utils.set_random_seed(0)
    model, x, y = _sigmoid_mlp()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientStatistics(str(tmp_path))])
    with pytest.raises(ValueError, match="holds gradients/<name>/mean_abs, "
                       "gradients/<name>/zero_fraction only, from which VanishingGradient "
                       "cannot judge"):
        kerasdbg.check_run(str(tmp_path), [VanishingGradient()])
    assert kerasdbg.check_run(str(tmp_path), default_rules(), skip_missing=True) == []
    # `kerasdbg check` (the default rules) says so.
    assert cli.main(["check", str(tmp_path)]) == 0
    said = capsys.readouterr().err
    assert "VanishingGradient cannot judge run 'train'" in said
    assert "VanishingGradient reads weights/<name>/update_ratio" in said


@pytest.mark.parametrize("kwargs, error, message", [
    ({"update_threshold": -1.0}, ValueError,
     "VanishingGradient: `update_threshold` must be a finite number >= 0"),
    ({"update_threshold": "small"}, TypeError,
     "VanishingGradient: `update_threshold` must be a number"),
], ids=["negative", "type"])
def test_bad_update_threshold(kwargs, error, message):
    with pytest.raises(error, match=message):
        VanishingGradient(**kwargs)


def test_config_round_trips():
    rule = VanishingGradient(threshold=1e-6, require="all", update_threshold=1e-7)
    assert VanishingGradient.from_config(rule.get_config()).get_config() == rule.get_config()
