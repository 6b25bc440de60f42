"""The kerasdbg command: demo (the README's main job) and tags."""

import contextlib
import io
import os
import re

import pytest

from kerasdbg import cli, load_run


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo, run once for this module: (output directory, what it printed)."""
    out = tmp_path_factory.mktemp("cli") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["demo", "--out", str(out), "--epochs", "1"]) == 0
    return out, printed.getvalue()


def test_demo_writes_both_runs_and_says_how_to_open_them(demo):
    out, printed = demo
    assert f"tensorboard --logdir {os.path.abspath(out)}" in printed
    assert "first step with a NaN gradient" in printed  # the diverging run
    assert "dead ReLU units at the last recorded step: conv1 " in printed
    for name in ("healthy", "lr_too_high"):
        run = load_run(str(out / name))
        assert "gradients/global_norm" in run.tags()
        assert run.tags("^weights/.*update_ratio$")
        assert run.tags(kind="histograms")
        assert "epoch_loss" in run.tags()  # Keras's TensorBoard callback, same dir
        assert "activations/conv1_tap/dead_fraction" in run.tags()
        assert "activations/dense_tap" in run.tags(kind="histograms")
        assert "step/loss" in run.tags()
        report = out / name / "report" / "report.html"
        assert f"report: {report}" in printed
        assert {"loss.png", "gradient_heatmap.png"} <= set(os.listdir(report.parent))
        # One epoch (--epochs 1): Keras's epoch logs are a table, not plots of single dots.
        assert 'class="epochs"' in report.read_text()


def test_demo_runs_the_healthy_run_to_its_end_and_a_rule_stops_the_other(demo):
    out, printed = demo
    healthy = load_run(str(out / "healthy"))
    assert healthy.steps("step/loss") == list(range(1, 28))  # 1728 samples / 64, one epoch
    assert healthy.tags(kind="text") == []
    assert "rules: none fired" in printed
    broken = load_run(str(out / "lr_too_high"))
    verdicts = broken.texts("rules/verdicts")
    # The dead-ReLU warning comes first; the NaN stops training at its step.
    match = re.search(r"rule: NonFiniteLoss at step (\d+)", printed)
    fault = int(match.group(1))
    assert int(re.search(r"rule: DeadReLU at step (\d+)", printed).group(1)) < fault
    assert f"rule: NaNSource at step {fault}: the first layer whose output held NaN/Inf is" \
        in printed
    assert f"stopped by StopOnRule after step {fault}" in printed
    assert broken.steps("step/loss") == list(range(1, fault + 1))
    assert verdicts.step.max() == fault
    # Each step's loss is written once, though both StopOnRules record it.
    assert len(broken.scalars("step/loss")) == fault


def test_tags_lists_and_reports_missing_dirs(demo, tmp_path, capsys):
    out, _ = demo
    assert cli.main(["tags", str(out / "healthy"), "--pattern", "global_norm"]) == 0
    assert capsys.readouterr().out.strip() == "gradients/global_norm"
    assert cli.main(["tags", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert cli.main(["demo", "--epochs", "0"]) == 2


def test_help_explains_each_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "demo" in text and "tags" in text and "example" in text.lower()
