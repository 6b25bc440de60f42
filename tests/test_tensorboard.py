"""The real TensorBoard server reads what kerasdbg writes: its HTTP data API and its dashboards."""

import os
import re
import shutil
import subprocess
import warnings

import keras

import kerasdbg
import numpy as np
import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule
from kerasdbg.rules import NonFiniteLoss, Rule, RuleWarning
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training
from tests.tensorboard_server import NO_BROWSER, chromium as _chromium, get as _get, keep
from tests.tensorboard_server import custom_scalars, screenshot, serve, wait_for

STEPS = len(X) // BATCH
FAULT = 6
EARLY, HEALTHY_STEPS = 3, 3


class _FiresAt(Rule):
    """Fires at one step (a verdict before the fault's, in the same text)."""

    requires = (("step", "loss"),)

    def __init__(self, step):
        self.step = step

    def check(self, step, record):
        if step == self.step:
            return self.verdict(step, "the chosen step", {"step/loss": record["step/loss"]})
        return None

    def get_config(self):
        return {"step": self.step}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A run with a NaN batch at step FAULT (and a rule firing at step EARLY),
    its GradientTape reference, and a healthy run `healthy/train` of
    HEALTHY_STEPS steps under the same log directory."""
    log_dir = str(tmp_path_factory.mktemp("tb") / "logs")
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    initial = [v.numpy() for v in model.trainable_variables]
    y = Y.copy()
    y[(FAULT - 1) * BATCH] = np.inf
    callbacks = [GradientStatistics(log_dir, histogram_every_n_steps=2),
                 StopOnRule(NonFiniteLoss(), action="warn", log_dir=log_dir, verbose=False),
                 StopOnRule(_FiresAt(EARLY), action="warn", log_dir=log_dir, verbose=False)]
    # Read after every execution: the two StopOnRules write their verdicts at
    # the reads of their steps, in step order.
    kerasdbg.set_read_interval(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuleWarning)
            model.fit(X, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    finally:
        kerasdbg.set_read_interval(None)
    healthy = make_mlp()
    healthy.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    healthy.fit(X[:HEALTHY_STEPS * BATCH], Y[:HEALTHY_STEPS * BATCH], batch_size=BATCH,
                verbose=0, callbacks=[StopOnRule(NonFiniteLoss(), verbose=False,
                                                 log_dir=os.path.join(log_dir, "healthy"))])
    reference = reference_training(initial, FAULT - 1)
    return log_dir, model, reference


@pytest.fixture(scope="module")
def server(recorded):
    """The server of the recorded run."""
    with serve(recorded[0]) as base:
        yield base


def test_scalars_are_listed_and_served_with_reference_values(server, recorded):
    _, model, reference = recorded
    tags = _get(server, "/data/plugin/scalars/tags")["train"]
    kernel = model.trainable_variables[0].path
    for tag in ("gradients/global_norm", f"gradients/{kernel}/l2_norm", "step/loss"):
        assert tag in tags
    served = _get(server, "/data/plugin/scalars/scalars", run="train", tag="gradients/global_norm")
    steps = [int(step) for _, step, _ in served]
    assert steps == list(range(1, STEPS + 1))
    for _, step, value in served[: FAULT - 1]:
        grads = reference[step - 1]["grads"]
        expected = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))
        assert value == pytest.approx(expected, rel=1e-5)
    losses = {int(s): v for _, s, v in _get(server, "/data/plugin/scalars/scalars",
                                             run="train", tag="step/loss")}
    assert float(losses[FAULT]) == np.inf  # (served as the string "Infinity")


def test_histograms_are_listed_and_hold_every_element(server, recorded):
    _, model, reference = recorded
    kernel = model.trainable_variables[0].path
    assert f"gradients/{kernel}" in _get(server, "/data/plugin/histograms/tags")["train"]
    served = _get(server, "/data/plugin/histograms/histograms", run="train",
                  tag=f"gradients/{kernel}")
    by_step = {int(step): buckets for _, step, buckets in served}
    assert sorted(by_step)[:2] == [2, 4]
    buckets = by_step[2]  # [[left, right, count], ...]
    grad = reference[1]["grads"][0]
    assert sum(count for _, _, count in buckets) == pytest.approx(grad.size)
    assert buckets[0][0] == pytest.approx(grad.min(), rel=1e-5)
    assert buckets[-1][1] == pytest.approx(grad.max(), rel=1e-5)


def test_the_verdict_text_is_served_at_its_step(server):
    """Each write holds the run's verdicts so far in step order (TensorBoard
    shows the newest first: it reads top to bottom), as a list; a run whose
    rules ran and did not fire says so."""
    tags = _get(server, "/data/plugin/text/tags")
    assert "rules/verdicts" in tags["train"] and "rules/verdicts" in tags["healthy/train"]
    served = _get(server, "/data/plugin/text/text", run="train", tag="rules/verdicts")
    assert [int(entry["step"]) for entry in served] == [EARLY, FAULT]
    items = [re.findall(r"<li><strong>step (\d+) · (\w+)</strong>", entry["text"])
             for entry in served]
    assert items == [[(str(EARLY), "_FiresAt")],
                     [(str(EARLY), "_FiresAt"), (str(FAULT), "NonFiniteLoss"),
                      (str(FAULT), "NaNSource")]]
    assert "<table" not in served[-1]["text"]
    assert f"<strong>step {FAULT} · NonFiniteLoss</strong>: the loss is inf" in served[-1]["text"]
    # Its tensors on a line of their own: a list nested in the verdict's item.
    assert re.search(rf"<strong>step {FAULT} · NonFiniteLoss</strong>: the loss is inf\s*<ul>\s*"
                     r"<li>tensors: <code>step/loss</code></li>", served[-1]["text"]), \
        served[-1]["text"]
    healthy = _get(server, "/data/plugin/text/text", run="healthy/train", tag="rules/verdicts")
    assert [int(entry["step"]) for entry in healthy] == [HEALTHY_STEPS]
    assert (f"No verdict: NonFiniteLoss, FreezeOnFault, NaNSource ran over steps "
            f"1-{HEALTHY_STEPS} and none fired.") in healthy[0]["text"]


# The Custom Scalars tab of the run: chart -> its lines (the MLP's four
# variables are four groups of one, named by their paths without the model's).
EVERY = "every variable and tap"
CUSTOM_SCALARS = {
    "loss": {"loss": 1, "log10 loss": 1},
    "gradients": {"global norm": 1, "log10 global norm": 1,
                  "log10 largest l2 norm in each group of variables": 4,
                  "largest l2 norm in each group of variables": 4,
                  "log10 largest and smallest l2 norm of all variables": 2},
    EVERY: {"gradient l2 norm of every variable": 4},
}


def test_custom_scalars_draw_few_lines_each_with_reference_values(server, recorded, tmp_path):
    browser = _chromium()
    assert browser is not None, NO_BROWSER
    _, model, reference = recorded
    # A group's largest is written at every step (NaN once every norm is);
    # the log10 views are left out where their value is NaN.
    wait_for(lambda: len(_get(server, "/data/plugin/scalars/scalars", run="train",
                              tag="views/gradients/l2_norm/max/hidden/kernel")) == STEPS,
             "every step")
    layout, lines, served = custom_scalars(server)
    paths = [v.path for v in model.trainable_variables]
    norms = np.array([[np.linalg.norm(g.astype(np.float64)) for g in r["grads"]]
                      for r in reference[:FAULT - 1]])
    # A line per variable that held the largest (smallest) norm at a step
    # before the fault (the reference's steps).
    holders = {f"views/gradients/l2_norm/log10_largest/{paths[i]}" for i in norms.argmax(axis=1)} \
        | {f"views/gradients/l2_norm/log10_smallest/{paths[i]}" for i in norms.argmin(axis=1)}
    drawn = {tag for tag in served if "/log10_largest/" in tag or "/log10_smallest/" in tag}
    assert lines["gradients"].pop(
        "log10 largest and smallest l2 norm, by the variable holding it") == len(drawn)
    assert holders <= drawn
    # Any other line holds steps from the fault on only (no reference there).
    assert all(min(int(step) for _, step, _ in served[tag]) >= FAULT for tag in drawn - holders)
    assert lines == CUSTOM_SCALARS
    assert [c.get("closed", False) for c in layout["category"]] == [False, False, True]
    values = {tag: {int(step): float(v) for _, step, v in events}
              for tag, events in served.items()}
    groups = [v.path.partition("/")[2] for v in model.trainable_variables]  # hidden/kernel, ...
    for step in range(1, FAULT):
        expected = reference[step - 1]
        norms = np.array([np.linalg.norm(g.astype(np.float64)) for g in expected["grads"]])
        for group, norm in zip(groups, norms):
            assert values[f"views/gradients/l2_norm/max/{group}"][step] == pytest.approx(
                norm, rel=1e-5)
            assert values[f"views/gradients/l2_norm/log10_max/{group}"][step] == pytest.approx(
                np.log10(norm), abs=1e-5)
        for view, norm in [("log10_max", norms.max()), ("log10_min", norms.min())]:
            assert values[f"views/gradients/l2_norm/{view}"][step] == pytest.approx(
                np.log10(norm), abs=1e-5)
        for view, i in [("log10_largest", norms.argmax()), ("log10_smallest", norms.argmin())]:
            assert values[f"views/gradients/l2_norm/{view}/{paths[i]}"][step] == pytest.approx(
                np.log10(norms[i]), abs=1e-5)
        assert values["views/gradients/global_norm/log10"][step] == pytest.approx(
            np.log10(np.sqrt(np.sum(norms ** 2))), abs=1e-5)
        assert values["views/step/loss/log10"][step] == pytest.approx(
            np.log10(expected["loss"]), abs=1e-5)
    assert values["views/step/loss/log10"][FAULT] == np.inf  # the inf loss
    # The fault's NaN gradients: no log10 view draws NaN or -inf.
    logged = [v for tag, by_step in values.items() if "log10" in tag for v in by_step.values()]
    assert logged and not any(np.isnan(v) or v == -np.inf for v in logged)
    # At the fault, the output bias's gradient sums the inf target's -inf (its
    # norm is inf); the other norms are NaN (0 * inf after the ReLU): the only
    # norm known is inf, so the largest and the smallest are +inf.
    for view in ("log10_max", "log10_min", "log10_largest/sequential/out/bias",
                 "log10_smallest/sequential/out/bias"):
        assert values[f"views/gradients/l2_norm/{view}"].get(FAULT) == np.inf, view
    shot = tmp_path / "tensorboard_custom_scalars.png"
    screenshot(browser, f"{server}/?darkMode=false#custom_scalars", shot, tmp_path / "profile",
               size=(1280, 1600))
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page
    keep(shot)


@pytest.mark.parametrize("dashboard", ["scalars", "histograms", "text"])
def test_dashboard_screenshot(server, tmp_path, dashboard):
    browser = _chromium()
    assert browser is not None, (
        "no headless browser for the dashboard screenshots: `./run.sh test` installs Debian's "
        "`chromium` with apt-get when it can (as root or with sudo); install it by hand otherwise")
    shot = tmp_path / f"tensorboard_{dashboard}.png"
    url = f"{server}/?darkMode=false#{dashboard}" + (
        "" if dashboard == "text" else "&tagFilter=global_norm%7Ckernel")
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1280,860", "--virtual-time-budget=15000", f"--screenshot={shot}", url],
        capture_output=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page
    keep = os.environ.get("KERASDBG_SCREENSHOTS")
    if keep:  # for the docs: KERASDBG_SCREENSHOTS=docs/images ./run.sh test -k screenshot
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, os.path.join(keep, shot.name))
