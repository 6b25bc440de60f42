"""The documentation site builds with `mkdocs build --strict` and shows everything it should.

Strict mode turns every warning into a failure: a broken link or anchor between the guides, a
docstring section griffe cannot parse, an `Args:` entry whose parameter has no type annotation.
The built site must then document every public name (the reference pages are written by hand,
one `::: kerasdbg.<module>` per module), render each notebook with its stored outputs, and hold
every guide. One build serves all the tests of this module.
"""

import ast
import html
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kerasdbg"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
GUIDES = sorted((ROOT / "docs").glob("*.md"))

# Public modules without a reference page: the `kerasdbg` command and its demo, which
# docs/reading-runs.md describes as a command line.
COMMAND_LINE = {"kerasdbg.cli", "kerasdbg.demo"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site, built by the venv's mkdocs into a temporary directory; mkdocs's log (stdout
    and stderr) is `build.log` beside it."""
    out = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        # Material's notice about MkDocs 2.0 would open every failure message.
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert result.returncode == 0, (
        "`mkdocs build --strict` failed (install the docs extra: pip install -e '.[docs]'):\n"
        f"{result.stdout}\n{result.stderr}"
    )
    (out.parent / "build.log").write_text(result.stdout + result.stderr, encoding="utf-8")
    return out


def _literal_names(tree: ast.Module, target: str):
    """The value of a module-level `target = <literal>`, or None."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(name, ast.Name) and name.id == target for name in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:  # not a literal: `tuple(sorted(_EXPORTS))`
                return None
    return None


def _public_names():
    """`{module: [anchor, ...]}` of every public name, read from the source (no TensorFlow).

    A module's public names are its `__all__` where it has a literal one, else its classes and
    functions whose names do not start with `_`. The top level's `__all__` is built from its
    `_EXPORTS` table, and each of those names is documented where it is defined.
    """
    names = {}
    top = ast.parse((PACKAGE / "__init__.py").read_text())
    exports = _literal_names(top, "_EXPORTS")
    assert exports, "kerasdbg/__init__.py has no literal _EXPORTS table"
    names["kerasdbg"] = sorted(
        module if attribute is None else f"{module}.{attribute}"
        for module, attribute, _ in exports.values()
    )
    sources = [path for path in PACKAGE.glob("*.py") if not path.name.startswith("_")]
    sources += [path / "__init__.py" for path in PACKAGE.iterdir()
                if path.is_dir() and not path.name.startswith("_")
                and (path / "__init__.py").exists()]
    for path in sorted(sources):
        relative = path.relative_to(ROOT).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        module = ".".join(parts)
        if module in COMMAND_LINE:
            continue
        tree = ast.parse(path.read_text())
        public = _literal_names(tree, "__all__")
        if public is None:
            public = [node.name for node in tree.body
                      if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                      and not node.name.startswith("_")]
        names[module] = [f"{module}.{name}" for name in public]
    return names


def test_every_public_name_has_an_entry_in_the_reference(site):
    anchors = set()
    for page in (site / "reference").rglob("*.html"):
        anchors.update(re.findall(r'id="(kerasdbg[\w.]*)"', page.read_text(encoding="utf-8")))
    missing = {module: [name for name in public if name not in anchors]
               for module, public in _public_names().items()}
    missing = {module: absent for module, absent in missing.items() if absent}
    assert not missing, (
        "public names with no entry (no `id=` anchor) in the API reference; give the module a "
        f"page under docs/reference/ (and the nav of mkdocs.yml), or the name a docstring: {missing}"
    )


def test_reference_overview_lists_every_top_level_name(site):
    page = (site / "reference" / "index.html").read_text(encoding="utf-8")
    top = ast.parse((PACKAGE / "__init__.py").read_text())
    absent = [name for name in sorted(_literal_names(top, "_EXPORTS"))
              if f"kerasdbg.{name}</code>" not in page]
    assert not absent, f"docs/reference/index.md's table does not list kerasdbg.{absent}"


def test_every_notebook_is_rendered_with_its_stored_outputs(site):
    assert NOTEBOOKS, "no notebooks found"
    problems = []
    for path in NOTEBOOKS:
        page_path = site / "notebooks" / path.stem / "index.html"
        if not page_path.exists():
            problems.append(f"{path.name}: no page {page_path.relative_to(site)}")
            continue
        page = page_path.read_text(encoding="utf-8")
        cells = [cell for cell in json.loads(path.read_text())["cells"]
                 if cell["cell_type"] == "code"]
        with_outputs = sum(bool(cell["outputs"]) for cell in cells)
        images = sum("image/png" in output.get("data", {})
                     for cell in cells for output in cell["outputs"])
        shown_outputs = page.count('class="jp-OutputArea jp-Cell-outputArea"')  # one a cell
        shown_images = page.count('src="data:image/png;base64,')
        if not with_outputs:
            problems.append(f"{path.name}: stored without outputs")
        if shown_outputs < with_outputs:
            problems.append(f"{path.name}: {shown_outputs} outputs on its page, "
                            f"{with_outputs} cells with outputs stored")
        if shown_images < images:
            problems.append(f"{path.name}: {shown_images} images on its page, {images} stored")
    assert not problems, "notebook pages:\n" + "\n".join(problems)


def test_every_guide_and_the_readme_are_in_the_site(site):
    assert GUIDES, "no guides found in docs/"
    pages = {guide.name: site / ("index.html" if guide.stem == "index"
                                 else f"{guide.stem}/index.html") for guide in GUIDES}
    pages["README.md"] = site / "readme" / "index.html"
    missing = [name for name, page in pages.items() if not page.exists()]
    assert not missing, f"guides with no page in the site: {missing}"
    for name, page in pages.items():
        source = (ROOT / "docs" / name) if name != "README.md" else ROOT / "README.md"
        title = re.search(r"^# (.+)$", source.read_text(encoding="utf-8"), re.MULTILINE).group(1)
        assert title in page.read_text(encoding="utf-8"), f"{name}'s title {title!r} not on its page"


def _misplaced_examples(docstring: str):
    """The `>>>` lines of a docstring that are not indented under an `Examples:` header."""
    misplaced, header = [], None  # header: indentation of the open `Examples:`, or None
    for line in docstring.splitlines():
        indent = len(line) - len(line.lstrip())
        if re.match(r"^\s*Examples:\s*$", line):
            header = indent
        elif line.strip() and header is not None and indent <= header:
            header = None  # a line as far left as the header closes the section
        if line.lstrip().startswith(">>>") and header is None:
            misplaced.append(line.strip())
    return misplaced


def test_docstring_examples_are_in_an_examples_section():
    # griffe reads a Google-style section only from an indented block under its header: a
    # `>>>` line elsewhere is Markdown, a quote with the output run into the code.
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        # Every string statement: the docstrings of modules, classes and functions, and
        # those of attributes (a string right after an assignment), which griffe reads too.
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                    and _misplaced_examples(inspect.cleandoc(node.value.value))):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not problems, (
        "docstring examples outside an indented `Examples:` section (write `Examples:` and "
        "indent the `>>>` lines under it):\n" + "\n".join(sorted(set(problems)))
    )


