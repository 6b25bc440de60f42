"""The kerasdbg command: demo (the README's main job) and tags."""

import contextlib
import io
import os
import re

import pytest

from kerasdbg import cli, load_run
from kerasdbg.sinks import events as _events
from tests.mounts import tmpfs


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
    # The command comparing its two runs, as the user copies it.
    assert (f"kerasdbg report {os.path.abspath(out / 'healthy')} "
            f"{os.path.abspath(out / 'lr_too_high')}\n") in printed
    assert "first step with a NaN gradient" in printed  # the diverging run
    # The report's medians, by NumPy on the records: before the first step whose global
    # norm grew more than 10x, or the first non-finite one.
    import numpy as np

    assert "mean gradient norm" not in printed
    broken = load_run(str(out / "lr_too_high"))
    norms = broken.scalar_table(r"gradients/.*/l2_norm")
    total = broken.scalar_table("gradients/global_norm")["gradients/global_norm"]
    counts = broken.scalar_table(r"gradients/.*/nan_count").to_numpy().sum(axis=1)
    finite = total[np.isfinite(total.to_numpy())]
    grew = finite.index[1:][finite.to_numpy()[1:] / finite.to_numpy()[:-1] > 10]
    end = min(list(grew[:1]) + list(total.index[counts > 0][:1]))
    medians = np.median(norms[norms.index < end].to_numpy(), axis=0)
    top = norms.columns[np.argmax(medians)][len("gradients/"):-len("/l2_norm")]
    assert re.search(rf"largest median gradient norm \(steps? 1(-{end - 1})?, before [^\n]*\):  "
                     rf"{re.escape(top)} \({medians.max():.3g}\)\n", printed), printed
    assert "dead ReLU units at the last recorded step: conv1 " in printed
    for name in ("healthy", "lr_too_high"):
        run = load_run(str(out / name))
        assert "gradients/global_norm" in run.tags()
        assert not run.tags("^views/")  # TensorBoard's chart views are not records
        assert run.tags("^weights/.*update_ratio$")
        assert run.tags(kind="histograms")
        # Keras's epoch logs and the learning rate, by StopOnRule (no TensorFlow needed).
        assert {"epoch/loss", "epoch/val_loss", "epoch/learning_rate"} <= set(run.tags())
        assert not run.tags("^epoch_")  # no Keras TensorBoard callback
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
    # Both StopOnRules ran and neither fired: the run's last text says so.
    from kerasdbg.records.verdicts import no_verdict, verdict_rows

    last = healthy.texts("rules/verdicts").text.iloc[-1]
    assert verdict_rows(last) == [] and len(no_verdict(last)) == 2, last
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


