"""experiments/fc_spectrum.py: the spectrum numbers against numpy, and a smoke run."""

from __future__ import annotations

import json
import os

import numpy as np


def test_spectrum_of_a_known_matrix():
    from experiments import fc_spectrum

    lam = np.array([0.5, 0.3, 0.0, 0.2])
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((4, 4)))
    R = np.diag(np.sqrt(lam)) @ q.T  # R^T R = q diag(lam) q^T
    s = fc_spectrum.spectrum(R)
    np.testing.assert_allclose(s["frobenius"], np.sqrt(np.sum(lam**2)), rtol=1e-12)
    np.testing.assert_allclose(s["largest"], 0.5, rtol=1e-12)
    np.testing.assert_allclose(s["participation"], 1.0**2 / 0.38, rtol=1e-12)
    assert s["above_0.01"] == 3 and abs(s["smallest"]) < 1e-12
    rank_one = fc_spectrum.spectrum(np.outer([1.0, 0, 0], [0.6, 0.8, 0]))
    np.testing.assert_allclose(rank_one["participation"], 1.0, rtol=1e-12)


def test_smoke_writes_the_table_and_figure(tmp_path):
    from experiments import fc_spectrum

    rows = fc_spectrum.run(workdir=str(tmp_path), hs=["1", "1/30"], steps=3, smoke=True)
    assert [(r["h"], r["step"]) for r in rows] == [(1.0, s) for s in (0, 1, 2, 3)] + [(1 / 30, s) for s in (0, 1, 2, 3)]
    # Algorithm 1 keeps ||R^T R||_F at most delta = 1 - 2 eps after every step
    assert all(r["frobenius"] <= 1 - 2 * 0.01 + 1e-6 for r in rows)
    assert all(0 <= r["saturated"] <= 1 and r["straightness"] > 0 for r in rows)
    assert all("update_over_R" in r for r in rows if r["step"] < 3)
    for name in ("results.json", "results.md", "spectrum.png"):
        assert os.path.getsize(tmp_path / name) > 0
    with open(tmp_path / "results.json") as f:
        assert len(json.load(f)["rows"]) == 8


def test_drive_probe_smoke(tmp_path):
    from experiments import fc_spectrum

    rows = fc_spectrum.run_drive_probe(
        workdir=str(tmp_path), hs=["1"], eps_values=["0.01", "0.25"], steps=3, smoke=True
    )
    assert [(r["eps"], r["step"]) for r in rows] == [(e, s) for e in (0.01, 0.25) for s in (0, 1, 2, 3)]
    for r in rows:
        assert all(0 <= r[k] <= 1 for k in ("saturated", "drive_beyond_2", "saturated_R_at_start"))
        assert r["drive_rms"] > 0 and r["input_kernel_norm"] > 0 and r["state_term_rms"] >= 0
    # at step 0 nothing has moved, so putting R or the drive back at its start changes nothing
    for r in (rows[0], rows[4]):
        assert r["saturated_R_at_start"] == r["saturated"] == r["saturated_drive_at_start"]
    with open(tmp_path / "drive_probe.json") as f:
        header = json.load(f)["header"]
    assert header["script"] and header["device"]
    assert not (tmp_path / "results.json").exists()  # the spectrum's outputs are not touched
    assert os.path.getsize(tmp_path / "drive_probe.md") > 0


def test_block_terms_follow_the_plain_loop():
    import jax
    import jax.numpy as jnp

    from experiments import fc_spectrum
    from naisnet_jax.models import get_model

    eps, h = 0.05, 0.7  # the parameters are float32: the loop agrees to float32 rounding
    net = get_model("naisnet_fc_tiny", eps=eps, h=h, activation="tanh")
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 3, 3, 1))
    params = net.init(jax.random.PRNGKey(0), x)["params"]
    drive, state_term, pre = fc_spectrum.block_terms(net.apply, params, x, eps=eps)
    R = np.asarray(params["block"]["R"], np.float64)
    A = -R.T @ R - eps * np.eye(R.shape[1])
    want_drive = np.asarray(x).reshape(5, -1) @ np.asarray(params["block"]["input"]["kernel"]) + np.asarray(
        params["block"]["input"]["bias"]
    )
    state, want = np.zeros_like(want_drive), []
    for _ in range(net.steps):
        want.append(state @ A.T + want_drive)
        state = state + h * np.tanh(want[-1])
    np.testing.assert_allclose(drive, want_drive, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pre, np.stack(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state_term, np.stack(want) - want_drive, rtol=1e-5, atol=1e-6)
    assert jnp.all(pre[0] == drive)  # x_0 = 0: the first pre-activation is the drive