# ---------------------------------------------------------------- links and formatting
HREF = re.compile(r'\bhref="([^"]*)"')
ID = re.compile(r'\bid="([^"]+)"')


def _page_of(site: pathlib.Path, page: pathlib.Path, target: str):
    """`(file, anchor)` that a relative `href` of `page` points to (a directory: its
    index.html), or None for a link that leaves the site (a URL, `mailto:`, `//host`)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^//", target, re.IGNORECASE):
        return None
    path, _, anchor = target.partition("#")
    path = path.partition("?")[0]
    if not path:
        return page, anchor
    resolved = (site / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
    if path.endswith("/") or resolved.is_dir():
        resolved = resolved / "index.html"
    return resolved.resolve(), anchor


def test_every_internal_link_resolves(site):
    # mkdocs --strict checks the Markdown's links; this checks what the pages hold once
    # rendered: the navigation, the notebooks' tables of contents and links, the API
    # reference's cross-references, the README's links mapped by docs/hooks.py.
    ids, broken, checked = {}, [], 0
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        ids[page.resolve()] = set(ID.findall(page.read_text(encoding="utf-8")))
    for page in pages:
        for target in HREF.findall(page.read_text(encoding="utf-8")):
            found = _page_of(site, page, target)
            if found is None:
                continue
            checked += 1
            file, anchor = found
            if not file.exists():
                broken.append(f"{page.relative_to(site)}: {target} (no file)")
            elif anchor and file.suffix == ".html" and anchor not in ids[file]:
                broken.append(f"{page.relative_to(site)}: {target} (no id {anchor!r} there)")
    assert checked > 1000, f"only {checked} internal links found: is the site complete?"
    assert not broken, f"{len(broken)} internal links of the site lead nowhere:\n" + "\n".join(
        sorted(set(broken))[:50])


def _source_headings(path: pathlib.Path, level: int):
    """The text of a notebook's Markdown headings of `level`, code spans shown as their text."""
    headings = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#" * level + " "):
                    headings.append(line[level + 1:].replace("`", "").strip())
    return headings


