"""The verdict text: `StopOnRule`'s `rules/verdicts` Markdown, written and
read back here (`verdict_markdown`, `verdict_rows`), and the one console line
of a fit's information notes (`notes_line`). Plain Python."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Sequence

__all__ = ("VERDICT_TENSORS", "no_verdict", "notes_line", "verdict_markdown", "verdict_rows")

VERDICT_TENSORS = 5
"""Tensors listed per verdict in the `rules/verdicts` text; the others are counted."""
VERDICT_TEXT_LIMIT = 100
"""Verdicts a `rules/verdicts` write holds at most (the newest); a line counts
the earlier ones, which the texts of earlier steps hold."""
INFORMATION = "information, not a fault"
NO_VERDICT = "No verdict"
_ITEM = re.compile(r"^- \*\*step (?P<step>-?\d+) · (?P<rule>[^*]+?)\*\*"
                   rf"(?P<info> \({re.escape(INFORMATION)}\))?(?P<sep>[:;]) (?P<reason>.*)$")
_TENSORS = re.compile(r"^\s+(?:- )?tensors: (?P<tensors>.*)$")
_HEADING = re.compile(r"^\*\*Verdicts, in step order\*\*|^" + NO_VERDICT + ":"
                      r"|^\(\d+ earlier verdicts? of this run")
# The table that runs written before the list hold.
_VERDICT_ROW = re.compile(
    r"^\|\s*(?P<rule>[^|]*?)\s*\|\s*(?P<step>-?\d+)\s*\|\s*(?P<tensors>[^|]*?)\s*\|"
    r"\s?(?P<reason>.*?)\s*\|\s*$")
_VERDICT_HEAD = re.compile(r"^\|\s*rule\s*\|\s*step\s*\||^\|[-:| ]*\|\s*$")
_MORE = re.compile(r"\s*\.\.\.(?: and (?P<count>\d+) more)?$")


def _steps(steps: Sequence[int]) -> str:
    """`1, 3-7`: steps in ranges."""
    ranges: List[List[int]] = []
    for step in sorted(set(int(s) for s in steps)):
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def verdict_markdown(verdicts: Sequence[Any], ran: Sequence[Sequence[Any]] = (),
                     earlier: int = 0) -> str:
    """The `rules/verdicts` text of `StopOnRule` (TensorBoard's Text
    dashboard renders it); `verdict_rows` reads it back.

    A list, one item a verdict, in step order (TensorBoard shows the newest
    write first: each write holds every verdict so far, so the newest reads
    top to bottom): `- **step <step> · <rule>**: <reason>`, an "info"
    verdict marked "(information, not a fault)", and the tensors on the
    item's nested line. A list, not a table: TensorBoard gives a table's
    columns the width of their shortest words and breaks the rest.

    Args:
        verdicts: `kerasdbg.rules.Verdict`s (anything with `rule`, `step`,
            `tensors`, `reason` and `severity`), in any order.
        ran: a `(rule names, first step, last step)` for each set of rules
            (a `StopOnRule`) that ran and did not fire: a last line says so
            ("No verdict: ..."). Defaults to `()`.
        earlier: how many verdicts of the run came before `verdicts` and are
            left out (a first line says so). Defaults to `0`.

    Returns:
        The Markdown text, at most `VERDICT_TENSORS` tensors a verdict and
        then how many more.

    Examples:
        >>> from kerasdbg.records import verdict_markdown, verdict_rows
        >>> from kerasdbg.rules import AllZero
        >>> text = verdict_markdown([AllZero().check(3, {"weights/m/d/bias/zero_fraction": 1.0})])
        >>> print(text)
        **Verdicts, in step order** (step 3)
        <BLANKLINE>
        - **step 3 · AllZero**: zero_fraction at or above 1 in weights: m/d/bias=1
            - tensors: `m/d/bias`
        >>> verdict_rows(text)[0]["tensors"]
        ['m/d/bias']
        >>> print(verdict_markdown([], ran=[(["NonFiniteLoss", "DeadReLU"], 1, 40)]))
        No verdict: NonFiniteLoss, DeadReLU ran over steps 1-40 and none fired.
    """
    ordered = sorted(verdicts, key=lambda v: int(v.step))  # stable: a step's order kept
    lines = []
    if ordered:
        steps = sorted({int(v.step) for v in ordered})
        lines += [f"**Verdicts, in step order** (step {steps[0]})" if len(steps) == 1 else
                  f"**Verdicts, in step order** (steps {_steps(steps)}; the newest last)", ""]
    if earlier:
        lines += [f"({earlier} earlier verdict{'' if earlier == 1 else 's'} of this run: in the "
                  "texts of earlier steps)", ""]
    for v in ordered:
        prefix = f"{v.rule} at step {int(v.step)}: "
        reason = str(v.reason)
        sep = ":" if reason.startswith(prefix) else ";"
        reason = reason[len(prefix):] if sep == ":" else reason
        info = f" ({INFORMATION})" if getattr(v, "severity", "fault") != "fault" else ""
        lines.append(f"- **step {int(v.step)} · {v.rule}**{info}{sep} {reason}")
        if v.tensors:
            hidden = len(v.tensors) - VERDICT_TENSORS
            # A nested item (4 spaces, as Python-Markdown nests): its own line (a
            # continuation line would join the reason's).
            lines.append("    - tensors: " + ", ".join(
                f"`{t}`" for t in v.tensors[:VERDICT_TENSORS])
                + (f" ... and {hidden} more" if hidden > 0 else ""))
    notes = ordered and all(getattr(v, "severity", "fault") != "fault" for v in ordered)
    lines += [""] if ordered and ran else []
    for names, first, last in ran:
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        lines.append(f"{NO_VERDICT}: {', '.join(names)} ran over {steps} and none fired"
                     + (" (the notes above are information)." if notes else "."))
    return "\n".join(lines)


def notes_line(notes: Sequence[Any], limit: int = VERDICT_TENSORS) -> str:
    """One line for a fit's "info" verdicts (tensors zero by construction in
    a healthy network, ...): what each rule noted, at which steps, on how
    many tensors, none of them a fault. `StopOnRule` prints it once, at
    the end of the fit.

    Args:
        notes: the "info" `kerasdbg.rules.Verdict`s.
        limit: tensors named per rule; the others are counted. Defaults to `5`.

    Returns:
        The line, without the `kerasdbg: ` prefix; "" for no notes.

    Examples:
        >>> from kerasdbg.records.verdicts import notes_line
        >>> from kerasdbg.rules.rule import make_verdict
        >>> notes = [make_verdict("VanishingGradient", s, f"zero by construction, not a fault "
        ...                       f"(below 1e-07): m/c{s}/bias=0", {f"m/c{s}/bias": 0.0},
        ...                       severity="info") for s in (1, 3, 4)]
        >>> print(notes_line(notes))
        information, not faults (3 tensors): VanishingGradient, at steps 1, 3-4: zero by construction: m/c1/bias, m/c3/bias, m/c4/bias
    """
    groups: Dict[tuple, Dict[str, Any]] = {}
    for v in notes:
        body = str(v.reason)
        prefix = f"{v.rule} at step {int(v.step)}: "
        body = body[len(prefix):] if body.startswith(prefix) else body
        # What was noted, without the listing of values and the explanation.
        what = body.rpartition(": ")[0] or body
        what = what.split(" (")[0].removesuffix(", not a fault")
        group = groups.setdefault((v.rule, what), {"steps": [], "tensors": {}})
        group["steps"].append(int(v.step))
        group["tensors"].update(dict.fromkeys(v.tensors))
    if not groups:
        return ""
    parts, count = [], 0
    for (rule, what), group in groups.items():
        tensors = list(group["tensors"])
        count += len(tensors)
        hidden = len(tensors) - limit
        named = ", ".join(tensors[:limit]) + (f" and {hidden} more" if hidden > 0 else "")
        parts.append(f"{rule}, at step{'s' if len(set(group['steps'])) > 1 else ''} "
                     f"{_steps(group['steps'])}: {what}" + (f": {named}" if named else ""))
    return (f"information, not faults ({count} tensor{'' if count == 1 else 's'}): "
            + "; ".join(parts))


def verdict_rows(text: str) -> List[Dict[str, Any]]:
    """The verdicts of a `verdict_markdown` text (or of the table that runs
    written before it hold), in the text's order.

    Each row is a dict of `rule`, `step` (None for a line that is not a
    verdict, kept as a `reason`), `tensors` (a list), `hidden` (tensors left
    out of the list; -1 when a run written before this count says only
    " ..."), `reason` (as the `Verdict` has it) and `severity` ("fault" or
    "info"; a table says none: "fault"). The heading and the "No verdict"
    line are not verdicts: left out.

    Args:
        text: a `rules/verdicts` text (`kerasdbg.reader.Run.texts`).

    Returns:
        The rows.

    Examples:
        >>> from kerasdbg.records import verdict_rows
        >>> text = "- **step 2 · R**: why\\n  tensors: `a`, `b` ... and 3 more"
        >>> verdict_rows(text)
        [{'rule': 'R', 'step': 2, 'tensors': ['a', 'b'], 'hidden': 3, 'reason': 'R at step 2: why', 'severity': 'fault'}]
        >>> text = "| rule | step | tensors | reason |\\n|---|---|---|---|\\n| R | 2 | a, b ... | why |"
        >>> verdict_rows(text)[0]["hidden"]
        -1
    """
    rows: List[Dict[str, Any]] = []
    for line in str(text).splitlines():
        tensors = _TENSORS.match(line)
        line = line.strip()
        if tensors is not None and rows and rows[-1]["step"] is not None:
            listed, hidden = _listed(tensors["tensors"])
            rows[-1].update(tensors=[t.strip("`") for t in listed], hidden=hidden)
            continue
        if not line or _VERDICT_HEAD.match(line) or _HEADING.match(line):
            continue
        item = _ITEM.match(line)
        if item is not None:
            reason = item["reason"]
            if item["sep"] == ":":
                reason = f"{item['rule']} at step {item['step']}: {reason}"
            rows.append({"rule": item["rule"], "step": int(item["step"]), "tensors": [],
                         "hidden": 0, "reason": reason,
                         "severity": "info" if item["info"] else "fault"})
            continue
        match = _VERDICT_ROW.match(line)
        if match is None:
            rows.append({"rule": "", "step": None, "tensors": [], "hidden": 0, "reason": line,
                         "severity": "fault"})
            continue
        listed, hidden = _listed(match["tensors"])
        rows.append({"rule": match["rule"], "step": int(match["step"]), "tensors": listed,
                     "hidden": hidden, "reason": match["reason"], "severity": "fault"})
    return rows


def _listed(tensors: str):
    """`(names, hidden)` of a list of tensors that may end "... and k more"."""
    hidden = 0
    more = _MORE.search(tensors)
    if more is not None:
        hidden = int(more["count"]) if more["count"] else -1
        tensors = tensors[:more.start()]
    return [t.strip() for t in tensors.split(",") if t.strip()], hidden


def no_verdict(text: str) -> List[str]:
    """The "No verdict: ..." lines of a `verdict_markdown` text (rules that
    ran and did not fire).

    Examples:
        >>> from kerasdbg.records.verdicts import no_verdict
        >>> no_verdict("No verdict: DeadReLU ran over steps 1-8 and none fired.")
        ['No verdict: DeadReLU ran over steps 1-8 and none fired.']
    """
    return [line.strip() for line in str(text).splitlines()
            if line.startswith(f"{NO_VERDICT}:")]
