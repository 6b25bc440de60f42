"""The kerasdbg command: demo (the README's main job) and tags."""

import os

import pytest

from kerasdbg import cli, load_run


def test_demo_writes_both_runs_and_says_how_to_open_them(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--epochs", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"tensorboard --logdir {os.path.abspath(out)}" in printed
    assert "first step with a NaN gradient" in printed  # the diverging run
    assert "dead ReLU units at the last recorded step: conv1 " in printed
    assert "rule: NonFiniteLoss at step" in printed and "rule: NaNSource at step" in printed
    for name in ("healthy", "lr_too_high"):
        run = load_run(str(out / name))
        assert "gradients/global_norm" in run.tags()
        assert run.tags("^weights/.*update_ratio$")
        assert run.tags(kind="histograms")
        assert "epoch_loss" in run.tags()  # Keras's TensorBoard callback, same dir
        assert "activations/conv1_tap/dead_fraction" in run.tags()
        assert "activations/dense_tap" in run.tags(kind="histograms")
        assert "step/loss" in run.tags()
    assert load_run(str(out / "lr_too_high")).tags(kind="text") == ["rules/verdicts"]


def test_tags_lists_and_reports_missing_dirs(tmp_path, capsys):
    out = tmp_path / "demo"
    cli.main(["demo", "--out", str(out), "--epochs", "1"])
    capsys.readouterr()
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
