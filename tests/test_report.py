"""`kerasdbg report`: the HTML page, its plots and the summary, against GradientTape."""

import html
import html.parser
import os
import re
import signal
import subprocess
import warnings

import keras
import numpy as np
import pytest
from PIL import Image

import kerasdbg
from kerasdbg import cli
from kerasdbg.sinks import events as _events
from kerasdbg.callbacks import ActivationStatistics, GradientStatistics, StopOnRule
from kerasdbg.callbacks import WeightStatistics
from kerasdbg.report import NotARunError, write_report
from kerasdbg.rules import NonFiniteLoss, RuleWarning
from tests.helpers import BATCH, LEARNING_RATE, X, Y, make_mlp, reference_training
from tests.mounts import tmpfs
from tests.test_tensorboard import _chromium

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
    # The order of the variables by median gradient norm, from GradientTape.
    reference = reference_training(initial, STEPS)
    medians = {p: np.median([np.linalg.norm(r["grads"][i]) for r in reference])
               for i, p in enumerate(paths)}
    ranked = sorted(medians, key=medians.get)
    summary = printed.out
    assert summary.startswith("run logs (")  # the run's directory, as the user named it
    assert f"steps recorded: {STEPS} (1-{STEPS})" in summary
    assert "first non-finite step: none" in summary
    largest = re.search(r"largest median gradient norms:\s+(.*)", summary).group(1)
    assert [part.split(" (")[0] for part in largest.split(", ")] == ranked[::-1][:3]
    value = float(re.search(rf"{re.escape(ranked[-1])} \(([^)]+)\)", largest).group(1))
    assert value == pytest.approx(medians[ranked[-1]], rel=1e-2)  # printed with 3 digits
    # StopOnRule ran (its records) and nothing fired: said, not "none recorded".
    ran = kerasdbg.load_run(log_dir).steps("step/fault")
    assert ran == list(range(1, STEPS + 1))
    said = f"StopOnRule ran its rules at steps 1-{STEPS}"
    assert f"rule verdicts: 0 ({said}: none fired)" in summary
    assert f"No rule fired: {said}" in page and "None recorded" not in page
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
    parsed = _Page()
    parsed.feed(text)
    rows = [[c["text"] for c in r] for r in parsed.tables["verdicts"][1:]]
    assert len(rows) == 2 and "NaNSource" in [r[0] for r in rows]
    assert all(r[1] == "4" and r[3].startswith(f"{r[0]} at step 4: ") for r in rows)
    assert cli.main(["report", log_dir]) == 0
    summary = capsys.readouterr().out
    assert "first non-finite step: 4" in summary
    assert "rule verdicts: 2" in summary
    # What to try: the NaN came with the data (the input layer held it first).
    said = html.unescape(text)
    assert "output held NaN/Inf is 'input_layer'" in said
    assert ("'input_layer' is the model's input: the batch of step 4 held NaN/Inf, before "
            "any layer computed (check the data)") in said


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


# ------------------------------------------------------------- at ResNet50 scale
RESNET_STEPS = 30
FAULT_STEP = 27  # the loss and a few gradients turn non-finite here
TOP = 10  # the lines the report draws of a plot with one line per variable


def _resnet50_layers():
    """The layers with weights of keras.applications.ResNet50, by name, in order."""
    layers = ["conv1_conv", "conv1_bn"]
    for stage, blocks in zip(range(2, 6), (3, 4, 6, 3)):
        for block in range(1, blocks + 1):
            for conv in ([0] if block == 1 else []) + [1, 2, 3]:
                layers += [f"conv{stage}_block{block}_{conv}_conv",
                           f"conv{stage}_block{block}_{conv}_bn"]
    return layers + ["predictions"]


LAYERS = _resnet50_layers()
VARIABLES = [f"resnet50/{layer}/{name}" for layer in LAYERS
             for name in (("gamma", "beta") if layer.endswith("_bn") else ("kernel", "bias"))]
TAPS = [f"conv{s}_block{b}_{c}_relu_tap" for s, blocks in zip(range(2, 6), (3, 4, 6, 3))
        for b in range(1, blocks + 1) for c in (1, 2)]
