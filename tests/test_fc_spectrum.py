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
