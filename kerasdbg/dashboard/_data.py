"""What kerasdbg's TensorBoard dashboard shows, read from a log directory as JSON-able dicts.

TensorBoard names a run by its directory relative to `--logdir`
(`healthy/train`); `kerasdbg.reader.load_run` names runs the same way, so a
run here is read with `report.collect(logdir, run_name=<that name>)`, as
`kerasdbg report` reads it.

JSON has no NaN: a recorded value that is not finite is the string `"nan"`,
`"inf"` or `"-inf"`; a step a series did not record is `null` (a heatmap's
cell) or left out (a line's points). A heatmap is per layer (a row each,
grouped by name for large models): the gradient norm of a layer is that of
all its variables together (the root of the sum of their squared norms), its
update ratio the largest finite one of its variables' (a zero-initialised
bias's first update ratio is infinite by definition), NaN where one is; a tap's dead and saturated
fractions are its own row.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from kerasdbg import report as _report
from kerasdbg import run_comparison as _comparison
from kerasdbg.reader import load_run
from kerasdbg.records import tags as _tags

GROUP_LIMIT = 16
"""The most groups a heatmap's rows are put in (`tags.groups`): a ResNet50's
layers read as `conv2`, `conv3`, ... each expandable."""

HEATMAPS = (
    # (key, title, collection, statistic, how a layer's variables combine, scale)
    ("gradient_norm", "gradient norm", _tags.GRADIENTS, "l2_norm", "norm", "log"),
    ("update_ratio", "update ratio", _tags.WEIGHTS, "update_ratio", "max", "log"),
    ("dead_fraction", "dead fraction (taps)", _tags.ACTIVATIONS, "dead_fraction", None,
     "linear"),
    ("saturated_fraction", "saturated fraction (taps)", _tags.ACTIVATIONS, "saturated_fraction",
     None, "linear"),
)
"""The heatmaps of a run, in the order shown."""


def value(number) -> object:
    """A float as JSON takes it: finite as is, else `"nan"`, `"inf"` or `"-inf"`.

    Examples:
        >>> from kerasdbg.dashboard._data import value
        >>> value(0.5), value(float("nan")), value(float("-inf"))
        (0.5, 'nan', '-inf')
    """
    number = float(number)
    if math.isfinite(number):
        return number
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def _recorded(logdir: str):
    """The names of the runs under `logdir` that hold kerasdbg's tags, in name order."""
    run = load_run(logdir)
    for name in run.runs:
        try:
            _report.require_run(run, name)
        except _report.NotARunError:
            continue
        yield name


def runs(logdir: str) -> List[Dict[str, object]]:
    """The runs under `logdir` that hold kerasdbg's records, in name order:
    `{"run", "steps", "verdicts", "first_nonfinite"}` each (the last step
    recorded, the number of verdicts, the first step whose loss or gradients
    held NaN/Inf or None)."""
    found = []
    for name in _recorded(logdir):
        data = _report.collect(logdir, run_name=name)
        found.append({"run": name, "steps": _last_step(data),
                      "verdicts": len(_faults(data)),
                      "first_nonfinite": _report._first_nonfinite(data)})
    return found


def has_runs(logdir: str) -> bool:
    """Whether a run under `logdir` holds kerasdbg's records (its tags only:
    cheap enough for TensorBoard's listing of the plugins at each load)."""
    return next(_recorded(logdir), None) is not None


def _faults(data) -> list:
    """The verdict rows of faults (the rules' notes, `severity="info"`, and
    lines that name no rule left out)."""
    return [r for r in _report._verdict_rows(data["verdicts"])
            if r["rule"] and r.get("severity", "fault") == "fault"]


def _last_step(data) -> Optional[int]:
    steps = [int(frame.index.max()) for frame in (data["loss"], data["gradient_norms"],
                                                   data["rule_steps"])
             if len(frame.index)]
    return max(steps) if steps else None