EXPLODING = VARIABLES[-12:]
VERDICTS = [  # (step, rule, tensors, reason): StopOnRule's markdown rows, written below
    (10, "DeadReLU", TAPS[:2],
     f"DeadReLU at step 10: dead_fraction at or above 0.5: {TAPS[0]}=0.62, {TAPS[1]}=0.55"),
    (26, "ExplodingTensor", EXPLODING,
     "ExplodingTensor at step 26: |values| above 1e+06 in gradients <b>&</b>"),
    (FAULT_STEP, "NonFiniteLoss", ["step/loss"],
     f"NonFiniteLoss at step {FAULT_STEP}: the loss is nan"),
    (FAULT_STEP, "NaNSource", ["conv5_block3_out", VARIABLES[-2]],
     f"NaNSource at step {FAULT_STEP}: the first layer whose output held NaN/Inf is "
     "'conv5_block3_out'"),
]
EPOCH_VALUES = {("train", "epoch_loss"): 0.8125, ("train", "epoch_accuracy"): 0.25,
                ("validation", "epoch_loss"): 0.9375, ("validation", "epoch_accuracy"): 0.125}


def _markdown(rows):
    """StopOnRule's format: `| rule | step | tensors | reason |`, the tensors cut after
    five with " ..." (written here by hand, from the inputs)."""
    lines = ["| rule | step | tensors | reason |", "|---|---|---|---|"]
    for step, rule, tensors, reason in rows:
        cell = ", ".join(tensors[:5]) + (" ..." if len(tensors) > 5 else "")
        lines.append(f"| {rule} | {step} | {cell} | {reason} |")
    return "\n".join(lines)


def _write_resnet_run(log_dir):
    """Synthetic event files of a ResNet50-sized run, written with kerasdbg's own
    writer: 214 variables' gradient norms and update ratios, 32 taps' dead
    fractions, the loss, verdicts, and one epoch of Keras's epoch logs.
    Returns the update ratios (variables x steps)."""
    rng = np.random.default_rng(0)
    depth = np.linspace(0.0, 1.0, len(VARIABLES))[:, None]
    steps = np.arange(1, RESNET_STEPS + 1)[None, :]
    norms = 10 ** (-4 + 3 * depth) * (1 + 0.3 * np.sin(steps + 7 * depth))
    ratios = 10 ** rng.uniform(-5, -2, (len(VARIABLES), 1)) * np.exp(-steps / 40)
    dead = np.clip(rng.uniform(0, 40, (len(TAPS), 1)) + 0.5 * steps, 0, 100) / 100
    norms[-2:, FAULT_STEP - 1:] = np.inf
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    texts = {}
    for step, rule, tensors, reason in VERDICTS:
        texts.setdefault(step, []).append((step, rule, tensors, reason))
    for i, step in enumerate(steps[0]):
        scalars = {"step/loss": float("nan") if step >= FAULT_STEP else 2.0 / step}
        finite = norms[:, i][np.isfinite(norms[:, i])]
        scalars["gradients/global_norm"] = float(np.sqrt(np.sum(finite ** 2)))
        for v, name in enumerate(VARIABLES):
            scalars[f"gradients/{name}/l2_norm"] = norms[v, i]
            scalars[f"gradients/{name}/nan_count"] = float(not np.isfinite(norms[v, i]))
            scalars[f"weights/{name}/update_ratio"] = ratios[v, i]
        for t, tap in enumerate(TAPS):
            scalars[f"activations/{tap}/dead_fraction"] = dead[t, i]
        writer.write(int(step), scalars, texts={"rules/verdicts": _markdown(texts[step])}
                     if step in texts else ())
    writer.flush()
    for run in ("train", "validation"):
        epoch_writer = _events.EventWriter(os.path.join(log_dir, run))
        epoch_writer.write(0, {tag: value for (name, tag), value in EPOCH_VALUES.items()
                               if name == run})
        epoch_writer.flush()
    return ratios


