"""The quickstart notebook runs top to bottom and finds what it says.

``experiments/notebooks/quickstart.ipynb`` is executed with nbclient in quick mode
(``NAISNET_NOTEBOOK_QUICK=1``), in a temporary working directory, by an IPython kernel of the
interpreter running the tests (``experiments.notebooks.run.execute``, as ``make notebook``).
Any cell error fails the test. The figures the notebook wrote to
``summary.json`` are then checked against the theory: the block reached its equilibrium, the 1-D
claims hold for the stable map and break for the unstable one, the audit's bound is at least
numpy's radius and below 1, and adaptive depths lie in ``[1, max_steps]`` and grow as the tolerance
shrinks. The committed file must carry no outputs.
"""

import json

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from experiments.notebooks import run
from naisnet_jax import data as data_lib

NOTEBOOK = run.QUICKSTART
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code) >= 5
    for i, cell in enumerate(code):
        assert cell.outputs == [], f"code cell {i} of {NOTEBOOK.name} has committed outputs"
        assert cell.execution_count is None, f"code cell {i} of {NOTEBOOK.name} has an execution count"
        assert "execution" not in cell.metadata, f"code cell {i} of {NOTEBOOK.name} has execution timings"


def _require_fashion_mnist() -> None:
    """The notebook trains on real Fashion-MNIST; a machine without it fails here, saying why."""
    directory = data_lib.fashion_mnist_dir()
    missing = [s for s in IDX_FILES if not ((directory / f"{s}.gz").is_file() or (directory / s).is_file())]
    if missing:
        pytest.fail(
            f"the quickstart notebook trains on real Fashion-MNIST, but {directory} lacks {missing} "
            f"(.gz or uncompressed). Install Debian's dataset-fashion-mnist (`make data`) or set "
            f"{data_lib.FASHION_MNIST_ENV} to a folder holding the four IDX files.",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """``(notebook, summary)``: the notebook executed in quick mode in a temporary directory."""
    _require_fashion_mnist()
    cwd = tmp_path_factory.mktemp("quickstart")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    try:
        run.execute(nb, cwd=cwd, quick=True)
    except CellExecutionError as error:
        pytest.fail(
            f"{NOTEBOOK.name} failed in quick mode (executed copy: {cwd / 'executed.ipynb'}):\n{error}", pytrace=False
        )
    finally:
        nbformat.write(nb, cwd / "executed.ipynb")
    return nb, json.loads((cwd / "runs" / "quickstart-quick" / "summary.json").read_text())


def test_notebook_runs_with_its_figures(executed):
    nb, _ = executed
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # equilibrium, 1-D maps, training curves, spectrum, depths
    html = [o for o in outputs if "text/html" in o.get("data", {})]
    assert any("certified" in o.data["text/html"] for o in html)  # the Certificate's table


def test_block_converges_to_its_equilibrium(executed):
    block = executed[1]["block"]
    eps = 0.1
    lo, hi = block["eig_A"]
    assert -1 + eps - 1e-6 <= lo <= hi <= -eps + 1e-6  # Algorithm 1's set: eig(A) in [-1 + eps, -eps]
    assert block["distance_last"] < 1e-3 * block["distance_first"]


def test_one_d_maps_stable_and_unstable(executed):
    stable, unstable = executed[1]["one_d"]["-0.5"], executed[1]["one_d"]["1.0"]
    assert stable["monotone"] and stable["slope_below_gain"] and stable["converges"]
    assert not unstable["slope_below_gain"] and unstable["converges"] is False
    assert unstable["max_slope"] > 100  # the step at u = 0 (bifurcation)


def test_training_audit_and_adaptive_depths(executed):
    summary = executed[1]
    assert summary["quick"] is True
    train = summary["train"]
    assert train["epoch"] == 2 and train["test_accuracy"] > 0.6  # ten classes: chance is 0.1
    assert train["rho_max"] <= 0.9 + 1e-6  # h = 1, eps = 0.1: rho(I + hA) <= 1 - h eps
    audit = summary["audit"]
    assert audit["certified"] and audit["blocks"] == 1
    assert audit["rho_numpy"] <= audit["rho_bound"] * (1 + 1e-12) and audit["rho_bound"] < 1
    adaptive = summary["adaptive"]
    rows = adaptive["rows"]
    assert [r["tol"] for r in rows] == sorted((r["tol"] for r in rows), reverse=True)
    for r in rows:
        assert 1 <= r["depth_min"] <= r["depth_mean"] <= r["depth_max"] <= adaptive["max_steps"]
        assert r["accuracy"] > 0.6
    # a smaller tol can only stop a pattern later
    means = [r["depth_mean"] for r in rows]
    assert means == sorted(means) and means[0] < means[-1]