def run(logdir: str, name: str) -> Dict[str, object]:
    """One run as the dashboard draws it.

    Returns:
        `{"run", "headline", "loss", "global_norm", "verdicts", "skipped",
        "rollbacks", "first_nonfinite", "nan_source", "heatmaps"}`: the
        headline is the sentences that say what went wrong and where (or
        that no rule fired); `loss` and `global_norm` are `{"steps",
        "values"}` lines; `verdicts` the faults' rows `{"step", "rule",
        "reason", "tensors"}` (the rules' notes left out); `nan_source` `{"layer", "step"}` or None; each heatmap
        `{"title", "scale", "rows", "groups", "steps", "values"}` (a row of
        values per row name, a cell per step), absent where nothing was
        recorded.

    Raises:
        NotARunError: `name` holds no kerasdbg records.
    """
    data = _report.collect(logdir, run_name=name)
    reader = load_run(logdir)
    verdicts = [{"step": int(r["step"]), "rule": r["rule"], "reason": r["reason"],
                 "tensors": list(r["tensors"])} for r in _faults(data)]
    source = _nan_source(data, verdicts)
    first = _report._first_nonfinite(data)
    heatmaps = {}
    for key, title, collection, statistic, combine, scale in HEATMAPS:
        pattern = _tags.statistic_pattern(collection, statistic)
        if not reader.tags(pattern, run=name):
            continue
        long = reader.scalars(pattern, run=name)
        heatmaps[key] = _heatmap(long, title, combine, scale)
    rollbacks = data["rollbacks"]
    return {
        "run": name,
        "headline": _headline(verdicts, first, source, _report.skipped_steps(data),
                              _report.stop_on_rule_steps(data)),
        "loss": _line(reader, _tags.LOSS, name),
        "global_norm": _line(reader, _tags.per_optimizer_pattern(_tags.GRADIENTS,
                                                                  _tags.GLOBAL_NORM), name),
        "verdicts": verdicts,
        "skipped": _report.skipped_steps(data),
        "rollbacks": [int(s) for s in rollbacks["step"]] if len(rollbacks) else [],
        "first_nonfinite": first,
        "nan_source": source,
        "heatmaps": heatmaps,
    }


def _line(reader, pattern: str, name: str) -> Dict[str, list]:
    """A scalar's steps and values (the first tag the pattern matches: the
    first optimizer's global norm), empty where none was recorded."""
    if not reader.tags(pattern, run=name):
        return {"tag": None, "steps": [], "values": []}
    rows = reader.scalars(pattern, run=name)
    tag = sorted(set(rows.tag))[0]
    rows = rows[rows.tag == tag].sort_values("step", kind="stable").drop_duplicates(
        "step", keep="last")
    return {"tag": tag, "steps": [int(s) for s in rows.step],
            "values": [value(v) for v in rows.value]}


def _nan_source(data, verdicts) -> Optional[Dict[str, object]]:
    """The layer whose output first held NaN/Inf and its step, as the report
    names it (`faults/nan_source/layer/<name>`, else NaNSource's verdict)."""
    found = data.get("nan_source", pd.DataFrame())
    prefix = _tags.fault("nan_source", "layer") + "/"
    for step in sorted(int(s) for s in found.index):
        row = found.loc[step]
        for column in found.columns:
            if pd.notna(row[column]):
                return {"layer": column[len(prefix):], "step": step}
    for verdict in verdicts:
        if verdict["rule"] == "NaNSource" and verdict["tensors"]:
            return {"layer": verdict["tensors"][0], "step": verdict["step"]}
    return None


def _headline(verdicts, first, source, skipped, rule_steps) -> List[str]:
    """What went wrong and where, in a few sentences, seen without a click."""
    lines = []
    if source is not None:
        lines.append(f"First NaN/Inf at step {source['step']}: layer {source['layer']!r} "
                     "(NaNSource)")
    elif first is not None:
        lines.append(f"First NaN/Inf at step {first} (loss or gradients; no layer located)")
    if verdicts:
        head = verdicts[0]
        reason = head["reason"]
        if not reason.startswith(f"{head['rule']} at step"):
            reason = f"{head['rule'] or 'a rule'} at step {head['step']}: {reason}"
        lines.append(f"First verdict: {reason}")
        if len(verdicts) > 1:
            lines.append(f"{len(verdicts)} verdicts in all (steps "
                         f"{verdicts[0]['step']}-{verdicts[-1]['step']})")
    if skipped:
        lines.append(f"{len(skipped)} step(s) skipped: {', '.join(map(str, skipped[:10]))}"
                     + (" ..." if len(skipped) > 10 else ""))
    if not lines:
        lines.append("No rule fired" + (f" (StopOnRule ran at {len(rule_steps)} steps)"
                                        if rule_steps else
                                        " (no StopOnRule recorded in this run)"))
    return lines