class _Page(html.parser.HTMLParser):
    """The tables (rows of cells: text and the `<code>` texts) and images of a page."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self._cell, self._code = {}, {}, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._rows = self.tables.setdefault(attrs.get("class"), [])
        elif tag == "tr":
            self._rows.append([])
        elif tag in ("td", "th"):
            self._cell = {"text": "", "code": []}
            self._rows[-1].append(self._cell)
        elif tag == "code" and self._cell is not None:
            self._code = ""
        elif tag == "img":
            self.images[attrs["src"]] = attrs["alt"]

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._cell = None
        elif tag == "code" and self._code is not None:
            self._cell["code"].append(self._code)
            self._code = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data
        if self._code is not None:
            self._code += data


def _screenshot(browser, page, shot, profile):
    """Headless Chromium's screenshot of `page`, 1280 x 3400 (from the summary to the
    update ratios' lines); the browser's process group is killed if it outlives the
    timeout."""
    process = subprocess.Popen(
        [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
         f"--user-data-dir={profile}", "--window-size=1280,3400",
         "--virtual-time-budget=5000", f"--screenshot={shot}", f"file://{page}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"chromium did not screenshot {page} within 120 s")
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]


def test_report_at_resnet50_scale_stays_legible(tmp_path, monkeypatch):
    """214 variables, 32 taps: the verdicts are an HTML table, a line plot draws
    the 10 largest with a heatmap of all, one epoch is a table; and the page
    renders in Chromium."""
    keep = os.environ.get("KERASDBG_SCREENSHOTS")  # for the docs, see below
    keep = keep and os.path.abspath(keep)
    monkeypatch.chdir(tmp_path)  # the page names the log directory as given
    log_dir = os.path.join("runs", "resnet50")
    ratios = _write_resnet_run(log_dir)
    assert len(VARIABLES) == 214 and len(LAYERS) == 107
    page = os.path.abspath(write_report(log_dir, str(tmp_path / "report")))
    out = os.path.dirname(page)
    assert sorted(os.listdir(out)) == [
        "activation_health.png", "activation_health_heatmap.png", "global_norm.png",
        "gradient_heatmap.png", "loss.png", "report.html", "update_ratios.png",
        "update_ratios_heatmap.png"]  # one epoch: no epochs.png
    text = open(page, encoding="utf-8").read()
    parsed = _Page()
    parsed.feed(text)

    # The verdicts: one row each, every text escaped, long tensor lists cut and counted.
    assert "|---|" not in text and not re.search(r"<pre>[^<]*\| rule \|", text)
    assert "<b>&</b>" not in text and "&lt;b&gt;&amp;&lt;/b&gt;" in text
    rows = parsed.tables["verdicts"]
    assert [c["text"] for c in rows[0]] == ["rule", "step", "tensors", "reason"]
    assert [(int(r[1]["text"]), r[0]["text"], r[3]["text"]) for r in rows[1:]] == [
        (step, rule, reason) for step, rule, _, reason in VERDICTS]
    for row, (_, _, tensors, _) in zip(rows[1:], VERDICTS):
        assert row[2]["code"] == tensors[:5]
    assert rows[2][2]["text"].endswith("… and more")  # 12 tensors, cut at 5 by the writer

    # One line per variable: the 10 kernels with the largest maximum (legend; biases
    # and normalisation weights ranked apart), a heatmap of all, every row named.
    kernels = [v for v, name in enumerate(VARIABLES) if name.endswith("/kernel")]
    peaks = ratios[kernels].max(axis=1)
    largest = [VARIABLES[kernels[v]] for v in np.argsort(-peaks)[:TOP]]
    alt = parsed.images["update_ratios.png"]
    assert alt.split("lines: ")[1].split(", ") == largest
    assert f"the 10 of {len(kernels)} kernels with the largest maximum" in text
    assert "the heatmap below shows all 214" in text
    with Image.open(os.path.join(out, "update_ratios_heatmap.png")) as image:
        assert image.size[1] >= 214 * 10  # >= 10 px a row: each row's name fits
    assert "Lines: the 10 of 32 tap statistics" in text
    assert "gradient_heatmap.png" in parsed.images

    # One epoch: its values as a table, train and validation.
    epochs = {r[0]["text"]: [c["text"] for c in r[1:]] for r in parsed.tables["epochs"][1:]}
    assert [c["text"] for c in parsed.tables["epochs"][0]] == ["metric", "train", "validation"]
    assert epochs == {tag: [f"{EPOCH_VALUES[('train', tag)]:.4g}",
                            f"{EPOCH_VALUES[('validation', tag)]:.4g}"]
                      for tag in ("epoch_accuracy", "epoch_loss")}

    # Rendered: a full window of text, tables and colour plots.
    browser = _chromium()
    assert browser is not None, (
        "no headless browser for the report's screenshot: `./run.sh test` installs Debian's "
        "`chromium` with apt-get when it can (as root or with sudo); install it by hand otherwise")
    shot = tmp_path / "report.png"
    _screenshot(browser, page, shot, tmp_path / "chromium-profile")
    with Image.open(shot) as image:
        assert image.size == (1280, 3400)
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    colours = np.unique(pixels, axis=0)
    assert len(colours) > 200  # the plots' colour maps and lines, not a blank page
    assert np.mean(np.any(pixels < 200, axis=1)) > 0.05  # ink on at least 5% of the window
    if keep:  # for the docs: KERASDBG_SCREENSHOTS=docs/images ./run.sh test -k resnet50
        os.makedirs(keep, exist_ok=True)
        with Image.open(shot) as image:  # a 256-colour palette keeps it small
            image.convert("RGB").quantize(256).save(os.path.join(keep, "report.png"),
                                                    optimize=True)


def test_report_plots_all_lines_of_a_few_variables_and_keeps_markdown_cells_whole(tmp_path):
    """Ten variables or fewer: every line, no heatmap. A reason holding "|" stays whole;
    a list longer than the cell shows is counted."""
    log_dir = str(tmp_path / "logs")
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    names = [f"m/dense_{i}/kernel" for i in range(TOP)]
    tensors = [f"m/dense_{i}/kernel" for i in range(9)]
    table = ("| rule | step | tensors | reason |\n|---|---|---|---|\n"
             f"| ExplodingTensor | 2 | {', '.join(tensors)} | |values| above 10 in gradients |\n"
             "| NonFiniteLoss | 2 |  | the loss is inf |")
    for step in (1, 2):
        writer.write(step, {f"weights/{n}/update_ratio": 1e-3 * (i + 1) * step
                            for i, n in enumerate(names)},
                     texts={"rules/verdicts": table} if step == 2 else ())
    writer.flush()
    page = write_report(log_dir)
    assert sorted(os.listdir(os.path.dirname(page))) == ["report.html", "update_ratios.png"]
    parsed = _Page()
    parsed.feed(open(page, encoding="utf-8").read())
    rows = parsed.tables["verdicts"][1:]
    assert [[c["text"] for c in r] for r in rows][1] == [
        "NonFiniteLoss", "2", "", "the loss is inf"]
    assert rows[0][3]["text"] == "|values| above 10 in gradients"
    assert rows[0][2]["code"] == tensors[:5]
    assert rows[0][2]["text"].endswith("… and 4 more")


# ------------------------------------------------------- where the report goes
def _small_run(log_dir):
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    for step in (1, 2, 3):
        writer.write(step, {"gradients/global_norm": float(step), "step/loss": 1.0 / step,
                            "gradients/m/d/kernel/l2_norm": float(step)})
    writer.close()
    return log_dir


def test_report_out_an_existing_file_is_refused_with_a_message(tmp_path, capsys):
    log_dir = _small_run(str(tmp_path / "logs"))
    afile = tmp_path / "afile"
    afile.write_text("kept")
    assert cli.main(["report", log_dir, "--out", str(afile)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kerasdbg report: write_report: `out` must be a directory (made if missing), not a "
        f"file. Received: out={str(afile)!r}"]
    with pytest.raises(NotADirectoryError, match=re.escape(
            f"write_report: `out` must be a directory (made if missing), not a file. "
            f"Received: out={str(afile)!r}")):
        write_report(log_dir, out=str(afile))
    assert afile.read_text() == "kept"


@pytest.mark.parametrize("read_only, cause", [
    (False, "No space left on device"), (True, "Read-only file system")],
    ids=["full", "read-only"])
def test_report_into_a_full_or_read_only_directory_says_so_in_one_line(
        tmp_path, capsys, read_only, cause):
    log_dir = _small_run(str(tmp_path / "logs"))
    with tmpfs(str(tmp_path / "disk"), size="64k", read_only=read_only) as disk:
        if not read_only:  # fill it up: the report's first plot does not fit
            with open(os.path.join(disk, "filler"), "wb") as stream:
                stream.write(b"\0" * (60 << 10))
        out = os.path.join(disk, "report")
        assert cli.main(["report", log_dir, "--out", out]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith(f"kerasdbg report: could not write the report in {out!r}: "
                                    f"{cause}"), lines
        assert "Traceback" not in "\n".join(lines)
        with pytest.raises(OSError, match=cause):
            write_report(log_dir, out=out)


# ------------------------------------------------------- what to try, and compare_runs
def test_every_rule_has_likely_causes_and_what_to_try():
    from kerasdbg import rules as rules_lib
    from kerasdbg.rules.remedies import REMEDIES

    rules = [n for n in rules_lib.__all__ if isinstance(getattr(rules_lib, n), type)
             and issubclass(getattr(rules_lib, n), rules_lib.Rule) and n != "Rule"]
    assert len(rules) == 22
    assert sorted(REMEDIES) == sorted(rules)
    assert all(r.causes and r.tries for r in REMEDIES.values())


def _lines_of(monkeypatch):
    """The (label, x, y) of each line of each plot the report draws, by title."""
    from kerasdbg import report as report_lib

    drawn, save = {}, report_lib._save

    def keep(plt, figure, path):
        for axes in figure.axes:
            legend = axes.get_legend()
            drawn[axes.get_title()] = {
                "lines": [(line.get_label(), line.get_xdata(), line.get_ydata())
                          for line in axes.get_lines()],
                "legend": [t.get_text() for t in legend.get_texts()] if legend else []}
        return save(plt, figure, path)

    monkeypatch.setattr(report_lib, "_save", keep)
    return drawn


def test_report_plots_only_recorded_steps_and_lists_only_drawn_series(tmp_path, monkeypatch):
    """Update ratios sampled at steps 1-3, 10 and 50: a marker at each, no line
    across 3-10 or 10-50; a variable with no positive value is not in the legend;
    one epoch's table is labelled as users count (epoch 1)."""
    log_dir = str(tmp_path / "sampled")
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    recorded = [1, 2, 3, 10, 50]
    for step in recorded:
        writer.write(step, {"weights/m/d/kernel/update_ratio": 1e-3 * step,
                            "weights/m/d/bias/update_ratio": 0.0,
                            "weights/m/e/kernel/update_ratio": 2e-3 * step})
    writer.write(0, {"epoch_loss": 0.5})
    writer.flush()
    drawn = _lines_of(monkeypatch)
    page = open(write_report(log_dir), encoding="utf-8").read()
    plot = drawn["update ratio ||dw|| / ||w||"]
    # The bias is 0 everywhere: nothing to draw on a log axis, and no legend entry.
    assert plot["legend"] == ["m/d/kernel", "m/e/kernel"]
    label, x, y = plot["lines"][0]
    x, y = np.asarray(x, float), np.asarray(y, float)
    np.testing.assert_array_equal(x[np.isfinite(x)], recorded)
    np.testing.assert_allclose(y[np.isfinite(y)], 1e-3 * np.array(recorded), rtol=1e-6)
    # A NaN between 3 and 10 and between 10 and 50 breaks the line: only 1-2-3 are joined.
    assert np.isnan(x).sum() == 2 and list(np.flatnonzero(np.isnan(x))) == [3, 5]
    assert "Epoch 1, the only one recorded" in page and "from 0" not in page


