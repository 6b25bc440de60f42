"""`write_report`: a run's health on one HTML page with PNG plots, plus a text summary."""

from __future__ import annotations

import html
import math
import os
import re
import sys
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import numpy as np
import pandas as pd

from kerasdbg.records import tags as _tags
from kerasdbg.records.verdicts import verdict_rows
from kerasdbg.reader import Run, load_run
from kerasdbg.rules.remedies import LEARNING_RATE_RULES, REMEDIES, first_tries
from kerasdbg.rules.remedies import learning_rate_note

__all__ = ("NotARunError", "collect", "first_growth_step", "first_positive_step", "mean_norms",
           "median_norms", "median_window", "other_trainings", "require_run", "run_title",
           "skipped_steps", "stop_on_rule_steps", "summary", "write_report")

KERASDBG_PREFIXES = _tags.KERASDBG_PREFIXES
"""Tags that kerasdbg writes start with one of these."""

TOP_LINES = 10
"""A line plot of one line per variable (or tap) draws at most this many: those
with the largest maximum; a heatmap below it shows them all."""

TENSORS_PER_CELL = 5
"""Tensors listed in a cell of the verdict table; the rest are counted."""

VERDICT_ROWS = 100
"""Rows of the verdict table; the rest are counted."""

GROWTH = 10.0
"""A global gradient norm more than this many times the previous recorded one
marks a run that has begun to explode: the median gradient norms end before it."""


