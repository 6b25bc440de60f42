"""`write_report`: a run's health on one HTML page with PNG plots, plus a text summary."""

from __future__ import annotations

import html
import os
import sys
from typing import Callable, Dict, List, Optional

import numpy as np
import pandas as pd

from kerasdbg.reader import Run, load_run
from kerasdbg.rules.rule import CLASSES, COLLECTIONS, SCALAR_COLLECTIONS

__all__ = ("NotARunError", "collect", "first_positive_step", "mean_norms", "summary",
           "write_report")

KERASDBG_PREFIXES = tuple(f"{c}/" for c in COLLECTIONS + SCALAR_COLLECTIONS + (CLASSES,))
"""Tags that kerasdbg writes start with one of these."""


class NotARunError(ValueError):
    """The directory holds no run kerasdbg can report on (the message says why).

    Example:

    >>> import tempfile
    >>> from kerasdbg.report import NotARunError, collect
    >>> try:
    ...     collect(tempfile.mkdtemp())
    ... except NotARunError as error:
    ...     print("holds no TensorBoard event files" in str(error))
    True
    """


def _progress(stream) -> Callable[[int, int, str], None]:
    """A one-line progress bar on `stream` (redrawn in place on a terminal)."""
    interactive = getattr(stream, "isatty", lambda: False)()

    def show(done: int, total: int, what: str) -> None:
        filled = int(20 * done / max(total, 1))
        line = f"kerasdbg report: [{'#' * filled}{'.' * (20 - filled)}] {done}/{total} {what}"
        if interactive:
            stream.write("\r" + line.ljust(79) + ("\n" if done == total else ""))
        elif done == total:
            stream.write(line + "\n")
        stream.flush()

    return show


def _wide(run: Run, pattern: str, run_name: str) -> pd.DataFrame:
    """Scalars matching `pattern` as a step x tag table (empty if none)."""
    try:
        return run.scalar_table(pattern, run=run_name)
    except KeyError:
        return pd.DataFrame()


def _strip(columns, prefix: str, suffix: str) -> List[str]:
    return [c[len(prefix):len(c) - len(suffix)] if c.endswith(suffix) else c[len(prefix):]
            for c in columns]


def _layer_norms(norms: pd.DataFrame) -> pd.DataFrame:
    """Per-variable gradient norms -> per-layer norms (root of the sum of squares)."""
    layers = {}
    for column in norms.columns:
        layer = column.rsplit("/", 1)[0] if "/" in column else column
        layers.setdefault(layer, []).append(column)
    return pd.DataFrame({layer: np.sqrt((norms[cols] ** 2).sum(axis=1, min_count=1))
                         for layer, cols in layers.items()})