def test_report_says_what_to_try_with_the_runs_own_facts(tmp_path):
    """A learning rate of 30 (Keras's epoch_learning_rate) against the usual ranges,
    once; a rule without the learning rate among its causes does not cite it."""
    log_dir = str(tmp_path / "lr_too_high")
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    table = ("| rule | step | tensors | reason |\n|---|---|---|---|\n"
             "| WeightUpdateRatio | 2 | m/d/kernel | update/weight ratio above 10 |\n"
             "| ClassImbalance | 2 |  | class 1 is rare |")
    for step in (1, 2):
        writer.write(step, {"step/loss": 1.0 * step, "step/fault": 0.0, "step/frozen": 0.0,
                            "weights/m/d/kernel/update_ratio": 10.0 ** step},
                     texts={"rules/verdicts": table} if step == 2 else ())
    writer.write(0, {"epoch_learning_rate": 30.0})
    writer.flush()
    page = html.unescape(open(write_report(log_dir), encoding="utf-8").read())
    rate = kerasdbg.load_run(log_dir).scalars("epoch_learning_rate").value.iloc[-1]
    assert rate == 30.0
    assert (f"The learning rate of epoch 1 is {rate:g}, {rate / 0.1:.0f}x above the usual range "
            f"for SGD (0.001-0.1) and {rate / 0.01:.0f}x above that for Adam, AdamW, RMSprop "
            "(1e-05-0.01)") in page
    parsed = _Page()
    parsed.feed(open(os.path.join(log_dir, "report", "report.html"), encoding="utf-8").read())
    rows = {r[0]["text"]: [c["text"] for c in r[1:]] for r in parsed.tables["remedies"][1:]}
    assert list(rows) == ["WeightUpdateRatio(step 2)", "ClassImbalance(step 2)"]
    assert "the learning rate, 30 (above)" in rows["WeightUpdateRatio(step 2)"][0]
    assert "learning rate" not in rows["ClassImbalance(step 2)"][0]
    assert "class_weight" in rows["ClassImbalance(step 2)"][1]


