"""kerasdbg's own TensorBoard dashboard (`kerasdbg.dashboard`): its data against
NumPy on the records, in a real TensorBoard server (with TensorFlow and
without), and as headless Chromium renders it."""

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg.callbacks import (
    ActivationStatistics, GradientStatistics, StopOnRule, WeightStatistics,
)
from kerasdbg.dashboard import DashboardPlugin, _data
from kerasdbg.reader import load_run
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp
from tests.tensorboard_server import NO_BROWSER, chromium, dump_dom, get, keep, screenshot
from tests.tensorboard_server import serve, wait_for

FAULT = 6
BROKEN, HEALTHY = "broken/train", "healthy/train"
STEPS, HEALTHY_STEPS = len(X) // BATCH, 8


def _fit(log_dir, x, steps):
    model = kerasdbg.insert_taps(make_mlp())
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    model.fit(x[:steps * BATCH], Y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[GradientStatistics(log_dir), WeightStatistics(log_dir),
                         ActivationStatistics(log_dir), StopOnRule(log_dir=log_dir,
                                                                   verbose=False)])


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Two runs under one log directory: `broken`, whose batch of step FAULT
    overflows the first layer's output to inf (StopOnRule freezes the model
    there and locates it), and `healthy`, the same model on finite batches."""
    log_dir = str(tmp_path_factory.mktemp("dashboard") / "logs")
    x = X.copy()
    x[(FAULT - 1) * BATCH] = 3e38  # finite input, infinite `hidden` output
    _fit(os.path.join(log_dir, "broken"), x, STEPS)
    _fit(os.path.join(log_dir, "healthy"), X, HEALTHY_STEPS)
    return log_dir


def _long(log_dir, run, pattern):
    rows = load_run(log_dir).scalars(pattern, run=run)
    return rows.drop_duplicates(["tag", "step"], keep="last")


def test_the_runs_are_listed_with_their_first_fault(logs):
    listed = {r["run"]: r for r in _data.runs(logs)}
    assert set(listed) == {BROKEN, HEALTHY}
    # StopOnRule acts at its next read: the frozen steps after the fault are recorded too.
    assert listed[BROKEN]["first_nonfinite"] == FAULT and listed[BROKEN]["steps"] == STEPS
    assert listed[HEALTHY]["first_nonfinite"] is None and listed[HEALTHY]["verdicts"] == 0


def test_the_layer_heatmap_is_the_records_combined_per_layer(logs):
    run = _data.run(logs, BROKEN)
    grads = run["heatmaps"]["gradient_norm"]
    assert [r.rsplit("/", 1)[-1] for r in grads["rows"]] == ["hidden", "out"]
    long = _long(logs, BROKEN, r"gradients/.*/l2_norm")
    for row, layer in zip(grads["values"], grads["rows"]):
        for step, cell in zip(grads["steps"], row):
            values = long[(long.step == step) & long.tag.str.startswith(
                f"gradients/{layer}/")].value.to_numpy()
            if not len(values):
                assert cell is None
                continue
            expected = np.sqrt(np.sum(values.astype(np.float64) ** 2))
            if np.isfinite(expected):
                np.testing.assert_allclose(cell, expected, rtol=1e-12)
            else:
                assert cell == ("nan" if np.isnan(expected) else "inf"), (layer, step, cell)
    # The fault's step is marked non-finite, the steps before are numbers.
    at = grads["steps"].index(FAULT)
    assert all(isinstance(row[at], str) for row in grads["values"])
    assert all(isinstance(v, float) for row in grads["values"] for v in row[:at])
    ratios = run["heatmaps"]["update_ratio"]
    long = _long(logs, BROKEN, r"weights/.*/update_ratio")
    for row, layer in zip(ratios["values"], ratios["rows"]):
        for step, cell in zip(ratios["steps"], row):
            values = long[(long.step == step) & long.tag.str.startswith(
                f"weights/{layer}/")].value.to_numpy()
            finite = values[np.isfinite(values)]
            if np.isnan(values).any():
                assert cell == "nan"
            elif len(finite):
                assert cell == pytest.approx(finite.max(), rel=1e-12)
    dead = run["heatmaps"]["dead_fraction"]
    long = _long(logs, BROKEN, r"activations/.*/dead_fraction")
    # The tap after the ReLU layer records its dead fraction; the one after the logits, none.
    assert dead["rows"] == sorted({t.split("/")[1] for t in long.tag}) == ["hidden_tap"]
    for row, tap in zip(dead["values"], dead["rows"]):
        mine = long[long.tag == f"activations/{tap}/dead_fraction"].set_index("step").value
        assert [s for s, v in zip(dead["steps"], row) if v is not None] == sorted(mine.index)
        for step, cell in zip(dead["steps"], row):
            if cell is not None and not isinstance(cell, str):
                assert cell == pytest.approx(mine[step], abs=0)


def test_the_headline_names_the_faulty_layer_and_step(logs):
    run = _data.run(logs, BROKEN)
    assert run["nan_source"] == {"layer": "hidden", "step": FAULT}
    assert run["first_nonfinite"] == FAULT
    assert run["headline"][0] == f"First NaN/Inf at step {FAULT}: layer 'hidden' (NaNSource)"
    assert any(v["rule"] == "NaNSource" and v["step"] == FAULT for v in run["verdicts"])
    loss = _long(logs, BROKEN, "step/loss").set_index("step").value
    assert run["loss"]["steps"] == sorted(loss.index)
    assert [v if isinstance(v, float) else np.nan for v in run["loss"]["values"]] == \
        pytest.approx([loss[s] if np.isfinite(loss[s]) else np.nan for s in sorted(loss.index)],
                      nan_ok=True)
    healthy = _data.run(logs, HEALTHY)
    assert healthy["headline"] == [f"No rule fired (StopOnRule ran at {HEALTHY_STEPS} steps)"]


def test_two_runs_are_compared_from_their_first_divergence(logs):
    result = _data.compare(logs, HEALTHY, BROKEN)
    # The same model, seed and batches until the broken run's batch FAULT.
    assert result["divergence"]["step"] == FAULT and result["divergence"]["kind"] == "value"
    assert result["divergence"]["tag"] == "step/loss"
    assert result["divergence"]["value_b"] in ("nan", "inf")
    assert set(result["loss"]) == {HEALTHY, BROKEN}


def test_a_model_at_resnet50_scale_is_grouped_by_layer_name(tmp_path):
    """ResNet50's variables (214, of 107 layers), recorded for 3 steps by the
    event writer: the rows are its layers, in at most 16 groups by name."""
    from kerasdbg.sinks import events as _events

    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    paths = [v.path for v in model.trainable_variables]
    writer = _events.EventWriter(str(tmp_path / "train"))
    rng = np.random.default_rng(0)
    for step in (1, 2, 3):
        writer.write(step, {f"gradients/{p}/l2_norm": float(rng.uniform(0.1, 2)) for p in paths})
    writer.flush()
    grads = _data.run(str(tmp_path), "train")["heatmaps"]["gradient_norm"]
    layers = list(dict.fromkeys(p.rsplit("/", 1)[0] for p in paths))
    assert sorted(grads["rows"]) == sorted(layers) and len(layers) > 100
    # Numbers by value: conv2's blocks, then conv3's, ..., the classifier last.
    assert grads["rows"].index("conv2_block3_3_conv") < grads["rows"].index("conv3_block1_1_conv")
    assert 2 <= len(grads["groups"]) <= _data.GROUP_LIMIT
    assert sorted(i for _, members in grads["groups"] for i in members) == list(range(len(layers)))
    assert any(name.startswith("conv2") for name, _ in grads["groups"])


def _raw(base, path):
    try:
        with urllib.request.urlopen(base + path, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_real_tensorboard_lists_the_plugin_and_serves_its_routes(logs, tmp_path):
    with serve(logs, run=BROKEN) as base:
        listing = get(base, "/data/plugins_listing")
        assert listing["kerasdbg"]["tab_name"] == "kerasdbg"
        assert listing["kerasdbg"]["loading_mechanism"]["module_path"] == \
            "/data/plugin/kerasdbg/index.js"
        assert get(base, "/data/plugin/kerasdbg/runs")["runs"] == _data.runs(logs)
        assert get(base, "/data/plugin/kerasdbg/run", run=BROKEN) == json.loads(
            json.dumps(_data.run(logs, BROKEN)))
        status, body = _raw(base, "/data/plugin/kerasdbg/run?run=nope")
        assert status == 400 and "nope" in body["error"] and BROKEN in body["error"]
        status, body = _raw(base, "/data/plugin/kerasdbg/run")
        assert status == 400 and "?run=" in body["error"]
        status, body = _raw(base, f"/data/plugin/kerasdbg/compare?a={HEALTHY}")
        assert status == 400 and "?a=<run>&b=<run>" in body["error"]
        status, body = _raw(base, f"/data/plugin/kerasdbg/compare?a=nope&b={HEALTHY}")
        assert status == 400 and "nope" in body["error"]
        assert get(base, "/data/plugin/kerasdbg/compare", a=HEALTHY, b=BROKEN)["divergence"][
            "step"] == FAULT
        with urllib.request.urlopen(base + "/data/plugin/kerasdbg/index.js", timeout=30) as r:
            assert "export async function render" in r.read().decode()
        browser = chromium()
        assert browser is not None, NO_BROWSER
        # The page TensorBoard loads in the tab's iframe, rendered: it names the fault.
        dom = dump_dom(browser, f"{base}/data/plugin_entry.html?name=kerasdbg",
                       tmp_path / "profile")
        text = re.sub(r"<[^>]+>", " ", dom)
        assert f"First NaN/Inf at step {FAULT}: layer 'hidden' (NaNSource)" in text, text[-3000:]
        assert f"First divergence at step {FAULT}" in text
        assert dom.count("<canvas") >= 6  # 3 heatmaps a run
        shot = tmp_path / "kerasdbg_dashboard.png"
        screenshot(browser, f"{base}/?darkMode=false#kerasdbg", shot, tmp_path / "profile2",
                   size=(1280, 1400))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        keep(shot)


def test_tensorboard_without_tensorflow_loads_the_plugin(logs):
    """TensorBoard where TensorFlow is not installed ("reduced feature set"):
    `import tensorflow` fails in the server's process."""
    with serve(logs, run=BROKEN, without_tensorflow=True) as base:
        assert "kerasdbg" in get(base, "/data/plugins_listing")
        wait_for(lambda: get(base, "/data/plugin/kerasdbg/runs")["runs"] == _data.runs(logs),
                 "kerasdbg's runs")


