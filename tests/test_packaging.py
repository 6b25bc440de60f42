"""kerasdbg as users install it: the wheel and sdist that `python -m build`
makes, checked by `twine check --strict`, and the wheel installed into a
clean virtual environment (its dependencies from the package index) where
the demo runs.

The builds run on a copy of the files git knows (tracked, or untracked and
not ignored), so that the checkout's own `build/` and `*.egg-info` are
neither used nor touched.
"""

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def _run(command, *, cwd, timeout, env=None):
    result = subprocess.run(command, cwd=cwd, env=env, timeout=timeout,
                            capture_output=True, text=True)
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
        f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def _source_copy(destination):
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = os.path.join(ROOT, name)
        if not os.path.isfile(source):  # deleted in the working tree
            continue
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)
    return destination


def _build(source, outdir, *what):
    # --no-isolation: setuptools and wheel come from the test environment,
    # so that the build needs no download.
    _run([PYTHON, "-m", "build", "--no-isolation", *what, "--outdir", str(outdir), str(source)],
         cwd=source, timeout=300)


def _package_modules(names):
    return sorted(n for n in names if n.startswith("kerasdbg/") and n.endswith(".py"))


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist and the wheel of the current sources."""
    source = _source_copy(tmp_path_factory.mktemp("source"))
    outdir = tmp_path_factory.mktemp("dist")
    _build(source, outdir, "--sdist", "--wheel")
    (sdist,) = [os.path.join(outdir, n) for n in os.listdir(outdir) if n.endswith(".tar.gz")]
    (wheel,) = [os.path.join(outdir, n) for n in os.listdir(outdir) if n.endswith(".whl")]
    return {"sdist": sdist, "wheel": wheel, "source": source}


def test_twine_accepts_the_wheel_and_the_sdist(dist):
    output = _run([PYTHON, "-m", "twine", "check", "--strict", dist["sdist"], dist["wheel"]],
                  cwd=ROOT, timeout=120)
    assert output.count("PASSED") == 2, output


def test_the_wheel_holds_every_module_the_type_marker_and_the_metadata(dist):
    sources = _package_modules(
        os.path.relpath(os.path.join(d, f), dist["source"]).replace(os.sep, "/")
        for d, _, fs in os.walk(os.path.join(dist["source"], "kerasdbg")) for f in fs)
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = wheel.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(wheel.read(metadata_name))
        entry_points = wheel.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    assert _package_modules(names) == sources
    assert "kerasdbg/py.typed" in names
    assert not [n for n in names if n.startswith("tests/")], "the wheel carries the tests"
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names)
    assert metadata["Name"] == "kerasdbg"
    assert metadata["License"] == "Apache-2.0"
    requires = metadata.get_all("Requires-Dist")
    for needed in ("keras", "numpy", "tensorboard", "pandas", "matplotlib"):
        assert any(r.startswith(needed) for r in requires), (needed, requires)
    # TensorFlow comes with an extra, so that a user's own build is kept.
    assert any(r.startswith("tensorflow-cpu") and "extra ==" in r for r in requires), requires
    assert "kerasdbg = kerasdbg.cli:main" in entry_points
    # The TensorBoard dashboard: its plugin and the page's module.
    assert "[tensorboard_plugins]\nkerasdbg = kerasdbg.dashboard:DashboardPlugin" in entry_points
    assert "kerasdbg/dashboard/static/index.js" in names


def test_the_sdist_rebuilds_the_same_wheel_and_carries_the_project(dist, tmp_path):
    with tarfile.open(dist["sdist"]) as sdist:
        names = sdist.getnames()
        sdist.extractall(tmp_path, filter="data")
    (top,) = {n.split("/")[0] for n in names}
    for needed in ("README.md", "CHANGELOG.md", "LICENSE", "setup.cfg", "pyproject.toml",
                   "kerasdbg/py.typed", "tests/conftest.py", "docs/index.md", "run.sh"):
        assert f"{top}/{needed}" in names, f"the sdist lacks {needed}"
    outdir = tmp_path / "wheel"
    _build(tmp_path / top, outdir, "--wheel")
    (rebuilt,) = os.listdir(outdir)
    with zipfile.ZipFile(outdir / rebuilt) as again, zipfile.ZipFile(dist["wheel"]) as first:
        assert sorted(again.namelist()) == sorted(first.namelist())


def test_the_wheel_installs_into_a_clean_environment_and_runs_the_demo(dist, tmp_path):
    """Dependencies come from the package index (a few hundred MB the first
    time); the demo runs from outside the checkout, so it can only import the
    installed package."""
    venv = tmp_path / "venv"
    _run([PYTHON, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          f"{dist['wheel']}[cpu]"], cwd=tmp_path, timeout=900)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    where = _run([python, "-c", "import kerasdbg, os; print(os.path.dirname(kerasdbg.__file__))"],
                 cwd=tmp_path, timeout=120, env=env).strip()
    assert where.startswith(str(venv)), where
    assert os.path.exists(os.path.join(where, "py.typed"))
    output = _run([str(venv / "bin" / "kerasdbg"), "demo", "--out", "runs", "--epochs", "1"],
                  cwd=tmp_path, timeout=600, env=env)
    for run in ("healthy", "lr_too_high"):
        assert (tmp_path / "runs" / run).is_dir(), output
    assert "tensorboard --logdir" in output, output


_WITHOUT_TENSORFLOW = """
import contextlib, io, json, sys
import keras
import kerasdbg
import kerasdbg.layers
from kerasdbg import cli, load_run
from kerasdbg.errors import UnsupportedBackendError

