"""Where the published results come from: every link of experiments/RESULTS.md (and the README's and
docs/experiments.md's links into experiments/results/) resolves; every stored result file names the
commit of the script that made it and the device it ran on; and the parameter counts RESULTS.md
states are those of the models, built without training."""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import provenance
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS_MD = REPO / "experiments" / "RESULTS.md"
RESULTS_DIR = REPO / "experiments" / "results"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
#: A short (or full) git hash, "+changes" where the tree had uncommitted changes to src/, experiments/ or verify/.
SCRIPT = re.compile(r"^[0-9a-f]{7,40}(\+changes)?$")
#: ``naisnet_jax.sweep.device_description()``: "<platform>: <device kind>", e.g. "gpu: NVIDIA H200".
DEVICE = re.compile(r"\b(cpu|gpu|tpu): \S")
DEVICE_KEYS = ("device", "trained on")


def relative_links(path: pathlib.Path) -> list[str]:
    """The page's link and image targets outside fenced code, less URLs and in-page anchors."""
    targets = LINK.findall(FENCE.sub("", path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE) and not t.startswith("#")]


def missing_targets(path: pathlib.Path, *, under: pathlib.Path | None = None) -> list[str]:
    """The relative links of ``path`` (only those into ``under``, where given) whose file or folder
    does not exist."""
    missing = []
    for target in relative_links(path):
        linked = (path.parent / target.partition("#")[0]).resolve()
        if under is not None and under.resolve() not in (linked, *linked.parents):
            continue
        if not linked.exists():
            missing.append(target)
    return missing


def test_every_link_of_results_md_resolves():
    assert relative_links(RESULTS_MD), "RESULTS.md links to no stored result"
    assert not missing_targets(RESULTS_MD), f"RESULTS.md links to missing files: {missing_targets(RESULTS_MD)}"


def test_the_link_check_catches_a_missing_file(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "table.md").write_text("")
    page = tmp_path / "page.md"
    page.write_text(
        "[table](results/table.md) ![figure](results/gone.png) [folder](results/) [web](https://x.org/a.md) "
        "[anchor](#a)\n```\n[in code](results/none.md)\n```\n[elsewhere](other/none.md)"
    )
    assert missing_targets(page) == ["results/gone.png", "other/none.md"]
    assert missing_targets(page, under=tmp_path / "results") == ["results/gone.png"]


@pytest.mark.parametrize("page", ["README.md", "docs/experiments.md"])
def test_links_into_the_stored_results_resolve(page):
    missing = missing_targets(REPO / page, under=RESULTS_DIR)
    assert not missing, f"{page} links to missing files under experiments/results/: {missing}"


def fields(record, names: tuple[str, ...]) -> list:
    """Every value stored under one of ``names``, at any depth of a JSON record; list values are
    flattened."""
    return provenance.fields(record, names, flatten_lists=True)


def provenance_problems(record) -> list[str]:
    """What a stored result lacks: a ``script`` field naming a commit (every one well formed), and a
    ``device`` or ``trained on`` field naming the card (every one naming a platform)."""
    problems = []
    scripts = fields(record, ("script",))
    if not scripts:
        problems.append("no 'script' field: the commit that made it is not recorded")
    bad = sorted({str(s) for s in scripts if not (isinstance(s, str) and SCRIPT.match(s))})
    if bad:
        problems.append(f"'script' values that name no commit: {bad}")
    devices = fields(record, DEVICE_KEYS)
    if not devices:
        problems.append("no 'device' or 'trained on' field: the card it ran on is not recorded")
    bad = sorted({str(d) for d in devices if not (isinstance(d, str) and DEVICE.search(d))})
    if bad:
        problems.append(f"device values that name no platform: {bad}")
    return problems


def result_files() -> list[pathlib.Path]:
    """Every stored JSON record: each experiment's tables and the per-sweep summaries beside them."""
    return sorted(RESULTS_DIR.rglob("*.json"))


