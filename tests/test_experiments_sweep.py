"""The sweep experiments' code paths on tiny data (``--smoke``): section 5.1's ablation, section
5.2's conv comparison, and the CIFAR configs at the paper's schedule through TFDS files in the
real layout."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jax
import numpy as np
import pytest

from naisnet_jax import sweep, train

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _no_training(*args, **kwargs):
    raise AssertionError("a finished model was trained again")


def test_ablation_smoke_writes_the_table_and_figures_and_resumes(tmp_path, monkeypatch, capsys):
    from experiments import ablation

    workdir = str(tmp_path)
    rows = ablation.run(
        workdir=workdir, dataset="fashion_mnist_idx", seeds=2, epochs=None, models=["naisnet_mnist"], smoke=True
    )
    (row,) = rows
    assert row["label"] == "NAIS-Net" and row["seeds"] == [0, 1] and row["epochs"] == 2
    assert row["test_accuracy"]["n"] == 2
    assert row["test_accuracy"]["mean"] == pytest.approx(np.mean(row["test_accuracy"]["per_seed"]))
    assert row["certified_seeds"] == 2 and row["all_certified"] is True and row["diverged"] == 0
    curves = np.asarray(row["per_layer_loss"]["per_seed"])
    assert curves.shape == (2, 3)
    np.testing.assert_allclose(row["per_layer_loss"]["mean"], curves.mean(0))
    mono = row["monotonicity"]
    rises = np.diff(curves, axis=1) > ablation.RISE_TOL * np.abs(curves[:, :-1])
    assert mono["monotone_seeds"] == int((~rises.any(1)).sum())
    traj = row["neuron_trajectory"]
    assert sorted(traj["classes"]) == [str(c) for c in range(10)]
    assert all(
        np.asarray(t).shape == (ablation.TRAJECTORY_SAMPLES, 4) and t[0][0] == 0.0 for t in traj["classes"].values()
    )  # x_0 = 0, then K = 3 steps
    for name in ("results.json", "results.md", "per_layer_loss.png", "neuron_trajectory.png", "test_accuracy.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0
    with open(os.path.join(workdir, "results.json")) as f:
        saved = json.load(f)
    assert "h" in saved["header"] and saved["rows"][0]["label"] == "NAIS-Net"
    out = capsys.readouterr().out
    assert "NAIS-Net" in out.splitlines()[-3] and "wall time" in out.splitlines()[-1]
    # the per-seed exports are single-run checkpoints
    assert os.path.isdir(os.path.join(workdir, "naisnet_mnist", "seed_1", train.CHECKPOINT_DIR))

    monkeypatch.setattr(sweep, "train_sweep", _no_training)
    again = ablation.run(
        workdir=workdir, dataset="fashion_mnist_idx", seeds=2, epochs=None, models=["naisnet_mnist"], smoke=True
    )
    assert again[0]["test_accuracy"] == row["test_accuracy"]


def test_monotonicity_counts_rises_beyond_round_off():
    from experiments import ablation

    curves = np.array([[3.0, 2.0, 1.0, 1.0], [3.0, 2.0, 2.5, 1.0]])
    m = ablation.monotonicity(curves)
    assert m["monotone_seeds"] == 1
    assert m["mean_curve_rises"] == 0  # mean (3, 2, 1.75, 1) is non-increasing
    m = ablation.monotonicity(np.array([[2.0, 1.0, 1.5, 1.25]]))
    assert (m["mean_curve_rises"], m["largest_rise"], m["argmin_layer"]) == (1, 0.5, 2)
    assert m["rise_min_to_last"] == pytest.approx(0.25) and m["mean_curve_rise_layers"] == [3]


def test_scaled_schedule_keeps_the_papers_fractions():
    from naisnet_jax.configs import conv_paper

    assert conv_paper.scaled_boundaries(450) == [150, 250, 350]
    assert conv_paper.scaled_boundaries(9) == [3, 5, 7]
    assert conv_paper.scaled_boundaries(3) == [1, 2]
    assert conv_paper.scaled_boundaries(1) == []
    config = conv_paper.get_config()
    assert config.dataset == "mnist_pinned"
    config.dataset = "digits"  # validate the rest where the MNIST loader may not exist yet
    train.validate_config(config)
    assert list(config.lr_boundaries_epochs) == conv_paper.scaled_boundaries(config.num_epochs)


@pytest.mark.slow  # a conv sweep compiles for about a minute on two CPU cores
def test_conv_smoke_writes_the_table_and_figures(tmp_path):
    from experiments import conv
    from naisnet_jax import data

    workdir = str(tmp_path)
    rows = conv.run(workdir=workdir, datasets=["mnist_pinned"], seeds=2, variants=["naisnet1"], smoke=True)
    (row,) = rows
    assert (
        row["dataset"] == "digits"
        and row["model"] == "naisnet_conv_tiny"
        and row["model_kwargs"] == {"initial_state": "zero", "steps": 1, **conv.NAIS_FAST}
    )
    assert row["test_accuracy"]["n"] == 2 and row["certified_seeds"] == 2
    assert row["devices"] == min(jax.local_device_count(), 2)  # the devices that split 2 seeds evenly
    assert row["seeds_at_once"] is None  # all of a device's seeds side by side
    assert row["train_accuracy_curve"]["epochs"] == [1, 2]
    # chance: the commonest class's share of the test examples the sweep evaluated on (the first 100)
    labels = np.asarray(data.load_dataset("digits").test_labels[:100])
    assert row["chance_accuracy"] == np.bincount(labels).max() / 100
    for name in ("results.json", "results.md", "accuracy_digits.png", "gap.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0
    with open(os.path.join(workdir, "results.md")) as f:
        text = f.read()
    assert "same fractions of the run" in text and "| digits | NAIS-Net1 |" in text  # the headline: x(0) = 0


def test_conv_report_only_tables_the_finished_sweeps_and_trains_nothing(tmp_path, capsys):
    """Sweeps gathered from several machines: the report reads the finished ones, names the rest,
    and refuses when none has finished."""
    from experiments import conv, sweep_report

    workdir = str(tmp_path)
    with open(os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "conv", "results.json")) as f:
        stored = json.load(f)["rows"]
    row = next(r for r in stored if r["variant"] == "naisnet1")
    config = conv.make_config("naisnet1", dataset="mnist_pinned", seeds=2, epochs=None, smoke=True)
    sweep_report.write_summary(os.path.join(workdir, "digits", "naisnet1", "summary.json"), config, row)
    rows = conv.run(
        workdir=workdir,
        datasets=["mnist_pinned"],
        seeds=2,
        variants=["naisnet1", "resnet"],
        smoke=True,
        report_only=True,
    )
    assert rows == [row]
    assert sorted(os.listdir(os.path.join(workdir, "digits"))) == ["naisnet1"]  # nothing trained
    last = capsys.readouterr().out.splitlines()[-1]  # not this call's time and CPU, as if it had trained
    assert last.endswith("from the finished sweeps' records (each row's device and times are in results.md)")
    with open(os.path.join(workdir, "results.md")) as f:
        text = f.read()
    assert "- not yet run: digits/resnet" in text and sweep_report.pm(row["test_accuracy"]) in text
    with pytest.raises(ValueError, match="no finished sweep"):
        conv.run(workdir=workdir, datasets=["mnist_pinned"], seeds=2, variants=["resnet"], smoke=True, report_only=True)


def test_conv_claims_compare_each_nais_net_with_each_resnet():
    """The paper's three claims from the per-seed numbers: difference of means with Welch's
    standard error, ratio of mean gaps, ratio of the spreads; a diverged seed (no training
    statistics, whatever its test accuracy) is left out, and a net that diverged makes no claim."""
    from experiments import conv

    def row(variant, acc, gap):
        return {
            "variant": variant,
            "label": conv.VARIANTS[variant][0],
            "dataset": "mnist_pinned",
            "test_accuracy": {"per_seed": acc},
            "generalisation_gap": {"per_seed": gap},
            "train_accuracy": {"mean": 0.98},
            "train_accuracy_curve": {"epochs": [1, 2, 3], "mean": [0.9, 0.97, 0.995]},
            "test_accuracy_curve": {"epochs": [1, 2, 3], "mean": [0.92, 0.96, 0.975]},
        }

    a, b = [0.99, 0.97, 0.98, 0.10], [0.96, 0.98, 0.97, 0.95]
    rows = [row("naisnet10", a, [0.01, 0.02, 0.03, None]), row("resnet", b, [0.03, 0.03, 0.06, 0.04])]
    (c,) = conv.claims(rows)
    x, y = np.array(a[:3]), np.array(b)
    assert c["nais"] == "NAIS-Net10" and c["resnet"] == "ResNet"
    np.testing.assert_allclose(c["accuracy_difference"], x.mean() - y.mean(), rtol=1e-12)
    np.testing.assert_allclose(c["difference_se"], np.sqrt(x.var(ddof=1) / 3 + y.var(ddof=1) / 4), rtol=1e-12)
    np.testing.assert_allclose(c["gap_ratio"], 0.02 / 0.04, rtol=1e-12)
    np.testing.assert_allclose(c["spread_ratio"], x.std() / y.std(), rtol=1e-12)
    # the ResNet reaches NAIS-Net's 98% training accuracy 0.4 of the way from epoch 2 to 3
    assert c["resnet_gap_at_matched_fit"] == pytest.approx({"epoch": 2.4, "gap": 0.6 * 0.01 + 0.4 * 0.02})
    assert c["gap_ratio_at_matched_fit"] == pytest.approx(0.02 / 0.014)
    lo, hi = c["bootstrap"]["gap_ratio"]
    assert lo <= c["gap_ratio"] <= hi and c["bootstrap"]["resamples"] == conv.BOOTSTRAP
    line = next(x for x in conv.claims_table(rows).splitlines() if "| NAIS-Net10 | ResNet |" in x)
    assert line.startswith("| mnist_pinned | NAIS-Net10 | ResNet | +1.50 ± 0.87 | 0.50 [")
    assert line.endswith("| 1.40 (epoch 2.4) | 1.43 |")
    # a NAIS-Net that fits its training set less than its test set has no smaller gap to report
    rows[0]["generalisation_gap"]["per_seed"] = [-0.01, -0.02, 0.0, None]
    (c,) = conv.claims(rows)
    assert c["gap_ratio"] is None
    assert "| +1.50 ± 0.87 | n/a (a gap <= 0) | 0.73 [" in conv.claims_table(rows)
    # an ablation row is compared with the one-convolution ResNet only, after the shipped nets
    rows.append(row("naisnet10_input", [0.97, 0.98, 0.99, 0.98], [0.02, 0.02, 0.02, 0.02]))
    rows.append(row("resnet2", b, [0.03, 0.03, 0.06, 0.04]))
    assert [(c["nais"], c["resnet"]) for c in conv.claims(rows)] == [
        ("NAIS-Net10", "ResNet"),
        ("NAIS-Net10", conv.VARIANTS["resnet2"][0]),
        ("NAIS-Net10, x(0) = u", "ResNet"),
    ]
    np.testing.assert_allclose(conv.claims(rows)[2]["gap_ratio"], 0.02 / 0.04, rtol=1e-12)
    # an ablation that diverged on some seeds is listed, with no difference, gap or spread
    rows.append(row("naisnet10_none", [0.10, 0.10, 0.10, 0.10], [None, -0.001, None, None]) | {"diverged": 3})
    assert conv.claims(rows)[-1] == {
        "dataset": "mnist_pinned",
        "nais": conv.VARIANTS["naisnet10_none"][0],
        "resnet": "ResNet",
        "no_claim": "diverged on 3 of 4 seeds",
    }
    assert "| ResNet | n/a: diverged on 3 of 4 seeds | | | | |" in conv.claims_table(rows)
    # so does one that stays at chance (within a point of always answering the commonest class)
    rows[-1]["chance_accuracy"] = 0.0995
    assert conv.claims(rows)[-1]["no_claim"] == "diverged on 3 of 4 seeds, at chance on 1"
    rows.append(
        row("naisnet10_transitions", [0.1135, 0.1135, 0.1234, 0.99], [-0.001] * 4) | {"chance_accuracy": 0.1135}
    )
    assert "| ResNet | n/a: at chance on 3 of 4 seeds | | | | |" in conv.claims_table(rows)
    rows[-1]["test_accuracy"]["per_seed"][2] = 0.1236  # 1.01 points above chance: it learned something
    transitions = conv.VARIANTS["naisnet10_transitions"][0]
    assert [c["no_claim"] for c in conv.claims(rows) if c["nais"] == transitions] == ["at chance on 2 of 4 seeds"]
    # rows of the shipped nets that learned are compared as before
    rows[0]["chance_accuracy"] = 0.1135
    assert conv.claims(rows)[0]["accuracy_difference"] == pytest.approx(x.mean() - y.mean(), rel=1e-12)


def test_conv_bootstrap_intervals_of_the_ratios():
    """Constant gaps give a point interval; an undefined ratio (a zero spread) is counted, not
    averaged; with many seeds the interval covers the true ratio."""
    from experiments import conv

    acc = np.array([0.9, 0.91, 0.92, 0.93])
    out = conv.bootstrap_ratios(acc, np.full(4, 0.02), np.full(4, 0.95), np.full(4, 0.04), resamples=500)
    assert out["gap_ratio"] == [0.5, 0.5] and out["gap_ratio_undefined"] == 0
    assert out["spread_ratio"] is None and out["spread_ratio_undefined"] == 500
    rng = np.random.default_rng(1)
    a, b = rng.normal(0.9, 0.02, 200), rng.normal(0.9, 0.04, 200)
    ga, gb = rng.normal(0.02, 0.002, 200), rng.normal(0.03, 0.002, 200)
    out = conv.bootstrap_ratios(a, ga, b, gb, resamples=2000)
    assert (
        out["spread_ratio"][0] < 0.5 < out["spread_ratio"][1] and out["spread_ratio"][1] - out["spread_ratio"][0] < 0.2
    )
    assert out["gap_ratio"][0] < 2 / 3 < out["gap_ratio"][1]


def test_conv_gap_at_training_accuracy_interpolates_and_says_never():
    from experiments import conv

    row = {
        "train_accuracy_curve": {"epochs": [1, 2, 3], "mean": [0.5, 0.8, 0.9]},
        "test_accuracy_curve": {"epochs": [1, 2, 3], "mean": [0.6, 0.75, 0.8]},
    }
    assert conv.gap_at_training_accuracy(row, 0.4) == {"epoch": 1.0, "gap": pytest.approx(-0.1)}
    m = conv.gap_at_training_accuracy(row, 0.85)
    assert m["epoch"] == pytest.approx(2.5) and m["gap"] == pytest.approx(0.5 * 0.05 + 0.5 * 0.1)
    assert conv.gap_at_training_accuracy(row, 0.95) is None


def test_conv_gap_figure_names_the_seeds_behind_each_bar():
    """A bar over seeds that diverged or stayed at chance says so, per dataset."""
    from experiments import conv

    def row(dataset, acc, gap, diverged, chance):
        return {
            "label": "NAIS-Net10, no BN on drives",
            "dataset": dataset,
            "test_accuracy": {"per_seed": acc},
            "generalisation_gap": {"per_seed": gap},
            "diverged": diverged,
            "chance_accuracy": chance,
        }

    mnist = row("mnist_pinned", [0.1135, 0.1135, 0.1135, 0.09], [-0.001, -0.001, -0.001, None], 1, 0.1135)
    fashion = row("fashion_mnist_idx", [0.93, 0.92, 0.94, 0.93], [0.01] * 4, 0, 0.1)
    label = "NAIS-Net10, no BN on drives"
    assert conv.gap_label(label, [mnist]) == label + "\ndiverged on 1 of 4 seeds, at chance on 3"
    assert conv.gap_label(label, [mnist, fashion]) == label + "\nmnist_pinned: diverged on 1 of 4 seeds, at chance on 3"
    assert conv.gap_label("ResNet", [mnist, fashion]) == "ResNet"


def test_conv_chance_accuracy_is_the_commonest_test_class():
    from experiments import conv
    from naisnet_jax import data

    ds = data.load_dataset("digits")
    labels = np.asarray(ds.test_labels)
    assert conv.chance_accuracy(ds.test_labels) == max(np.sum(labels == k) for k in range(10)) / len(labels)


@pytest.mark.parametrize("arg", ["cifar10,naisnet_cifar10", "cifar100,naisnet_cifar1", "cifar10,resnet_cifar"])
def test_cifar_configs_keep_the_papers_schedule(arg):
    from naisnet_jax.configs import cifar_paper

    config = cifar_paper.get_config(arg)
    train.validate_config(config)
    assert (config.num_epochs, list(config.lr_boundaries_epochs), config.learning_rate) == (450, [150, 250, 350], 0.1)
    assert config.lr_decay_factor == 0.1 and config.augment and config.momentum == 0.9
    assert (config.dataset, config.model) == tuple(arg.split(","))


def test_cifar_config_refuses_an_unknown_pair():
    from naisnet_jax.configs import cifar_paper

    with pytest.raises(ValueError, match="cifar_paper config argument 'svhn,resnet_cifar'"):
        cifar_paper.get_config("svhn,resnet_cifar")


@pytest.mark.parametrize("dataset, model", [("cifar10", "naisnet_cifar10"), ("cifar100", "naisnet_cifar1")])
def test_cifar_config_reads_tfds_files_in_the_real_layout(tmp_path, dataset, model):
    """The CIFAR config's own data path: TFDS array_record files written by the registered
    builder (PNG images, no mock) under ``config.data_dir``, loaded as the trainer loads them;
    the config's model (full size, shapes only) fits the data."""
    tfds = pytest.importorskip("tensorflow_datasets")
    import jax
    import jax.numpy as jnp
    from test_data import prepare_tiny_tfds

    from naisnet_jax import data
    from naisnet_jax.configs import cifar_paper

    rng = np.random.default_rng(3)
    splits = {
        split: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n))
        for split, n in (("train", 5), ("test", 3))
    }
    prepare_tiny_tfds(tfds, dataset, tmp_path / "tfds", splits)
    config = cifar_paper.get_config(f"{dataset},{model}")
    config.data_dir = str(tmp_path / "tfds")
    train.validate_config(config)
    ds = data.load_dataset(config.dataset, data_dir=config.data_dir)
    assert ds.train_images.shape == (5, 32, 32, 3) and ds.test_images.shape == (3, 32, 32, 3)
    assert sorted(ds.train_labels.tolist()) == sorted(splits["train"][1].tolist())
    net = train.build_model(config, ds.num_classes)
    shapes = jax.eval_shape(
        lambda x: net.init(jax.random.PRNGKey(0), x, train=False), jnp.zeros((1, *ds.image_shape), jnp.float32)
    )
    assert shapes["params"]["classifier"]["kernel"].shape == (64, ds.num_classes)
    assert len([k for k in shapes["params"] if k.startswith("stage")]) == 54


