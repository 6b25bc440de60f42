"""MkDocs hook: the repository's README and notebooks in the site, and its links mapped.

The guides link each other and files elsewhere in the repository the way
GitHub reads them (`../README.md`, `../notebooks/02_rules.ipynb`,
`docs/rules.md` from the README). The site is built from `docs/` alone, so
this hook

- adds `README.md` as the page `readme.md` and every `notebooks/*.ipynb` as
  `notebooks/<name>.ipynb` (which mkdocs-jupyter then renders), read where
  they are: no copy or link to keep in sync;
- rewrites each relative link of a page that leaves `docs/` (and every link
  of the README) to the page that file became, so the same link works on
  GitHub and in the site;
- shows a link to any other file of the repository (`../bench/x.py`) as its
  text alone: the site has no page for it. A link to no file at all is left as it
  is, for mkdocs to report.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Optional

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Repository path (a file, or a directory ending in "/") -> site path.
MAPPED = {"README.md": "readme.md", "notebooks/": "notebooks/"}

# An inline link or image: `[text](target)` or `[text](target "title")`.
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^\s*(```|~~~)")


def _inside(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or lies under it."""
    return os.path.commonpath([path, directory]) == directory


def _site_path(repository_path: str, docs_dir: str) -> Optional[str]:
    """The site path of a repository file, or None if the site has no page for it."""
    docs = os.path.relpath(docs_dir, ROOT).replace(os.sep, "/") + "/"
    if repository_path.startswith(docs):
        return repository_path[len(docs):]
    for source, target in MAPPED.items():
        if repository_path == source:
            return target
        if source.endswith("/") and repository_path.startswith(source):
            return target + repository_path[len(source):]
    return None


@event_priority(100)  # before mkdocs-jupyter, which turns the .ipynb files into pages
def on_files(files: Files, config) -> Files:
    """Adds the README and the notebooks, read from where they are."""
    files.append(File.generated(config, "readme.md", abs_src_path=os.path.join(ROOT, "README.md")))
    # A plain File with the repository as its source directory, not a generated
    # one: mkdocs-jupyter's wrapper finds the notebook from `src_dir`.
    for name in sorted(os.listdir(os.path.join(ROOT, "notebooks"))):
        if name.endswith(".ipynb"):
            files.append(File(f"notebooks/{name}", ROOT, config["site_dir"],
                              config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Rewrites the page's links to repository files outside `docs/` (see the module)."""
    docs_dir = os.path.abspath(config["docs_dir"])
    source_dir = os.path.dirname(page.file.abs_src_path)
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        opening, target, closing = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, re.IGNORECASE):
            return match.group(0)  # a URL, an anchor on this page, or absolute
        path, _, anchor = target.partition("#")
        absolute = os.path.normpath(os.path.join(source_dir, path))
        if not (_inside(source_dir, docs_dir) and _inside(absolute, docs_dir)):
            repository_path = os.path.relpath(absolute, ROOT).replace(os.sep, "/")
            site_path = _site_path(repository_path, docs_dir)
            if site_path is not None:
                target = posixpath.relpath(site_path, page_dir or ".")
                return f"{opening}{target}{'#' + anchor if anchor else ''}{closing}"
            if os.path.exists(absolute) and not opening.startswith("!"):
                return opening[1:-2]  # the link's text alone
        return match.group(0)

    lines, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        lines.append(line if fenced else LINK.sub(rewrite, line))
    return "\n".join(lines)