def test_the_check_catches_a_record_without_provenance():
    good = {"header": {"device": ["gpu: NVIDIA H200"], "script": ["26c705d"]}, "rows": [{"script": "a745776+changes"}]}
    assert provenance_problems(good) == []
    assert (
        provenance_problems({"header": {"trained on": "gpu: NVIDIA H200 (script 4a195df)"}, "script": "4a195df"}) == []
    )
    no_commit = {"device": "cpu: cpu", "seconds": 1.4, "rows": [{"case": "stable_fc"}]}
    assert any("no 'script'" in p for p in provenance_problems(no_commit))
    unknown = {"device": "cpu: cpu", "script": "unknown"}
    assert any("name no commit" in p for p in provenance_problems(unknown))
    no_device = {"rows": [{"script": "e5ad10c"}]}
    assert any("no 'device'" in p for p in provenance_problems(no_device))
    assert any("no platform" in p for p in provenance_problems({"script": "e5ad10c", "device": "H200"}))


def test_there_are_stored_results():
    assert len(result_files()) >= 9


@pytest.mark.parametrize("path", result_files(), ids=lambda p: str(p.relative_to(RESULTS_DIR)))
def test_every_stored_result_names_its_commit_and_device(path):
    problems = provenance_problems(json.loads(path.read_text()))
    assert not problems, f"{path.relative_to(REPO)}: {problems}"


def test_every_recorded_commit_is_in_the_history():
    if not provenance.full_history():
        pytest.skip("not a full git checkout: the recorded commits cannot be looked up")
    unknown = provenance.unknown_commits(
        s for p in result_files() for s in fields(json.loads(p.read_text()), ("script",))
    )
    assert not unknown, f"recorded script commits that this repository does not hold: {unknown}"


# ------------------------------------------------------------------------------ parameter counts


def parameter_count(name: str, shape: tuple[int, ...], **kwargs) -> int:
    """The model's trainable parameters (``"params"``; BatchNorm's statistics are not counted),
    from the shapes of its initialisation alone (``jax.eval_shape``: nothing is computed)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax import models

    net = models.get_model(name, **models.without_speed_options(kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", models.StateUnusedWarning)  # NAIS-Net1 from x(0) = 0
        shapes = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros(shape)))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes["params"]))


#: RESULTS.md, section 5.2: the CIFAR-10 shapes (32 x 32 x 3 images, 10 classes).
CIFAR_COUNTS = {
    ("naisnet_cifar1", ()): 1_723_930,
    ("naisnet_cifar10", ()): 1_723_930,
    ("resnet_cifar", ()): 855_578,
    ("resnet_cifar", (("convs", 2),)): 1_730_522,
}
#: RESULTS.md's MNIST table (28 x 28 x 1), by the label each sweep has in experiments/results/conv
#: (the rerun's report, and the earlier record in conv/earlier/).
MNIST_COUNTS = {
    "ResNet": 855_290,
    "ResNet-110, two convolutions a block": 1_730_234,
    "NAIS-Net1": 1_723_642,
    "NAIS-Net10": 1_723_642,
    "NAIS-Net10, x(0) = u": 1_723_642,
    "NAIS-Net1, x(0) = u": 1_723_642,
    "NAIS-Net10, BN at stage changes only": 1_721_722,
    "NAIS-Net10, no BN on drives": 1_721_626,
}


@pytest.mark.parametrize(("model", "count"), CIFAR_COUNTS.items(), ids=["nais1", "nais10", "resnet", "resnet_convs2"])
def test_cifar_parameter_counts(model, count):
    name, kwargs = model
    assert parameter_count(name, (1, 32, 32, 3), **dict(kwargs)) == count
    assert f"{count:,}" in RESULTS_MD.read_text()


def test_mnist_parameter_counts_of_the_stored_sweeps():
    """Each MNIST sweep of the conv results, the rerun's and the earlier record's, built from the model
    and options the sweep recorded."""
    rows = [
        row
        for record in ("results.json", "earlier/results.json")
        for row in json.loads((RESULTS_DIR / "conv" / record).read_text())["rows"]
        if row["dataset"] == "mnist_pinned"
    ]
    assert {r["label"] for r in rows} == set(MNIST_COUNTS)
    text = RESULTS_MD.read_text()
    for row in rows:
        label = row["label"]
        count = parameter_count(row["model"], (1, 28, 28, 1), **row["model_kwargs"])
        assert count == MNIST_COUNTS[label], f"{label}: {count:,} parameters, RESULTS.md states {MNIST_COUNTS[label]:,}"
        assert f"| {count:,} |" in text, f"{label}: RESULTS.md's MNIST table does not state {count:,}"
