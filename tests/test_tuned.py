"""Section 5.1 with tuned learning rates (``experiments/tuned.py``): the grid and its growth, the
score, the saturated share against a float64 numpy unroll, and the whole experiment on tiny data."""

from __future__ import annotations

import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from naisnet_jax import data as data_lib
from naisnet_jax import models, sweep

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from experiments import tuned  # noqa: E402


def test_neighbour_walks_half_decades():
    assert tuned.neighbour(0.3, up=True) == 1.0 and tuned.neighbour(0.1, up=True) == 0.3
    assert tuned.neighbour(0.1, up=False) == 0.03 and tuned.neighbour(0.0003, up=False) == 0.0001
    assert tuned.neighbour(1e-5, up=True) == 3e-5
    lr = 0.3
    for _ in range(6):  # down three decades and back lands on the same floats
        lr = tuned.neighbour(lr, up=False)
    assert lr == 0.0003 and tuned.GRID[-1] == lr
    with pytest.raises(ValueError, match="lr=0.2 is not a half-decade rate"):
        tuned.neighbour(0.2, up=True)


def _history(acc: dict[int, list[float]], diverged: dict[int, int] | None = None):
    diverged = diverged or {}
    return [
        {"epoch": e + 1, "seed": s, "test_accuracy": a, "diverged_epoch": diverged.get(s)}
        for s, accs in acc.items()
        for e, a in enumerate(accs)
    ]


def test_score_averages_the_last_epochs_and_zeroes_a_diverged_seed():
    accs = {0: [0.1] * 3 + [0.5, 0.6, 0.7, 0.8, 0.9], 1: [0.2] * 3 + [0.4] * 5}
    out = tuned.score(_history(accs), (0, 1), epochs=8)
    assert out["per_seed"] == pytest.approx([0.7, 0.4])  # epochs 4..8
    assert out["score"] == pytest.approx(0.55) and out["complete"] and out["diverged"] == 0
    assert out["final_accuracy"] == [0.9, 0.4]
    out = tuned.score(_history(accs, {1: 6}), (0, 1), epochs=10)
    assert out["per_seed"] == pytest.approx([0.7, 0.0]) and out["diverged"] == 1 and not out["complete"]


def test_choose_takes_the_best_score_and_the_larger_rate_on_a_tie():
    rows = {0.1: {"score": 0.9}, 0.03: {"score": 0.95}, 0.01: {"score": 0.95}, 0.003: {"score": 0.2}}
    assert tuned.choose(rows) == 0.03


def test_confidence_interval_is_students_t():
    v = np.arange(10.0)
    ci = tuned.confidence_interval(v)
    half = 2.2621571627409915 * v.std(ddof=1) / np.sqrt(10)  # t(0.975, 9)
    assert ci["low"] == pytest.approx(4.5 - half) and ci["high"] == pytest.approx(4.5 + half) and ci["n"] == 10
    assert tuned.confidence_interval([0.5])["low"] is None


def test_rank_among_ten_puts_a_relaxed_row_in_its_namesakes_place():
    def row(label, model, acc, bound=None):
        return {"label": label, "model": model, "bound": bound, "test_accuracy": {"mean": acc, "n": 10}}

    rows = [
        row("NAIS-Net", "naisnet_mnist", 0.90, "1 − 2ε"),
        row("ResNet", "resnet", 0.95),
        row("ResNet-SH", "resnet_sh", 0.92),
        row("NAIS-Net, δ = 2(1 − ε)", "naisnet_mnist", 0.96, "2(1 − ε)"),
    ]
    assert tuned.rank_among_ten(rows) == {"NAIS-Net": 3, "ResNet": 1, "ResNet-SH": 2, "NAIS-Net, δ = 2(1 − ε)": 1}


