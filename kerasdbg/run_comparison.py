"""`compare_runs`: two recorded runs side by side (`kerasdbg report RUN_A RUN_B`)."""

from __future__ import annotations

import dataclasses
import html
import os
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np
import pandas as pd

from kerasdbg import report as _report
from kerasdbg.reader import load_run
from kerasdbg.records import tags as _tags

__all__ = ("Divergence", "RunComparison", "compare_runs", "write_comparison")

VALUE = "value"
"""`Divergence.kind` of a series whose values differ at a step both runs recorded."""

END = "end"
"""`Divergence.kind` of a run that ends before the other, every value equal until then."""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first differ: the step, the series (`tag`), its value in
    each run, why it counts (`reason`) and its `kind`: `"value"` (the values
    differ at `step`), or `"end"` (one run's last recorded step is `step`, the
    other goes on; `value_a` and `value_b` are `tag`'s, equal, at that step).

    Examples:
        >>> from kerasdbg.run_comparison import Divergence
        >>> Divergence(3, "step/loss", 0.5, float("nan"), "non-finite in b only").step
        3
    """

    step: int
    tag: str
    value_a: float
    value_b: float
    reason: str
    kind: str = VALUE


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """What `compare_runs` returns.

    Attributes:
        a: the first log directory, as given.
        b: the second log directory, as given.
        names: the runs as the report names them (their directories' names).
        loss: the loss (`step/loss`) per step, a column per run (`names`);
            empty when neither run recorded it.
        global_norm: the global gradient norm per step, likewise.
        steps_compared: the steps at which both runs recorded a compared
            series, in order.
        divergence: the first step where the runs differ (a `Divergence`):
            a value that differs (`kind="value"`), or else, when one run
            ends before the other, its end (`kind="end"`); None when they
            agree at every step compared and end at the same step. A step
            that one run recorded and the other did not (a sampled series)
            is not compared: no divergence by itself.
        verdicts_a: the rule verdicts of `a`, rows of `rule`, `step`,
            `tensors`, `reason` (those `kerasdbg report` shows).
        verdicts_b: those of `b`.
        rule_steps_a: the steps at which `StopOnRule` ran its rules in `a`
            (from its `step/fault` and `step/frozen` records; empty when it
            did not run with a `log_dir`).
        rule_steps_b: those of `b`.
        rtol: the relative tolerance used.
        atol: the absolute tolerance used.
        steps_a: the steps at which `a` recorded a compared series (the
            loss or a global norm both runs recorded; any of them when none
            is compared), in order.
        steps_b: those of `b`.

    Examples:
        >>> from kerasdbg.run_comparison import RunComparison
        >>> "divergence" in RunComparison.__dataclass_fields__
        True
    """

    a: str
    b: str
    names: Tuple[str, str]
    loss: pd.DataFrame
    global_norm: pd.DataFrame
    steps_compared: List[int]
    divergence: Optional[Divergence]
    verdicts_a: List[Dict[str, object]]
    verdicts_b: List[Dict[str, object]]
    rule_steps_a: List[int]
    rule_steps_b: List[int]
    rtol: float
    atol: float
    steps_a: List[int] = dataclasses.field(default_factory=list)
    steps_b: List[int] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        a, b = self.names
        lines = [f"runs {a} ({self.a}) and {b} ({self.b})"]
        lines.append("  steps recorded: " + ", ".join(
            f"{name} {_range(steps)}" for name, steps in ((a, self.steps_a), (b, self.steps_b))))
        if not self.steps_compared:
            lines.append("  no step recorded in both: nothing compared")
        else:
            steps = self.steps_compared
            lines.append(f"  steps compared: {len(steps)} ({steps[0]}-{steps[-1]})")
        d = self.divergence
        if d is not None and d.kind == END:
            lines.append(f"  first divergence: {d.reason} (equal within rtol={self.rtol:g}, "
                         f"atol={self.atol:g} at every step compared)")
        elif d is not None:
            lines.append(f"  first divergence: step {d.step}, {d.tag}: {a} {d.value_a:.6g}, "
                         f"{b} {d.value_b:.6g} ({d.reason})")
        elif self.steps_compared:
            lines.append(f"  first divergence: none (equal within rtol={self.rtol:g}, "
                         f"atol={self.atol:g} at every step compared)")
        for name, rows, ran in ((a, self.verdicts_a, self.rule_steps_a),
                                (b, self.verdicts_b, self.rule_steps_b)):
            fired = [f"{r['rule']} at step {r['step']}" for r in rows if r["rule"]]
            none = (f"none (StopOnRule ran its rules at steps {ran[0]}-{ran[-1]})" if ran
                    else "none (no rule ran)")
            lines.append(f"  verdicts of {name}: {', '.join(fired) if fired else none}")
        return "\n".join(lines)


def _range(steps: List[int]) -> str:
    """`1-10 (10 steps)`, `step 3`, `none`: the steps a run recorded."""
    if not steps:
        return "none"
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"{steps[0]}-{steps[-1]} ({len(steps)} steps)"


def _read(log_dir, argument: str, run_name: str) -> Dict[str, object]:
    """One run's loss and global norms (long form: a NaN it wrote stays a NaN),
    its name and verdicts; an error says which argument it was about."""
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"compare_runs: `{argument}` must be a log directory (a path). "
                        f"Received: {argument}={log_dir!r}")
    log_dir = os.fspath(log_dir)
    try:
        run = load_run(log_dir)
        _report.require_run(run, run_name)
    except _report.NotARunError as error:
        raise _report.NotARunError(f"compare_runs: `{argument}` is not a run: {error}") from None
    except FileNotFoundError as error:
        raise FileNotFoundError(f"compare_runs: `{argument}`: {error}") from None
    pattern = _tags.any_pattern([_tags.scalar_pattern(_tags.STEP, ["loss"]),
                                 _tags.per_optimizer_pattern(_tags.GRADIENTS, _tags.GLOBAL_NORM)])
    series = {}
    if run.tags(pattern, run=run_name):
        rows = run.scalars(pattern, run=run_name).sort_values("step", kind="stable")
        for tag, group in rows.groupby("tag", sort=True):
            group = group.drop_duplicates("step", keep="last")  # a rollback's later write
            series[tag] = pd.Series(group.value.to_numpy(dtype=float),
                                    index=group.step.to_numpy(dtype=int), name=tag)
    verdicts = pd.DataFrame()
    if run.tags(_tags.VERDICTS, kind="text", run=run_name):
        verdicts = run.texts(_tags.VERDICTS, run=run_name)[["step", "text"]]
    ran = _tags.scalar_pattern(_tags.STEP, ["fault", "frozen"])
    ran = (sorted(set(int(s) for s in run.scalars(ran, run=run_name).step))
           if run.tags(ran, run=run_name) else [])
    data = {"log_dir": log_dir, "run": run_name}
    return {"title": _report.run_title(data), "series": series,
            "verdicts": _report._verdict_rows(verdicts), "rule_steps": ran}


def _differs(a: float, b: float, rtol: float, atol: float) -> Optional[str]:
    """Why `a` and `b` count as different, or None: one finite and the other
    not, or both finite and |a - b| > atol + rtol * max(|a|, |b|)."""
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if finite_a != finite_b:
        return f"non-finite in {'b' if finite_a else 'a'} only"
    if not finite_a:
        return None  # both NaN/Inf: they agree that the step failed
    gap = abs(a - b)
    if gap > atol + rtol * max(abs(a), abs(b)):
        scale = max(abs(a), abs(b))
        return (f"relative difference {gap / scale:.3g} > rtol={rtol:g}" if scale
                else f"difference {gap:.3g}")
    return None


def compare_runs(a: str, b: str, run_name: str = "train", rtol: float = 1e-2,
                 atol: float = 1e-12, run_name_b: Optional[str] = None) -> RunComparison:
    """Two recorded runs side by side: where they first diverge, their loss
    and global gradient norm per step, and the verdicts of each.

    The first divergence is the first step recorded in both runs at which the
    loss (`step/loss`) or the global gradient norm differ: finite in one run
    and NaN/Inf in the other, or both finite and
    `|a - b| > atol + rtol * max(|a|, |b|)` (NaN/Inf in both: they agree).
    At one step the loss is looked at before the norm. With no such step,
    a run whose last recorded step comes before the other's diverges there
    (`kind="end"`: e.g. a rule stopped it). A step recorded in one run only,
    before both ends, is not compared. Two runs from the same initial weights and batches
    (seeded) agree at step 1 and part where their learning rates, data or
    code first make a difference.

    Args:
        a: a log directory written by kerasdbg's callbacks (e.g. the healthy run).
        b: another one (e.g. the broken run, or the run after a fix).
        run_name: the run of each log directory. Defaults to `"train"`.
        rtol: relative tolerance, >= 0. Defaults to `1e-2`.
        atol: absolute tolerance, >= 0. Defaults to `1e-12`.
        run_name_b: the run of `b`, where it is not `run_name` (two runs of
            one directory: `compare_runs(d, d, "healthy/train",
            run_name_b="broken/train")`). Defaults to `None` (`run_name`).

    Returns:
        A `RunComparison`; `str()` of it is the summary `kerasdbg report A B`
        prints.

    Raises:
        NotARunError: `a` or `b` holds no run kerasdbg can read (the message
            names the argument and says why).
        FileNotFoundError: `a` or `b` is not a directory.
        TypeError: `a` or `b` is not a path.
        ValueError: a tolerance is negative or not a number.

    Examples:
        >>> import keras, numpy as np, tempfile
        >>> from kerasdbg import compare_runs
        >>> from kerasdbg.callbacks import GradientStatistics
        >>> def train(learning_rate):
        ...     log_dir = tempfile.mkdtemp()
        ...     keras.utils.set_random_seed(0)
        ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        ...     model.compile(keras.optimizers.SGD(learning_rate), "mse")
        ...     _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=1, verbose=0,
        ...                   callbacks=[GradientStatistics(log_dir)])
        ...     return log_dir
        >>> result = compare_runs(train(0.01), train(1.0))
        >>> result.divergence.step, result.divergence.tag
        (2, 'gradients/global_norm')
    """
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"compare_runs: `{name}` must be a float >= 0. "
                            f"Received: {name}={value!r}")
        if not value >= 0 or not np.isfinite(value):
            raise ValueError(f"compare_runs: `{name}` must be a float >= 0. "
                             f"Received: {name}={value!r}")
    data_a = _read(a, "a", run_name)
    data_b = _read(b, "b", run_name if run_name_b is None else run_name_b)
    names = (data_a["title"], data_b["title"])
    if names[0] == names[1]:  # two directories of the same name: tell them apart
        names = (f"{names[0]} (a)", f"{names[1]} (b)")
    # The loss first, then each optimizer's global norm both runs recorded.
    compared = [t for t in sorted(set(data_a["series"]) & set(data_b["series"]),
                                  key=lambda t: (t != _tags.LOSS, t))]
    steps, divergence = set(), None
    for tag in compared:
        steps.update(int(s) for s in data_a["series"][tag].index.intersection(
            data_b["series"][tag].index))
    for step in sorted(steps):
        for tag in compared:
            sa, sb = data_a["series"][tag], data_b["series"][tag]
            if step not in sa.index or step not in sb.index:
                continue
            reason = _differs(float(sa[step]), float(sb[step]), rtol, atol)
            if reason is not None:
                divergence = Divergence(step, tag, float(sa[step]), float(sb[step]), reason)
                break
        if divergence is not None:
            break

    def recorded(data) -> List[int]:
        series = [data["series"][t] for t in (compared or data["series"])]
        return sorted({int(s) for values in series for s in values.index})

    steps_a, steps_b = recorded(data_a), recorded(data_b)
    if divergence is None and steps and steps_a[-1] != steps_b[-1]:
        short, long_ = ((0, 1) if steps_a[-1] < steps_b[-1] else (1, 0))
        end = (steps_a, steps_b)[short][-1]
        tag = next(t for t in compared if end in data_a["series"][t].index
                   and end in data_b["series"][t].index) if end in steps else None
        values = ((float(data_a["series"][tag][end]), float(data_b["series"][tag][end]))
                  if tag else (float("nan"), float("nan")))
        divergence = Divergence(
            end, tag or "", *values,
            f"{names[short]} ends at step {end}, {names[long_]} goes on to step "
            f"{(steps_a, steps_b)[long_][-1]}", kind=END)

    def side_by_side(tag: Optional[str]) -> pd.DataFrame:
        columns = {name: data["series"][tag] for name, data in zip(names, (data_a, data_b))
                   if tag in data["series"]}
        return (pd.concat(columns, axis=1).sort_index() if columns
                else pd.DataFrame(columns=list(names), dtype=float))

    norms = [t for t in sorted(set(data_a["series"]) | set(data_b["series"])) if t != _tags.LOSS]
    return RunComparison(
        a=os.fspath(a), b=os.fspath(b), names=names, loss=side_by_side(_tags.LOSS),
        global_norm=side_by_side(norms[0] if norms else None), steps_compared=sorted(steps),
        divergence=divergence, verdicts_a=data_a["verdicts"], verdicts_b=data_b["verdicts"],
        rule_steps_a=data_a["rule_steps"], rule_steps_b=data_b["rule_steps"],
        rtol=float(rtol), atol=float(atol), steps_a=steps_a, steps_b=steps_b)


AROUND = 3
"""Steps shown on each side of the first divergence in the comparison's table."""


def _around(comparison: RunComparison) -> str:
    """The loss and norm of both runs at the steps around the first divergence."""
    d = comparison.divergence
    table = pd.concat({"loss": comparison.loss, "global norm": comparison.global_norm}, axis=1)
    if d is None or not len(table):
        return ""
    table = table[(table.index >= d.step - AROUND) & (table.index <= d.step + AROUND)]
    head = "".join(f"<th>{html.escape(what)}: {html.escape(name)}</th>"
                   for what, name in table.columns)
    recorded = dict(zip(comparison.names, (set(comparison.steps_a), set(comparison.steps_b))))
    body = ""
    for step, row in table.iterrows():
        style = ' class="diverged"' if step == d.step else ""
        # A step a run never recorded is said so: a NaN in the table is one it recorded.
        cells = "".join(f"<td>{value:.6g}</td>" if int(step) in recorded.get(name, ()) else
                        '<td class="absent">not recorded</td>'
                        for (_, name), value in zip(table.columns, row.to_numpy(dtype=float)))
        body += f"<tr{style}><td>{step}</td>{cells}</tr>"
    return f'<table class="around"><tr><th>step</th>{head}</tr>{body}</table>'


def write_comparison(comparison: RunComparison, out: str) -> str:
    """Writes `compare.html` (the summary, where the runs diverge, the loss
    and the global gradient norm of both overlaid with the divergence
    marked, the values around it, the verdicts of each) and its plots
    (`compare_loss.png`, `compare_global_norm.png`: names no report uses,
    so `out` may be a report's folder) into `out`; returns the page's path.

    Args:
        comparison: from `compare_runs`.
        out: a directory (made if missing).

    Raises:
        NotADirectoryError: `out` is a file.
        OSError: a file could not be written; the error names it.

    Examples:
        >>> import os, tempfile
        >>> import pandas as pd
        >>> from kerasdbg.run_comparison import RunComparison, write_comparison
        >>> empty = pd.DataFrame(columns=["a", "b"], dtype=float)
        >>> page = write_comparison(RunComparison("x/a", "x/b", ("a", "b"), empty, empty, [],
        ...                                       None, [], [], [], [], 0.01, 0.0),
        ...                         tempfile.mkdtemp())
        >>> os.path.basename(page)
        'compare.html'
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(
            f"write_comparison: `out` must be a directory (made if missing), not a file. "
            f"Received: out={out!r}")
    os.makedirs(out, exist_ok=True)
    a, b = comparison.names
    d = comparison.divergence
    mark = {} if d is None else {"mark": d.step, "mark_label": (
        "first divergence" if d.kind != END else d.reason.split(",")[0])}
    sections = []
    if d is not None and d.kind == END:
        sections.append(
            f"<h2>Where they diverge</h2><p>{html.escape(d.reason[0].upper() + d.reason[1:])}"
            ": up to it, the loss and global gradient norms recorded in both agree within "
            f"atol + rtol &middot; max(|a|, |b|) (rtol={comparison.rtol:g}, "
            f"atol={comparison.atol:g}).</p>" + _around(comparison))
    elif d is not None:
        sections.append(
            f"<h2>Where they diverge</h2><p>First at step {d.step}: <code>{html.escape(d.tag)}"
            f"</code> is {d.value_a:.6g} in {html.escape(a)} and {d.value_b:.6g} in "
            f"{html.escape(b)} ({html.escape(d.reason)}). A step counts as diverged when "
            "the loss or a global gradient norm is finite in one run and not in the other, "
            f"or differs by more than atol + rtol &middot; max(|a|, |b|) (rtol="
            f"{comparison.rtol:g}, atol={comparison.atol:g}).</p>" + _around(comparison))
    # Names of their own: a comparison written into a report's folder leaves
    # report.html's `loss.png` and `global_norm.png` as they were.
    for stem, title, frame, log in (("compare_loss", "Loss", comparison.loss, None),
                                    ("compare_global_norm", "Global gradient norm",
                                     comparison.global_norm, True)):
        if frame.notna().to_numpy().any():
            path = os.path.join(out, f"{stem}.png")
            _report._plot_lines(frame, f"{title.lower()}: {a} and {b}", title.lower(), path,
                                log=log, **mark)
            sections.append(f"<h2>{html.escape(title)}</h2>"
                            f'<img src="{stem}.png" alt="{html.escape(title)} of {html.escape(a)} '
                            f'and {html.escape(b)}">')
    for name, rows, ran in ((a, comparison.verdicts_a, comparison.rule_steps_a),
                            (b, comparison.verdicts_b, comparison.rule_steps_b)):
        table = (_report._rows_table(rows, link=False) if any(r["rule"] for r in rows)
                 else _report._no_verdict_html(ran, rows))
        sections.append(f"<h2>Verdicts of {html.escape(name)}</h2>{table}")
    page = os.path.join(out, "compare.html")
    with open(page, "w", encoding="utf-8") as stream:
        stream.write(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kerasdbg: "
            f"{html.escape(a)} and {html.escape(b)}</title><style>{_report._STYLE}"
            "tr.diverged td{background:#fde2e1}</style></head><body>"
            f"<h1>{html.escape(a)} and {html.escape(b)}</h1>"
            f"<pre>{html.escape(str(comparison))}</pre>{''.join(sections)}</body></html>")
    return page


def main_compare(a: str, b: str, out: Optional[str], run_name: str, rtol: float) -> int:
    """`kerasdbg report RUN_A RUN_B`: exit status 0, or 2 on bad input or when
    the page cannot be written."""
    try:
        comparison = compare_runs(a, b, run_name=run_name, rtol=rtol)
        out = out or os.path.join(a, "report", "vs_" + os.path.basename(os.path.normpath(b)))
        page = write_comparison(comparison, out)
    except (FileNotFoundError, NotADirectoryError, _report.NotARunError, ValueError,
            TypeError) as error:
        print(f"kerasdbg report: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        print(f"kerasdbg report: could not write the comparison in {out!r}: "
              f"{error.strerror or error}{where}", file=sys.stderr)
        return 2
    print(comparison)
    print(f"report: {page}")
    return 0