def test_input_stats_standardize_or_unit_interval():
    from naisnet_jax.configs import ablation_paper

    images = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 3), dtype=np.uint8)
    config = ablation_paper.get_config()
    config.dataset = "digits"
    config.standardize = True
    mean, std = train.input_stats(config, images)
    np.testing.assert_allclose(mean, images.reshape(-1, 3).mean(0) / 255)
    np.testing.assert_allclose(std, images.reshape(-1, 3).std(0) / 255)
    config.standardize = False
    mean, std = train.input_stats(config, images)
    assert mean.tolist() == [0, 0, 0] and std.tolist() == [1, 1, 1]
    import ml_collections

    config = ml_collections.ConfigDict(dict(config.to_dict(), standardize="no"))
    with pytest.raises(ValueError, match="config.standardize='no'"):
        train.validate_config(config)


def test_count_kernels_reads_launches_outside_fusions():
    from experiments import sweep_report

    text = (
        jax.jit(lambda x, w: jax.numpy.tanh(x @ w) * 2.0)
        .lower(np.ones((4, 3), np.float32), np.ones((3, 5), np.float32))
        .compile()
        .as_text()
    )
    counts = sweep_report.count_kernels(text)
    assert sum(counts.values()) >= 1
    assert sweep_report.count_kernels("%fused_computation (p: f32[2]) -> f32[2] {\n  %a = f32[2] fusion(%p)\n}\n") == {}


