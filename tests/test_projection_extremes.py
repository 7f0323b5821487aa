"""Algorithms 1 and 2 at every float32 scale: the result is in the set in exact arithmetic.

Reference: the returned float32 values converted to float64 and summed with
``math.fsum`` (exact sums of the products, which are exact in float64), so a
result that is in the set only "up to float32 rounding" fails.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naisnet_jax as nj
from naisnet_jax.parametrize import EPS_MIN, check_eps


def exact_frobenius_gram(R) -> float:
    """||R^T R||_F of float32 R: products exact in float64, sums by fsum (correctly rounded)."""
    R = np.asarray(R, np.float64)
    n = R.shape[1]
    entries = [math.fsum(R[:, i] * R[:, j]) for i in range(n) for j in range(n)]
    return math.sqrt(math.fsum(e * e for e in entries))


def exact_radii(kernel) -> np.ndarray:
    """Per output channel: exact absolute sum of the off-centre taps."""
    K = np.asarray(kernel, np.float64)
    p, c = K.shape[0] // 2, K.shape[-1]
    K = K.copy()
    K[p, p, np.arange(c), np.arange(c)] = 0
    return np.array([math.fsum(np.abs(K[..., o]).ravel()) for o in range(c)])


SCALES = [1e-38, 1e-30, 1e-12, 1e-3, 0.3, 1.0, 7.0, 1e3, 1e12, 1e30, 1e37, 3e38]


@pytest.mark.parametrize("scale", SCALES)
def test_project_fc_lands_in_the_set_at_every_float32_scale(scale):
    rng = np.random.default_rng(int(math.log10(scale) + 40))
    for shape, eps, relaxed in [((3, 5), 0.01, False), ((5, 5), 0.2, True), ((2, 16), EPS_MIN, False)]:
        raw = rng.uniform(-1, 1, shape) * scale
        R = jnp.asarray(raw, jnp.float32)
        assert np.all(np.isfinite(np.asarray(R)))
        P = np.asarray(nj.project_fc(R, eps=eps, relaxed=relaxed))
        delta = 2 * (1 - eps) if relaxed else 1 - 2 * eps
        assert P.dtype == np.float32 and np.all(np.isfinite(P))
        frob = exact_frobenius_gram(P)
        assert frob <= delta, (scale, shape, frob, delta)
        R64 = np.asarray(R, np.float64)
        if exact_frobenius_gram(R) > delta:  # projected: on the boundary up to ~1e-4, direction kept
            assert frob >= delta * (1 - 1e-3)
            ref = R64 / np.linalg.norm(R64)
            mask = np.abs(R64) > 1e-6 * np.abs(R64).max()  # entries that float32 can still hold
            np.testing.assert_allclose((P / np.linalg.norm(P))[mask], ref[mask], rtol=1e-5)
            c = P[mask] / R64[mask]
            assert np.all(c > 0) and np.ptp(c) <= 1e-6 * c.max()  # one positive factor
        else:
            np.testing.assert_array_equal(P, np.asarray(R))


@pytest.mark.parametrize("scale", SCALES)
def test_project_conv_lands_in_the_set_at_every_float32_scale(scale):
    rng = np.random.default_rng(int(math.log10(scale) + 80))
    for (k, C), eps, eta in [((3, 2), 0.01, 0.5), ((5, 3), EPS_MIN, 0.1), ((3, 16), 0.2, 0.9)]:
        kernel = jnp.asarray(rng.uniform(-1, 1, (k, k, C, C)) * scale, jnp.float32)
        delta = jnp.asarray(rng.uniform(-1.5, 1.5, C), jnp.float32)
        pk, pd = nj.project_conv(kernel, delta, eps=eps, eta=eta)
        pk, pd = np.asarray(pk), np.asarray(pd)
        assert np.all(np.isfinite(pk)) and np.all(np.abs(pd.astype(np.float64)) <= 1 - eta)
        p = k // 2
        np.testing.assert_array_equal(pk[p, p, np.arange(C), np.arange(C)], (np.float32(-1) - pd))
        budget = 1 - eps - np.abs(pd.astype(np.float64))
        radii = exact_radii(pk)
        assert np.all(radii <= budget), (scale, radii - budget)
        before = exact_radii(kernel)
        off = np.asarray(kernel, np.float64).copy()
        off[p, p, np.arange(C), np.arange(C)] = 0
        out = pk.astype(np.float64).copy()
        out[p, p, np.arange(C), np.arange(C)] = 0
        for o in range(C):
            if before[o] > budget[o]:  # rescaled onto the boundary, never zeroed
                assert radii[o] >= budget[o] * (1 - 1e-5), (scale, o)
                keep = np.abs(off[..., o]) > 1e-6 * np.abs(off[..., o]).max()
                c = out[..., o][keep] / off[..., o][keep]
                assert np.all(c > 0) and np.ptp(c) <= 1e-6 * c.max()
            else:
                np.testing.assert_array_equal(out[..., o], off[..., o])


def test_projections_near_the_boundary_are_proven_and_idempotent():
    """Inputs within float32 rounding of the boundary: the output is exactly feasible and a
    second projection leaves it bit-for-bit unchanged."""
    rng = np.random.default_rng(5)
    for _trial in range(40):
        R = rng.standard_normal((6, 6))
        R *= np.sqrt((1 - 2 * 0.01) / np.linalg.norm(R.T @ R)) * (1 + rng.uniform(-3e-7, 3e-7))
        R = jnp.asarray(R, jnp.float32)
        once = nj.project_fc(R, eps=0.01)
        assert exact_frobenius_gram(once) <= 1 - 2 * 0.01
        np.testing.assert_array_equal(nj.project_fc(once, eps=0.01), once)
        K = rng.standard_normal((3, 3, 4, 4))
        K[1, 1, range(4), range(4)] = 0
        K *= (1 - 0.01) / np.abs(K).sum(axis=(0, 1, 2)) * (1 + rng.uniform(-3e-7, 3e-7, 4))
        pk, pd = nj.project_conv(jnp.asarray(K, jnp.float32), jnp.zeros(4, jnp.float32), eps=0.01, eta=0.5)
        assert np.all(exact_radii(pk) <= 1 - 0.01)
        pk2, pd2 = nj.project_conv(pk, pd, eps=0.01, eta=0.5)
        np.testing.assert_array_equal(pk2, pk)
        np.testing.assert_array_equal(pd2, pd)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_outside_jit_and_nan_inside(bad):
    R = np.ones((3, 3), np.float32)
    R[1, 2] = bad
    with pytest.raises(ValueError, match=r"R has 1 non-finite entries"):
        nj.project_fc(jnp.asarray(R), eps=0.1)
    assert np.all(np.isnan(jax.jit(lambda r: nj.project_fc(r, eps=0.1))(jnp.asarray(R))))
    K = np.zeros((3, 3, 2, 2), np.float32)
    K[0, 0, 1, 0] = bad
    with pytest.raises(ValueError, match=r"kernel has 1 non-finite"):
        nj.project_conv(jnp.asarray(K), jnp.zeros(2, jnp.float32), eps=0.1, eta=0.5)
    with pytest.raises(ValueError, match=r"delta has 1 non-finite"):
        nj.project_conv(jnp.zeros((3, 3, 2, 2)), jnp.asarray([0.0, bad]), eps=0.1, eta=0.5)
    out = jax.jit(lambda k: nj.project_conv(k, jnp.zeros(2, jnp.float32), eps=0.1, eta=0.5)[0])(jnp.asarray(K))
    assert np.all(np.isnan(out))


@pytest.mark.parametrize("eps", [1e-8, 1e-7, 5e-7, 0.0, -1.0, 0.5])
def test_eps_below_the_float32_floor_is_refused_everywhere(eps):
    """eps = 1e-8 gives a float32 A with rho(I + A) = 1 + 8e-9: refused in the parametrisation,
    the projections, the optax transform and every model."""
    from naisnet_jax import models

    with pytest.raises(ValueError, match=r"eps=.*(outside \(0, 0\.5\)|below the float32 floor EPS_MIN=1e-06)"):
        check_eps(eps)
    with pytest.raises(ValueError, match="eps="):
        nj.project_fc(jnp.ones((2, 2)), eps=eps)
    with pytest.raises(ValueError, match="eps="):
        nj.stability_projection(eps=eps)
    with pytest.raises(ValueError, match="eps="):
        nj.fc_state_matrix(jnp.ones((2, 2)), eps)
    for name in ("naisnet_fc_tiny", "naisnet_conv_tiny", "resnet_sh_stable"):
        with pytest.raises(ValueError, match="eps="):
            models.get_model(name, eps=eps)
    check_eps(EPS_MIN)  # the floor itself is allowed
