"""The supplement's 1-D analysis: the scalar maps against a plain Python loop, and its claims
(monotone, slope bounded by the steady-state gain, convergence to the equilibrium map) holding
for every stable a on a grid and failing for unstable ones."""

import json
import math

import jax
import numpy as np
import pytest

from experiments import one_d

U = np.linspace(-3.0, 3.0, 241)  # contains 0
STABLE = (-0.05, -0.3, -0.7, -0.95)  # Algorithm 1's set: a in (-1, 0)
UNSTABLE = (0.5, 1.0, -2.5, -3.0)  # |1 + a| > 1


def loop_maps(a, u, *, activation, max_steps, tol=None):
    """x_K(u) for K = 1..max_steps by a plain Python loop over each u."""
    act = math.tanh if activation == "tanh" else (lambda z: max(z, 0.0))
    maps = np.zeros((max_steps, len(u)))
    depth = np.zeros((max_steps, len(u)), int)
    for i, ui in enumerate(u):
        x, d, stopped = 0.0, 0, False
        for k in range(max_steps):
            if not stopped:
                x_new = x + act(a * x + float(ui))
                d += 1
                stopped = tol is not None and abs(x_new - x) < tol
                x = x_new
            maps[k, i], depth[k, i] = x, d
    return maps, depth


@pytest.mark.parametrize("activation", one_d.ACTIVATIONS)
@pytest.mark.parametrize("tol", [None, 0.95, 0.3])
def test_maps_equal_plain_loop(activation, tol):
    u = np.linspace(-3, 3, 25)
    for a in (-0.3, -1.5, 1.0):
        maps, depth = one_d.scalar_maps(a, u, activation=activation, max_steps=30, tol=tol)
        want, want_depth = loop_maps(a, u, activation=activation, max_steps=30, tol=tol)
        np.testing.assert_allclose(maps, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(depth, want_depth)
    assert one_d.stopping_rule_agrees(-0.3, u, activation=activation, max_steps=30, tol=0.95)


def assert_claims_hold(a, activation, *, tol=None, max_steps=100):
    """The supplement's claims for a stable scalar block, on the grid U."""
    maps, depth = one_d.scalar_maps(a, U, activation=activation, max_steps=max_steps, tol=tol)
    claims = one_d.check_claims(a, U, maps, depth, activation=activation, stopping=tol is not None)
    assert claims.monotone, "map not monotone"
    assert claims.slope_below_gain, f"slope {claims.max_slope} above the gain {claims.gain}"
    if activation == "tanh":
        assert claims.increasing_at_0, "tanh map not strictly increasing at the origin"
    if tol is None:
        assert claims.converges, "distance to the equilibrium map does not shrink"
    return claims


@pytest.mark.parametrize("activation", one_d.ACTIVATIONS)
@pytest.mark.parametrize("a", STABLE)
def test_claims_hold_for_stable_a(a, activation):
    claims = assert_claims_hold(a, activation)
    # The bound is the gain, and it is approached: slopes tend to |b|/|a| (tanh: at the origin).
    assert claims.max_slope > 0.5 * claims.gain
    # With the stopping rule, between its jumps.
    stopped = assert_claims_hold(a, activation, tol=0.95)
    assert stopped.jumps > 0 or activation == "relu"


@pytest.mark.parametrize("activation", one_d.ACTIVATIONS)
@pytest.mark.parametrize("a", UNSTABLE)
def test_claims_fail_for_unstable_a(a, activation):
    with pytest.raises(AssertionError):
        assert_claims_hold(a, activation)
    maps, depth = one_d.scalar_maps(a, U, activation=activation, max_steps=100)
    claims = one_d.check_claims(a, U, maps, depth, activation=activation)
    assert not claims.slope_below_gain
    if a > 0:
        assert not claims.converges
    if activation == "tanh" and a < -2:
        assert not claims.monotone and not claims.increasing_at_0
    if activation == "relu" and a < -2:  # the uninformative map max(u, 0)
        np.testing.assert_allclose(maps, np.broadcast_to(np.maximum(U, 0), maps.shape))


def test_relu_gain_of_a_equal_one_is_two_to_the_k():
    """The supplement's figure: gain ~1e30 at K = 100 for a = 1 (ReLU), i.e. 2^100."""
    maps, _ = one_d.scalar_maps(1.0, np.array([0.0, 1.0]), activation="relu", max_steps=100)
    np.testing.assert_allclose(maps[:, 1], 2.0 ** np.arange(1, 101) - 1, rtol=1e-12)


def test_smoke_run_writes_outputs(tmp_path):
    rows = one_d.run(str(tmp_path), smoke=True)
    assert len(rows) == sum(len(v) for v in one_d.CASES.values()) * 2
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["rows"]) == len(rows)
    assert results["script"] and results["device"].startswith(jax.default_backend())
    stable = [r for r in results["rows"] if r["case"] == "stable_fc"]
    assert all(r["monotone"] and r["slope_below_gain"] for r in stable)
    assert "What this shows" in (tmp_path / "results.md").read_text()
    for case in one_d.CASES:
        assert (tmp_path / f"one_d_{case}.png").stat().st_size > 5_000