def _norms_run(log_dir, norms):
    """A run of per-variable gradient norms {step: [m/a/kernel, m/b/kernel]} (NaN: a
    NaN gradient, counted), their global norm and a loss."""
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    for step, values in norms.items():
        values = np.asarray(values, float)
        scalars = {"step/loss": 1.0 if np.isfinite(values).all() else NAN,
                   "gradients/global_norm": float(np.sqrt(np.sum(values ** 2)))}
        for name, value in zip(("m/a/kernel", "m/b/kernel"), values):
            scalars[f"gradients/{name}/l2_norm"] = float(value)
            scalars[f"gradients/{name}/nan_count"] = 0.0 if np.isfinite(value) else 1.0
        writer.write(step, scalars)
    writer.flush()
    return log_dir


def test_report_medians_end_before_the_norm_explodes_or_the_first_nan(tmp_path, capsys):
    """The medians stop before the first step whose global norm grew more than 10x
    (NumPy on the records), said beside them; a NaN at step 1 leaves none."""
    norms = {1: [1.0, 2.0], 2: [1.5, 2.5], 3: [2.0, 3.0], 4: [40.0, 80.0], 5: [1e8, 1e9],
             6: [NAN, NAN]}
    log_dir = _norms_run(str(tmp_path / "exploding"), norms)
    values = np.array([norms[s] for s in sorted(norms)])
    total = np.sqrt((values ** 2).sum(axis=1))
    ratios = total[1:] / total[:-1]
    grew = int(np.flatnonzero(ratios > 10)[0]) + 2  # steps count from 1
    assert grew == 4
    medians = np.median(values[:grew - 1], axis=0)
    assert cli.main(["report", log_dir, "--out", str(tmp_path / "r1")]) == 0
    printed = capsys.readouterr().out
    window = (f"steps 1-{grew - 1}, before step {grew}, where the global gradient norm grew "
              f"{ratios[grew - 2]:.3g}x (> 10x) over the step before")
    assert (f"largest median gradient norms ({window}):  m/b/kernel ({medians[1]:.3g}), "
            f"m/a/kernel ({medians[0]:.3g})\n") in printed
    assert (f"smallest median gradient norms (same steps): m/a/kernel ({medians[0]:.3g}), "
            f"m/b/kernel ({medians[1]:.3g})\n") in printed
    log_dir = _norms_run(str(tmp_path / "nan_first"), {1: [NAN, 1.0], 2: [1.0, 2.0]})
    assert cli.main(["report", log_dir, "--out", str(tmp_path / "r2")]) == 0
    printed = capsys.readouterr().out
    assert "first non-finite step: 1\n" in printed
    assert "largest median gradient norms:  none finite before step 1\n" in printed
    assert "smallest median gradient norms: none finite before step 1\n" in printed