def collect(log_dir: str, run_name: str = "train", progress=None) -> Dict[str, object]:
    """Reads what the report shows from a log directory: step x tag tables
    under "loss", "global_norm", "gradient_norms", "nan_counts",
    "update_ratios", "activations", the `epoch_*` scalars of Keras's
    `TensorBoard` callback (this run and its "validation" sibling; steps are
    epochs) in `Run.scalars`'s long form under "epochs", the "verdicts"
    texts, and the "rollbacks" (`Run.rollbacks`: where a run was resumed
    from a backup; the tables keep the latest values).

    Args:
        log_dir: a log directory written by kerasdbg's callbacks.
        run_name: the run of the log directory. Defaults to `"train"`.
        progress: called as `progress(done, total, what)`, or None.

    Example:

    >>> import keras, numpy as np, tempfile
    >>> from kerasdbg.callbacks import GradientStatistics
    >>> from kerasdbg.report import collect
    >>> log_dir = tempfile.mkdtemp()
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")], name="m")
    >>> model.compile("sgd", "mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0,
    ...               callbacks=[GradientStatistics(log_dir)])
    >>> list(collect(log_dir)["global_norm"].columns)
    ['gradients/global_norm']

    Raises:
        FileNotFoundError: `log_dir` is not a directory.
        NotARunError: it holds no event files, or none with kerasdbg tags.
    """
    run = load_run(log_dir)
    if not run.runs:
        raise NotARunError(
            f"{log_dir!r} holds no TensorBoard event files; give the log_dir of the "
            "kerasdbg callbacks (e.g. GradientStatistics(log_dir))"
        )
    if run_name not in run.runs:
        raise NotARunError(f"{log_dir!r} has no run {run_name!r}. Runs: {', '.join(run.runs)}")
    tags = run.tags(run=run_name)
    if not any(t.startswith(KERASDBG_PREFIXES) for t in tags):
        raise NotARunError(
            f"run {run_name!r} of {log_dir!r} holds no kerasdbg tags (gradients/, weights/, "
            f"activations/, step/, epoch/). Its tags: {', '.join(tags[:10]) or '(none)'}"
        )
    parts = [
        ("loss", r"step/loss|epoch/loss|epoch/val_loss"),
        ("global_norm", r"gradients/(.+/)?global_norm"),
        ("gradient_norms", r"gradients/.+/l2_norm"),
        ("nan_counts", r"gradients/.+/(nan|inf)_count"),
        ("update_ratios", r"weights/.+/update_ratio"),
        ("activations", r"activations/.+/(dead_fraction|saturated_fraction|std)"),
    ]
    data: Dict[str, object] = {"log_dir": log_dir, "run": run_name}
    total = len(parts) + 1
    for done, (name, pattern) in enumerate(parts):
        if progress:
            progress(done, total, f"reading {name}")
        data[name] = _wide(run, pattern, run_name)
    # Keras's own TensorBoard callback: epoch_loss, epoch_<metric> per epoch,
    # in this run and in its "validation" sibling.
    epochs = [run.scalars(r"epoch_.+", run=name)
              for name in dict.fromkeys((run_name, "validation"))
              if name in run.runs and run.tags(r"epoch_.+", run=name)]
    data["epochs"] = (pd.concat(epochs, ignore_index=True) if epochs
                      else pd.DataFrame(columns=["run", "tag", "step", "wall_time", "value"]))
    verdicts = pd.DataFrame()
    if run.tags("rules/verdicts", kind="text", run=run_name):
        verdicts = run.texts("rules/verdicts", run=run_name)[["step", "text"]]
    data["verdicts"] = verdicts
    data["rollbacks"] = run.rollbacks(run=run_name)
    if progress:
        progress(total, total, "read")
    return data


def first_positive_step(table: pd.DataFrame) -> Optional[int]:
    """The first step (index) at which any column is above 0 (e.g. NaN counts), or None.

    Example:

    >>> import pandas as pd
    >>> from kerasdbg.report import first_positive_step
    >>> first_positive_step(pd.DataFrame({"a/nan_count": [0.0, 0.0, 3.0]}, index=[1, 2, 3]))
    3
    """
    if not len(table.columns):
        return None
    bad = table.index[(table.fillna(0).to_numpy() > 0).any(axis=1)]
    return int(bad[0]) if len(bad) else None


def mean_norms(norms: pd.DataFrame) -> pd.Series:
    """Each column's mean over the steps, finite values only, smallest first.

    Example:

    >>> import pandas as pd
    >>> from kerasdbg.report import mean_norms
    >>> mean_norms(pd.DataFrame({"a": [1.0, 3.0], "b": [0.5, float("inf")]})).to_dict()
    {'b': 0.5, 'a': 2.0}
    """
    return norms.replace([np.inf, -np.inf], np.nan).mean().dropna().sort_values()


