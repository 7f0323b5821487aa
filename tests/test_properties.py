"""Hypothesis properties of Algorithms 1 and 2, every case checked in float64 numpy.

Strategies draw shapes (leading per-step axes included), scales from 1e-8 to 1e8, zero,
rank-one and one-entry matrices, eps, eta, h, and delta. Properties:

* ``project_fc``: the result is a non-negative multiple (at most 1) of ``R``; it satisfies
  ``||R^T R||_F <= delta``; feasible inputs come back bit for bit; projecting twice changes
  nothing; every eigenvalue of ``I + h A``, ``A = -R^T R - eps I``, lies in
  ``[1 - h (eps + delta), 1 - h eps]`` (the Lemma of Algorithm 1: real and inside the unit
  circle).
* ``project_conv``: ``delta`` is clipped to ``[-1 + eta, 1 - eta]``; the centre taps are
  ``-1 - delta_c``; the other taps are a multiple (at most 1) of the input's, with absolute
  sum at most ``1 - eps - |delta_c|``; projecting twice changes nothing; on the dense matrix of
  the convolution (built by a plain loop), every Gershgorin disc lies in
  ``{|z + 1| <= 1 - eps}``, ``||I + h A||_inf <= 1 - h eps`` and ``rho(I + h A) < 1``.

``make test`` runs a quick sample (120 cases over a few shapes); ``make test-slow`` runs 12,000
cases over every shape of the menus.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import loop_conv_matrix

import naisnet_jax as nj
from naisnet_jax.projection import fc_delta

QUICK, SLOW = 60, 6000  # cases per property test: default suite, slow suite (2 x 6000)
TOL = 1e-12  # float64 round-off on O(1) quantities


def _settings(n):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


scales = st.floats(-8.0, 8.0).map(lambda e: 10.0**e)
eps_values = st.floats(1e-4, 0.49)
step_sizes = st.floats(1e-3, 1.0)
FC_SHAPES = [(1, 1), (1, 6), (6, 1), (2, 5), (5, 5), (8, 3), (8, 8)]  # (r, n) of R
CONV_SHAPES = [(1, 1), (1, 3), (3, 1), (3, 2), (3, 3), (5, 2)]  # (filter size, channels)
QUICK_FC_SHAPES, QUICK_CONV_SHAPES = [(1, 6), (5, 5)], [(1, 3), (3, 2)]  # fewer compilations
KINDS = ("gaussian", "zero", "rank_one", "one_entry", "feasible")


def _matrix(rng, shape, kind, scale):
    """A random array of ``shape`` (last two axes a matrix) of the given structure."""
    if kind == "zero":
        return np.zeros(shape)
    if kind == "rank_one":
        u = rng.standard_normal(shape[:-1] + (1,))
        v = rng.standard_normal(shape[:-2] + (1, shape[-1]))
        return scale * u * v
    if kind == "one_entry":
        out = np.zeros(shape)
        out[tuple(rng.integers(0, n) for n in shape)] = scale * rng.choice([-1.0, 1.0])
        return out
    return scale * rng.standard_normal(shape)


@st.composite
def fc_cases(draw, shapes=None):
    # a fixed menu of shapes (each new shape costs JAX a compilation per operation)
    shape = draw(st.sampled_from([(), (3,)])) + draw(st.sampled_from(shapes or FC_SHAPES))  # (3,): untied
    kind = draw(st.sampled_from(KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    eps, relaxed = draw(eps_values), draw(st.booleans())
    R = _matrix(rng, shape, "gaussian" if kind == "feasible" else kind, draw(scales))
    if kind == "feasible":  # scale each R strictly inside the set
        norm = np.linalg.norm(np.swapaxes(R, -1, -2) @ R, "fro", axis=(-2, -1), keepdims=True)
        shrink = draw(st.floats(1e-6, 1.0 - 1e-6))
        R = R * np.sqrt(shrink * fc_delta(eps, relaxed) / np.where(norm > 0, norm, 1.0))
    return R, kind, eps, relaxed, draw(step_sizes)


def _check_fc(case):
    R, kind, eps, relaxed, h = case
    delta = fc_delta(eps, relaxed)
    P = np.asarray(nj.project_fc(jnp.asarray(R), eps=eps, relaxed=relaxed), np.float64)
    assert P.shape == R.shape and np.all(np.isfinite(P))
    for r, p in zip(R.reshape((-1,) + R.shape[-2:]), P.reshape((-1,) + R.shape[-2:])):
        norm_in = np.linalg.norm(r.T @ r, "fro")
        norm_out = np.linalg.norm(p.T @ p, "fro")
        assert norm_out <= delta * (1 + TOL)
        if norm_in <= delta:
            np.testing.assert_array_equal(p, r)  # feasible: untouched, bit for bit
        else:
            c = np.sqrt(delta / norm_in)  # the scaling Algorithm 1 prescribes
            np.testing.assert_allclose(p, c * r, rtol=1e-12, atol=0)
            assert norm_out == pytest.approx(delta, rel=1e-12)
        mu = 1.0 + h * np.linalg.eigvalsh(-p.T @ p - eps * np.eye(p.shape[1]))
        assert mu.max() <= 1 - h * eps + TOL
        assert mu.min() >= 1 - h * (eps + delta) - TOL
        assert np.max(np.abs(mu)) < 1
    if kind == "feasible":
        np.testing.assert_array_equal(P, R)
    twice = np.asarray(nj.project_fc(jnp.asarray(P), eps=eps, relaxed=relaxed))
    np.testing.assert_allclose(twice, P, rtol=1e-12, atol=0)


@st.composite
def conv_cases(draw, shapes=None):
    lead = draw(st.sampled_from([(), (2,)]))
    k, c = draw(st.sampled_from(shapes or CONV_SHAPES))
    kind = draw(st.sampled_from(KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    eps = draw(eps_values)
    eta = draw(st.floats(eps, 1.0, exclude_min=True, exclude_max=True).filter(lambda e: e < 1.0 - 1e-9))
    scale = draw(scales)
    if kind == "rank_one":  # an outer product over (position, input channel, output channel)
        kernel = scale * np.einsum(
            "...ab,...i,...o->...abio",
            rng.standard_normal(lead + (k, k)),
            rng.standard_normal(lead + (c,)),
            rng.standard_normal(lead + (c,)),
        )
    else:
        kernel = _matrix(rng, lead + (k, k, c, c), "gaussian" if kind == "feasible" else kind, scale)
    delta = draw(st.sampled_from([0.0, 1.0, 2.0])) * rng.uniform(-1, 1, lead + (c,))
    if kind == "feasible":
        delta = np.clip(delta, -1 + eta, 1 - eta) * (1 - 1e-9)
        p = k // 2
        off = kernel.copy()
        off[..., p, p, range(c), range(c)] = 0
        budget = (1 - eps - np.abs(delta)) * draw(st.floats(1e-6, 1.0 - 1e-6))
        total = np.abs(off).sum(axis=(-4, -3, -2))
        off = off * (budget / np.where(total > 0, total, 1.0))[..., None, None, None, :]
        kernel = off
        kernel[..., p, p, range(c), range(c)] = -1 - delta
    return kernel, delta, kind, eps, eta, draw(step_sizes)


def _check_conv(case):
    kernel, delta, kind, eps, eta, h = case
    K, D = nj.project_conv(jnp.asarray(kernel), jnp.asarray(delta), eps=eps, eta=eta)
    K, D = np.asarray(K, np.float64), np.asarray(D, np.float64)
    k, c = kernel.shape[-4], kernel.shape[-1]
    p = k // 2
    np.testing.assert_array_equal(D, np.clip(delta, -1 + eta, 1 - eta))
    centre = np.zeros((k, k, c, c), bool)
    centre[p, p, range(c), range(c)] = True
    for kin, kout, d in zip(kernel.reshape((-1, k, k, c, c)), K.reshape((-1, k, k, c, c)), D.reshape(-1, c)):
        np.testing.assert_array_equal(kout[centre].reshape(c), -1 - d)
        off_in, off_out = np.where(centre, 0, kin), np.where(centre, 0, kout)
        budget = 1 - eps - np.abs(d)
        radius_in, radius_out = np.abs(off_in).sum(axis=(0, 1, 2)), np.abs(off_out).sum(axis=(0, 1, 2))
        assert np.all(radius_out <= budget * (1 + TOL))
        scale = np.where(radius_in > budget, budget / np.where(radius_in > 0, radius_in, 1), 1.0)
        # the projection rounds its budget down by a few units in the last place of 1 (so that the
        # rounded result stays in the set): an absolute error of that size in the budget, relative
        # to the radius, is allowed on top of the relative one (it matters when the budget is ~0)
        slack = 16 * np.finfo(np.float64).eps * np.abs(off_in) / np.where(radius_in > 0, radius_in, 1)
        assert np.all(np.abs(off_out - off_in * scale) <= 1e-12 * np.abs(off_in * scale) + slack)
        # the dense operator on a small image: Gershgorin discs, infinity norm, spectral radius
        side = max(k, 2)
        A = loop_conv_matrix(kout, side, side)
        n = A.shape[0]
        centres, radii = np.diag(A), np.abs(A).sum(axis=1) - np.abs(np.diag(A))
        assert np.all(np.abs(centres + 1) + radii <= 1 - eps + TOL)
        J = np.eye(n) + h * A
        assert np.abs(J).sum(axis=1).max() <= 1 - h * eps + TOL
        assert np.max(np.abs(np.linalg.eigvals(J))) < 1
    if kind == "feasible":
        np.testing.assert_array_equal(K, kernel)
    K2, D2 = nj.project_conv(jnp.asarray(K), jnp.asarray(D), eps=eps, eta=eta)
    np.testing.assert_allclose(np.asarray(K2), K, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(np.asarray(D2), D)


@_settings(QUICK)
@given(fc_cases(QUICK_FC_SHAPES))
def test_project_fc_properties_quick(case):
    _check_fc(case)


@_settings(QUICK)
@given(conv_cases(QUICK_CONV_SHAPES))
def test_project_conv_properties_quick(case):
    _check_conv(case)


@pytest.mark.slow
@_settings(SLOW)
@given(fc_cases())
def test_project_fc_properties_at_scale(case):
    _check_fc(case)


@pytest.mark.slow
@_settings(SLOW)
@given(conv_cases())
def test_project_conv_properties_at_scale(case):
    _check_conv(case)