def test_summary_says_each_remedy_once_and_the_first_epochs_learning_rate(tmp_path):
    """Four rules answered by lowering the learning rate: one `try:` line naming them
    (WeightUpdateRatio with its case); a decaying rate (30, 3, 0.3 by epoch): epoch
    1's is the one compared with the usual ranges, the last one said beside it."""
    from kerasdbg.report import collect, summary

    log_dir = str(tmp_path / "decaying")
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    table = ("| rule | step | tensors | reason |\n|---|---|---|---|\n"
             "| WeightUpdateRatio | 2 | m/d/kernel | update/weight ratio above 10 |\n"
             "| DeadReLU | 3 | d_tap | dead fraction 0.9 |\n"
             "| NonFiniteLoss | 4 | step/loss | the loss is nan |\n"
             "| ExplodingTensor | 4 | m/d/kernel | non-finite values in gradients |\n"
             "| ClassImbalance | 4 |  | class 1 is rare |")
    for step in (1, 2, 3, 4):
        writer.write(step, {"step/loss": 1.0 if step < 4 else NAN, "step/fault": 0.0},
                     texts={"rules/verdicts": table} if step == 4 else ())
    rates = [30.0, 3.0, 0.3]
    for epoch, rate in enumerate(rates):  # Keras writes epoch 1 as step 0
        writer.write(epoch, {"epoch_learning_rate": rate})
    writer.flush()
    lines = summary(collect(log_dir)).splitlines()
    tries = [line for line in lines if line.startswith("  try: ")]
    assert tries == [
        "  try: lower the learning rate (by 10x to start with) (for WeightUpdateRatio when its "
        "ratios are above the range, DeadReLU, NonFiniteLoss, ExplodingTensor; more in "
        "report.html)",
        "  try: pass `class_weight` to fit, or resample the data (for ClassImbalance; more in "
        "report.html)"]
    (cause,) = [line for line in lines if line.startswith("  likely cause: ")]
    assert cause.startswith(f"  likely cause: the learning rate of epoch 1 is {rates[0]:g} "
                            f"({rates[-1]:g} by epoch {len(rates)}), {rates[0] / 0.1:.0f}x above "
                            "the usual range for SGD")