class NotARunError(ValueError):
    """The directory holds no run kerasdbg can report on (the message says why).

    Examples:
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


def _tensors(tags) -> List[str]:
    """The tensor of each per-tensor tag (`m/d/kernel` of `gradients/m/d/kernel/l2_norm`)."""
    return [_tags.tensor_of(t) for t in tags]


def _layer_norms(norms: pd.DataFrame) -> pd.DataFrame:
    """Per-variable gradient norms -> per-layer norms (root of the sum of squares)."""
    layers = {}
    for column in norms.columns:
        layer = column.rsplit("/", 1)[0] if "/" in column else column
        layers.setdefault(layer, []).append(column)
    return pd.DataFrame({layer: np.sqrt((norms[cols] ** 2).sum(axis=1, min_count=1))
                         for layer, cols in layers.items()})


def collect(log_dir: str, run_name: str = "train",
            progress: Optional[Callable[[int, int, str], None]] = None) -> Dict[str, object]:
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

    Examples:
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
    require_run(run, run_name)
    parts = [
        ("loss", _tags.any_pattern([_tags.scalar_pattern(_tags.STEP, ["loss"]),
                                    _tags.scalar_pattern(_tags.EPOCH, ["loss", "val_loss"])])),
        ("global_norm", _tags.per_optimizer_pattern(_tags.GRADIENTS, _tags.GLOBAL_NORM)),
        ("gradient_norms", _tags.statistic_pattern(_tags.GRADIENTS, "l2_norm")),
        ("nan_counts", _tags.statistic_pattern(_tags.GRADIENTS, ["nan_count", "inf_count"])),
        ("update_ratios", _tags.statistic_pattern(_tags.WEIGHTS, "update_ratio")),
        ("activations", _tags.statistic_pattern(
            _tags.ACTIVATIONS, ["dead_fraction", "saturated_fraction", "std"])),
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
    if not epochs:
        # Without it (an install without TensorFlow), StopOnRule's `epoch/` records.
        epochs = _own_epochs(run, run_name)
    data["epochs"] = (pd.concat(epochs, ignore_index=True) if epochs
                      else pd.DataFrame(columns=["run", "tag", "step", "wall_time", "value"]))
    # StopOnRule records whether each step faulted or froze: that it ran, even
    # when no rule fired; a NaN's source as `faults/nan_source/...` scalars.
    data["rule_steps"] = _wide(run, _tags.scalar_pattern(_tags.STEP, ["fault", "frozen"]),
                               run_name)
    data["nan_source"] = _wide(run, "^" + re.escape(_tags.fault("nan_source", "layer")) + "/",
                               run_name)
    # The steps an in-graph fault skipped (StopOnRule(action="skip"/"rollback")).
    data["skipped"] = _wide(run, _tags.per_optimizer_pattern(_tags.STEP, "skipped"), run_name)
    data["tap_extremes"] = _wide(run, _tags.statistic_pattern(
        _tags.ACTIVATIONS, ["max", "min", "nan_count", "inf_count"]), run_name)
    data["learning_rate"], data["learning_rate_epochs"] = _learning_rate(data["epochs"])
    verdicts = pd.DataFrame()
    if run.tags(_tags.VERDICTS, kind="text", run=run_name):
        verdicts = run.texts(_tags.VERDICTS, run=run_name)[["step", "text"]]
    data["verdicts"] = verdicts
    data["rollbacks"] = run.rollbacks(run=run_name)
    if progress:
        progress(total, total, "read")
    return data


def _own_epochs(run: Run, run_name: str) -> List[pd.DataFrame]:
    """`StopOnRule`'s epoch records (`epoch/<log>` at the step that ended each
    epoch, `epoch/learning_rate` among them) in the form of Keras's
    TensorBoard callback: `epoch_<log>` in `run_name`, `epoch_<log>` of a
    `val_<log>` in "validation", the step the epoch's number from 0 (the
    epochs in step order; the rows of one step written again, the last)."""
    pattern = re.escape(_tags.prefix(_tags.EPOCH)) + ".+"
    if run_name not in run.runs or not run.tags("^" + pattern, run=run_name):
        return []
    rows = run.scalars(pattern, run=run_name).drop_duplicates(["tag", "step"], keep="last")
    ends = sorted(rows.step.unique())
    rows = rows.assign(step=rows.step.map({step: i for i, step in enumerate(ends)}))
    name = rows.tag.str.slice(len(_tags.prefix(_tags.EPOCH)))
    validation = name.str.startswith("val_")
    rows = rows.assign(
        run=np.where(validation, "validation", run_name),
        tag="epoch_" + np.where(validation, name.str.slice(len("val_")), name))
    return [rows[~validation], rows[validation]] if validation.any() else [rows]


def _learning_rate(epochs: pd.DataFrame):
    """The learning rate recorded at each epoch's end (`epoch_learning_rate`:
    Keras's TensorBoard callback's, or `StopOnRule`'s `epoch/learning_rate` as
    `_own_epochs` gives it) of the first epoch with a finite one: under a decaying schedule the rate a
    run exploded at is nearer the first than the last. `(rate, {"epoch": its
    epoch from 1, "last": (epoch, rate) of the last epoch when it differs})`,
    or `(None, {})`."""
    rows = epochs[epochs.tag == "epoch_learning_rate"].sort_values("step", kind="stable")
    rows = rows[np.isfinite(rows.value.to_numpy(dtype=float))]
    if not len(rows):
        return None, {}
    first, last = rows.iloc[0], rows.iloc[-1]
    # Keras writes epoch 1 as step 0; users count from 1.
    said = {"epoch": int(first.step) + 1, "last": None}
    if float(last.value) != float(first.value):
        said["last"] = (int(last.step) + 1, float(last.value))
    return float(first.value), said


def require_run(run: Run, run_name: str = "train") -> List[str]:
    """The scalar tags of a run that kerasdbg can read back (`report`,
    `check`); else a `NotARunError` that says what the directory holds: no
    event file, other runs (and, for a directory of log directories, which
    ones to give), no value yet (a fit that has just started, a process
    killed before its first steps reached the event file), or no kerasdbg
    tag.

    Args:
        run: the log directory, from `load_run`.
        run_name: the run of the log directory. Defaults to `"train"`.

    Raises:
        NotARunError: the message says why.

    Examples:
        >>> import tempfile
        >>> from kerasdbg import load_run
        >>> from kerasdbg.report import NotARunError, require_run
        >>> try:
        ...     require_run(load_run(tempfile.mkdtemp()))
        ... except NotARunError as error:
        ...     print(str(error).split("; ")[0].split("' ")[1])
        holds no TensorBoard event files
    """
    log_dir = run.log_dir
    if not run.runs:
        raise NotARunError(
            f"{log_dir!r} holds no TensorBoard event files; give the log_dir of the "
            "kerasdbg callbacks (e.g. GradientStatistics(log_dir))"
        )
    if run_name not in run.runs:
        # A directory of log directories (`runs/demo` of `runs/demo/healthy/train`).
        nested = sorted({os.path.join(log_dir, name[:-len(run_name) - 1]) for name in run.runs
                         if name.endswith("/" + run_name)})
        hint = (f" It holds the log directories {', '.join(nested)}: give one of them."
                if nested else "")
        raise NotARunError(
            f"{log_dir!r} has no run {run_name!r}. Runs: {', '.join(run.runs)}.{hint}")
    tags = run.tags(run=run_name)
    if any(t.startswith(KERASDBG_PREFIXES) for t in tags):
        return tags
    # Another training in the same directory is a run of its own (`train-2`).
    others = [name for name in run.runs if name != run_name
              and any(t.startswith(KERASDBG_PREFIXES) for t in run.tags(run=name))]
    elsewhere = f" Runs with kerasdbg tags: {', '.join(others)}." if others else ""
    if not tags and not run.tags(kind="histograms", run=run_name) \
            and not run.tags(kind="text", run=run_name):
        raise NotARunError(
            f"run {run_name!r} of {log_dir!r} holds no values yet: its event files hold no "
            "step (a fit that has just started, or a process killed before its first steps "
            f"were written).{elsewhere}"
        )
    raise NotARunError(
        f"run {run_name!r} of {log_dir!r} holds no kerasdbg tags (gradients/, weights/, "
        f"activations/, step/, epoch/). Its tags: {', '.join(tags[:10]) or '(none)'}.{elsewhere}"
    )


def other_trainings(run: Run, run_name: str = "train") -> str:
    """A note naming the other trainings of a log directory (`train-2`, ...:
    another training in a used log directory is a run of its own), or "".

    Examples:
        >>> import tempfile
        >>> from kerasdbg import load_run
        >>> from kerasdbg.report import other_trainings
        >>> other_trainings(load_run(tempfile.mkdtemp()))
        ''
    """
    others = [name for name in run.runs
              if name != run_name and re.fullmatch(r"train(-\d+)?", name)]
    if not others:
        return ""
    return (f"{run.log_dir!r} holds other trainings as runs of their own: {', '.join(others)} "
            f"(--run {others[-1]}); this is run {run_name!r}")


def first_positive_step(table: pd.DataFrame) -> Optional[int]:
    """The first step (index) at which any column is above 0 (e.g. NaN counts), or None.

    Examples:
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

    Examples:
        >>> import pandas as pd
        >>> from kerasdbg.report import mean_norms
        >>> mean_norms(pd.DataFrame({"a": [1.0, 3.0], "b": [0.5, float("inf")]})).to_dict()
        {'b': 0.5, 'a': 2.0}
    """
    return norms.replace([np.inf, -np.inf], np.nan).mean().dropna().sort_values()


def median_norms(norms: pd.DataFrame, before: Optional[int] = None) -> pd.Series:
    """Each column's median over the steps (before step `before` when given),
    finite values only, smallest first: a median is not pulled up by the few
    steps of a run that exploded, as a mean is.

    Examples:
        >>> import pandas as pd
        >>> from kerasdbg.report import median_norms
        >>> frame = pd.DataFrame({"a": [1.0, 2.0, 3.0, 1e30], "b": [0.5, 0.7, 0.6, float("nan")]},
        ...                      index=[1, 2, 3, 4])
        >>> median_norms(frame).to_dict()
        {'b': 0.6, 'a': 2.5}
        >>> median_norms(frame, before=4).to_dict()
        {'b': 0.6, 'a': 2.0}
    """
    if before is not None:
        norms = norms[norms.index < before]
    return norms.replace([np.inf, -np.inf], np.nan).median().dropna().sort_values()


def first_growth_step(global_norm: pd.DataFrame,
                      growth: float = GROWTH) -> Optional[Tuple[int, float]]:
    """The first step at which a column (a global gradient norm) is more than
    `growth` times its previous recorded finite, positive value, and that
    factor; None when none is. NaN/Inf and zeros are skipped.

    Examples:
        >>> import pandas as pd
        >>> from kerasdbg.report import first_growth_step
        >>> first_growth_step(pd.DataFrame({"g": [0.9, 3126.0, 1.2e10]}, index=[1, 2, 3]))
        (2, 3473.333333333333)
        >>> first_growth_step(pd.DataFrame({"g": [1.0, 5.0, 2.0]}, index=[1, 2, 3])) is None
        True
    """
    found = []
    for column in global_norm.columns:
        series = global_norm[column].astype(float)
        series = series[np.isfinite(series.to_numpy()) & (series.to_numpy() > 0)].sort_index()
        values = series.to_numpy()
        ratios = values[1:] / values[:-1]
        over = np.flatnonzero(ratios > growth)
        if over.size:
            found.append((int(series.index[over[0] + 1]), float(ratios[over[0]])))
    return min(found) if found else None


def median_window(data: Dict[str, object]) -> Tuple[Optional[int], str]:
    """Where the median gradient norms of `summary` end: `(step, why)`, the
    window being the steps before `step`: the first non-finite step, or, when
    earlier, the first step at which the global gradient norm grew more than
    `GROWTH` times over the previous recorded step (a run that explodes grows
    by orders of magnitude before its first NaN). `(None, "")` when neither.

    Args:
        data: from `collect`.

    Examples:
        >>> import pandas as pd
        >>> from kerasdbg.report import median_window
        >>> empty = pd.DataFrame()
        >>> median_window({"loss": empty, "nan_counts": empty, "global_norm": pd.DataFrame(
        ...     {"gradients/global_norm": [0.9, 3126.0]}, index=[1, 2])})
        (2, 'before step 2, where the global gradient norm grew 3.47e+03x (> 10x) over the step before')
    """
    first = _first_nonfinite(data)
    grew = first_growth_step(data.get("global_norm", pd.DataFrame()))
    if grew is not None and (first is None or grew[0] < first):
        return grew[0], (f"before step {grew[0]}, where the global gradient norm grew "
                         f"{grew[1]:.3g}x (> {GROWTH:g}x) over the step before")
    if first is not None:
        return first, "before the first non-finite step"
    return None, ""


def run_title(data: Dict[str, object]) -> str:
    """The run as a user names it: its directory's name (`lr_too_high`), and the
    training when it is not the first (`train-2`).

    Examples:
        >>> from kerasdbg.report import run_title
        >>> run_title({"log_dir": "runs/demo/lr_too_high/", "run": "train"})
        'lr_too_high'
        >>> run_title({"log_dir": "runs/x", "run": "train-2"})
        'x (training train-2)'
    """
    name = os.path.basename(os.path.normpath(os.path.abspath(str(data["log_dir"]))))
    return name + ("" if data["run"] == "train" else f" (training {data['run']})")


def stop_on_rule_steps(data: Dict[str, object]) -> List[int]:
    """The steps at which `StopOnRule` ran its rules, from its records
    (`step/fault`, `step/frozen`); empty when it did not run with a `log_dir`.

    Examples:
        >>> import keras, numpy as np, tempfile
        >>> from kerasdbg.callbacks import StopOnRule
        >>> from kerasdbg.report import collect, stop_on_rule_steps
        >>> log_dir = tempfile.mkdtemp()
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0,
        ...               callbacks=[StopOnRule(log_dir=log_dir, verbose=False)])
        >>> stop_on_rule_steps(collect(log_dir))
        [1, 2]
    """
    return sorted(int(s) for s in data.get("rule_steps", pd.DataFrame()).index)


def _steps_text(steps: List[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def summary(data: Dict[str, object], top: int = 3) -> str:
    """A short text summary of `collect`'s data: steps, the first non-finite
    step, the variables with the largest and smallest median gradient norms
    over the steps before `median_window`'s step (the first non-finite one,
    or the first where the global norm grew more than `GROWTH` times: said
    beside them; "none finite before step N" when no step is left), the number of rule
    verdicts (or that `StopOnRule` ran and none fired), and what to try for
    each rule that fired.

    Examples:
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
          largest median gradient norms:  m/d/kernel (...), m/d/bias (...)
          smallest median gradient norms: m/d/bias (...), m/d/kernel (...)
          rule verdicts: 0 (no StopOnRule(log_dir=...) records: no rule ran)
    """
    lines = [f"run {run_title(data)} ({data['log_dir']})"]
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
        end, why = median_window(data)
        median = median_norms(norms, before=end)
        median.index = _tensors(median.index)
        kept = sorted(int(s) for s in norms.index if end is None or s < end)
        over = f" ({_steps_text(kept)}, {why})" if end is not None and len(median) else ""
        for which, ranked in (("largest", median.iloc[::-1]), ("smallest", median)):
            said = (", ".join(f"{name} ({value:.3g})" for name, value in ranked[:top].items())
                    if len(median) else "none finite" + (f" before step {end}" if end else ""))
            lines.append(f"  {which} median gradient norms{over}:{' ' if which[0] == 'l' else ''}"
                         f" {said}")
            over = " (same steps)" if over else ""
    verdicts: pd.DataFrame = data["verdicts"]
    count = _verdict_count(verdicts)
    ran = stop_on_rule_steps(data)
    if count:
        why = ""
    elif ran:
        why = f" (StopOnRule ran its rules at {_steps_text(ran)}: none fired)"
    else:
        why = " (no StopOnRule(log_dir=...) records: no rule ran)"
    lines.append(f"  rule verdicts: {count}{why}")
    note = learning_rate_note(data.get("learning_rate"), **data.get("learning_rate_epochs", {}))
    fired = list(dict.fromkeys(r["rule"] for r in _verdict_rows(verdicts) if r["rule"]))
    if note and any(rule in LEARNING_RATE_RULES for rule in fired):
        lines.append(f"  likely cause: {note}")
    for text, rules in first_tries(fired):  # a remedy once, naming the rules it answers
        lines.append(f"  try: {text} (for {', '.join(rules)}; more in report.html)")
    skipped = skipped_steps(data)
    if skipped:
        listed = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        lines.append(f"  skipped steps: {len(skipped)} ({listed}): nothing was applied there "
                     "(an in-graph fault, or the batches after a rollback)")
    rollbacks = data.get("rollbacks")
    if rollbacks is not None and len(rollbacks):
        first = rollbacks.iloc[0]
        dropped = first["dropped"]
        lines.append(
            f"  rolled back: training restarted at step {int(first['step'])} "
            f"({len(rollbacks)} time{'s' if len(rollbacks) > 1 else ''}); steps "
            f"{dropped[0]}-{dropped[-1]} of the abandoned run are left out")
    return "\n".join(lines)


def skipped_steps(data: Dict[str, object]) -> List[int]:
    """The steps whose update an in-graph fault skipped (`step/skipped`, of
    any optimizer), in order; empty when none was or nothing says.

    Examples:
        >>> import os, tempfile
        >>> from kerasdbg.report import collect, skipped_steps
        >>> from kerasdbg.sinks import events as _events
        >>> log_dir = tempfile.mkdtemp()
        >>> writer = _events.EventWriter(os.path.join(log_dir, "train"))
        >>> for step in (1, 2, 3):
        ...     writer.write(step, {"step/loss": 1.0, "step/skipped": float(step == 2)})
        >>> writer.flush()
        >>> skipped_steps(collect(log_dir))
        [2]
    """
    table = data.get("skipped")
    if table is None or not len(table):
        return []
    return sorted(int(s) for s, row in table.iterrows() if (row.fillna(0) > 0).any())


def _verdict_count(verdicts: pd.DataFrame) -> int:
    """The verdicts of the texts `StopOnRule` writes, each once."""
    return sum(1 for row in _verdict_rows(verdicts) if row["rule"])


def _verdict_rows(verdicts: pd.DataFrame) -> List[Dict[str, object]]:
    """The rows of the verdict texts (`collect(...)["verdicts"]`), in order
    (`verdict_rows`; a line that is not a row takes its text's step), each
    once: a write holds the run's verdicts so far."""
    rows, seen = [], set()
    for step, text in zip(verdicts.get("step", []), verdicts.get("text", [])):
        for row in verdict_rows(text):
            row = {**row, "step": int(step) if row["step"] is None else row["step"]}
            key = (row["rule"], row["step"], row["reason"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def _no_verdict_lines(verdicts: pd.DataFrame) -> List[str]:
    """The "no verdict" lines of the last verdict text (the rules that ran and did
    not fire), where StopOnRule writes them; else none."""
    try:
        from kerasdbg.records.verdicts import no_verdict
    except ImportError:  # a records module without them: StopOnRule's records say it
        return []
    texts = list(verdicts.get("text", []))
    return no_verdict(texts[-1]) if texts else []


def _tensor_cell(tensors: List[str], hidden: int) -> str:
    """At most `TENSORS_PER_CELL` tensors, then how many more (`hidden`: those
    the writer left out; -1 when it did not count them)."""
    shown = "<br>".join(f"<code>{html.escape(t)}</code>" for t in tensors[:TENSORS_PER_CELL])
    more = max(len(tensors) - TENSORS_PER_CELL, 0) + max(hidden, 0)
    if more:
        text = f"… and {more}{'+' if hidden < 0 else ''} more"
    else:
        text = "… and more" if hidden < 0 else ""
    return shown + (f"<br><em>{text}</em>" if text else "")


def _verdict_table(verdicts: pd.DataFrame) -> str:
    """The verdicts as an HTML table (rule, step, tensors, reason), every text escaped."""
    return _rows_table(_verdict_rows(verdicts))


def _rows_table(rows: List[Dict[str, object]], link: bool = True) -> str:
    """Verdict rows (`_verdict_rows`) as the HTML table of `_verdict_table`;
    `link`: each rule linked to its "What to try" row."""
    if not rows:
        return "<p>None recorded (StopOnRule(log_dir=...) writes them).</p>"
    body = "".join(
        f"<tr><td>{_rule_link(r['rule']) if link else html.escape(r['rule'])}</td>"
        f"<td>{r['step']}</td>"
        f"<td>{_tensor_cell(r['tensors'], r['hidden'])}</td><td>{html.escape(r['reason'])}</td></tr>"
        for r in rows[:VERDICT_ROWS])
    left = len(rows) - VERDICT_ROWS
    note = (f"<p>… and {left} more verdicts (all of them: TensorBoard's Text dashboard, tag "
            f"<code>{_tags.VERDICTS}</code>).</p>" if left > 0 else "")
    return ('<table class="verdicts"><colgroup><col style="width:14%"><col style="width:7%">'
            '<col style="width:33%"><col style="width:46%"></colgroup>'
            "<tr><th>rule</th><th>step</th><th>tensors</th><th>reason</th></tr>"
            f"{body}</table>{note}")


def _rule_link(rule: str) -> str:
    """The rule's name, linked to its "What to try" entry when it has one."""
    if rule in REMEDIES:
        return f'<a href="#try-{html.escape(rule)}">{html.escape(rule)}</a>'
    return html.escape(rule)


def _no_verdicts(data: Dict[str, object]) -> str:
    """What the verdict section says when no rule fired: that StopOnRule ran
    (from its records) and nothing fired, or that no rule ran."""
    return _no_verdict_html(stop_on_rule_steps(data), _verdict_rows(data["verdicts"]),
                            _no_verdict_lines(data["verdicts"]))


def _no_verdict_html(ran: List[int], rows: List[Dict[str, object]],
                     lines: Sequence[str] = ()) -> str:
    """`_no_verdicts` of the steps StopOnRule ran at, the verdict text's rows
    (lines that are not a verdict are shown) and its "no verdict" lines."""
    notes = list(lines) + [r["reason"] for r in rows if not r["rule"]]
    said = "".join(f"<p>{html.escape(n)}</p>" for n in notes)
    if ran:
        return (f"<p>No rule fired: StopOnRule ran its rules at {_steps_text(ran)} "
                "(its <code>step/fault</code> and <code>step/frozen</code> records) and none "
                f"gave a verdict.</p>{said}")
    return ("<p>No rule ran: the run holds no StopOnRule records (StopOnRule(log_dir=...) "
            f"writes them, and its verdicts).</p>{said}")


def _layer_variables(data: Dict[str, object], layer: str) -> List[str]:
    """The recorded variables of a layer (`m/conv2/kernel` of `conv2`)."""
    names = _tensors(data["gradient_norms"].columns) + _tensors(data["update_ratios"].columns)
    return list(dict.fromkeys(n for n in names if layer in n.split("/")[:-1]))


def _value_at(frame: pd.DataFrame, column: str, step: int) -> Optional[float]:
    if column not in frame.columns or step not in frame.index:
        return None
    value = frame.at[step, column]
    return None if pd.isna(value) else float(value)


def _nan_source_facts(data: Dict[str, object], layer: str, step: int) -> List[str]:
    """What the records say of a layer whose output first held NaN/Inf at `step`:
    its weights' gradient norms and update ratios at the step before, and the
    taps' largest values and NaN/Inf counts at the step (the layer's inputs when
    a tap sits before it)."""
    facts = []
    norms, ratios = data["gradient_norms"], data["update_ratios"]
    for name in _layer_variables(data, layer):
        parts = []
        for label, frame, stat in (("gradient norm", norms, "l2_norm"),
                                   ("update ratio", ratios, "update_ratio")):
            value = _value_at(frame, _tags.statistic(
                _tags.GRADIENTS if frame is norms else _tags.WEIGHTS, name, stat), step - 1)
            if value is not None:
                parts.append(f"{label} {value:.3g}")
        if parts:
            facts.append(f"{name} at step {step - 1}: " + ", ".join(parts))
    taps = data.get("tap_extremes", pd.DataFrame())
    for tap in dict.fromkeys(_tensors(taps.columns)):
        parts = []
        for stat in ("max", "min", "nan_count", "inf_count"):
            value = _value_at(taps, _tags.statistic(_tags.ACTIVATIONS, tap, stat), step)
            if value is not None and (stat in ("max", "min") or value):
                parts.append(f"{stat} {value:.3g}")
        if parts:
            facts.append(f"tap {tap} at step {step}: " + ", ".join(parts))
    return facts


_INPUT_LAYER = re.compile(r"input_layer(_\d+)?|input_\d+")
"""The names Keras gives a model's `Input` layers."""


def _remedies(data: Dict[str, object]) -> str:
    """The "What to try" section: for each rule that fired (its first verdict),
    the likely causes and what to try, with the run's own facts (its learning
    rate against the usual ranges; a NaN's layer and what was recorded around
    it)."""
    rows = [r for r in _verdict_rows(data["verdicts"]) if r["rule"]]
    first = {}
    for row in rows:
        first.setdefault(row["rule"], row)
    if not first:
        return ""
    rate = data.get("learning_rate")
    note = learning_rate_note(rate, **data.get("learning_rate_epochs", {}))
    blocks = []
    for rule, row in first.items():
        remedy = REMEDIES.get(rule)
        if remedy is None:
            continue
        facts = []
        if rule in LEARNING_RATE_RULES and note:
            facts.append(f"the learning rate, {rate:g} (above)")
        if rule == "NaNSource":
            found = data.get("nan_source", pd.DataFrame())
            layers = [c for c in found.columns if _value_at(found, c, row["step"]) is not None]
            layer = layers[0][len(_tags.fault("nan_source", "layer")) + 1:] if layers else (
                row["tensors"][0] if row["tensors"] else None)
            if layer and _INPUT_LAYER.fullmatch(layer):
                facts.append(f"{layer!r} is the model's input: the batch of step {row['step']} "
                             "held NaN/Inf, before any layer computed (check the data)")
            elif layer:
                found = _nan_source_facts(data, layer, row["step"])
                facts.append(
                    f"layer {layer!r} first held NaN/Inf at step {row['step']}; recorded "
                    "around it (its weights at the step before, the taps at the step: its "
                    "input where a tap sits before it): " + (
                        "; ".join(found) if found else "nothing (no statistics of its "
                        "weights or of a tap)"))
        said = "".join(f"<li><strong>{html.escape(f)}</strong></li>" for f in facts)
        items = "".join(f"<li>{_code_spans(c)}</li>" for c in remedy.causes)
        tries = "".join(f"<li>{_code_spans(t)}</li>" for t in remedy.tries)
        blocks.append(
            f'<tr id="try-{html.escape(rule)}"><td>{html.escape(rule)}<br>(step {row["step"]})'
            f"</td><td><ul>{said}{items}</ul></td><td><ul>{tries}</ul></td></tr>")
    if not blocks:
        return ""
    head = ""
    if note and any(rule in LEARNING_RATE_RULES for rule in first):
        head = (f'<p class="cause"><strong>{html.escape(note[0].upper() + note[1:])}.</strong> '
                "(From the learning rate recorded at each epoch's end: "
                "the first epoch's, nearest the rate a run that exploded early trained at; "
                "the optimizer is not "
                "recorded, so the ranges of the common ones are given.)</p>")
    elif rate is None and any(rule in LEARNING_RATE_RULES for rule in first):
        head = ("<p>The learning rate is not recorded (<code>StopOnRule</code> records it "
                "at each epoch's end as <code>epoch/learning_rate</code>, and Keras's "
                "TensorBoard callback in the same log_dir as "
                "<code>epoch_learning_rate</code>).</p>")
    return ("<h2>What to try</h2>" + head + '<table class="remedies"><colgroup>'
            '<col style="width:16%"><col style="width:46%"><col style="width:38%"></colgroup>'
            "<tr><th>rule (first verdict)</th><th>likely causes (this run's first, in bold)"
            f"</th><th>what to try</th></tr>{''.join(blocks)}</table>")


def _code_spans(text: str) -> str:
    """`text` escaped, its `backquoted` parts as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _first_nonfinite(data) -> Optional[int]:
    candidates = []
    loss: pd.DataFrame = data["loss"]
    if _tags.LOSS in loss.columns:
        bad = loss.index[~np.isfinite(loss[_tags.LOSS].to_numpy(dtype=float))
                         & loss[_tags.LOSS].notna().to_numpy()]
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
    try:
        figure.tight_layout()
        figure.savefig(path, dpi=96)
    finally:  # a write that failed (a full disk) leaves no figure open
        plt.close(figure)
    return path


def _plot_lines(frame: pd.DataFrame, title: str, ylabel: str, path: str,
                log: Optional[bool] = False, labels: Optional[List[str]] = None,
                mark: Optional[int] = None, mark_label: str = "first non-finite step") -> str:
    """Lines over optimizer steps. `log=None` picks a log scale when the finite
    values are positive and span more than three decades (a diverging loss);
    `mark` draws a step (by default the first non-finite one: `mark_label`)."""
    plt, MaxNLocator = _pyplot()

    finite = frame.replace([np.inf, -np.inf], np.nan)
    if log is None:
        values = finite.to_numpy(dtype=float)
        values = values[~np.isnan(values)]
        log = bool(values.size and values.min() > 0 and values.max() / values.min() > 1e3)
    drawn = []
    for column, label in zip(frame.columns, labels or list(frame.columns)):
        series = finite[column].dropna()
        if log:
            series = series[series > 0]
        if len(series):  # a series with nothing to draw stays out of the legend
            drawn.append((label, series))
    entries = len(drawn) + (mark is not None)
    # Beyond four entries the legend goes to the right, off the lines.
    figure, axes = plt.subplots(figsize=(8 if entries <= 4 else 10, 3.6))
    for label, series in drawn:
        steps = series.index.to_numpy(dtype=float)
        values = series.to_numpy(dtype=float)
        # A line joins consecutive steps only: a marker on each recorded step,
        # no line drawn across steps that were not recorded (sampled statistics).
        gap = np.flatnonzero(np.diff(steps) > 1) + 1
        axes.plot(np.insert(steps, gap, np.nan), np.insert(values, gap, np.nan),
                  label=label, linewidth=1.2, marker="o",
                  markersize=3 if len(series) <= 60 else 1.5)
    if mark is not None:
        axes.axvline(mark, color="crimson", linestyle="--", linewidth=1,
                     label=f"{mark_label} ({mark})")
    if log:
        axes.set_yscale("log")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(ylabel)
    if 1 < entries <= 4:
        axes.legend(fontsize=7, loc="best")
    elif 4 < entries <= TOP_LINES + 2:
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes.grid(alpha=0.3)
    return _save(plt, figure, path)


def _largest(frame: pd.DataFrame, count: int) -> List[str]:
    """The `count` columns with the largest finite maximum, largest first (columns
    without a finite value last, in their order)."""
    peaks = frame.replace([np.inf, -np.inf], np.nan).max()
    order = sorted(range(len(frame.columns)),
                   key=lambda i: (np.isnan(peaks.iloc[i]), -np.nan_to_num(peaks.iloc[i]), i))
    return [frame.columns[i] for i in order[:count]]


_OFFSETS = ("bias", "beta", "gamma", "moving_mean", "moving_variance")


def _is_offset(variable: str) -> bool:
    """A bias or a normalisation layer's weight (`.../bias`, `.../gamma`), not a kernel."""
    return variable.rsplit("/", 1)[-1] in _OFFSETS


def _name_order(names: List[str]) -> List[str]:
    """Names sorted with their numbers by value (`dense_2` before `dense_10`): for
    Keras's layer names, the order the layers were made in."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p
                                        for p in re.split(r"(\d+)", n)])


def _common_prefix(names: List[str]) -> str:
    """The `/`-separated prefix every name shares and none is (e.g. `resnet50/`)."""
    if len(names) < 2:
        return ""
    parts = os.path.commonprefix([n.split("/") for n in names])
    prefix = "/".join(parts) + "/" if parts else ""
    return prefix if all(len(n) > len(prefix) for n in names) else ""


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
            # Keras writes epoch 1 as step 0; users count from 1.
            axes.plot(series.step[finite] + 1, series.value[finite], marker="o", label=run,
                      linewidth=1.2)
            bad += [f"{run} {int(e) + 1}" for e in series.step[~finite]]
        if bad:
            axes.text(0.02, 0.95, "non-finite at epoch: " + ", ".join(bad), color="crimson",
                      fontsize=7, transform=axes.transAxes, va="top")
        shown = sorted(int(e) + 1 for e in epochs.step.unique())
        if len(shown) <= 12:
            axes.set_xticks(shown)
            axes.set_xlim(shown[0] - 0.5, shown[-1] + 0.5)
        else:
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(metric, fontsize=9)
        axes.set_xlabel("epoch", fontsize=8)
        axes.legend(fontsize=7, loc="best")
        axes.grid(alpha=0.3)
    for axes in list(grid.flat)[len(metrics):]:
        axes.set_visible(False)
    return _save(plt, figure, path)


def _plot_heatmap(frame: pd.DataFrame, path: str, title: str, what: str,
                  log: bool = True, unit: str = "") -> str:
    """Steps x columns of `frame` as colours, one row per column in name order,
    log10 (blank: zero or non-finite) or linear (0-1, for fractions). Every row
    is named up to about 340 rows (the figure grows with them); beyond, the
    labels thin out (every n-th) and the height is bounded."""
    plt, MaxNLocator = _pyplot()

    names = _name_order(list(frame.columns))
    prefix = _common_prefix(names)
    values = frame[names].T.to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        if log:
            shown = np.where(np.isfinite(values) & (values > 0), np.log10(values), np.nan)
        else:
            shown = np.where(np.isfinite(values), values, np.nan)
    rows = len(names)
    # 11 px a row names every row up to ~340 (a ResNet50's 214 variables); beyond, every n-th.
    height = min(max(2.0, 0.8 + max(0.32 * min(rows, 20), 0.115 * rows)), 40.0)
    stride = max(1, math.ceil(rows * 10 / (96 * (height - 0.8))))  # >= 10 px per label
    figure, axes = plt.subplots(figsize=(8, height))
    image = axes.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis",
                        vmin=None if log else 0, vmax=None if log else 1,
                        extent=(frame.index.min() - 0.5, frame.index.max() + 0.5,
                                rows - 0.5, -0.5))
    axes.set_yticks(range(0, rows, stride))
    axes.set_yticklabels([n[len(prefix):] for n in names[::stride]],
                         fontsize=7 if rows <= 24 else 6)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(f"{rows} {what}" + (f" of {prefix}" if prefix else "") + " in name order"
                    + (f", one named per {stride}" if stride > 1 else ""), fontsize=8)
    axes.set_title(title + (" (log10; blank: zero or non-finite)" if log
                            else " (blank: non-finite)"), fontsize=10)
    bar = figure.colorbar(image, ax=axes, fraction=0.03, pad=0.02)
    bar.set_label(f"log10 of the {unit}" if log else unit, fontsize=8)
    return _save(plt, figure, path)


def _epoch_table(epochs: pd.DataFrame) -> str:
    """Keras's epoch logs of a one-epoch run as an HTML table: a row per metric, a
    column per run (train, validation)."""
    runs = list(dict.fromkeys(epochs.run))
    head = "".join(f"<th>{html.escape(r)}</th>" for r in runs)
    body = ""
    for metric in sorted(epochs.tag.unique()):
        cells = ""
        for run in runs:
            values = epochs[(epochs.tag == metric) & (epochs.run == run)].value
            cells += f"<td>{float(values.iloc[-1]):.4g}</td>" if len(values) else "<td></td>"
        body += f"<tr><td>{html.escape(metric)}</td>{cells}</tr>"
    epoch = int(epochs.step.iloc[0]) + 1  # Keras writes epoch 1 as step 0
    return (f"<p>Epoch {epoch}, the only one recorded: its values.</p>"
            f'<table class="epochs"><tr><th>metric</th>{head}</tr>{body}</table>')


def write_report(log_dir: str, out: Optional[str] = None, run_name: str = "train",
                 progress_stream: Optional[TextIO] = None) -> str:
    """Writes `report.html` and its PNG plots; returns the HTML file's path.

    The page, headed by the run's directory name, shows the text `summary`,
    the rule verdicts as a table (rule, step, tensors, reason;
    `TENSORS_PER_CELL` tensors a cell, the rest counted; when none fired,
    whether `StopOnRule` ran), "What to try": each rule's likely causes and
    remedies (`kerasdbg.rules.remedies`) with this run's facts (its learning
    rate against the usual ranges, a NaN's layer and what was recorded
    around it), the loss, Keras's epoch logs (when its `TensorBoard` callback
    shared the log directory: plotted per epoch, or a table of the values
    after one epoch), the global gradient norm, a per-layer gradient-norm
    heatmap (layers x steps, in name order), the weights' update ratios and
    the activation health of the taps, each when the run recorded it. A plot
    of one line per variable (or tap) draws the `TOP_LINES` with the largest
    maximum when there are more, and a heatmap of all of them below it
    (`<name>_heatmap.png`), so that it stays legible with hundreds of
    variables (a ResNet50 has 214).

    Args:
        log_dir: a log directory written by kerasdbg's callbacks.
        out: where to write. Defaults to `<log_dir>/report`.
        run_name: the run of the log directory. Defaults to `"train"`.
        progress_stream: a stream for a progress bar (e.g. `sys.stderr`), or None.

    Raises:
        FileNotFoundError: `log_dir` is not a directory.
        NotARunError: it holds nothing kerasdbg can report on.
        NotADirectoryError: `out` is a file.
        OSError: a file of the report could not be written (a full disk, a
            directory without write permission); the error names it.

    Examples:
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


_STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:auto;padding:0 8px}"
    "img{max-width:100%;display:block;margin:4px 0}"
    "pre{white-space:pre-wrap;overflow-wrap:anywhere}"
    "table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:4px;vertical-align:top;text-align:left}"
    "table.verdicts{width:100%;table-layout:fixed}"
    "table.verdicts td{overflow-wrap:anywhere;font-size:0.9em}"
    "table.remedies{width:100%;table-layout:fixed;font-size:0.9em}"
    "table.remedies ul{margin:0;padding-left:1.2em}"
    "code{font-size:0.95em}.caption{font-size:0.9em;color:#444}"
)


