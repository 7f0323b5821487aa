"""The README and docs/: size limits, no development-history wording, and links that resolve."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README_LIMIT = 10_240  # bytes: the README is a front page; the rest lives in docs/
DOCS_LIMIT = 20_480  # bytes per docs page
HISTORY = re.compile(r"\b(session|issue)\s*#?\d+|\bs\d{2}/", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def pages() -> list[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def page_ids() -> list[str]:
    return [str(p.relative_to(REPO)) for p in pages()]


def prose(path: pathlib.Path) -> str:
    """The page without its fenced code blocks (a link or heading inside code is not one)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(prose(path))}


def test_there_are_docs_pages():
    names = {p.name for p in pages()}
    assert {"training.md", "verifier.md", "performance.md", "experiments.md"} <= names


@pytest.mark.parametrize("path", pages(), ids=page_ids())
def test_page_size(path):
    limit = README_LIMIT if path.name == "README.md" and path.parent == REPO else DOCS_LIMIT
    size = len(path.read_bytes())
    assert size <= limit, f"{path.relative_to(REPO)} is {size} bytes, over its limit of {limit}"


@pytest.mark.parametrize("path", pages(), ids=page_ids())
def test_no_development_history(path):
    hits = [m.group(0) for m in HISTORY.finditer(path.read_text())]
    assert not hits, f"{path.relative_to(REPO)} mentions {hits}"


@pytest.mark.parametrize("path", pages(), ids=page_ids())
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO)}: links that do not resolve: {broken}"


def test_the_checks_catch_what_they_are_for():
    assert HISTORY.search("as in Session 26") and HISTORY.search("see issue #31")
    assert HISTORY.search("runs/s29/out") and HISTORY.search("Issue 7")
    assert not HISTORY.search("the issue's target") and not HISTORY.search("sessions of training")
    assert LINK.findall("[a](docs/x.md) and ![b](img.png)") == ["docs/x.md", "img.png"]
    assert slug('What "certified" means') == "what-certified-means"
    assert slug('What `"fused"` does') == "what-fused-does"
