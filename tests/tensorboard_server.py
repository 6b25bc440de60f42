"""A real TensorBoard server on 127.0.0.1 and a headless Chromium's screenshots
of it, for the dashboard tests of both backends (no TensorFlow or Keras here)."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

START_TIMEOUT_S = 90
LOAD_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(base, path, **query):
    """The JSON answer of the server's route `path`."""
    url = f"{base}{path}" + (("?" + urllib.parse.urlencode(query)) if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read().decode("utf-8"))


_WITHOUT_TENSORFLOW = (
    "import sys; sys.modules['tensorflow'] = None; "  # `import tensorflow` raises ImportError
    "from tensorboard.main import run_main; sys.argv[0] = 'tensorboard'; run_main()")


@contextlib.contextmanager
def serve(log_dir, load_fast="false", run="train", without_tensorflow=False):
    """`tensorboard --logdir` on 127.0.0.1 and a free port, with the Python
    loader (`load_fast="false"`) or the Rust data server ("true"), once it
    lists the scalars of `run`; with `without_tensorflow`, as where
    TensorFlow is not installed (its import fails in the server); stopped by
    its PID, then its process group (the data server)."""
    port = _free_port()
    command = ["-c", _WITHOUT_TENSORFLOW] if without_tensorflow else ["-m", "tensorboard.main"]
    process = subprocess.Popen(
        [sys.executable, *command, "--logdir", log_dir, "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", load_fast, "--reload_interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if run in get(base, "/data/plugin/scalars/tags"):
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


def wait_for(condition, what):
    """Polls `condition()` until true: the server reads the run's files in the
    background, a few events at a time."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while True:
        try:
            if condition():
                return
        except OSError:  # a tag not read yet: HTTP 400
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"tensorboard did not serve {what} within {LOAD_TIMEOUT_S} s")
        time.sleep(0.5)


def custom_scalars(base, run="train"):
    """What the Custom Scalars tab of `run` draws, asked of the plugin's own
    routes: `(layout, {category: {chart: its number of lines}}, {tag: its
    events})`."""
    layout = get(base, "/data/plugin/custom_scalars/layout")
    lines, served = {}, {}
    for category in layout["category"]:
        charts = lines.setdefault(category["title"], {})
        for chart in category["chart"]:
            for regex in chart["multiline"]["tag"]:
                tags = get(base, "/data/plugin/custom_scalars/scalars", run=run,
                           tag=regex)["tag_to_events"]
                served.update(tags)
                charts[chart["title"]] = charts.get(chart["title"], 0) + len(tags)
    return layout, lines, served


def chromium():
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


NO_BROWSER = ("no headless browser for the dashboard screenshots: `./run.sh test` installs "
              "Debian's `chromium` with apt-get when it can (as root or with sudo); install it "
              "by hand otherwise")


def screenshot(browser, url, shot, profile, size=(1280, 1500)):
    """Headless Chromium's screenshot of `url`, in its own process group,
    killed whole after it (nothing of the browser outlives the test)."""
    process = subprocess.Popen(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
         "--virtual-time-budget=15000", f"--screenshot={shot}", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        err = b"(no screenshot within 120 s)"
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # a renderer or zygote left behind
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]


def dump_dom(browser, url, profile) -> str:
    """The DOM headless Chromium holds once `url`'s scripts ran (their
    fetches included), in its own process group, killed whole after it."""
    process = subprocess.Popen(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
         "--virtual-time-budget=20000", "--dump-dom", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


def keep(shot):
    """Copies a screenshot to `$KERASDBG_SCREENSHOTS` when set (for the docs:
    `KERASDBG_SCREENSHOTS=docs/images ./run.sh test -k screenshot`)."""
    where = os.environ.get("KERASDBG_SCREENSHOTS")
    if where:
        os.makedirs(where, exist_ok=True)
        shutil.copy(shot, os.path.join(where, os.path.basename(str(shot))))