def _out(log_dir: str, out: Optional[str]) -> str:
    """Where the report goes: `out`, or `<log_dir>/report`; a file is refused."""
    out = out or os.path.join(log_dir, "report")
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(
            f"write_report: `out` must be a directory (made if missing), not a file. "
            f"Received: out={out!r}")
    return out


def _write(data: Dict[str, object], out: Optional[str]) -> str:
    out = _out(data["log_dir"], out)
    os.makedirs(out, exist_ok=True)
    sections = []

    def figure(name: str, title: Optional[str], make, alt: Optional[str] = None,
               caption: str = "") -> None:
        make(os.path.join(out, name))
        sections.append((f"<h2>{html.escape(title)}</h2>" if title else "") + caption
                        + f'<img src="{html.escape(name)}" alt="{html.escape(alt or title)}">')

    def per_variable(stem: str, title: str, frame: pd.DataFrame, labels: List[str],
                     plot_title: str, ylabel: str, what: str, log: bool,
                     kernels_first: bool = False) -> None:
        """A line per column; beyond TOP_LINES, the largest ones and a heatmap of all."""
        frame = frame.copy()
        frame.columns = labels
        if len(labels) <= TOP_LINES:
            figure(f"{stem}.png", title, lambda p: _plot_lines(
                frame, plot_title, ylabel, p, log=log))
            return
        prefix = _common_prefix(labels)
        under = f" (names under <code>{html.escape(prefix)}</code>)" if prefix else ""
        kernels = [c for c in labels if not _is_offset(c)] if kernels_first else []
        if kernels and len(kernels) < len(labels):
            # A bias or a normalisation's scale moves far more, relative to its size,
            # than a kernel: ranked together, the largest are all biases.
            drawn = _largest(frame[kernels], TOP_LINES)
            caption = (f'<p class="caption">Lines: the {len(drawn)} of {len(kernels)} kernels '
                       f"with the largest maximum{under} (biases and normalisation weights, "
                       f"{len(labels) - len(kernels)} more, move more relative to their size "
                       f"and are ranked apart); the heatmap below shows all {len(labels)}.</p>")
        else:
            drawn = _largest(frame, TOP_LINES)
            caption = (f'<p class="caption">Lines: the {len(drawn)} of {len(labels)} {what} '
                       f"with the largest maximum{under}; the heatmap below shows all "
                       f"{len(labels)}.</p>")
        figure(f"{stem}.png", title, lambda p: _plot_lines(
            frame[drawn], f"{plot_title}: the {len(drawn)} largest"
            + (" kernels" if kernels and len(kernels) < len(labels) else ""), ylabel, p, log=log,
            labels=[d[len(prefix):] for d in drawn]),
            alt=f"{title}, lines: {', '.join(drawn)}", caption=caption)
        figure(f"{stem}_heatmap.png", None, lambda p: _plot_heatmap(
            frame, p, f"{plot_title}, all {len(labels)}", what, log=log, unit=ylabel),
            alt=f"{title}: heatmap of all {len(labels)} {what}")

    table = (_verdict_table(data["verdicts"]) if any(r["rule"] for r in _verdict_rows(
        data["verdicts"])) else _no_verdicts(data))
    sections.append("<h2>Rule verdicts</h2>" + table + _remedies(data))
    first = _first_nonfinite(data)
    loss: pd.DataFrame = data["loss"]
    if len(loss.columns):
        figure("loss.png", "Loss", lambda p: _plot_lines(loss, "loss", "loss", p, log=None,
                                                         mark=first))
    epochs: pd.DataFrame = data["epochs"]
    epochs_title = "Keras's epoch logs"
    if epochs.step.nunique() > 1:
        figure("epochs.png", epochs_title, lambda p: _plot_epochs(epochs, p))
    elif len(epochs):  # a plot of one dot per metric says less than its numbers
        sections.append(f"<h2>{html.escape(epochs_title)}</h2>{_epoch_table(epochs)}")
    if len(data["global_norm"].columns):
        figure("global_norm.png", "Global gradient norm", lambda p: _plot_lines(
            data["global_norm"], "global gradient norm", "norm", p, log=True, mark=first))
    norms: pd.DataFrame = data["gradient_norms"]
    if len(norms.columns):
        norms = norms.copy()
        norms.columns = _tensors(norms.columns)
        figure("gradient_heatmap.png", "Gradient norm per layer", lambda p: _plot_heatmap(
            _layer_norms(norms), p, "gradient norm per layer", "layers", unit="norm"))
    ratios: pd.DataFrame = data["update_ratios"]
    if len(ratios.columns):
        per_variable("update_ratios", "Update ratio per variable", ratios,
                     _tensors(ratios.columns),
                     "update ratio ||dw|| / ||w||", "ratio", "variables", log=True,
                     kernels_first=True)
    health: pd.DataFrame = data["activations"]
    fractions = [c for c in health.columns if _tags.tag_parts(c)[2].endswith("_fraction")]
    if fractions:
        per_variable("activation_health", "Activation health", health[fractions],
                     [_tags.column(c, _tags.ACTIVATIONS) for c in fractions],
                     "dead / saturated units of the taps",
                     "fraction of units", "tap statistics", log=False)
    elif len(health.columns):
        per_variable("activation_health", "Activation spread", health,
                     _tensors(health.columns),
                     "standard deviation of the tapped activations", "std", "taps", log=True)
    text = summary(data)
    page = os.path.join(out, "report.html")
    with open(page, "w", encoding="utf-8") as stream:
        stream.write(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kerasdbg report</title>"
            f"<style>{_STYLE}</style></head><body>"
            f"<h1>kerasdbg report: {html.escape(run_title(data))}</h1>"
            f"<pre>{html.escape(text)}</pre>{''.join(sections)}"
            "</body></html>"
        )
    return page


def main_report(log_dir: str, out: Optional[str], run_name: str) -> int:
    """The `kerasdbg report` command: exit status 0, or 2 on bad input or
    when the report cannot be written."""
    try:
        out = _out(log_dir, out)
        data = collect(log_dir, run_name, _progress(sys.stderr))
    except (FileNotFoundError, NotADirectoryError, NotARunError) as error:
        print(f"kerasdbg report: {error}", file=sys.stderr)
        return 2
    note = other_trainings(load_run(log_dir), run_name)
    if note:
        print(f"kerasdbg report: {note}", file=sys.stderr)
    try:
        page = _write(data, out)
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        print(f"kerasdbg report: could not write the report in {out!r}: "
              f"{error.strerror or error}{where}", file=sys.stderr)
        return 2
    print(summary(data))
    print(f"report: {page}")
    return 0


