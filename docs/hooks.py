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
  is, for mkdocs to report;
- gives each notebook page the table of contents of its rendered headings.
  mkdocs-jupyter builds a notebook's from a second Markdown rendering from
  which it removes every code span first: a heading "1. `PrintLayer`" came out
  as "1." linking to `#1`, an anchor that does not exist (the heading's id is
  `1-printlayer`). The entries here are the headings' own ids and text.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Optional

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.toc import get_toc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Repository path (a file, or a directory ending in "/") -> site path.
MAPPED = {"README.md": "readme.md", "notebooks/": "notebooks/"}

# An inline link or image: `[text](target)` or `[text](target "title")`.
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^\s*(```|~~~)")
# A heading of a rendered notebook: nbconvert's `<hN id="...">text<a class="anchor-link" ...>`.
HEADING = re.compile(r'<h([1-6])\b[^>]*\bid="([^"]+)"[^>]*>(.*?)</h\1>', re.S)
ANCHOR_LINK = re.compile(r'<a\b[^>]*class="anchor-link"[^>]*>.*?</a>', re.S)
TAG = re.compile(r"<[^>]+>")


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


def headings_toc(html: str) -> list:
    """The table-of-contents tokens of the headings in `html`, nested by level.

    Each token is what Python-Markdown's toc extension gives mkdocs: `level`,
    `id` (the heading's own), `name` (its text, code spans' text included, still
    HTML-escaped, the pilcrow link left out) and `children`.
    """
    tokens, open_tokens = [], []  # open_tokens: the chain of the last heading's parents
    for level, anchor, inner in HEADING.findall(html):
        name = " ".join(TAG.sub("", ANCHOR_LINK.sub("", inner)).split())
        token = {"level": int(level), "id": anchor, "name": name, "children": []}
        while open_tokens and open_tokens[-1]["level"] >= token["level"]:
            open_tokens.pop()
        (open_tokens[-1]["children"] if open_tokens else tokens).append(token)
        open_tokens.append(token)
    return tokens


def on_page_content(html: str, page, config, files: Files) -> str:
    """A notebook page's table of contents, from its rendered headings (see the module)."""
    if page.file.src_uri.endswith(".ipynb"):
        page.toc = get_toc(headings_toc(html))
    return html