def test_the_command_says_nothing_of_tensorflows_start_up(tmp_path):
    """The installed `kerasdbg` entry point, in a fresh process with no
    TF_CPP_MIN_LOG_LEVEL set: stderr holds what the command says, none of the
    lines TensorFlow's C++ writes as it loads (absl, oneDNN, CPU features;
    `check` loads TensorFlow, Keras's backend, as every command does)."""
    import shutil
    import subprocess
    import sys

    _log_dir(tmp_path)
    command = shutil.which("kerasdbg", path=os.path.dirname(sys.executable))
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([command, "check", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.stderr.splitlines() == ["kerasdbg check: 0 of 1 rules fired"], done.stderr


# ------------------------------------------------- directories that are not a run
def _log_dir(path, steps=(1, 2)):
    """A log directory of one `train` run holding a few kerasdbg values."""
    writer = _events.EventWriter(os.path.join(str(path), "train"))
    for step in steps:
        writer.write(step, {"gradients/global_norm": float(step), "step/loss": 1.0 / step})
    writer.close()
    return str(path)


def _error(capsys, argv):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()[-1]


def test_check_says_what_report_says_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    parent = tmp_path / "parent"  # a directory of log directories
    _log_dir(parent / "a")
    _log_dir(parent / "b")
    started = tmp_path / "started"  # a run whose process died before its first step was written
    _events.EventWriter(str(started / "train")).close()
    for directory, message in [
        (empty, "holds no TensorBoard event files; give the log_dir of the kerasdbg callbacks"),
        (parent, f"has no run 'train'. Runs: a/train, b/train. It holds the log directories "
                 f"{parent / 'a'}, {parent / 'b'}: give one of them."),
        (started, "holds no values yet: its event files hold no step (a fit that has just "
                  "started, or a process killed before its first steps were written)"),
    ]:
        check = _error(capsys, ["check", str(directory)])
        report = _error(capsys, ["report", str(directory), "--out", str(tmp_path / "out")])
        assert check[0] == report[0] == 2, directory
        assert message in check[1] and check[1].startswith("kerasdbg check: "), check
        assert check[1].replace("kerasdbg check: ", "") == \
            report[1].replace("kerasdbg report: ", ""), directory
        assert "must hold at least one rule" not in check[1]


def test_tags_exits_2_on_the_mistakes_the_other_commands_exit_2_on(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, message = _error(capsys, ["tags", str(tmp_path / "empty")])
    assert code == 2 and "holds no TensorBoard event files" in message
    code, message = _error(capsys, ["tags", str(tmp_path / "missing")])
    assert code == 2 and "`log_dir` is not a directory" in message
    log_dir = _log_dir(tmp_path / "run")
    code, message = _error(capsys, ["tags", log_dir, "--pattern", "^nope"])
    assert code == 2 and message == (f"kerasdbg tags: no scalars tags matching '^nope' in "
                                     f"{log_dir!r}. Runs: train")
    code, message = _error(capsys, ["tags", log_dir, "--kind", "histograms"])
    assert code == 2 and "no histograms tags in" in message
    assert cli.main(["tags", log_dir]) == 0
    assert capsys.readouterr().out.split() == ["gradients/global_norm", "step/loss"]


def test_demo_refuses_an_out_it_cannot_write_in_one_line_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    with tmpfs(str(tmp_path / "read_only"), size="64k", read_only=True) as read_only:
        for out, cause in [(str(afile / "demo"), "Not a directory"),
                           (os.path.join(read_only, "demo"), "Read-only file system")]:
            assert cli.main(["demo", "--out", out]) == 2
            captured = capsys.readouterr()
            assert captured.out == ""  # nothing trained
            assert captured.err == (f"kerasdbg demo: run_demo: `out` must be a directory it can "
                                    f"write in ({cause}). Received: out={out!r}\n")


def test_check_and_report_name_the_other_runs_that_hold_kerasdbg_tags(tmp_path, capsys):
    """Another training in the same directory is a run of its own (`train-2`)."""
    writer = _events.EventWriter(str(tmp_path / "train"))
    writer.write(0, {"epoch_loss": 0.5})  # Keras's TensorBoard callback alone
    writer.close()
    writer = _events.EventWriter(str(tmp_path / "train-2"))
    writer.write(1, {"gradients/global_norm": 1.0, "step/loss": 0.5})
    writer.close()
    for command in ("check", "report"):
        code, message = _error(capsys, [command, str(tmp_path), "--run", "train"])
        assert code == 2 and message.endswith(
            "holds no kerasdbg tags (gradients/, weights/, activations/, step/, epoch/). Its "
            "tags: epoch_loss. Runs with kerasdbg tags: train-2."), message
    assert cli.main(["check", str(tmp_path), "--run", "train-2"]) in (0, 1)


def test_check_gives_the_verdicts_stop_on_rule_gave_during_the_demo(demo, capsys):
    """One verdict per run: `kerasdbg check` (the default rules) says what the demo's
    StopOnRules (the same default rules) wrote to TensorBoard, step for step, and
    nothing on the healthy run."""
    from kerasdbg.records import verdict_rows

    out, _ = demo
    assert cli.main(["check", str(out / "healthy")]) == 0
    said = capsys.readouterr()
    assert said.out == "" and " 0 of " in said.err
    broken = load_run(str(out / "lr_too_high"))
    # The last write holds every verdict of the run.
    online = sorted((row["step"], row["rule"], row["reason"], row["severity"])
                    for row in verdict_rows(broken.texts("rules/verdicts").text.iloc[-1]))
    assert cli.main(["check", str(out / "lr_too_high")]) == 1
    printed = capsys.readouterr().out.splitlines()
    # A line per fault; the information notes, if any, in one line after them.
    faults = [line for line in printed if not line.startswith("(info) ")]
    assert printed[:len(faults)] == faults
    offline = sorted((int(m.group(2)), m.group(1), m.group(0))
                     for m in (re.fullmatch(r"(\w+) at step (\d+): .*", line) for line in faults))
    assert offline == [(step, rule, reason) for step, rule, reason, severity in online
                       if severity == "fault"]
    noted = {rule for _, rule, _, severity in online if severity == "info"}
    assert len(printed) - len(faults) == (1 if noted else 0), printed
    if noted:
        assert printed[-1].startswith("(info) information, not faults (")
        assert {rule for rule in noted if f" {rule}, at step" not in printed[-1]} == set()
    assert {"NonFiniteLoss", "NaNSource"} <= {rule for _, rule, _, _ in online}


def test_check_says_the_information_notes_in_one_line_after_the_faults(tmp_path, capsys):
    """Six biases zero by construction (a gradient 1e9 times below their
    kernel's, never moved, as before a BatchNormalization) and a NaN loss at
    step 3: the fault in its line, the notes gathered in one, as a fit ends."""
    writer = _events.EventWriter(str(tmp_path / "train"))
    layers = [f"c{i}" for i in range(1, 7)]
    for step in (1, 2, 3):
        values = {"step/loss": 1.0 / step if step < 3 else float("nan")}
        for layer in layers:
            values.update({f"gradients/m/{layer}/kernel/mean_abs": 0.01,
                           f"gradients/m/{layer}/bias/mean_abs": 1e-11,
                           f"weights/m/{layer}/kernel/update_ratio": 1e-3,
                           f"weights/m/{layer}/bias/update_ratio": 0.0})
        writer.write(step, values)
    writer.close()
    assert cli.main(["check", str(tmp_path), "--rule", "VanishingGradient",
                     "--rule", "NonFiniteLoss"]) == 1
    said = capsys.readouterr()
    assert said.out.splitlines() == [
        "NonFiniteLoss at step 3: the loss is nan",
        "(info) information, not faults (6 tensors): VanishingGradient, at step 1: zero by "
        "construction: m/c1/bias, m/c2/bias, m/c3/bias, m/c4/bias, m/c5/bias and 1 more"]
    assert said.err.splitlines() == ["kerasdbg check: 1 of 2 rules fired (NonFiniteLoss)"]


def test_the_demo_run_again_in_the_same_out_reports_its_own_training(tmp_path):
    """Another training in a used log directory is a run of its own (`train-2`)."""
    from kerasdbg.demo import new_run

    log_dir = str(tmp_path / "healthy")
    before = []
    assert new_run(log_dir, before) == "train"
    _log_dir(log_dir)  # the first demo
    before = load_run(log_dir).runs
    assert new_run(log_dir, before) == "train"  # nothing new yet
    writer = _events.EventWriter(os.path.join(log_dir, "train-2"))  # the second one
    writer.write(1, {"gradients/global_norm": 2.0})
    writer.close()
    assert new_run(log_dir, before) == "train-2"


def test_check_and_report_say_which_training_they_read_when_there_are_several(tmp_path, capsys):
    for run in ("train", "train-2"):
        writer = _events.EventWriter(str(tmp_path / run))
        writer.write(1, {"gradients/global_norm": 1.0, "step/loss": 0.5})
        writer.close()
    note = (f"{str(tmp_path)!r} holds other trainings as runs of their own: train-2 "
            "(--run train-2); this is run 'train'")
    assert cli.main(["check", str(tmp_path)]) in (0, 1)
    assert f"kerasdbg check: {note}" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    assert f"kerasdbg report: {note}" in capsys.readouterr().err
    assert cli.main(["check", str(tmp_path), "--run", "train-2"]) in (0, 1)
    assert "this is run 'train-2'" in capsys.readouterr().err


def test_report_of_the_demo_says_what_to_try_and_compares_its_two_runs(demo, capsys):
    """`report HEALTHY LR_TOO_HIGH` names the first step where their loss or global
    norm part (NumPy on the records); the broken run's report says the learning
    rate is far above the usual ranges and what the records hold around the NaN."""
    import html

    import numpy as np

    out, _ = demo
    healthy, broken = load_run(str(out / "healthy")), load_run(str(out / "lr_too_high"))

    def series(run, tag):
        rows = run.scalars(tag).drop_duplicates("step", keep="last")
        return dict(zip(rows.step, rows.value))

    expected = None
    for tag in ("step/loss", "gradients/global_norm"):
        a, b = series(healthy, tag), series(broken, tag)
        for step in sorted(set(a) & set(b)):
            x, y = a[step], b[step]
            if np.isfinite(x) != np.isfinite(y) or (
                    np.isfinite(x) and abs(x - y) > 1e-2 * max(abs(x), abs(y))):
                expected = min(expected or step, step)
                break
    assert expected is not None
    assert cli.main(["report", str(out / "healthy"), str(out / "lr_too_high"),
                     "--out", str(out / "compare")]) == 0
    printed = capsys.readouterr().out
    assert f"first divergence: step {expected}, " in printed
    steps = healthy.steps("step/fault")
    assert f"verdicts of healthy: none (StopOnRule ran its rules at steps 1-{steps[-1]})" \
        in printed
    page = (out / "compare" / "compare.html").read_text()
    assert f"First at step {expected}:" in page and "Verdicts of lr_too_high" in page

    report = html.unescape((out / "lr_too_high" / "report" / "report.html").read_text())
    rate = broken.scalars("epoch/learning_rate").value.iloc[-1]
    assert rate == 30.0  # the demo's SGD, by StopOnRule
    assert (f"The learning rate of epoch 1 is {rate:g}, {rate / 0.1:.0f}x above the usual range "
            "for SGD (0.001-0.1)") in report
    assert "lower the learning rate (by 10x to start with)" in report
    # The NaN's layer: its kernel's gradient norm at the step before, as recorded.
    layer = re.search(r"first layer whose output held NaN/Inf is '([^']+)'", report).group(1)
    fault = int(re.search(r"NaNSource at step (\d+)", report).group(1))
    (tag,) = broken.tags(rf"^gradients/.*/{layer}/kernel/l2_norm$")
    norm = series(broken, tag)[fault - 1]
    assert f"{tag[len('gradients/'):-len('/l2_norm')]} at step {fault - 1}: gradient norm " \
           f"{norm:.3g}" in report

    # The comparison as a browser draws it (kept for the docs: KERASDBG_SCREENSHOTS).
    from PIL import Image

    from tests.tensorboard_server import NO_BROWSER, chromium
    from tests.test_report import _screenshot

    browser = chromium()
    assert browser is not None, NO_BROWSER
    shot = out / "compare.png"
    _screenshot(browser, str(out / "compare" / "compare.html"), shot, out / "chromium-profile")
    with Image.open(shot) as image:
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
        assert len(np.unique(pixels, axis=0)) > 200  # the plots' lines, not a blank page
        keep = os.environ.get("KERASDBG_SCREENSHOTS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            image.crop((0, 0, 1280, 1900)).convert("RGB").quantize(256).save(
                os.path.join(keep, "compare.png"), optimize=True)


def test_the_dashboard_names_the_demo_s_faulty_layer_and_step(demo, tmp_path):
    """kerasdbg's TensorBoard tab on the demo's runs, rendered by headless
    Chromium: the broken run's headline names the layer and the step its
    records give (`faults/nan_source/layer/<layer>`)."""
    from tests.tensorboard_server import NO_BROWSER, chromium, dump_dom, serve

    out, _ = demo
    broken = "lr_too_high/train"
    located = load_run(str(out)).scalars(r"faults/nan_source/layer/.*", run=broken)
    assert len(located) == 1
    layer, step = located.tag.iloc[0].rsplit("/", 1)[-1], int(located.step.iloc[0])
    browser = chromium()
    assert browser is not None, NO_BROWSER
    with serve(str(out), run=broken) as base:
        dom = dump_dom(browser, f"{base}/data/plugin_entry.html?name=kerasdbg",
                       tmp_path / "profile")
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    assert f"First NaN/Inf at step {step}: layer '{layer}' (NaNSource)" in text, text[-2000:]
    assert "healthy/train" in text and "No rule fired" in text