def _loss_norm_run(log_dir, loss, norm):
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    for step, (value, norm_value) in enumerate(zip(loss, norm), start=1):
        writer.write(step, {"step/loss": value, "gradients/global_norm": norm_value})
    writer.flush()
    return log_dir


def _first_divergence(a, b, rtol=1e-2):
    """The first step (from 1) where two (loss, norm) series differ, by NumPy: finite
    in one only, or |a - b| > rtol * max(|a|, |b|); the loss before the norm."""
    for step, pair in enumerate(zip(zip(*a), zip(*b)), start=1):
        for x, y in zip(*pair):
            if np.isfinite(x) != np.isfinite(y) or (
                    np.isfinite(x) and abs(x - y) > rtol * max(abs(x), abs(y))):
                return step
    return None


NAN = float("nan")


@pytest.mark.parametrize("loss_b, norm_b, tag", [
    ([1.0, 0.9, 0.804, 0.7, 0.6], [2.0, 2.0, 2.0, 2.5, 2.0], "gradients/global_norm"),
    ([1.0, NAN, 0.8, 0.7, 0.6], [2.0, 2.0, 2.0, 2.0, 2.0], "step/loss"),
    ([1.0, 0.9, 0.8, 0.7, 0.6], [2.0, 2.0, 2.0, 2.0, 2.0], None),
], ids=["norm-beyond-rtol", "nan-in-b", "equal"])
def test_compare_runs_names_the_first_divergent_step(tmp_path, capsys, loss_b, norm_b, tag):
    loss_a, norm_a = [1.0, 0.9, 0.8, 0.7, 0.6], [2.0] * 5
    a = _loss_norm_run(str(tmp_path / "before"), loss_a, norm_a)
    b = _loss_norm_run(str(tmp_path / "after"), loss_b, norm_b)
    expected = _first_divergence((loss_a, norm_a), (loss_b, norm_b))
    result = kerasdbg.compare_runs(a, b)
    assert result.names == ("before", "after")
    assert result.steps_compared == [1, 2, 3, 4, 5]
    if expected is None:
        assert tag is None and result.divergence is None
    else:
        assert (result.divergence.step, result.divergence.tag) == (expected, tag)
        np.testing.assert_allclose(result.loss.loc[expected].to_numpy(),
                                   [loss_a[expected - 1], loss_b[expected - 1]])
    assert cli.main(["report", a, b, "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert ("first divergence: none" if expected is None
            else f"first divergence: step {expected}, {tag}") in printed
    page = open(tmp_path / "cmp" / "compare.html", encoding="utf-8").read()
    assert "<h1>before and after</h1>" in page and 'src="compare_loss.png"' in page


def _steps_run(log_dir, records):
    """A run of {step: (loss, global norm)}, the steps as given."""
    writer = _events.EventWriter(os.path.join(log_dir, "train"))
    for step, (loss, norm) in records.items():
        writer.write(step, {"step/loss": loss, "gradients/global_norm": norm})
    writer.flush()
    return log_dir


@pytest.mark.parametrize("steps_a, steps_b, nan_at", [
    (range(1, 7), range(1, 4), None),
    (range(1, 6), [1, 2, 4, 5], None),
    (range(1, 6), range(1, 6), 3),
], ids=["b-ends-early", "b-skips-step-3", "nan-in-both-at-3"])
def test_compare_runs_says_when_a_run_ends_first_and_skips_the_rest(
        tmp_path, capsys, steps_a, steps_b, nan_at):
    """Equal values where both recorded: a run whose records end first diverges
    there (its own kind); a step recorded in one run only, or NaN in both, does not."""
    def records(steps):
        return {s: ((NAN, NAN) if s == nan_at else (1.0 / s, 2.0 + s)) for s in steps}

    a = _steps_run(str(tmp_path / "before"), records(steps_a))
    b = _steps_run(str(tmp_path / "after"), records(steps_b))
    result = kerasdbg.compare_runs(a, b)
    last_a, last_b = max(steps_a), max(steps_b)
    assert (result.steps_a, result.steps_b) == (list(steps_a), list(steps_b))
    assert result.steps_compared == sorted(set(steps_a) & set(steps_b))
    text = str(result)
    assert (f"steps recorded: before {min(steps_a)}-{last_a} ({len(steps_a)} steps), "
            f"after {min(steps_b)}-{last_b} ({len(steps_b)} steps)") in text
    if last_a == last_b:
        assert result.divergence is None
        assert "first divergence: none" in text
    else:
        d = result.divergence
        assert (d.kind, d.step, d.tag) == ("end", min(last_a, last_b), "step/loss")
        np.testing.assert_allclose([d.value_a, d.value_b], 1.0 / min(last_a, last_b))
        said = f"after ends at step {last_b}, before goes on to step {last_a}"
        assert d.reason == said and f"first divergence: {said} (equal within" in text
        assert cli.main(["report", a, b, "--out", str(tmp_path / "cmp")]) == 0
        page = open(tmp_path / "cmp" / "compare.html", encoding="utf-8").read()
        assert f"<p>After ends at step {last_b}, before goes on to step {last_a}: up to it" \
            in page
        # The steps `after` never recorded read so, not as a NaN loss.
        around = page[page.index('<table class="around">'):]
        around = around[:around.index("</table>")]
        for step in range(last_b + 1, last_a + 1):
            row = re.search(rf"<tr[^>]*><td>{step}</td>(.*?)</tr>", around).group(1)
            cells = re.findall(r"<td[^>]*>([^<]*)</td>", row)
            assert cells == [f"{1.0 / step:.6g}", "not recorded",
                             f"{2.0 + step:.6g}", "not recorded"], (step, cells)
        assert "nan" not in around


def test_a_comparison_beside_a_report_leaves_the_reports_plots_alone(tmp_path, capsys):
    """The README writes `report A --out report` and may write `report A B` there too:
    report.html's images stay the report's own (same names, same bytes)."""
    a = _loss_norm_run(str(tmp_path / "healthy"), [1.0, 0.9, 0.8], [2.0, 2.0, 2.0])
    b = _loss_norm_run(str(tmp_path / "lr_too_high"), [1.0, 9.0, NAN], [2.0, 50.0, NAN])
    out = tmp_path / "report"
    page = write_report(b, out=str(out))
    images = re.findall(r'<img src="([^"]+)"', open(page, encoding="utf-8").read())
    assert "loss.png" in images and "global_norm.png" in images
    before = {name: (out / name).read_bytes() for name in images}
    assert cli.main(["report", a, b, "--out", str(out)]) == 0
    capsys.readouterr()
    assert {name: (out / name).read_bytes() for name in images} == before
    shown = re.findall(r'<img src="([^"]+)"', (out / "compare.html").read_text())
    assert shown == ["compare_loss.png", "compare_global_norm.png"]
    assert not set(shown) & set(images)


def test_compare_runs_refuses_what_is_not_a_run(tmp_path, capsys):
    a = _loss_norm_run(str(tmp_path / "a"), [1.0], [1.0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotARunError, match="compare_runs: `b` is not a run: .* holds no "
                       "TensorBoard event files"):
        kerasdbg.compare_runs(a, str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="compare_runs: `a`: .*is not a directory"):
        kerasdbg.compare_runs(str(tmp_path / "missing"), a)
    with pytest.raises(TypeError, match=r"compare_runs: `a` must be a log directory \(a path\)"
                       r". Received: a=3"):
        kerasdbg.compare_runs(3, a)
    with pytest.raises(ValueError, match=r"compare_runs: `rtol` must be a float >= 0. "
                       r"Received: rtol=-1"):
        kerasdbg.compare_runs(a, a, rtol=-1)
    assert cli.main(["report", a, str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("kerasdbg report: compare_runs: `b` is not a run")
