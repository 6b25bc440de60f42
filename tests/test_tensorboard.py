"""The real TensorBoard server reads what kerasdbg writes: its HTTP data API and its dashboards."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings

import keras
import numpy as np
import pytest

from kerasdbg.callbacks import GradientStatistics, StopOnRule
from kerasdbg.rules import NonFiniteLoss, Rule, RuleWarning
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = len(X) // BATCH
FAULT = 6
START_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(base, path, **query):
    url = f"{base}{path}" + (("?" + urllib.parse.urlencode(query)) if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read().decode("utf-8"))


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        model.fit(X, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    healthy = make_mlp()
    healthy.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    healthy.fit(X[:HEALTHY_STEPS * BATCH], Y[:HEALTHY_STEPS * BATCH], batch_size=BATCH,
                verbose=0, callbacks=[StopOnRule(NonFiniteLoss(), verbose=False,
                                                 log_dir=os.path.join(log_dir, "healthy"))])
    reference = reference_training(initial, FAULT - 1)
    return log_dir, model, reference


@contextlib.contextmanager
def serve(log_dir, load_fast="false"):
    """`tensorboard --logdir` on 127.0.0.1 and a free port, with the Python
    loader (`load_fast="false"`) or the Rust data server ("true"); stopped by
    its PID, then its process group (the data server)."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", log_dir, "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", load_fast, "--reload_interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if "train" in _get(base, "/data/plugin/scalars/tags"):
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                output = process.stdout.read().decode(errors="replace")[-2000:] \
                    if process.poll() is not None else "(still running)"
                pytest.fail(f"tensorboard did not serve {log_dir} within {START_TIMEOUT_S}s: {output}")
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever outlived it
        process.stdout.close()


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
    healthy = _get(server, "/data/plugin/text/text", run="healthy/train", tag="rules/verdicts")
    assert [int(entry["step"]) for entry in healthy] == [HEALTHY_STEPS]
    assert (f"No verdict: NonFiniteLoss, FreezeOnFault, NaNSource ran over steps "
            f"1-{HEALTHY_STEPS} and none fired.") in healthy[0]["text"]


def _chromium():
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


@pytest.mark.parametrize("dashboard", ["scalars", "histograms"])
def test_dashboard_screenshot(server, tmp_path, dashboard):
    browser = _chromium()
    assert browser is not None, (
        "no headless browser for the dashboard screenshots: `./run.sh test` installs Debian's "
        "`chromium` with apt-get when it can (as root or with sudo); install it by hand otherwise")
    shot = tmp_path / f"tensorboard_{dashboard}.png"
    url = f"{server}/?darkMode=false#{dashboard}&tagFilter=global_norm%7Ckernel"
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
