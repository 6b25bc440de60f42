"""Executes the notebooks and stores them with their outputs, for the documentation site.

The site renders notebooks/*.ipynb as they are stored (mkdocs-jupyter with
`execute: false`), so they are kept with their outputs; after editing a
notebook, run

    .venv/bin/python docs/execute_notebooks.py                      # every notebook
    .venv/bin/python docs/execute_notebooks.py notebooks/02_rules.ipynb

Each notebook runs in a fresh kernel whose working directory and temporary
directory are a scratch directory, removed afterwards, so nothing it writes
stays behind. What is stored is kept small and stable: no timing or widget
metadata, and the hash of the code cells that were run
(`metadata.kerasdbg.executed_sources`), which tests/test_notebooks.py compares
with the current cells: a notebook edited but not re-executed fails there.

Needs nbclient, nbformat and ipykernel (the `test` extra), not kerasdbg itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile
from typing import List, Optional

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
METADATA_KEY = "kerasdbg"
HASH_KEY = "executed_sources"
COMMAND = ".venv/bin/python docs/execute_notebooks.py"


def sources_hash(notebook: nbformat.NotebookNode) -> str:
    """The SHA-256 of the notebook's code cells' sources, in order.

    Markdown cells are left out: editing them changes no output.

    Args:
        notebook: a notebook as `nbformat.read` returns it.

    Returns:
        The hash as 64 hex digits.
    """
    sources = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources).encode("utf-8")).hexdigest()


# TensorFlow's C++ log lines, which its start-up writes to the kernel's stderr
# whatever TF_CPP_MIN_LOG_LEVEL says (absl's line before InitializeLog, oneDNN's).
TF_LOG_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] .*)$"
)


def _tidy(notebook: nbformat.NotebookNode) -> None:
    """Drops what changes from run to run without saying anything about the notebook.

    That is widget state, per-cell timing and view metadata, and TensorFlow's
    C++ log lines on stderr (timestamps and process ids); every other output
    is kept as it came.
    """
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        for key in ("execution", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        outputs = []
        for output in cell.outputs:
            if output.output_type == "stream" and output.name == "stderr":
                lines = output.text.splitlines(keepends=True)
                output.text = "".join(line for line in lines if not TF_LOG_LINE.match(line.rstrip("\n")))
                if not output.text:
                    continue
            outputs.append(output)
        cell.outputs = outputs


def execute(path: pathlib.Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs a notebook top to bottom in a scratch directory and stores it with its outputs.

    Args:
        path: the notebook file; rewritten in place.
        timeout: seconds a cell may run. Defaults to `600`.

    Returns:
        The executed notebook, as written.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised; the file is
            left as it was.
    """
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="kerasdbg-notebook-") as scratch:
        # The kernel inherits this environment: its tempfile.mkdtemp() calls
        # land in the scratch directory too, and go with it.
        environment = dict(os.environ, TMPDIR=scratch)
        client = NotebookClient(
            notebook, timeout=timeout, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": scratch}},
        )
        client.execute(env=environment)
    _tidy(notebook)
    notebook.metadata[METADATA_KEY] = {HASH_KEY: sources_hash(notebook)}
    nbformat.validate(notebook)
    nbformat.write(notebook, path)
    return notebook


def main(argv: Optional[List[str]] = None) -> int:
    """Executes the notebooks named on the command line, or all of notebooks/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebooks to execute (default: notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    for path in args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb")):
        print(f"executing {path} ...", flush=True)
        notebook = execute(path)
        size = path.stat().st_size
        cells = sum(cell.cell_type == "code" for cell in notebook.cells)
        print(f"  {cells} code cells, {size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
