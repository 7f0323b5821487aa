"""Section 5.3's script (experiments/depth.py): its bins and summaries against hand counts,
and its core (train with the masked scan, test with the while loop, figures, tables) on tiny
real data."""

import json
import types

import jax
import numpy as np
import pytest
from references import loop_conv_matrix

from experiments import depth
from naisnet_jax import models as M


@pytest.mark.parametrize("seed", range(4))
def test_depth_bins_cover_every_depth_once(seed):
    rng = np.random.default_rng(seed)
    total = rng.integers(2, 40, 500) if seed % 2 else rng.geometric(0.3, 500) + 1
    bins = depth.depth_bins(total, max_bins=6)
    assert len(bins) <= 6
    assert bins[0][0] == total.min() and bins[-1][1] == total.max()
    for (lo, hi), (next_lo, _) in zip(bins, bins[1:]):
        assert lo <= hi and next_lo == hi + 1  # contiguous, no overlap
    counts = [np.sum((total >= lo) & (total <= hi)) for lo, hi in bins]
    assert sum(counts) == len(total) and min(counts) > 0
    assert depth.depth_bins(np.array([3, 3, 5]), max_bins=6) == [(3, 3), (5, 5)]


def test_summarise_against_hand_counts():
    labels = np.array([0, 0, 1, 1, 1, 2])
    block_depth = np.array([[1, 2, 3, 3, 4, 4], [2, 2, 2, 5, 5, 1]])  # totals 3 4 5 8 9 5
    logits = np.eye(3)[[0, 1, 1, 1, 0, 2]]  # correct: yes no yes yes no yes
    scan = logits.copy()
    scan[1] = [1.0, 0.5, 0.0]  # one prediction differs between the two forms
    result = {"logits": logits, "logits_scan": scan, "depth": block_depth}
    s = depth.summarise(result, labels, max_steps=5, num_classes=3)
    assert s["test_accuracy_while_loop"] == pytest.approx(4 / 6)
    assert s["test_accuracy_masked_scan"] == pytest.approx(5 / 6)
    assert s["prediction_disagreements"] == 1
    assert s["depth_min"] == 3 and s["depth_max"] == 9 and s["distinct_depths"] == 5
    assert s["depth_mean"] == pytest.approx(34 / 6)
    assert s["fraction_at_cap"] == [0.0, pytest.approx(2 / 6)]
    assert s["block_depth_max"] == [4, 5]
    c1 = s["per_class"][1]
    assert c1["count"] == 3 and c1["depth_mean"] == pytest.approx(22 / 3)
    assert c1["accuracy"] == pytest.approx(2 / 3) and c1["depth_min"] == 5
    assert sum(b["count"] for b in s["per_bin"]) == 6


def _loop_block0_depths(variables, intermediates, *, tol, max_steps, h):
    """Depths of the first block by a plain float64 Python loop per pattern, from the block's
    input u = relu(stem_bn(stem(x))) (captured from the model) and its parameters."""
    u = np.maximum(np.asarray(intermediates["stem_bn"]["__call__"][0], np.float64), 0)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"]["stage0_block0"])
    kernel = p["state_kernel"].copy()
    C = kernel.shape[-1]
    kernel[1, 1, np.arange(C), np.arange(C)] = -1.0  # centre taps -1 - delta, delta = 0
    b, H, W, _ = u.shape
    state_matrix = loop_conv_matrix(kernel, H, W)
    drive = u.reshape(b, -1) @ loop_conv_matrix(p["input"]["kernel"], H, W).T
    if "drive_norm" in p:  # BatchNorm on the drive (the default; evaluation mode), its offset playing E
        n = p["drive_norm"]
        stats = jax.tree.map(
            lambda a: np.asarray(a, np.float64), variables["batch_stats"]["stage0_block0"]["drive_norm"]
        )
        g = n["scale"] / np.sqrt(stats["var"] + M.BN_EPSILON)
        drive = (drive - np.tile(stats["mean"], H * W)) * np.tile(g, H * W) + np.tile(n["bias"], H * W)
    else:
        drive = drive + np.tile(p["input"]["bias"], H * W)
    depths = []
    for i in range(b):
        x_i, steps = np.zeros(H * W * C), 0
        for _ in range(max_steps):
            x_new = x_i + h * np.maximum(state_matrix @ x_i + drive[i], 0)
            steps += 1
            done = np.linalg.norm(x_new - x_i) < tol
            x_i = x_new
            if done:
                break
        depths.append(steps)
    return np.array(depths)


