"""The Python snippets of README.md and of the guides in docs/, run as written, standalone.

Each ```python (or ```py) block of README.md and of every docs/*.md file runs in a fresh
namespace of its own: it defines or imports every name it uses, as a reader who pastes it
into an empty session would need. The blocks run in one process (for speed), in a directory
that holds the demo's runs (`runs/demo/...`, as after `kerasdbg demo --out runs/demo`), the
only thing a block may take from outside itself, and says so.

Comment lines right after a line calling `print(...)` are the output the document promises;
they must appear in that order ("..." stands for anything). Other blocks (```bash) are not run.

A block that cannot run on its own (it needs a cluster, or the reader's own training code)
says so on its first line, visibly: `# partial: <what it needs>`. It is compiled but not run;
such blocks must stay rare (at most `MAX_PARTIAL`) and docs/development.md explains them.
"""

import contextlib
import glob
import io
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DEVELOPMENT = os.path.join(ROOT, "docs", "development.md")
DOCUMENTS = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```(?:python|py|python3)[ \t]*\n(.*?)^```", re.S | re.M)
PARTIAL = re.compile(r"# partial: (\S.*)")
MAX_PARTIAL = 3


def _blocks(paths=DOCUMENTS):
    """`(code, path)` of every Python block, with ids like `README-line41`."""
    params = []
    for path in paths:
        text = open(path, encoding="utf-8").read()
        name = os.path.splitext(os.path.basename(path))[0]
        params += [pytest.param(match.group(1), path,
                                id=f"{name}-line{text[:match.start(1)].count(chr(10)) + 1}")
                   for match in FENCE.finditer(text)]
    return params


def _partial(code):
    """What a partial block says it needs, or None for a block that runs on its own."""
    match = PARTIAL.fullmatch(code.splitlines()[0].strip()) if code.strip() else None
    return match.group(1) if match else None


def _promised_output(code):
    """The comment lines that directly follow a line calling print()."""
    promised, after_print = [], False
    for line in code.splitlines():
        if after_print and line.startswith("# "):
            promised.append(line[2:])
            continue
        after_print = "print(" in line
    return promised


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from kerasdbg.demo import run_demo

    folder = tmp_path_factory.mktemp("readme")
    with contextlib.redirect_stdout(io.StringIO()):
        run_demo(str(folder / "runs" / "demo"), epochs=1)
    return folder


def test_every_block_is_found_and_none_takes_hidden_names():
    assert len(_blocks([README])) >= 4
    assert len(DOCUMENTS) > 1, "no guides found in docs/"
    for path in DOCUMENTS:
        text = open(path, encoding="utf-8").read()
        # The former convention: names given to a block by the test, which a reader never saw.
        assert "readme-test: context=" not in text, (
            f"{os.path.basename(path)} still gives a block hidden names (readme-test: context=); "
            "define or import them in the block")


def test_partial_blocks_are_rare_and_explained():
    partial = [(param.id, _partial(param.values[0])) for param in _blocks()]
    partial = [(name, needs) for name, needs in partial if needs is not None]
    assert len(partial) <= MAX_PARTIAL, (
        f"{len(partial)} blocks marked `# partial:` (at most {MAX_PARTIAL}): {partial}; make "
        "them run on their own")
    assert all(len(needs.split()) >= 3 for _, needs in partial), (
        f"a `# partial:` line says what the block needs, in words: {partial}")
    development = open(DEVELOPMENT, encoding="utf-8").read()
    assert "# partial: " in development, "docs/development.md does not explain `# partial:`"


@pytest.mark.parametrize("code, path", _blocks())
def test_readme_block_runs_as_written(code, path, demo_dir, monkeypatch):
    compiled = compile(code, path, "exec")
    if _partial(code) is not None:
        return  # compiled above; test_partial_blocks_are_rare_and_explained counts these
    monkeypatch.chdir(demo_dir)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compiled, {"__name__": "__main__"})  # noqa: S102 - the document's own code
    lines = iter(printed.getvalue().splitlines())
    for promised in _promised_output(code):
        pattern = re.compile(".*".join(re.escape(part) for part in promised.split("...")))
        assert any(pattern.fullmatch(line) for line in lines), (
            f"{os.path.basename(path)} promises the output {promised!r}; printed:\n"
            f"{printed.getvalue()}")