def test_the_plugin_is_inactive_without_kerasdbg_records(tmp_path):
    from tensorboard.plugins import base_plugin

    (tmp_path / "empty").mkdir()
    plugin = DashboardPlugin(base_plugin.TBContext(logdir=str(tmp_path / "empty")))
    assert not plugin.is_active()
    assert set(plugin.get_plugin_apps()) == {"/index.js", "/runs", "/run", "/compare"}
    assert plugin.frontend_metadata().es_module_path == "/index.js"


def test_the_plugin_imports_no_backend():
    """TensorBoard imports every plugin at its start: kerasdbg's must not
    import TensorFlow, JAX or Keras there."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, kerasdbg.dashboard; "
         "print(sorted(m for m in ('tensorflow', 'jax', 'keras') if m in sys.modules))"],
        capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out


def test_skipped_steps_and_rollbacks_are_marked(tmp_path):
    """A run whose faulty batch StopOnRule skipped (`action="skip"`), and one
    whose steps 2-3 were written again (a restart from a backup)."""
    from kerasdbg.sinks import events as _events

    skipped_dir = str(tmp_path / "skip")
    x = X.copy()
    x[(FAULT - 1) * BATCH] = 3e38
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    model.fit(x[:8 * BATCH], Y[:8 * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[GradientStatistics(skipped_dir),
                         StopOnRule(action="skip", log_dir=skipped_dir, verbose=False)])
    run = _data.run(skipped_dir, "train")
    recorded = load_run(skipped_dir).scalars(r"step/skipped(/.*)?", run="train")
    assert run["skipped"] == sorted(int(s) for s in recorded[recorded.value > 0].step) == [FAULT]
    assert f"1 step(s) skipped: {FAULT}" in run["headline"]
    resumed = str(tmp_path / "resumed")
    writer = _events.EventWriter(os.path.join(resumed, "train"))
    for step, loss in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (4, 40.0)]:
        writer.write(step, {"step/loss": loss, "gradients/m/d/kernel/l2_norm": loss})
    writer.flush()
    run = _data.run(resumed, "train")
    assert run["rollbacks"] == [2]
    assert run["loss"] == {"tag": "step/loss", "steps": [1, 2, 3, 4],
                           "values": [1.0, 20.0, 30.0, 40.0]}
    assert run["heatmaps"]["gradient_norm"]["values"] == [[1.0, 20.0, 30.0, 40.0]]
