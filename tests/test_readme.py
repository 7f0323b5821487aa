"""The README's Python snippet runs as written."""

import pathlib
import re

import numpy as np


def test_readme_snippet_runs():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["x_K"].shape == (8, 64) and scope["xs"].shape == (30, 8, 64)
    depth = np.asarray(scope["depth"])
    assert depth.shape == (8,) and np.all((depth >= 1) & (depth <= 500))


def test_readme_nnx_snippet_runs_and_stays_stable():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[1]
    assert "nnx.Optimizer" in code
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert all(np.isfinite(float(v)) for v in scope["losses"])
    R = np.asarray(scope["params"]["block"]["R"][...], np.float64)
    assert np.linalg.norm(R.T @ R, "fro") <= (1 - 2 * 0.01) * (1 + 1e-5)
