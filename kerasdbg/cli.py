"""The `kerasdbg` command."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import List, Optional

EXAMPLES = """examples:
  kerasdbg demo --out runs/demo      train the demo and write TensorBoard logs
  kerasdbg tags runs/demo/healthy    list the scalar tags of a log directory
  kerasdbg report runs/demo/lr_too_high --out report/   plots and a summary in report.html
  kerasdbg report runs/demo/healthy runs/demo/lr_too_high  two runs side by side: where they diverge
  kerasdbg check runs/demo/lr_too_high                      the default rules, as StopOnRule()
  kerasdbg check LOG_DIR --rule DeadReLU:layer_fraction=0.3 --rule ExplodingTensor
  kerasdbg compare tf1.npz keras.npz                        two step traces, tensor by tensor
"""


def _rule_names() -> List[str]:
    """The built-in rules, by class name."""
    from kerasdbg import rules as rules_lib

    return [
        n for n in rules_lib.__all__
        if isinstance(getattr(rules_lib, n), type) and issubclass(getattr(rules_lib, n), rules_lib.Rule)
        and getattr(rules_lib, n) is not rules_lib.Rule
    ]


def parse_rule(text: str):
    """`Name` or `Name:param=value,param=value` -> a rule; values are Python
    literals, bare words are strings, and `a|b` is a list."""
    import ast

    from kerasdbg import rules as rules_lib

    name, _, params = text.partition(":")
    known = _rule_names()
    if name not in known:
        raise ValueError(f"unknown rule {name!r}. Rules: {', '.join(known)}")
    kwargs = {}
    for item in filter(None, params.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"rule parameters are written param=value. Received: {item!r}")

        def literal(word):
            try:
                return ast.literal_eval(word)
            except (ValueError, SyntaxError):
                return word

        kwargs[key] = [literal(w) for w in raw.split("|")] if "|" in raw else literal(raw)
    import inspect

    cls = getattr(rules_lib, name)
    signature = inspect.signature(cls.__init__).parameters.values()
    parameters = [p.name for p in signature if p.name != "self" and p.kind not in (
        p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    # A rule that takes **deprecated accepts its deprecated names too (with a warning).
    takes_more = any(p.kind == p.VAR_KEYWORD for p in signature)
    unknown = [key for key in kwargs if key not in parameters]

    def refuse():
        return ValueError(f"{name} has no parameter {', '.join(map(repr, unknown))}. "
                          f"Parameters: {', '.join(parameters)}")

    if unknown and not takes_more:
        raise refuse()
    try:
        return cls(**kwargs)
    except TypeError as error:
        if unknown and "unexpected keyword argument" in str(error):
            raise refuse() from None
        raise ValueError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kerasdbg",
        description="Debugging instruments for Keras training.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small CNN twice (healthy, learning rate too high) with the instruments",
        description="Trains a small CNN twice, a healthy run and one whose learning rate is "
        "far too high, with GradientStatistics, WeightStatistics, taps and StopOnRule, "
        "and prints where the TensorBoard logs are. Example: kerasdbg demo --out runs/demo",
    )
    demo.add_argument("--out", default="runs/demo", help="log directory (default: runs/demo)")
    demo.add_argument("--epochs", type=int, default=3, help="epochs per run (default: 3)")
    tags = commands.add_parser(
        "tags",
        help="list the tags of a log directory",
        description="Lists the tags of a log directory. Exit status 2 on a missing or empty "
        "directory, or when no tag matches. Example: kerasdbg tags runs/demo/healthy",
    )
    tags.add_argument("log_dir")
    tags.add_argument("--kind", choices=["scalars", "histograms", "text"], default="scalars")
    tags.add_argument("--pattern", default=None, help="regular expression the tags must match")
    report = commands.add_parser(
        "report",
        help="write report.html with plots of a log directory and print a summary",
        description="Writes report.html: the rule verdicts as a table, PNG plots (loss, "
        "global gradient norm, a per-layer gradient-norm heatmap, update ratios and "
        "activation health: the 10 largest as lines and all of them as a heatmap), the "
        "epoch logs (a plot for several epochs, a table for one), and prints a short "
        "summary (first non-finite step, largest and smallest gradients), with what to try "
        "for each rule that fired. With two log directories, compare.html puts them side by "
        "side: the first step where their loss or global gradient norm diverge, both "
        "overlaid, and the verdicts of each. "
        "Exit status 2 on a missing, empty or not-a-run directory, or when the report "
        "cannot be written. "
        "Example: kerasdbg report runs/demo/lr_too_high --out report/",
    )
    report.add_argument("log_dir")
    report.add_argument("other", nargs="?", default=None, metavar="LOG_DIR_B",
                        help="a second log directory to compare LOG_DIR with")
    report.add_argument("--out", default=None, help="output directory (default: LOG_DIR/report, "
                        "or LOG_DIR/report/vs_<name of LOG_DIR_B> for two)")
    report.add_argument("--run", default="train", help="run of the log directory (default: train)")
    report.add_argument("--rtol", type=float, default=1e-2,
                        help="with two runs: the relative difference of the loss or the global "
                        "norm at which they count as diverged (default: 0.01)")
    check = commands.add_parser(
        "check",
        help="run rules on a recorded log directory; exit status 1 when one fires",
        description="Evaluates rules on every recorded step of a log directory and prints "
        "each rule's first firing. Exit status: 0 when none fires, 1 when one does, 2 on bad "
        "input. Without --rule, the default rules (kerasdbg.rules.default_rules(), those of "
        "StopOnRule()) the run holds statistics for; any other rule with --rule. "
        "Example: kerasdbg check runs/demo/lr_too_high --rule ExplodingTensor",
    )
    check.add_argument("log_dir")
    check.add_argument("--rule", action="append", default=[], metavar="NAME[:param=value,...]",
                       help="a rule and its parameters, e.g. DeadReLU:layer_fraction=0.3 "
                       "or ExplodingTensor:collections=gradients|activations (repeatable)")
    check.add_argument("--run", default="train", help="run of the log directory (default: train)")
    check.add_argument("--all-steps", action="store_true",
                       help="report every step at which a rule fires, not only the first")
    compare = commands.add_parser(
        "compare",
        help="compare two step traces (StepRecorder / TraceWriter files); exit status 1 on divergence",
        description="Compares two step traces tensor by tensor and step by step: the largest "
        "absolute and relative difference, pass or fail under the policy (absolute tolerance "
        "up to --exact-steps, relative after; NaN never equal), and the first divergence. "
        "Exit status: 0 when they match, 1 when they diverge, 2 on bad input. "
        "Example: kerasdbg compare tf1.npz keras.npz --map dense/kernel:0=dense/kernel",
    )
    compare.add_argument("a", help="the first trace (the reference)")
    compare.add_argument("b", help="the second trace")
    compare.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default: 1e-5)")
    compare.add_argument("--rtol", type=float, default=0.05, help="relative tolerance (default: 0.05)")
    compare.add_argument("--exact-steps", type=int, default=10,
                         help="last step compared with --atol (default: 10)")
    compare.add_argument("--map", action="append", default=[], metavar="NAME_IN_A=NAME_IN_B",
                         help="match a tensor of A with one of B (repeatable)")
    compare.add_argument("--all", action="store_true", help="print every comparison, not only failures")
    return parser


def _compare(args) -> int:
    from kerasdbg.trace import TraceError, compare_traces

    mapping = {}
    for item in args.map:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            print(f"kerasdbg compare: --map takes NAME_IN_A=NAME_IN_B. Received: {item!r}",
                  file=sys.stderr)
            return 2
        mapping[key] = value
    try:
        result = compare_traces(args.a, args.b, atol=args.atol, rtol=args.rtol,
                                exact_steps=args.exact_steps, mapping=mapping)
    except (TraceError, FileNotFoundError, ValueError, TypeError) as error:
        print(f"kerasdbg compare: {error}", file=sys.stderr)
        return 2
    print(result)
    if result.table.empty:
        return 2
    if args.all:
        columns = ["step", "tensor_a", "tensor_b", "max_abs", "max_rel", "passed"]
        print(result.table[columns].to_string(index=False))
    return 0 if result.passed else 1


# What TensorFlow's C++ writes to stderr as it loads, whatever TF_CPP_MIN_LOG_LEVEL
# says (absl logs oneDNN's note before reading it): nothing a user of the command acts on.
_START_UP = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called|port\.cc:\d+\] oneDNN custom "
    r"operations|cpu_feature_guard\.cc:\d+\]|^To enable the following instructions:")


def _import_quietly() -> None:
    """Imports Keras (which imports its backend, TensorFlow by default: every
    command reads or writes through it) with TensorFlow's start-up lines
    left out of stderr; anything else written meanwhile is passed on."""
    # A level the user set is kept; 2 leaves out TensorFlow's INFO and WARNING lines.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "keras" in sys.modules:
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no file descriptor 2 (an embedding)
        import keras  # noqa: F401
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            import keras  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(True)
                    if not _START_UP.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the `kerasdbg` command; returns its exit status."""
    args = _parser().parse_args(argv)
    _import_quietly()
    if args.command == "demo":
        if args.epochs < 1:
            print(f"kerasdbg demo: --epochs must be >= 1. Received: {args.epochs}", file=sys.stderr)
            return 2
        from kerasdbg.demo import run_demo

        try:
            run_demo(args.out, epochs=args.epochs)
        except OSError as error:
            print(f"kerasdbg demo: {error}", file=sys.stderr)
            return 2
        return 0
    if args.command == "tags":
        return _tags(args)
    if args.command == "check":
        return _check(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "report" and args.other is not None:
        from kerasdbg.run_comparison import main_compare

        return main_compare(args.log_dir, args.other, args.out, args.run, args.rtol)
    if args.command == "report":
        from kerasdbg.report import main_report

        return main_report(args.log_dir, args.out, args.run)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _tags(args) -> int:
    from kerasdbg.reader import load_run
    from kerasdbg.report import NotARunError, require_run

    try:
        run = load_run(args.log_dir)
        if not run.runs:
            require_run(run)  # says that the directory holds no event file
    except (FileNotFoundError, NotARunError) as error:
        print(f"kerasdbg tags: {error}", file=sys.stderr)
        return 2
    found = run.tags(args.pattern, kind=args.kind)
    if not found:
        matching = f" matching {args.pattern!r}" if args.pattern is not None else ""
        print(f"kerasdbg tags: no {args.kind} tags{matching} in {args.log_dir!r}. Runs: "
              f"{', '.join(run.runs)}", file=sys.stderr)
        return 2
    print("\n".join(found))
    return 0


def _check(args) -> int:
    from kerasdbg import rules as rules_lib
    from kerasdbg.reader import load_run
    from kerasdbg.offline import can_check, check_run, recorded_pairs
    from kerasdbg.records.tags import tag_pattern
    from kerasdbg.records.verdicts import notes_line
    from kerasdbg.report import other_trainings, require_run

    try:
        if args.rule:
            chosen = [parse_rule(text) for text in args.rule]
        else:
            # The default rules, as StopOnRule(): one verdict per run, online or offline.
            chosen = rules_lib.default_rules()
        run = load_run(args.log_dir)
        # What `report` says of a directory it cannot read: no event file, other
        # runs, no value yet, no kerasdbg tag.
        tags = require_run(run, args.run)
        if not args.rule:
            present = recorded_pairs(tags)
            # A rule the run feeds in part cannot judge it: said, never guessed.
            partial = [rule for rule in chosen if not can_check(rule, present)
                       and any(need in present for need in rule.requires)]
            chosen = [rule for rule in chosen if can_check(rule, present)]
            if partial and chosen:
                missing = "; ".join(
                    f"{rule.name} reads " + ", ".join(
                        tag_pattern(collection, statistic) for collection, statistic
                        in rule.requires if (collection, statistic) not in present)
                    for rule in partial)
                print(f"kerasdbg check: {', '.join(r.name for r in partial)} cannot judge run "
                      f"{args.run!r}: it holds only part of what they read ({missing}, not "
                      "recorded; WeightStatistics records the update ratios)",
                      file=sys.stderr)
            if not chosen:
                print(f"kerasdbg check: run {args.run!r} of {args.log_dir!r} holds none of the "
                      "statistics the default rules read (record them with GradientStatistics, "
                      "WeightStatistics, TapLayer + ActivationStatistics or "
                      "StopOnRule(log_dir=...)), or name a rule with --rule. Its tags: "
                      f"{', '.join(tags[:10])}", file=sys.stderr)
                return 2
        note = other_trainings(run, args.run)
        if note:
            print(f"kerasdbg check: {note}", file=sys.stderr)
        verdicts = check_run(run, chosen, run=args.run, first_only=not args.all_steps)
    except (ValueError, KeyError, FileNotFoundError) as error:
        message = error.args[0] if isinstance(error, KeyError) else error
        print(f"kerasdbg check: {message}", file=sys.stderr)
        return 2
    for verdict in verdicts:
        if verdict.severity == "fault":
            print(verdict.reason)
    # Information (zero by construction) is not a rule firing: one line after
    # the faults, as a fit ends with it.
    notes = [verdict for verdict in verdicts if verdict.severity != "fault"]
    if notes:
        print(f"(info) {notes_line(notes)}")
    fired = sorted({v.rule for v in verdicts if v.severity == "fault"})
    print(f"kerasdbg check: {len(fired)} of {len(chosen)} rules fired"
          + (f" ({', '.join(fired)})" if fired else ""), file=sys.stderr)
    return 1 if fired else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