def test_time_steps_projects_a_sweeps_cost():
    """``--time_steps``: steps per second of the compiled epoch, cut to a few steps, and the cost
    of the whole run projected from them (training at that rate plus one evaluation an epoch)."""
    from experiments import ablation, sweep_report

    config = ablation.make_config("naisnet_mnist", dataset="digits", seeds=2, epochs=3, h=None, smoke=True)
    t = sweep_report.time_steps(config, steps=3, repeats=2)
    assert t["seeds"] == 2 and t["steps_timed"] == 3 and t["steps_per_second"] > 0
    np.testing.assert_allclose(t["step_ms"], 1e3 / t["steps_per_second"], rtol=1e-9)
    np.testing.assert_allclose(
        t["projected_seconds"], 3 * (t["steps_per_epoch"] / t["steps_per_second"] + t["eval_seconds"]), rtol=1e-9
    )
    assert sum(t["kernels"].values()) >= 1


def test_conv_rows_and_their_timing_take_seeds_at_once():
    """``--seeds_at_once`` reaches the row's config (bookkeeping: a stored row still stands for it)
    and the timed program: ``time_steps`` runs and reports it."""
    from experiments import conv, sweep_report

    config = conv.make_config("naisnet10", dataset="mnist_pinned", seeds=2, epochs=None, smoke=True, seeds_at_once=1)
    assert config.seeds_at_once == 1
    t = sweep_report.time_steps(config, steps=2, repeats=1)
    assert t["seeds"] == 2 and t["seeds_at_once"] == 1 and t["steps_per_second"] > 0