try:
    import tensorflow  # noqa: F401
    raise SystemExit("TensorFlow is installed here")
except ModuleNotFoundError:
    pass
import numpy as np

# A tap records an eager call on JAX; what needs TensorFlow says so when made.
tap = kerasdbg.layers.TapLayer(stats=["max"])
tap(np.arange(6, dtype="float32").reshape(2, 3))
recorded = tap.latest
try:
    kerasdbg.layers.PrintLayer(printing="immediate")
    refused = ""
except UnsupportedBackendError as error:
    refused = str(error)
report = io.StringIO()
with contextlib.redirect_stdout(report):
    code = cli.main(["report", sys.argv[1]])
frame = load_run(sys.argv[1]).scalars("gradients/global_norm")
print(json.dumps({"backend": keras.config.backend(), "steps": frame["step"].tolist(),
                  "report": code, "refused": refused, "recorded": recorded,
                  "where": kerasdbg.__file__}))
"""


def test_the_wheel_with_the_jax_extra_installs_without_tensorflow_and_reads_runs(dist, tmp_path):
    """`pip install kerasdbg[jax]` into a clean environment: no TensorFlow
    comes with it; kerasdbg, a tap, `load_run` and `kerasdbg report` work
    there on a run recorded here (on TensorFlow)."""
    import keras
    import numpy as np

    from kerasdbg.callbacks import GradientStatistics

    log_dir = str(tmp_path / "logs")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, epochs=1, verbose=0,
              callbacks=[GradientStatistics(log_dir)])

    venv = tmp_path / "venv"
    _run([PYTHON, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          f"{dist['wheel']}[jax]"], cwd=tmp_path, timeout=900)
    installed = _run([python, "-m", "pip", "list", "--format=freeze"], cwd=tmp_path, timeout=120)
    names = {line.split("==")[0].lower() for line in installed.split()}
    assert not {n for n in names if n.startswith("tensorflow")} - {"tensorflow-io-gcs-filesystem"}
    assert {"jax", "jaxlib", "keras", "google-crc32c"} <= names, names
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["KERAS_BACKEND"] = "jax"
    import json

    out = json.loads(_run([python, "-c", _WITHOUT_TENSORFLOW, log_dir], cwd=tmp_path,
                          timeout=300, env=env).strip().splitlines()[-1])
    assert out["where"].startswith(str(venv)), out
    assert out["backend"] == "jax" and out["steps"] == [1, 2] and out["report"] == 0, out
    assert out["recorded"] == {"step": 1, "mode": "call", "max": 5.0}, out
    assert "printing='immediate' prints with tf.print" in out["refused"], out
