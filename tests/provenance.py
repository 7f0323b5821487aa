"""What the tests of stored results share: reading fields out of a JSON record and looking up the
commits a record names in this repository's history."""

from __future__ import annotations

import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def fields(record, names: tuple[str, ...], *, flatten_lists: bool = False) -> list:
    """Every value stored under one of ``names``, at any depth of a JSON record; with
    ``flatten_lists`` a list stored under such a name gives its items."""
    found = []
    if isinstance(record, dict):
        for key, value in record.items():
            if key in names:
                found.extend(value if flatten_lists and isinstance(value, list) else [value])
            found.extend(fields(value, names, flatten_lists=flatten_lists))
    elif isinstance(record, list):
        for item in record:
            found.extend(fields(item, names, flatten_lists=flatten_lists))
    return found


def git(*args) -> str | None:
    """``git args`` in the repository, its output stripped; None where git fails."""
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def full_history() -> bool:
    """A checkout whose whole history is here, so that recorded commits can be looked up."""
    return git("rev-parse", "--is-shallow-repository") == "false"


def unknown_commits(scripts) -> list[str]:
    """The commits of recorded script versions (``abc1234`` or ``abc1234+changes``) that this
    repository does not hold."""
    commits = {s.partition("+")[0] for s in scripts}
    return sorted(c for c in commits if git("cat-file", "-e", f"{c}^{{commit}}") is None)
