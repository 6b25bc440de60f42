"""`kerasdbg report`: the HTML page, its plots and the summary, against GradientTape."""

import os
import re
import warnings

import keras
import numpy as np
import pytest

import kerasdbg
from kerasdbg import cli
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.report import NotARunError, write_report
from kerasdbg.rules import NonFiniteLoss, RuleWarning
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training

STEPS = len(X) // BATCH


def _record(log_dir, x=X):
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    initial = [v.numpy() for v in model.trainable_variables]
    paths = [v.path for v in model.trainable_variables]
    tapped = kerasdbg.insert_taps(model, layers=["hidden"])
    callbacks = [GradientStatistics(log_dir), WeightStatistics(log_dir, stats=["update_ratio"]),
                 ActivationStatistics(log_dir),
                 StopOnRule(NonFiniteLoss(), action="warn", log_dir=log_dir, verbose=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleWarning)
        tapped.fit(x, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    return initial, paths


def test_report_plots_and_summarizes_a_healthy_run(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    initial, paths = _record(log_dir)
    out = tmp_path / "report"
    assert cli.main(["report", log_dir, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert sorted(os.listdir(out)) == [
        "activation_health.png", "global_norm.png", "gradient_heatmap.png", "loss.png",
        "report.html", "update_ratios.png"]
    page = (out / "report.html").read_text()
    for name in ("loss.png", "gradient_heatmap.png", "update_ratios.png", "Rule verdicts"):
        assert name in page
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The order of the variables by mean gradient norm, from GradientTape.
    reference = reference_training(initial, STEPS)
    means = {p: np.mean([np.linalg.norm(r["grads"][i]) for r in reference])
             for i, p in enumerate(paths)}
    ranked = sorted(means, key=means.get)
    summary = printed.out
    assert f"steps recorded: {STEPS} (1-{STEPS})" in summary
    assert "first non-finite step: none" in summary
    largest = re.search(r"largest mean gradient norms:\s+(.*)", summary).group(1)
    assert [part.split(" (")[0] for part in largest.split(", ")] == ranked[::-1][:3]
    value = float(re.search(rf"{re.escape(ranked[-1])} \(([^)]+)\)", largest).group(1))
    assert value == pytest.approx(means[ranked[-1]], rel=1e-2)  # printed with 3 digits
    assert "rule verdicts: 0" in summary
    assert "7/7 read" in printed.err  # the progress bar


def test_report_names_the_first_non_finite_step_and_the_verdicts(tmp_path, capsys):
    log_dir = str(tmp_path / "logs")
    x = X.copy()
    x[3 * BATCH] = np.nan  # step 4
    _record(log_dir, x)
    page = write_report(log_dir)
    assert page == os.path.join(log_dir, "report", "report.html")
    text = open(page).read()
    # The hidden kernel's gradient is NaN: the weights are frozen and its source named.
    # The loss is NaN too where the CPU's kernels keep the NaN through the ReLU (Eigen),
    # and finite where they turn it into 0 (oneDNN's fused MatMul+BiasAdd+Relu): then
    # the freeze is reported by itself.
    assert re.search(r"(NonFiniteLoss|FreezeOnFault) at step 4", text)
    assert "NaNSource at step 4: the first layer whose output held NaN/Inf is" in text
    assert cli.main(["report", log_dir]) == 0
    summary = capsys.readouterr().out
    assert "first non-finite step: 4" in summary
    assert "rule verdicts: 2" in summary


def test_report_refuses_missing_empty_and_foreign_directories(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no TensorBoard event files" in capsys.readouterr().err
    foreign = str(tmp_path / "foreign")
    model = make_mlp()
    model.compile("sgd", "mse")
    model.fit(X, Y, batch_size=BATCH, verbose=0, callbacks=[keras.callbacks.TensorBoard(foreign)])
    assert cli.main(["report", foreign]) == 2
    err = capsys.readouterr().err
    assert "holds no kerasdbg tags" in err and "epoch_loss" in err
    assert cli.main(["report", foreign, "--run", "nope"]) == 2
    assert "has no run 'nope'. Runs: train" in capsys.readouterr().err
    with pytest.raises(NotARunError):
        write_report(str(tmp_path / "empty"))


def test_help_explains_each_command_with_an_example(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    for command in ("demo", "tags", "check", "report"):
        assert command in top
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert "Example: kerasdbg " + command in " ".join(capsys.readouterr().out.split())


def test_report_plots_the_epoch_logs_of_keras_tensorboard_callback(tmp_path):
    """Keras's epoch_loss (steps are epochs, from 0) beside kerasdbg's per-step tags;
    the values are those of Keras's History."""
    log_dir = str(tmp_path / "logs")
    model = make_mlp()
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", metrics=["mae"])
    history = model.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        validation_data=(X[:4], Y[:4]),
                        callbacks=[GradientStatistics(log_dir),
                                   keras.callbacks.TensorBoard(log_dir)])
    data = kerasdbg.report.collect(log_dir)
    epochs = data["epochs"]
    for run, tag, key in [("train", "epoch_loss", "loss"), ("train", "epoch_mae", "mae"),
                          ("validation", "epoch_loss", "val_loss"),
                          ("validation", "epoch_mae", "val_mae")]:
        rows = epochs[(epochs.run == run) & (epochs.tag == tag)].sort_values("step")
        assert rows.step.tolist() == [0, 1, 2]
        np.testing.assert_allclose(rows.value.to_numpy(), history.history[key], rtol=1e-6)
    page = write_report(log_dir)
    assert "epochs.png" in os.listdir(os.path.dirname(page))
    assert "Keras&#x27;s epoch logs" in open(page).read()
