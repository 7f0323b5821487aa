"""The documentation's Python snippets run as written: the README's library example, and the Flax
NNX example in docs/library.md. (The README's audit example runs in tests/test_verify_api.py.)"""

import pathlib
import re

import numpy as np

REPO = pathlib.Path(__file__).parent.parent


def python_blocks(relative_path: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / relative_path).read_text(), re.S)


def test_readme_snippet_runs():
    code = python_blocks("README.md")[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["x_K"].shape == (8, 64) and scope["xs"].shape == (30, 8, 64)
    depth = np.asarray(scope["depth"])
    assert depth.shape == (8,) and np.all((depth >= 1) & (depth <= 500))


def test_readme_nnx_snippet_runs_and_stays_stable():
    (code,) = [block for block in python_blocks("docs/library.md") if "nnx.Optimizer" in block]
    scope: dict = {}
    exec(compile(code, "docs/library.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert all(np.isfinite(float(v)) for v in scope["losses"])
    R = np.asarray(scope["params"]["block"]["R"][...], np.float64)
    assert np.linalg.norm(R.T @ R, "fro") <= (1 - 2 * 0.01) * (1 + 1e-5)