def _numpy_share(params, u, *, eps, h, steps, threshold):
    """The NAIS block's pre-activations by a plain Python loop in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["block"])
    R = p["R"]
    A = -R.T @ R - eps * np.eye(R.shape[1])
    drive = u @ p["input"]["kernel"] + p["input"]["bias"]
    x = np.zeros_like(drive)
    pres = []
    for _ in range(steps):
        pre = x @ A.T + drive
        pres.append(pre)
        x = x + h * np.tanh(pre)
    return float(np.mean(np.abs(np.stack(pres)) > threshold))


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_saturated_share_matches_a_float64_unroll(scale):
    from naisnet_jax import train

    ds = data_lib.load_dataset("digits", limit_train=64, limit_test=200)
    net = models.get_model("naisnet_mnist", features=16, steps=5, h=1.0, eps=0.01, num_classes=10)
    images = jnp.asarray(ds.test_images)
    mean, std = data_lib.channel_stats(ds.train_images)
    variables = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    params = jax.tree.map(lambda a: a, variables["params"])
    params["block"]["input"]["kernel"] = params["block"]["input"]["kernel"] * scale  # more saturation
    state = train.TrainState.create(apply_fn=net.apply, params=params, tx=__import__("optax").sgd(0.1))
    test = data_lib.put_on_device(ds.test_images, ds.test_labels)
    with jax.default_matmul_precision("highest"):
        share = tuned.saturated_share(state, test, mean, std, batch_size=64)
    u = ((np.asarray(images, np.float64) / 255 - mean) / std).reshape(len(images), -1)
    expected = _numpy_share(params, u, eps=0.01, h=1.0, steps=5, threshold=tuned.SATURATION)
    assert 0.0 < expected < 1.0
    assert share == pytest.approx(expected, abs=2e-3)  # a unit on the threshold may round either way


def _no_training(*args, **kwargs):
    raise AssertionError("a finished sweep was trained again")


def test_smoke_chooses_on_the_held_out_images_and_reports(tmp_path, capsys, monkeypatch):
    workdir = str(tmp_path)
    rows = tuned.run(workdir=workdir, keys=["naisnet_mnist_relaxed"], seeds=2, choice_seeds=2, smoke=True, literal="")
    (row,) = rows
    choice = row["choice"]
    assert row["learning_rate"] == choice["chosen"] == tuned.choose({c["learning_rate"]: c for c in choice["rows"]})
    assert not choice["at_edge"] and choice["validation"] == 64
    assert {0.1, 0.03, 0.01} <= set(choice["grid"])
    for c in choice["rows"]:  # scored on the 64 held-out images: every accuracy is a multiple of 1/64
        acc = np.asarray(c["final_accuracy"]) * 64
        np.testing.assert_allclose(acc, np.round(acc), atol=1e-6)
    assert (
        row["label"] == "NAIS-Net, δ = 2(1 − ε)"
        and row["bound"] == "2(1 − ε)"
        and row["key"] == "naisnet_mnist_relaxed"
    )
    assert row["seeds"] == [0, 1] and row["certified_seeds"] == 2
    assert 0.0 <= row["saturated"]["mean"] <= 1.0 and len(row["saturated"]["per_seed"]) == 2
    assert row["test_accuracy_ci95"]["n"] == 2 and row["neuron_trajectory"]["classes"]
    for name in ("results.json", "results.md", "lr_choice.png", "per_layer_loss.png", "neuron_trajectory.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0
    text = open(os.path.join(workdir, "results.md")).read()
    assert (
        "| NAIS-Net, δ = 2(1 − ε) | 2(1 − ε) | " in text
        and f"**{100 * max(c['score'] for c in choice['rows']):.2f}**" in text
    )
    out = capsys.readouterr().out
    assert "NAIS-Net, δ = 2(1 − ε)" in out.splitlines()[-3]
    # a second call reads every sweep back and trains nothing
    monkeypatch.setattr(sweep, "train_sweep", _no_training)
    again = tuned.run(workdir=workdir, keys=["naisnet_mnist_relaxed"], seeds=2, choice_seeds=2, smoke=True, literal="")
    assert again[0]["test_accuracy"] == row["test_accuracy"]


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="unknown names \\['resnet_xl'\\]"):
        tuned.run(workdir="/nonexistent", keys=["resnet_xl"])