def _layer_of(tensor: str) -> str:
    return tensor.rsplit("/", 1)[0] if "/" in tensor else tensor


def _heatmap(long: pd.DataFrame, title: str, combine: Optional[str],
             scale: str) -> Dict[str, object]:
    """A row x step table of one statistic from its long-form scalars (a
    recorded NaN stays a NaN; a step not recorded stays absent), its rows'
    variables combined by `combine` ("norm", "max", or None: a row a tag)."""
    long = long.drop_duplicates(["tag", "step"], keep="last")
    values = long.pivot(index="step", columns="tag", values="value").sort_index()
    present = long.assign(one=1.0).pivot(index="step", columns="tag",
                                         values="one").reindex_like(values).notna().to_numpy()
    steps = [int(s) for s in values.index]
    tags_in_order = list(dict.fromkeys(long.tag))
    tensors = {t: _tags.tensor_of(t) for t in tags_in_order}
    rows_of = {t: (_layer_of(tensors[t]) if combine else tensors[t]) for t in tags_in_order}
    # Numbers by value (`dense_2` before `dense_10`): the order Keras made the layers in.
    order = _report._name_order(list(dict.fromkeys(rows_of[t] for t in tags_in_order)))
    position = {t: i for i, t in enumerate(values.columns)}
    table = values.to_numpy(dtype=float)
    cells, known = [], []
    for row in order:
        columns = [position[t] for t in tags_in_order if rows_of[t] == row]
        v, here = table[:, columns], present[:, columns]
        if combine == "norm":  # NaN when a variable's norm is NaN, inf when one is inf
            combined = np.sqrt(np.sum(np.where(here, np.square(v), 0.0), axis=1))
        elif combine == "max":
            # The largest finite ratio: a zero-initialised bias's first update is
            # infinite by definition, not a fault; NaN when one is, inf when
            # every variable's is.
            finite_ = here & np.isfinite(v)
            combined = np.max(np.where(finite_, v, -np.inf), axis=1)
            combined = np.where(np.any(finite_, axis=1), combined, np.inf)
            combined = np.where(np.any(here & np.isnan(v), axis=1), np.nan, combined)
        else:
            combined = v[:, 0]
        cells.append(combined)
        known.append(np.any(here, axis=1))
    groups = _tags.groups(order, limit=GROUP_LIMIT)
    grouped: Dict[str, List[int]] = {}
    for index, group in enumerate(groups):
        grouped.setdefault(group, []).append(index)
    return {
        "title": title, "scale": scale, "rows": order,
        "groups": [[name, members] for name, members in grouped.items()],
        "steps": steps,
        "values": [[value(v) if ok else None for v, ok in zip(row, here)]
                   for row, here in zip(cells, known)],
    }


def compare(logdir: str, a: str, b: str) -> Dict[str, object]:
    """Two runs of `logdir` side by side, as `kerasdbg report A B` compares
    them: `{"a", "b", "divergence", "loss"}`, the divergence
    `{"step", "tag", "value_a", "value_b", "reason", "kind"}` or None, and
    each run's loss line.

    Raises:
        NotARunError: `a` or `b` holds no kerasdbg records.
    """
    result = _comparison.compare_runs(logdir, logdir, run_name=a, run_name_b=b)
    found = result.divergence
    divergence = None if found is None else {
        "step": found.step, "tag": found.tag, "value_a": value(found.value_a),
        "value_b": value(found.value_b), "reason": found.reason, "kind": found.kind}
    reader = load_run(logdir)
    return {"a": a, "b": b, "divergence": divergence,
            "loss": {a: _line(reader, _tags.LOSS, a), b: _line(reader, _tags.LOSS, b)}}