def test_analysis_core_on_tiny_model(tmp_path):
    """The test-time half on a tiny conv NAIS-Net over real digits: depths from the while loop
    / masked scan against a plain loop, the summary, the figures."""
    from naisnet_jax import data, train

    config = depth.get_config("digits", smoke=True)
    config.adaptive_tol, config.max_steps, config.eval_batch_size = 1e-3, 12, 48
    ds = data.load_dataset("digits", limit_test=64)
    model = train.build_model(config, 10)
    mean, std = data.channel_stats(ds.train_images)
    x = np.asarray(data.preprocess(ds.test_images, mean, std))
    # One compiled init that also captures every submodule's output (for the reference).
    init = jax.jit(lambda k, x: model.init(k, x, capture_intermediates=True, mutable=True))
    variables = dict(init(jax.random.key(0), x))
    intermediates = variables.pop("intermediates")
    state = types.SimpleNamespace(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"]
    )
    row = depth.analyse_run(
        state, ds.test_images, ds.test_labels, mean, std, config=config, dataset="digits", workdir=str(tmp_path), dpi=40
    )
    assert row["num_test"] == 64 and row["prediction_disagreements"] == 0
    assert row["seed"] == config.seed  # the record names its seed
    saved = np.load(tmp_path / "digits_depths.npz")
    assert saved["depth"].shape == (2, 64) and saved["depth"].max() <= 12
    want = _loop_block0_depths(variables, intermediates, tol=1e-3, max_steps=12, h=config.h)
    assert len(np.unique(want)) > 1  # the patterns do stop at different steps
    np.testing.assert_array_equal(saved["depth"][0], want)
    assert row["test_accuracy_while_loop"] == pytest.approx(np.mean(saved["predictions"] == ds.test_labels))
    for name in ("depth_hist", "depth_grid", "accuracy_vs_depth"):
        assert (tmp_path / f"digits_{name}.png").stat().st_size > 2_000


@pytest.mark.slow
def test_core_on_tiny_data(tmp_path):
    """Train on a slice of digits with the masked scan, test with the while loop, write all
    (about 45 s of CPU: train.create_train_state initialises the conv model op by op)."""
    config = depth.get_config("digits", smoke=True)
    config.limit_train, config.limit_test = 128, 64
    config.batch_size, config.eval_batch_size = 64, 48  # 48: the last test batch is padded
    config.max_steps = 4
    row = depth.run_dataset("digits", str(tmp_path), smoke=True, config=config)
    assert row["adaptive_tol"] == depth.TOL and row["max_steps_per_block"] == 4
    assert row["num_test"] == 64 and len(row["per_class"]) == 10
    assert row["prediction_disagreements"] == 0  # same parameters, same stopping rule
    assert row["max_logit_difference"] < 1e-4
    saved = np.load(tmp_path / "digits_depths.npz")
    assert saved["depth"].shape == (2, 64)  # two blocks, every test pattern
    assert saved["depth"].min() >= 1 and saved["depth"].max() <= 4
    np.testing.assert_array_equal(saved["depth"].sum(0).min(), row["depth_min"])
    accuracy = np.mean(saved["predictions"] == saved["labels"])
    assert accuracy == pytest.approx(row["test_accuracy_while_loop"])
    for name in ("depth_hist", "depth_grid", "accuracy_vs_depth"):
        assert (tmp_path / f"digits_{name}.png").stat().st_size > 2_000
    # The run went through train_and_evaluate: a checkpoint and one metrics record to resume.
    assert any((tmp_path / "digits" / "checkpoints").iterdir())
    records = (tmp_path / "digits" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 1 and json.loads(records[0])["epoch"] == 1
    assert len(row["epoch_depth_mean"]) == 1 and 2 <= row["epoch_depth_mean"][0] <= 8
    table = depth.write_results([row], str(tmp_path), device="cpu: test", seconds=1.0)
    assert "| digits | 1 |" in table
    md = (tmp_path / "results.md").read_text()
    assert "What this shows" in md and "T-shirt" not in md
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["dataset"] == "digits"


def test_the_command_passes_its_seed_and_refuses_a_negative_one(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(depth, "run", lambda *a, **k: calls.append((a, k)))
    depth.main([f"--workdir={tmp_path}", "--datasets=mnist_pinned", "--seed=3", "--max_steps=50"])
    ((args, kwargs),) = calls
    assert args == (str(tmp_path), ["mnist_pinned"]) and kwargs["overrides"] == {"max_steps": 50, "seed": 3}
    depth.main([f"--workdir={tmp_path}", "--datasets=mnist_pinned"])
    assert calls[-1][1]["overrides"] == {}  # the config's own seed, 0
    with pytest.raises(SystemExit) as exit_:
        depth.main([f"--workdir={tmp_path}", "--seed=-1"])
    assert exit_.value.code == 2 and "--seed must be >= 0, got -1" in capsys.readouterr().err