def test_script_version_names_the_commit_and_a_changed_tree(monkeypatch, tmp_path):
    import subprocess

    from experiments import sweep_report

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout")
    head = git.stdout.strip()
    assert sweep_report.script_version() in (head, head + "+changes")
    probe = REPO / "experiments" / f".script_version_probe_{os.getpid()}"  # an untracked file: a changed tree
    probe.write_text("x")
    try:
        assert sweep_report.script_version() == head + "+changes"
    finally:
        probe.unlink()


def test_a_copy_without_git_names_its_commit_from_the_manifest_and_sees_any_change(tmp_path):
    """A copy of the tree without git (a lent GPU machine) names the commit its manifest was
    written at, with ``+changes`` once any file of src/, experiments/ or verify/ is changed, added
    or removed; links and byte code do not count. The manifest's hashes are git's own."""
    import shutil
    import subprocess

    from experiments import sweep_report

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout")
    here = sweep_report.script_version()
    copy = tmp_path / "copy"
    for folder in sweep_report.TREE_FOLDERS:
        shutil.copytree(  # links stay links (scripts/gpu_env.sh links verify/ into src/naisnet_jax/)
            REPO / folder, copy / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    assert sweep_report.script_version(str(copy)) == "unknown"  # no git, no manifest
    ours = REPO / sweep_report.TREE_MANIFEST  # the checkout's own manifest, if any, stays as it is
    before = ours.read_bytes() if ours.exists() else None
    written = sweep_report.write_tree_manifest(str(REPO), path=str(copy / sweep_report.TREE_MANIFEST))
    assert written == str(copy / sweep_report.TREE_MANIFEST)
    assert (ours.read_bytes() if ours.exists() else None) == before
    manifest = json.loads(pathlib.Path(written).read_text())
    assert manifest["version"] == here
    blob = subprocess.run(
        ["git", "hash-object", "src/naisnet_jax/cell.py"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert manifest["files"]["src/naisnet_jax/cell.py"] == blob.stdout.strip()
    assert sweep_report.script_version(str(copy)) == here
    (copy / "src" / "naisnet_jax" / "__pycache__").mkdir(exist_ok=True)
    (copy / "src" / "naisnet_jax" / "__pycache__" / "cell.cpython-311.pyc").write_bytes(b"\0")
    (copy / "experiments" / "linked").symlink_to(copy / "verify")
    assert sweep_report.script_version(str(copy)) == here  # byte code and links are not the tree
    changed = here if here.endswith("+changes") else here + "+changes"
    cell = copy / "src" / "naisnet_jax" / "cell.py"
    original = cell.read_bytes()
    cell.write_bytes(original + b"\n")
    assert sweep_report.script_version(str(copy)) == changed
    cell.write_bytes(original)
    (copy / "verify" / "extra.py").write_text("x = 1\n")
    assert sweep_report.script_version(str(copy)) == changed
    (copy / "verify" / "extra.py").unlink()
    (copy / "experiments" / "sweep_report.py").unlink()
    assert sweep_report.script_version(str(copy)) == changed


def test_a_manifest_is_written_from_a_git_checkout_only(tmp_path):
    from experiments import sweep_report

    with pytest.raises(ValueError, match="not a git checkout"):
        sweep_report.write_tree_manifest(str(tmp_path))


def test_a_stored_summary_stands_only_for_a_config_that_agrees_on_every_result_field(tmp_path):
    """A summary is reused for a config that differs in bookkeeping alone; any field that decides
    results (the learning rate's drop factor, its warm-up, the bound) makes it another run. A
    summary written before the fingerprint held every such field is matched on the fields it holds."""
    from experiments import sweep_report
    from naisnet_jax.configs import digits_tiny, schema

    path = str(tmp_path / "summary.json")
    config = digits_tiny.get_config()
    sweep_report.write_summary(path, config, {"x": 1})
    assert sweep_report.read_summary(path, config) == {"x": 1}
    for field, value in (
        ("progress", True),
        ("steps_per_chunk", 7),
        ("eval_batch_size", 64),
        ("num_devices", 1),
        ("seeds_at_once", 1),
    ):
        other = digits_tiny.get_config()
        other[field] = value
        assert sweep_report.read_summary(path, other) == {"x": 1}, field  # bookkeeping
    for field, value in (("lr_decay_factor", 0.5), ("lr_warmup_steps", 10), ("relaxed", True), ("max_steps", 7)):
        other = digits_tiny.get_config()
        other[field] = value
        assert sweep_report.read_summary(path, other) is None, field
    assert set(sweep_report.FINGERPRINT_KEYS) == {f.name for f in schema.FIELDS if not f.bookkeeping}
    # a summary from before: its fingerprint holds fewer fields, and only those are compared
    legacy = {k: v for k, v in sweep_report.fingerprint(config).items() if k not in ("relaxed", "lr_warmup_steps")}
    with open(path, "w") as f:
        json.dump({"fingerprint": legacy, "row": {"x": 2}}, f)
    relaxed = digits_tiny.get_config()
    relaxed.relaxed = True
    assert sweep_report.read_summary(path, relaxed) == {"x": 2}
    changed = digits_tiny.get_config()
    changed.learning_rate = 0.5
    assert sweep_report.read_summary(path, changed) is None
    # a current summary written before a field existed: that field held its default
    current = {k: v for k, v in sweep_report.fingerprint(config).items() if k != "lr_warmup_steps"}
    with open(path, "w") as f:
        json.dump({"fingerprint": current, "fingerprint_version": sweep_report.FINGERPRINT_VERSION, "row": 3}, f)
    assert sweep_report.read_summary(path, config) == 3
    warm = digits_tiny.get_config()
    warm.lr_warmup_steps = 10
    assert sweep_report.read_summary(path, warm) is None


def test_neuron_trajectory_of_resnet_sh_stable_starts_at_its_embedding(tmp_path):
    """Figure 3 (right) for ResNet-SH-Stable: each sampled trajectory is x_0 = tanh(u E^T + e),
    then x_{k+1} = x_k + h tanh(x_k W^T + b) with W = -R^T R - eps I, against a float64 numpy loop
    on the trained seed's parameters."""
    from experiments import ablation
    from naisnet_jax import data as data_lib

    config = ablation.make_config("resnet_sh_stable", dataset="mnist_pinned", seeds=1, epochs=None, h=None, smoke=True)
    result = sweep.train_sweep(config, str(tmp_path), audit_baselines=False)
    traj = ablation.neuron_trajectories(result)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), result.seed_state(0).params)
    W = -p["R"].T @ p["R"] - config.eps * np.eye(p["R"].shape[1])
    labels = np.asarray(result.test_data.labels)
    for c, samples in traj["classes"].items():
        idx = np.flatnonzero(labels == int(c))[: ablation.TRAJECTORY_SAMPLES]
        u, _ = data_lib.get_batch(result.test_data, idx, mean=result.mean, std=result.std)
        x = np.tanh(np.asarray(u, np.float64).reshape(len(idx), -1) @ p["embed"]["kernel"] + p["embed"]["bias"])
        expected = [x[:, traj["neuron"]]]
        for _ in range(config.model_kwargs.depth):
            x = x + config.h * np.tanh(x @ W.T + p["b"])
            expected.append(x[:, traj["neuron"]])
        np.testing.assert_allclose(np.asarray(samples), np.stack(expected, axis=1), rtol=0, atol=1e-5)
    assert any(abs(t[0]) > 1e-3 for s in traj["classes"].values() for t in s)  # not the NAIS-Net's zeros


def test_training_time_spans_a_resumed_sweep(tmp_path):
    """A sweep stopped after its first epoch and resumed: the row's training time is the first
    call's epoch plus the second call's, each counted once over the seeds' records, not only the
    time of the call that finished it."""
    from experiments import ablation, sweep_report

    config = ablation.make_config("resnet_sh", dataset="mnist_pinned", seeds=2, epochs=None, h=None, smoke=True)
    first = sweep.train_sweep(config, str(tmp_path), stop_after_epochs=1, audit=False, per_step_loss=False)
    second = sweep.train_sweep(config, str(tmp_path), audit=False, per_step_loss=False)
    (t1,) = {r["epoch_seconds"] for r in first.history}
    (t2,) = {r["epoch_seconds"] for r in second.history if r["epoch"] == 2}
    assert [r["epoch"] for r in second.history] == [1, 1, 2, 2]  # the log keeps the first call's epoch
    assert sweep_report.training_seconds(second.history) == pytest.approx(t1 + t2, rel=1e-12)
    row = ablation.summarise("ResNet-SH", second, config, second.seconds)
    assert row["training_seconds"] == pytest.approx(t1 + t2, rel=1e-12)
    assert sweep_report.training_time_text(row) == f"{t1 + t2:.0f}s"
    older = {k: v for k, v in row.items() if k != "training_seconds"}  # a row recorded before the sum
    assert sweep_report.training_time_text(older) == f"{second.seconds:.0f}s (its last call)"


def test_a_manifest_names_the_commit_of_a_tree_laid_over_an_older_git_checkout(tmp_path):
    """A lent machine may hold the tree's files over an older commit's ``.git``: git then calls the
    newer files changes, and the manifest (written from the newer, clean commit) names them."""
    import subprocess

    from experiments import sweep_report

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "src").mkdir()
    cell = tmp_path / "src" / "cell.py"
    cell.write_text("a = 1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "old")
    old = git("rev-parse", "--short", "HEAD")
    cell.write_text("a = 2\n")
    git("add", "src")
    git("commit", "-q", "-m", "new")
    (tmp_path / ".gitignore").write_text(sweep_report.TREE_MANIFEST + "\n")
    git("add", ".gitignore")
    git("commit", "-q", "-m", "ignore the manifest")
    new = git("rev-parse", "--short", "HEAD")
    sweep_report.write_tree_manifest(str(tmp_path))
    assert sweep_report.script_version(str(tmp_path)) == new  # clean: git says
    git("reset", "-q", "--soft", old)  # HEAD back at the old commit, the newer files in place
    assert git("status", "--porcelain", "src")  # git sees the newer file as a change
    assert sweep_report.script_version(str(tmp_path)) == new
    cell.write_text("a = 3\n")  # the tree is neither commit: git's answer stands
    assert sweep_report.script_version(str(tmp_path)) == old + "+changes"
