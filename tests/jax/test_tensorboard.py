"""TensorBoard's Custom Scalars tab at ResNet50 scale, on JAX: a real
`keras.applications.ResNet50` (214 trainable variables, 49 taps) trained
three steps with kerasdbg's instruments, served by a real TensorBoard,
looked at in a headless Chromium. (On TensorFlow the instrumented ResNet50's
trace alone took 121 s on two CPU cores; on JAX its first step, compile
included, 80 s on two busy cores, the whole test about two minutes.)"""

import re
import warnings

import keras
import numpy as np
import pytest

from kerasdbg import insert_taps
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StepTimer
from kerasdbg.callbacks import StopOnRule, WeightStatistics
from kerasdbg.rules import DiagnosisWarning
from tests.tensorboard_server import NO_BROWSER, chromium, get, keep, screenshot, serve
from tests.tensorboard_server import custom_scalars, dump_dom, wait_for

STEPS, BATCH = 3, 4
# ResNet50's stages, by hand: the first part of each variable's and tap's name.
STAGES = ["conv1", "conv2", "conv3", "conv4", "conv5"]


def _stage(name):
    return re.split(r"[_/]", name)[0]


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("resnet") / "logs")
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=4)
    model = insert_taps(model, layers=r"_(relu|out)$")
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 4, STEPS * BATCH)
    grads, weights = GradientStatistics(log_dir), WeightStatistics(log_dir)
    callbacks = [grads, weights, ActivationStatistics(log_dir), StepTimer(log_dir),
                 StopOnRule(log_dir=log_dir, verbose=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DiagnosisWarning)  # a verdict is not what is tested
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
    return log_dir, model, grads, weights


def test_custom_scalars_at_resnet50_scale_draw_ten_lines_or_fewer(resnet_run, tmp_path):
    browser = chromium()
    assert browser is not None, NO_BROWSER
    log_dir, model, grads, weights = resnet_run
    paths = [v.path for v in model.trainable_variables]
    taps = [layer.name for layer in model.layers if layer.name.endswith("_tap")]
    assert (len(paths), len(taps)) == (214, 49)
    assert sorted({_stage(p) for p in paths}) == STAGES + ["predictions"]
    # Chart title -> its lines: every series of the run in six groups or fewer.
    expected = {
        "loss": 1, "log10 loss": 1, "global norm": 1, "log10 global norm": 1,
        "log10 largest l2 norm in each group of variables": 6,
        "largest l2 norm in each group of variables": 6,
        "log10 largest and smallest l2 norm of all variables": 2,
        "log10 largest update ratio in each group of variables": 6,
        "fraction of variables with update ratio above 0.01": 1,
        "largest weight l2 norm in each group of variables": 6,
        "largest dead / saturated fraction in each group of taps": 5,
        "seconds per execution and per step: input, compute": 4,
        "input fraction": 1, "examples per second": 1,
    }
    with serve(log_dir) as base:
        # The server reads the event file a few events at a time: a view of
        # each callback at every step.
        for tag in ("views/gradients/l2_norm/max/conv5", "views/step/loss/log10",
                    "views/weights/update_ratio/fraction_above_0.01", "time/step_seconds"):
            wait_for(lambda: len(get(base, "/data/plugin/scalars/scalars", run="train",
                                     tag=tag)) == STEPS, f"every step of {tag}")
        wait_for(lambda: len(get(base, "/data/plugin/custom_scalars/layout")["category"]) == 5,
                 "the whole layout")
        layout, by_category, served = custom_scalars(base)
        lines = {chart: n for charts in by_category.values() for chart, n in charts.items()}
        shot = tmp_path / "tensorboard_layout_resnet50.png"
        screenshot(browser, f"{base}/?darkMode=false#custom_scalars", shot, tmp_path / "profile",
                   size=(1280, 2400))
    assert [c["title"] for c in layout["category"]] == [
        "loss", "gradients", "weights", "activations", "timing"]
    # One line per variable that held the largest (smallest) gradient norm at
    # a step, from the per-variable records.
    every = grads.history.set_index("step")[[f"{p}/l2_norm" for p in paths]].to_numpy(np.float64)
    holders = {f"views/gradients/l2_norm/log10_largest/{paths[i]}" for i in every.argmax(axis=1)} \
        | {f"views/gradients/l2_norm/log10_smallest/{paths[i]}"
           for i in np.where(every > 0, every, np.inf).argmin(axis=1)}
    expected["log10 largest and smallest l2 norm, by the variable holding it"] = len(holders)
    assert lines == expected
    assert holders <= set(served)
    held = {tag for tag in served if "/log10_largest/" in tag or "/log10_smallest/" in tag}
    short = {tag: [int(step) for _, step, _ in events] for tag, events in served.items()
             if tag not in held and len(events) != STEPS}
    assert not short, short
    assert sum(len(served[tag]) for tag in held) == 2 * STEPS  # one largest, one smallest a step
    # The groups' largest gradient norm and update ratio, against NumPy on
    # the per-variable records.
    history = grads.history.set_index("step")
    ratios = weights.history.set_index("step")
    for stage in STAGES + ["predictions"]:
        members = [p for p in paths if _stage(p) == stage]
        norms = history[[f"{p}/l2_norm" for p in members]].to_numpy(np.float64).max(axis=1)
        drawn = [float(v) for _, _, v in served[f"views/gradients/l2_norm/max/{stage}"]]
        np.testing.assert_allclose(drawn, norms, rtol=1e-6)
        # The largest finite ratio (a zero-initialised bias or beta: inf at step 1).
        members = ratios[[f"{p}/update_ratio" for p in members]].to_numpy(np.float64)
        largest = np.where(np.isfinite(members), members, -np.inf).max(axis=1)
        drawn = [float(v) for _, _, v in served[f"views/weights/update_ratio/log10_max/{stage}"]]
        np.testing.assert_allclose(drawn, np.log10(largest), rtol=1e-6)
    every = history[[f"{p}/l2_norm" for p in paths]].to_numpy(np.float64)
    nonzero = np.where(every > 0, every, np.inf)  # the smallest is the smallest nonzero norm
    for view, expected_values in [("log10_max", every.max(axis=1)),
                                  ("log10_min", nonzero.min(axis=1))]:
        drawn = [float(v) for _, _, v in served[f"views/gradients/l2_norm/{view}"]]
        np.testing.assert_allclose(drawn, np.log10(expected_values), rtol=1e-6)
    for view, held in [("log10_largest", every.argmax(axis=1)),
                       ("log10_smallest", nonzero.argmin(axis=1))]:
        for step, i in enumerate(held, start=1):
            tag = f"views/gradients/l2_norm/{view}/{paths[i]}"
            drawn = {int(s): float(v) for _, s, v in served[tag]}
            assert drawn[step] == pytest.approx(np.log10(every[step - 1, i]), rel=1e-6)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page
    keep(shot)


def test_kerasdbg_s_dashboard_at_resnet50_scale_groups_its_layers(resnet_run, tmp_path):
    """kerasdbg's own TensorBoard tab on the same run: a row per layer (the
    root of the sum of its variables' squared gradient norms, from the
    records), in at most 16 groups by name, each expandable in the page."""
    from kerasdbg.dashboard import _data
    from kerasdbg.reader import load_run

    browser = chromium()
    assert browser is not None, NO_BROWSER
    log_dir, model, grads, weights = resnet_run
    run = _data.run(log_dir, "train")
    heatmap = run["heatmaps"]["gradient_norm"]
    layers = {p.rsplit("/", 1)[0] for p in (v.path for v in model.trainable_variables)}
    assert sorted(heatmap["rows"]) == sorted(layers) and len(layers) == 107
    assert heatmap["steps"] == list(range(1, STEPS + 1))
    assert 2 <= len(heatmap["groups"]) <= _data.GROUP_LIMIT
    long = load_run(log_dir).scalars(r"gradients/.*/l2_norm", run="train")
    for layer in ("conv1_conv", "conv3_block2_2_bn", "predictions"):
        row = heatmap["values"][heatmap["rows"].index(layer)]
        for step, cell in zip(heatmap["steps"], row):
            mine = long[(long.step == step) & long.tag.str.startswith(f"gradients/{layer}/")]
            assert len(mine) == 2  # a kernel or gamma, and a bias or beta
            np.testing.assert_allclose(cell, np.sqrt(np.sum(mine.value.to_numpy() ** 2)),
                                       rtol=1e-12)
    with serve(log_dir) as base:
        assert "kerasdbg" in get(base, "/data/plugins_listing")
        dom = dump_dom(browser, f"{base}/data/plugin_entry.html?name=kerasdbg",
                       tmp_path / "profile")
    groups = re.findall(r'<details class="group"><summary>([^<]+)<', dom)
    # Each heatmap of layers or taps in its groups, each group named with its size.
    assert [g for g in groups[:len(heatmap["groups"])]] == [
        f"{name} ({len(members)})" for name, members in heatmap["groups"]]
