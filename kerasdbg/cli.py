"""The `kerasdbg` command."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

EXAMPLES = """examples:
  kerasdbg demo --out runs/demo      train the demo and write TensorBoard logs
  kerasdbg tags runs/demo/healthy    list the scalar tags of a log directory
"""


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
        "far too high, with GradientStatistics, WeightStatistics and Keras's TensorBoard "
        "callback, and prints where the TensorBoard logs are. Example: kerasdbg demo --out runs/demo",
    )
    demo.add_argument("--out", default="runs/demo", help="log directory (default: runs/demo)")
    demo.add_argument("--epochs", type=int, default=3, help="epochs per run (default: 3)")
    tags = commands.add_parser(
        "tags",
        help="list the tags of a log directory",
        description="Lists the tags of a log directory. Example: kerasdbg tags runs/demo/healthy",
    )
    tags.add_argument("log_dir")
    tags.add_argument("--kind", choices=["scalars", "histograms", "text"], default="scalars")
    tags.add_argument("--pattern", default=None, help="regular expression the tags must match")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the `kerasdbg` command; returns its exit status."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        if args.epochs < 1:
            print(f"kerasdbg demo: --epochs must be >= 1. Received: {args.epochs}", file=sys.stderr)
            return 2
        from kerasdbg.demo import run_demo

        run_demo(args.out, epochs=args.epochs)
        return 0
    if args.command == "tags":
        from kerasdbg.reader import load_run

        try:
            run = load_run(args.log_dir)
        except FileNotFoundError as error:
            print(error, file=sys.stderr)
            return 2
        found = run.tags(args.pattern, kind=args.kind)
        if not found:
            print(f"kerasdbg tags: no {args.kind} tags in {args.log_dir}", file=sys.stderr)
            return 1
        print("\n".join(found))
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