def summary(data: Dict[str, object], top: int = 3) -> str:
    """A short text summary of `collect`'s data: steps, the first non-finite
    step, the variables with the largest and smallest mean gradient norms,
    and the number of rule verdicts.

    Example:

    >>> import keras, numpy as np, tempfile
    >>> from kerasdbg.callbacks import GradientStatistics
    >>> from kerasdbg.report import collect, summary
    >>> log_dir = tempfile.mkdtemp()
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")], name="m")
    >>> model.compile("sgd", "mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0,
    ...               callbacks=[GradientStatistics(log_dir)])
    >>> for line in summary(collect(log_dir)).splitlines()[1:]:
    ...     print(line)
      steps recorded: 4 (1-4)
      first non-finite step: none
      largest mean gradient norms:  m/d/kernel (...), m/d/bias (...)
      smallest mean gradient norms: m/d/bias (...), m/d/kernel (...)
      rule verdicts: 0
    """
    lines = [f"run {data['run']!r} of {data['log_dir']}"]
    norms: pd.DataFrame = data["gradient_norms"]
    global_norm: pd.DataFrame = data["global_norm"]
    loss: pd.DataFrame = data["loss"]
    steps = set()
    for frame in (norms, global_norm, loss):
        steps.update(int(s) for s in frame.index)
    lines.append(f"  steps recorded: {len(steps)}" + (f" ({min(steps)}-{max(steps)})" if steps else ""))
    first = _first_nonfinite(data)
    lines.append(f"  first non-finite step: {first if first is not None else 'none'}")
    if len(norms.columns):
        mean = mean_norms(norms)
        mean.index = _strip(mean.index, "gradients/", "/l2_norm")
        lines.append("  largest mean gradient norms:  " + ", ".join(
            f"{name} ({value:.3g})" for name, value in mean.iloc[::-1][:top].items()))
        lines.append("  smallest mean gradient norms: " + ", ".join(
            f"{name} ({value:.3g})" for name, value in mean.iloc[:top].items()))
    verdicts: pd.DataFrame = data["verdicts"]
    lines.append(f"  rule verdicts: {_verdict_count(verdicts)}")
    rollbacks = data.get("rollbacks")
    if rollbacks is not None and len(rollbacks):
        first = rollbacks.iloc[0]
        dropped = first["dropped"]
        lines.append(
            f"  rolled back: training restarted at step {int(first['step'])} "
            f"({len(rollbacks)} time{'s' if len(rollbacks) > 1 else ''}); steps "
            f"{dropped[0]}-{dropped[-1]} of the abandoned run are left out")
    return "\n".join(lines)


def _verdict_count(verdicts: pd.DataFrame) -> int:
    """Rows of the markdown tables `StopOnRule` writes (a header and a rule line each)."""
    return sum(max(text.count("\n") - 1, 0) for text in verdicts.get("text", []))


def _first_nonfinite(data) -> Optional[int]:
    candidates = []
    loss: pd.DataFrame = data["loss"]
    if "step/loss" in loss.columns:
        bad = loss.index[~np.isfinite(loss["step/loss"].to_numpy(dtype=float))
                         & loss["step/loss"].notna().to_numpy()]
        candidates += [int(s) for s in bad[:1]]
    first = first_positive_step(data["nan_counts"])
    candidates += [] if first is None else [first]
    return min(candidates) if candidates else None


