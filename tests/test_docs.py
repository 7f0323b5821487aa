"""The README and docs/: size limits and links that resolve; and the whole tree speaks of the project
alone (no word of development rounds or issue numbers in any tracked text file)."""

from __future__ import annotations

import pathlib
import re
import subprocess

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


TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".json", ".yaml", ".yml", ".sh", ".ipynb", ".log", ""}


def tracked_text_files() -> list[pathlib.Path]:
    """The repository's tracked files (``git ls-files``; every file under the root, less caches and
    virtual environments, where git is missing) that hold text."""
    try:
        names = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, text=True
        ).stdout.split("\0")
        files = [REPO / n for n in names if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", "build"}
        files = [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)]
    return [p for p in files if p.suffix in TEXT_SUFFIXES and p.exists() and p.stat().st_size < 5_000_000]


def test_the_tree_speaks_of_the_project_alone():
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for m in HISTORY.finditer(line):
                hits.append(f"{path.relative_to(REPO)}:{i}: {m.group(0)!r}")
    assert not hits, "development rounds or issue numbers in the tree:\n" + "\n".join(hits[:50])


def test_the_checks_catch_what_they_are_for():
    # the examples are assembled so that this file passes its own tree-wide check
    session, issue = "Sess" + "ion", "Iss" + "ue"
    assert HISTORY.search(f"as in {session} 26") and HISTORY.search(f"see {issue.lower()} #31")
    assert HISTORY.search("runs/s" + "29/out") and HISTORY.search(f"{issue} 7")
    assert not HISTORY.search("the issue's target") and not HISTORY.search("sessions of training")
    assert LINK.findall("[a](docs/x.md) and ![b](img.png)") == ["docs/x.md", "img.png"]
    assert slug('What "certified" means') == "what-certified-means"
    assert slug('What `"fused"` does') == "what-fused-does"
