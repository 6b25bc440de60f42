"""The front page on a JAX install without TensorFlow: `kerasdbg demo` and the
Python blocks of README.md and docs/index.md run as written there, in a fresh
interpreter where `import tensorflow` fails as on such an install (the JAX
run of the suite; tests/test_readme.py runs every document's blocks on
TensorFlow)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.blockers import WITHOUT_TENSORFLOW
from tests.test_readme import _blocks, _partial, _promised_output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCUMENTS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "index.md")]

# Run in the demo's directory, each block in a namespace of its own, its output kept.
SCRIPT = textwrap.dedent("""
    import contextlib, io, json, os, sys, traceback
    import kerasdbg
    from kerasdbg.demo import run_demo
    from kerasdbg import load_run

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_demo("runs/demo", epochs=1)
    out = {"demo": printed.getvalue(), "blocks": {},
           "tags": sorted(load_run("runs/demo/lr_too_high").tags("^epoch/"))}
    for name, code in json.load(open(sys.argv[1])):
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            out["blocks"][name] = {"printed": printed.getvalue()}
        except Exception:
            out["blocks"][name] = {"printed": printed.getvalue(),
                                   "error": traceback.format_exc()[-3000:]}
    out["tensorflow"] = sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow")
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("front_page")
    blocks = [(param.id, param.values[0]) for param in _blocks(DOCUMENTS)
              if _partial(param.values[0]) is None]
    listing = folder / "blocks.json"
    listing.write_text(json.dumps(blocks))
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", WITHOUT_TENSORFLOW + SCRIPT, str(listing)],
                            capture_output=True, text=True, cwd=folder, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return blocks, json.loads(line[len("RESULT "):]), folder


def test_the_demo_runs_without_tensorflow_and_records_the_learning_rate(ran):
    _, out, folder = ran
    assert out["tensorflow"] == []
    assert "rules: none fired" in out["demo"] and "stopped by StopOnRule" in out["demo"]
    assert {"epoch/learning_rate", "epoch/loss", "epoch/val_loss"} <= set(out["tags"])
    # The report weighs the broken run's learning rate (30, SGD) by it.
    report = re.search(r"report: (\S+lr_too_high\S+report\.html)", out["demo"]).group(1)
    with open(os.path.join(folder, report), encoding="utf-8") as page:
        assert "The learning rate of epoch 1 is 30, 300x above" in page.read()


def test_the_front_page_blocks_run_as_written_without_tensorflow(ran):
    blocks, out, _ = ran
    assert len(blocks) >= 5
    for name, code in blocks:
        result = out["blocks"][name]
        assert "error" not in result, f"{name} failed on JAX without TensorFlow:\n{result['error']}"
        lines = iter(result["printed"].splitlines())
        for promised in _promised_output(code):
            pattern = re.compile(".*".join(re.escape(part) for part in promised.split("...")))
            assert any(pattern.fullmatch(line) for line in lines), (
                f"{name} promises the output {promised!r}; JAX printed:\n{result['printed']}")


def test_stop_on_rule_records_each_epochs_learning_rate_quietly(tmp_path):
    """`epoch/learning_rate` at each epoch's end, a schedule's and a constant one
    (`tests.epoch_records`)."""
    from tests.epoch_records import check_learning_rates

    check_learning_rates(tmp_path)