# ------------------------------------------------------------------ plots
def _pyplot():
    """`(matplotlib.pyplot, MaxNLocator)`, drawing off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    return plt, MaxNLocator


def _save(plt, figure, path: str) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=96)
    plt.close(figure)
    return path


def _plot_lines(frame: pd.DataFrame, title: str, ylabel: str, path: str,
                log: Optional[bool] = False, labels: Optional[List[str]] = None,
                mark: Optional[int] = None) -> str:
    """Lines over optimizer steps. `log=None` picks a log scale when the finite
    values are positive and span more than three decades (a diverging loss);
    `mark` draws the first non-finite step."""
    plt, MaxNLocator = _pyplot()

    finite = frame.replace([np.inf, -np.inf], np.nan)
    if log is None:
        values = finite.to_numpy(dtype=float)
        values = values[~np.isnan(values)]
        log = bool(values.size and values.min() > 0 and values.max() / values.min() > 1e3)
    figure, axes = plt.subplots(figsize=(8, 3.6))
    for column, label in zip(frame.columns, labels or list(frame.columns)):
        series = finite[column].dropna()
        if log:
            series = series[series > 0]
        axes.plot(series.index, series.to_numpy(), label=label, linewidth=1.2,
                  marker="o" if len(series) <= 12 else None, markersize=3)
    if mark is not None:
        axes.axvline(mark, color="crimson", linestyle="--", linewidth=1,
                     label=f"first non-finite step ({mark})")
    if log:
        axes.set_yscale("log")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(ylabel)
    if 1 < len(frame.columns) + (mark is not None) <= 12:
        axes.legend(fontsize=7, loc="best")
    axes.grid(alpha=0.3)
    return _save(plt, figure, path)


def _plot_epochs(epochs: pd.DataFrame, path: str) -> str:
    """One panel per Keras metric (epoch_loss, epoch_accuracy, ...), a line per run."""
    plt, MaxNLocator = _pyplot()

    metrics = sorted(epochs.tag.unique())
    columns = min(len(metrics), 3)
    rows = -(-len(metrics) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(8, 2.8 * rows), squeeze=False)
    for axes, metric in zip(grid.flat, metrics):
        bad = []
        for run, series in epochs[epochs.tag == metric].groupby("run", sort=False):
            finite = np.isfinite(series.value.to_numpy(dtype=float))
            axes.plot(series.step[finite], series.value[finite], marker="o", label=run,
                      linewidth=1.2)
            bad += [f"{run} {int(e)}" for e in series.step[~finite]]
        if bad:
            axes.text(0.02, 0.95, "non-finite at epoch: " + ", ".join(bad), color="crimson",
                      fontsize=7, transform=axes.transAxes, va="top")
        shown = sorted(epochs.step.unique())
        if len(shown) <= 12:
            axes.set_xticks(shown)
            axes.set_xlim(shown[0] - 0.5, shown[-1] + 0.5)
        else:
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(metric, fontsize=9)
        axes.set_xlabel("epoch (from 0, as Keras writes it)", fontsize=8)
        axes.legend(fontsize=7, loc="best")
        axes.grid(alpha=0.3)
    for axes in list(grid.flat)[len(metrics):]:
        axes.set_visible(False)
    return _save(plt, figure, path)


def _plot_heatmap(layers: pd.DataFrame, path: str) -> str:
    plt, MaxNLocator = _pyplot()

    values = layers.T.to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        shown = np.where(np.isfinite(values) & (values > 0), np.log10(values), np.nan)
    figure, axes = plt.subplots(figsize=(8, max(2.0, 0.6 + 0.32 * len(layers.columns))))
    image = axes.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis",
                        extent=(layers.index.min() - 0.5, layers.index.max() + 0.5,
                                len(layers.columns) - 0.5, -0.5))
    axes.set_yticks(range(len(layers.columns)))
    axes.set_yticklabels(layers.columns, fontsize=7)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_title("gradient norm per layer (log10; blank: zero or non-finite)")
    figure.colorbar(image, ax=axes, fraction=0.03)
    return _save(plt, figure, path)


def write_report(log_dir: str, out: Optional[str] = None, run_name: str = "train",
                 progress_stream=None) -> str:
    """Writes `report.html` and its PNG plots; returns the HTML file's path.

    The page shows the loss, Keras's epoch logs (when its `TensorBoard`
    callback shared the log directory), the global gradient norm, a per-layer
    gradient-norm heatmap (layers x steps), the weights' update ratios, the
    activation health of the taps and the rule verdicts, each when the run
    recorded it, with the text `summary` on top.

    Args:
        log_dir: a log directory written by kerasdbg's callbacks.
        out: where to write. Defaults to `<log_dir>/report`.
        run_name: the run of the log directory. Defaults to `"train"`.
        progress_stream: a stream for a progress bar (e.g. `sys.stderr`), or None.

    Raises:
        FileNotFoundError: `log_dir` is not a directory.
        NotARunError: it holds nothing kerasdbg can report on.

    Example:

    >>> import keras, numpy as np, os, tempfile
    >>> from kerasdbg.callbacks import GradientStatistics
    >>> from kerasdbg.report import write_report
    >>> log_dir = tempfile.mkdtemp()
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")], name="m")
    >>> model.compile("sgd", "mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0,
    ...               callbacks=[GradientStatistics(log_dir)])
    >>> page = write_report(log_dir)
    >>> sorted(os.listdir(os.path.dirname(page)))
    ['global_norm.png', 'gradient_heatmap.png', 'report.html']
    """
    progress = _progress(progress_stream) if progress_stream is not None else None
    return _write(collect(log_dir, run_name, progress), out)


def _write(data: Dict[str, object], out: Optional[str]) -> str:
    out = out or os.path.join(data["log_dir"], "report")
    os.makedirs(out, exist_ok=True)
    sections = []

    def figure(name: str, title: str, make) -> None:
        make(os.path.join(out, name))
        sections.append(f'<h2>{html.escape(title)}</h2><img src="{html.escape(name)}" alt="{html.escape(title)}">')

    first = _first_nonfinite(data)
    loss: pd.DataFrame = data["loss"]
    if len(loss.columns):
        figure("loss.png", "Loss", lambda p: _plot_lines(loss, "loss", "loss", p, log=None,
                                                         mark=first))
    epochs: pd.DataFrame = data["epochs"]
    if len(epochs):
        figure("epochs.png", "Keras's epoch logs (TensorBoard callback)",
               lambda p: _plot_epochs(epochs, p))
    if len(data["global_norm"].columns):
        figure("global_norm.png", "Global gradient norm", lambda p: _plot_lines(
            data["global_norm"], "global gradient norm", "norm", p, log=True, mark=first))
    norms: pd.DataFrame = data["gradient_norms"]
    if len(norms.columns):
        norms = norms.copy()
        norms.columns = _strip(norms.columns, "gradients/", "/l2_norm")
        figure("gradient_heatmap.png", "Gradient norm per layer",
               lambda p: _plot_heatmap(_layer_norms(norms), p))
    ratios: pd.DataFrame = data["update_ratios"]
    if len(ratios.columns):
        figure("update_ratios.png", "Update ratio per variable", lambda p: _plot_lines(
            ratios, "update ratio ||dw|| / ||w||", "ratio", p, log=True,
            labels=_strip(ratios.columns, "weights/", "/update_ratio")))
    health: pd.DataFrame = data["activations"]
    fractions = [c for c in health.columns if c.endswith("_fraction")]
    if fractions:
        figure("activation_health.png", "Activation health", lambda p: _plot_lines(
            100 * health[fractions], "dead / saturated units of the taps", "percent of units", p,
            labels=_strip(fractions, "activations/", "")))
    elif len(health.columns):
        figure("activation_health.png", "Activation spread", lambda p: _plot_lines(
            health, "standard deviation of the tapped activations", "std", p, log=True,
            labels=_strip(health.columns, "activations/", "/std")))
    verdicts: pd.DataFrame = data["verdicts"]
    rows = "".join(f"<tr><td>{int(r.step)}</td><td><pre>{html.escape(r.text)}</pre></td></tr>"
                   for r in verdicts.itertuples())
    sections.append("<h2>Rule verdicts</h2>" + (
        f"<table><tr><th>step</th><th>verdicts</th></tr>{rows}</table>" if rows
        else "<p>None recorded (StopOnRule(log_dir=...) writes them).</p>"))
    text = summary(data)
    page = os.path.join(out, "report.html")
    with open(page, "w", encoding="utf-8") as stream:
        stream.write(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kerasdbg report</title>"
            "<style>body{font-family:sans-serif;max-width:900px;margin:auto}img{max-width:100%}"
            "td,th{border:1px solid #ccc;padding:4px;vertical-align:top}</style></head><body>"
            f"<h1>kerasdbg report</h1><pre>{html.escape(text)}</pre>{''.join(sections)}"
            "</body></html>"
        )
    return page


def main_report(log_dir: str, out: Optional[str], run_name: str) -> int:
    """The `kerasdbg report` command: exit status 0, or 2 on bad input."""
    try:
        data = collect(log_dir, run_name, _progress(sys.stderr))
    except (FileNotFoundError, NotARunError) as error:
        print(f"kerasdbg report: {error}", file=sys.stderr)
        return 2
    page = _write(data, out)
    print(summary(data))
    print(f"report: {page}")
    return 0


