"""The verdict text: `StopOnRule`'s `rules/verdicts` Markdown table, written
and read back here (`verdict_markdown`, `verdict_rows`). Plain Python."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Sequence

__all__ = ("VERDICT_TENSORS", "verdict_markdown", "verdict_rows")

VERDICT_TENSORS = 5
"""Tensors listed per verdict in the `rules/verdicts` text; the others are counted."""
_HEADER = ("| rule | step | tensors | reason |", "|---|---|---|---|")
_VERDICT_ROW = re.compile(
    r"^\|\s*(?P<rule>[^|]*?)\s*\|\s*(?P<step>-?\d+)\s*\|\s*(?P<tensors>[^|]*?)\s*\|"
    r"\s?(?P<reason>.*?)\s*\|\s*$")
_VERDICT_HEAD = re.compile(r"^\|\s*rule\s*\|\s*step\s*\||^\|[-:| ]*\|\s*$")
_MORE = re.compile(r"\s*\.\.\.(?: and (?P<count>\d+) more)?$")


def verdict_markdown(verdicts: Sequence[Any]) -> str:
    """The `rules/verdicts` text of `StopOnRule`: a Markdown table `| rule |
    step | tensors | reason |` (TensorBoard's Text dashboard renders it);
    `verdict_rows` reads it back.

    Args:
        verdicts: `kerasdbg.rules.Verdict`s (anything with `rule`, `step`,
            `tensors` and `reason`).

    Returns:
        The table, one row a verdict, at most `VERDICT_TENSORS` tensors a
        row and then how many more.

    Examples:
        >>> from kerasdbg.records import verdict_markdown, verdict_rows
        >>> from kerasdbg.rules import AllZero
        >>> text = verdict_markdown([AllZero().check(3, {"weights/m/d/bias/zero_fraction": 1.0})])
        >>> print(text)
        | rule | step | tensors | reason |
        |---|---|---|---|
        | AllZero | 3 | m/d/bias | AllZero at step 3: zero_fraction at or above 1 in weights: m/d/bias=1 |
        >>> verdict_rows(text)[0]["tensors"]
        ['m/d/bias']
    """
    rows = list(_HEADER)
    for v in verdicts:
        hidden = len(v.tensors) - VERDICT_TENSORS
        tensors = ", ".join(v.tensors[:VERDICT_TENSORS]) + (
            f" ... and {hidden} more" if hidden > 0 else "")
        rows.append(f"| {v.rule} | {v.step} | {tensors} | {v.reason} |")
    return "\n".join(rows)


def verdict_rows(text: str) -> List[Dict[str, Any]]:
    """The rows of a `verdict_markdown` text, in order.

    Each row is a dict of `rule`, `step` (None for a line that is not a row,
    kept as a `reason`), `tensors` (a list), `hidden` (tensors left out of the
    list; -1 when a run written before this count says only " ...") and
    `reason`. The reason is the last cell, so it may itself hold a "|".

    Args:
        text: a `rules/verdicts` text (`kerasdbg.reader.Run.texts`).

    Returns:
        The rows, header lines left out.

    Examples:
        >>> from kerasdbg.records import verdict_rows
        >>> text = "| rule | step | tensors | reason |\\n|---|---|---|---|\\n| R | 2 | a, b ... | why |"
        >>> verdict_rows(text)
        [{'rule': 'R', 'step': 2, 'tensors': ['a', 'b'], 'hidden': -1, 'reason': 'why'}]
    """
    rows = []
    for line in str(text).splitlines():
        line = line.strip()
        if not line or _VERDICT_HEAD.match(line):
            continue
        match = _VERDICT_ROW.match(line)
        if match is None:
            rows.append({"rule": "", "step": None, "tensors": [], "hidden": 0, "reason": line})
            continue
        tensors, hidden = match["tensors"], 0
        more = _MORE.search(tensors)
        if more is not None:
            hidden = int(more["count"]) if more["count"] else -1
            tensors = tensors[:more.start()]
        rows.append({"rule": match["rule"], "step": int(match["step"]),
                     "tensors": [t.strip() for t in tensors.split(",") if t.strip()],
                     "hidden": hidden, "reason": match["reason"]})
    return rows
