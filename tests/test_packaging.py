"""Packaging: the Python floor, the licence file, the extras that error messages name, GPU
install lines in the README, and digits from a plain install saying which extra it needs."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import sys
import tomllib

import pytest

from naisnet_jax import data as data_lib
from naisnet_jax import train_cli

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_requires_python_matches_the_dependencies():
    # jax, flax and orbax-checkpoint (the versions this code uses) need Python 3.11
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert sys.version_info >= (3, 11)


def test_the_licence_file_is_the_licence_pyproject_names():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_every_extra_an_error_message_names_exists():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = set()
    for path in list((REPO / "src").rglob("*.py")) + list((REPO / "verify").rglob("*.py")):
        named |= set(re.findall(r"naisnet-jax\[(\w+)\]", path.read_text()))
    assert {"digits", "tensorboard", "tfds"} <= named
    assert named <= extras, named - extras
    assert "hypothesis" in " ".join(PYPROJECT["project"]["optional-dependencies"]["test"])


def test_the_readme_says_how_to_install_for_a_gpu():
    readme = (REPO / "README.md").read_text()
    assert "jax[cuda12]" in readme and "jax[cuda13]" in readme and "Python 3.11" in readme


@pytest.fixture
def no_sklearn(monkeypatch):
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn -> ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)


def test_digits_without_scikit_learn_names_the_extra(no_sklearn, tmp_path):
    with pytest.raises(ImportError, match=r"pip install 'naisnet-jax\[digits\]'"):
        data_lib.load_dataset("digits")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        train_cli.main(["--config=default", "--config.dataset=digits", f"--workdir={tmp_path / 'w'}"])
    assert info.value.code == 2
    assert err.getvalue().startswith("error: ") and "naisnet-jax[digits]" in err.getvalue()
    assert not (tmp_path / "w").exists()