def test_every_notebook_table_of_contents_links_its_headings(site):
    # The table of contents in a notebook page's sidebar: one entry a section heading, with
    # its code spans' text, linking to the anchor the renderer gave that heading (the id
    # mkdocs-jupyter's slugify makes of the heading's text).
    from mkdocs_jupyter.utils import slugify  # the site's (the docs extra), as the site built
    from nbconvert.filters.strings import _convert_header_id

    problems = []
    for path in NOTEBOOKS:
        page = (site / "notebooks" / path.stem / "index.html").read_text(encoding="utf-8")
        toc = page.split('data-md-component="toc"', 1)[-1].split("</nav>", 1)[0]
        entries = [(anchor, html.unescape(" ".join(re.sub(r"<[^>]+>", "", text).split())))
                   for anchor, text in re.findall(
                       r'<a href="#([^"]*)" class="md-nav__link">(.*?)</a>', toc, re.S)]
        headings = _source_headings(path, 2)
        expected = [(_convert_header_id(slugify(text)), text) for text in headings]
        if entries != expected:
            problems.append(f"{path.name}: table of contents {entries}, headings {expected}")
        page_ids = set(ID.findall(page))
        problems += [f"{path.name}: #{anchor} ({text!r}) is no id on the page"
                     for anchor, text in entries if anchor not in page_ids]
    assert not problems, "\n".join(problems)


def test_signatures_are_formatted(site):
    log = (site.parent / "build.log").read_text(encoding="utf-8")
    assert "Formatting signatures requires" not in log, (
        "mkdocstrings found no formatter: install the docs extra (ruff)")
    pages = list((site / "reference").rglob("*.html"))
    signatures = [html.unescape(re.sub(r"<[^>]+>", "", block)) for page in pages
                  for block in re.findall(r'<div class="doc-signature[^"]*">(.*?)</div>',
                                          page.read_text(encoding="utf-8"), re.S)]
    assert len(signatures) > 50, f"only {len(signatures)} signatures in the reference"
    long_lines = [line for signature in signatures for line in signature.splitlines()
                  if len(line) > 80]
    assert not long_lines, f"signature lines over mkdocs.yml's line_length of 80: {long_lines}"
    # A signature with several parameters is one parameter a line.
    assert any(line.startswith("    log_dir: ") for signature in signatures
               for line in signature.splitlines()), signatures[:3]


def test_notebook_outputs_wrap_at_spaces(site):
    # JupyterLab's stylesheet, inlined in every notebook page, wraps outputs anywhere
    # (`word-break: break-all`); docs/stylesheets/notebooks.css puts word wrapping back.
    css = (site / "stylesheets" / "notebooks.css").read_text(encoding="utf-8")
    rule = re.search(r"([^{}]*\.jp-OutputArea-output pre)\s*\{([^}]*)\}", css)
    assert rule and "word-break: normal" in rule.group(2), css
    # More specific than JupyterLab's `.jupyter-wrapper .jp-OutputArea-output pre`.
    assert rule.group(1).split("/*")[-1].split("*/")[-1].count(".") > 2, rule.group(1)
    for path in NOTEBOOKS:
        page = (site / "notebooks" / path.stem / "index.html").read_text(encoding="utf-8")
        assert 'href="../../stylesheets/notebooks.css"' in page, path.name
        assert "word-break:break-all" in page, (
            f"{path.name}: JupyterLab's stylesheet changed; check the override is still needed")
