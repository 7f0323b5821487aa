"""Algorithms 1 and 2 against float64 numpy references and the supplement's lemmas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import naisnet_jax as nj

SCALES = [1e-4, 1e-2, 1.0, 1e2, 1e4]
EPSILONS = [1e-3, 0.05, 0.25, 0.49]
STEP_SIZES = [0.1, 0.5, 1.0]


def _random_R(rng, rows, cols, scale):
    return scale * rng.standard_normal((rows, cols))


@pytest.mark.parametrize("shape", [(6, 6), (3, 7), (1, 5), (12, 12)])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("eps", EPSILONS)
def test_project_fc_lemma_eigenvalues_real_in_interval(shape, scale, eps):
    """Supplement, Lemma (FC implementation): eig(I + h diag(s) A) real, in
    [1 - h(1 - eps), 1 - h s_min eps] for every s in [s_min, 1]^n."""
    rng = np.random.default_rng(hash((shape, scale, eps)) % 2**32)
    R = jnp.asarray(_random_R(rng, *shape, scale))
    A = np.asarray(nj.fc_state_matrix(nj.project_fc(R, eps=eps), eps), np.float64)
    n = shape[1]
    for h in STEP_SIZES:
        for s_min in [1.0, 0.3, 1e-3]:
            for _ in range(4):
                s = rng.uniform(s_min, 1.0, size=n)
                s[rng.integers(n)] = s_min  # hit the ends of the interval too
                J = np.eye(n) + h * np.diag(s) @ A
                lam = np.linalg.eigvals(J)
                tol = 1e-9
                assert np.max(np.abs(lam.imag)) <= tol
                assert lam.real.min() >= 1 - h * (1 - eps) - tol
                assert lam.real.max() <= 1 - h * s_min * eps + tol
                assert np.max(np.abs(lam)) < 1


@pytest.mark.parametrize("eps", EPSILONS)
def test_project_fc_feasible_unchanged_and_idempotent(eps):
    rng = np.random.default_rng(0)
    delta = 1 - 2 * eps
    for scale in SCALES:
        R = jnp.asarray(_random_R(rng, 4, 6, scale))
        once = nj.project_fc(R, eps=eps)
        twice = nj.project_fc(once, eps=eps)
        np.testing.assert_allclose(twice, once, rtol=1e-12, atol=0)
        gram = np.asarray(once).T @ np.asarray(once)
        assert np.linalg.norm(gram, "fro") <= delta * (1 + 1e-12)
        if np.linalg.norm(np.asarray(R).T @ np.asarray(R), "fro") <= delta:
            np.testing.assert_array_equal(once, R)
        else:  # scaled onto the boundary of the set, direction kept
            np.testing.assert_allclose(np.linalg.norm(gram, "fro"), delta, rtol=1e-12)
            np.testing.assert_allclose(once / np.linalg.norm(once), R / np.linalg.norm(R), rtol=1e-10)
    # A point strictly inside is returned bit for bit.
    R = jnp.asarray(_random_R(rng, 5, 5, 1e-3))
    np.testing.assert_array_equal(nj.project_fc(R, eps=eps), R)


def test_project_fc_relaxed_bound_and_leading_axes():
    rng = np.random.default_rng(1)
    eps = 0.1
    R = jnp.asarray(10.0 * rng.standard_normal((3, 4, 5)))  # (steps, r, n): untied weights
    P = nj.project_fc(R, eps=eps, relaxed=True)
    for k in range(3):
        gram = np.asarray(P[k]).T @ np.asarray(P[k])
        np.testing.assert_allclose(np.linalg.norm(gram, "fro"), 2 * (1 - eps), rtol=1e-12)
        np.testing.assert_allclose(P[k], nj.project_fc(R[k], eps=eps, relaxed=True), rtol=1e-14)
        # relaxed: eigenvalues of I + A in [-1 + eps, 1 - eps] (stable, may be negative)
        lam = np.linalg.eigvalsh(np.eye(5) + np.asarray(nj.fc_state_matrix(P[k], eps)))
        assert lam.min() >= -1 + eps - 1e-12 and lam.max() <= 1 - eps + 1e-12


def test_project_fc_jits():
    R = jnp.asarray(np.random.default_rng(2).standard_normal((4, 4)))
    jitted = jax.jit(functools.partial(nj.project_fc, eps=0.1))
    np.testing.assert_allclose(jitted(R), nj.project_fc(R, eps=0.1), rtol=1e-14)


def _dense_conv_operator(kernel, image_hw):
    """Dense matrix of X -> conv_same(X, kernel) on one image, via jax.jacfwd."""
    H, W = image_hw
    C = kernel.shape[-1]

    def op(v):
        return nj.conv_same(v.reshape(1, H, W, C), kernel).reshape(-1)

    return np.asarray(jax.jacfwd(op)(jnp.zeros(H * W * C, kernel.dtype)), np.float64)


@pytest.mark.parametrize("channels", [1, 2, 3, 5])
@pytest.mark.parametrize("ksize", [3, 5])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_project_conv_inf_norm_and_radius_on_dense_operator(channels, ksize, scale):
    """Supplement, proof of the conv Lemma: ||I + A||_inf <= 1 - eps, rho(I + h A) < 1."""
    rng = np.random.default_rng(channels * 100 + ksize * 10 + int(np.log10(scale)) + 3)
    eps, eta = 0.05, 0.2
    kernel = jnp.asarray(scale * rng.standard_normal((ksize, ksize, channels, channels)))
    delta = jnp.asarray(rng.uniform(-2, 2, size=channels))  # some outside [-1+eta, 1-eta]
    pk, pd = nj.project_conv(kernel, delta, eps=eps, eta=eta)
    pd = np.asarray(pd)
    assert np.all(np.abs(pd) <= 1 - eta + 1e-15)
    p = ksize // 2
    np.testing.assert_array_equal(np.diagonal(np.asarray(pk)[p, p]), -1 - pd)
    A = _dense_conv_operator(pk, (6, 7))
    n = A.shape[0]
    assert np.abs(np.eye(n) + A).sum(axis=1).max() <= 1 - eps + 1e-12
    for h in STEP_SIZES:
        J = np.eye(n) + h * A
        assert np.abs(J).sum(axis=1).max() <= 1 - h * eps + 1e-12
        assert np.max(np.abs(np.linalg.eigvals(J))) < 1
        # with saturating slopes s in [s_min, 1] the infinity norm bound still holds
        s = rng.uniform(0.01, 1.0, size=n)
        assert np.abs(np.eye(n) + h * np.diag(s) @ A).sum(axis=1).max() < 1


def test_project_conv_feasible_unchanged_and_idempotent():
    rng = np.random.default_rng(3)
    eps, eta = 0.1, 0.3
    kernel = jnp.asarray(0.01 * rng.standard_normal((3, 3, 4, 4)))
    delta = jnp.asarray([0.0, 0.2, -0.3, 0.5])
    pk, pd = nj.project_conv(kernel, delta, eps=eps, eta=eta)
    # feasible off-centre taps are untouched, only the centres are set
    mask = np.asarray(nj.centre_mask(kernel.shape, kernel.dtype))
    np.testing.assert_array_equal(np.asarray(pk) * (1 - mask), np.asarray(kernel) * (1 - mask))
    np.testing.assert_array_equal(pd, np.clip(delta, -1 + eta, 1 - eta))
    pk2, pd2 = nj.project_conv(pk, pd, eps=eps, eta=eta)
    np.testing.assert_allclose(pk2, pk, rtol=1e-14, atol=0)
    np.testing.assert_array_equal(pd2, pd)
    big = jnp.asarray(50 * rng.standard_normal((3, 3, 4, 4)))
    bk, bd = nj.project_conv(big, delta, eps=eps, eta=eta)
    bk2, _ = nj.project_conv(bk, bd, eps=eps, eta=eta)
    np.testing.assert_allclose(bk2, bk, rtol=1e-12)
    radius = (np.abs(np.asarray(bk)) * (1 - mask)).sum(axis=(0, 1, 2))
    np.testing.assert_allclose(radius, 1 - eps - np.abs(np.asarray(bd)), rtol=1e-12)


def test_project_conv_untied_leading_axis_matches_per_step():
    rng = np.random.default_rng(4)
    kernel = jnp.asarray(rng.standard_normal((3, 5, 5, 2, 2)))
    delta = jnp.asarray(rng.uniform(-1, 1, size=(3, 2)))
    pk, pd = nj.project_conv(kernel, delta, eps=0.1, eta=0.2)
    for k in range(3):
        rk, rd = nj.project_conv(kernel[k], delta[k], eps=0.1, eta=0.2)
        np.testing.assert_allclose(pk[k], rk, rtol=1e-14)
        np.testing.assert_allclose(pd[k], rd, rtol=1e-14)


def test_like_conv_blocks_are_projected_together_with_each_blocks_own_result():
    """project_params stacks the conv blocks of one shape (and delta or not) into one
    Algorithm 2 call; every block's kernel and delta are bit for bit those it gets alone."""
    rng = np.random.default_rng(5)
    k = lambda *s: jnp.asarray(3.0 * rng.standard_normal(s), jnp.float32)  # noqa: E731 - infeasible
    d = lambda c: jnp.asarray(rng.uniform(-1.5, 1.5, size=(c,)), jnp.float32)  # noqa: E731
    params = {
        **{
            f"s0_b{i}": {"state_kernel": k(3, 3, 4, 4), "delta": d(4), "input": {"kernel": k(3, 3, 4, 4)}}
            for i in range(4)
        },
        **{f"s1_b{i}": {"state_kernel": k(3, 3, 8, 8), "delta": d(8)} for i in range(3)},
        "plain": {"state_kernel": k(3, 3, 4, 4)},  # no delta: its own group
        "plain2": {"state_kernel": k(3, 3, 4, 4)},
        "lone": {"state_kernel": k(5, 5, 4, 4), "delta": d(4)},  # a group of one
        "untied": {"state_kernel": k(2, 3, 3, 4, 4), "delta": k(2, 4)},
    }
    out = nj.project_params(params, eps=0.1, eta=0.3)
    for name, block in params.items():
        delta = block.get("delta", jnp.zeros(block["state_kernel"].shape[:-4] + (block["state_kernel"].shape[-1],)))
        want_k, want_d = nj.project_conv(block["state_kernel"], delta, eps=0.1, eta=0.3)
        np.testing.assert_array_equal(out[name]["state_kernel"], want_k, err_msg=name)
        if "delta" in block:
            np.testing.assert_array_equal(out[name]["delta"], want_d, err_msg=name)
        if "input" in block:
            np.testing.assert_array_equal(out[name]["input"]["kernel"], block["input"]["kernel"])
    # one projection per group of like blocks: s0 (4), s1 (3), plain (2), lone, untied
    jaxpr = str(jax.make_jaxpr(lambda p: nj.project_params(p, eps=0.1, eta=0.3))(params))
    assert jaxpr.count("name=_project_conv") == 5


def test_conv_state_kernel_sets_centre_taps():
    rng = np.random.default_rng(5)
    kernel = jnp.asarray(rng.standard_normal((5, 5, 3, 3)))
    delta = jnp.asarray([0.1, -0.2, 0.3])
    out = np.asarray(nj.conv_state_kernel(kernel, delta))
    ref = np.asarray(kernel).copy()
    for c in range(3):
        ref[2, 2, c, c] = -1 - float(delta[c])
    np.testing.assert_array_equal(out, ref)


def test_zero_delta_gives_centre_taps_of_minus_one_for_stacked_and_single_kernels():
    from naisnet_jax.parametrize import zero_delta

    kernels = jnp.asarray(np.random.default_rng(7).standard_normal((2, 3, 3, 4, 4)))
    delta = zero_delta(kernels.shape, kernels.dtype)
    assert delta.shape == (2, 4) and delta.dtype == kernels.dtype and not np.any(np.asarray(delta))
    out = np.asarray(nj.conv_state_kernel(kernels, delta))
    np.testing.assert_array_equal(out[:, 1, 1][:, np.arange(4), np.arange(4)], -np.ones((2, 4)))
    assert zero_delta((5, 5, 3, 3)).shape == (3,)
    with pytest.raises(ValueError, match="kernel"):
        zero_delta((3, 3, 4, 5))  # not C x C


def test_fc_state_matrix_matches_numpy():
    R = np.random.default_rng(6).standard_normal((3, 5))
    np.testing.assert_allclose(nj.fc_state_matrix(jnp.asarray(R), 0.2), -R.T @ R - 0.2 * np.eye(5), rtol=1e-14)


def test_stability_projection_in_optax_chain():
    rng = np.random.default_rng(7)
    params = {
        "dense_block": {"R": jnp.asarray(rng.standard_normal((4, 4))), "input": {"kernel": jnp.ones((3, 4))}},
        "stage": {
            "conv_block": {
                "state_kernel": jnp.asarray(rng.standard_normal((3, 3, 2, 2))),
                "delta": jnp.asarray([0.9, -0.9]),
            }
        },
        "head": {"kernel": jnp.ones((4, 2)), "bias": jnp.zeros(2)},
    }
    eps, eta = 0.1, 0.3
    tx = optax.chain(optax.sgd(10.0, momentum=0.9), nj.stability_projection(eps=eps, eta=eta))
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(5):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params)
        before = params
        params, state = step(params, state, grads)
        expected = nj.project_params(
            jax.tree.map(lambda p, g: p - 10.0 * g, before, grads) if i == 0 else params, eps=eps, eta=eta
        )
        if i == 0:  # first step: momentum buffer is the gradient itself
            np.testing.assert_allclose(params["dense_block"]["R"], expected["dense_block"]["R"], rtol=1e-12)
        R = np.asarray(params["dense_block"]["R"])
        assert np.linalg.norm(R.T @ R, "fro") <= (1 - 2 * eps) * (1 + 1e-12)
        k = np.asarray(params["stage"]["conv_block"]["state_kernel"])
        d = np.asarray(params["stage"]["conv_block"]["delta"])
        mask = np.asarray(nj.centre_mask(k.shape, k.dtype))
        assert np.all((np.abs(k) * (1 - mask)).sum(axis=(0, 1, 2)) <= 1 - eps - np.abs(d) + 1e-12)
        np.testing.assert_allclose(np.diagonal(k[1, 1]), -1 - d, rtol=1e-12)
        # parameters that are not NAIS state parameters follow plain SGD
        assert not np.allclose(params["head"]["kernel"], 1.0)
    assert nj.count_projected_blocks(params) == 2


def test_stability_projection_needs_params():
    tx = nj.stability_projection(eps=0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"R": jnp.ones((2, 2))}, tx.init(None))


@pytest.mark.parametrize("bad_eps", [0.0, 0.5, 0.7, -0.1])
def test_bad_eps_is_refused(bad_eps):
    with pytest.raises(ValueError, match=f"eps={bad_eps!r}"):
        nj.project_fc(jnp.ones((2, 2)), eps=bad_eps)
    with pytest.raises(ValueError, match="eps="):
        nj.stability_projection(eps=bad_eps)


@pytest.mark.parametrize("bad_eta", [0.05, 1.0, 1.5])
def test_bad_eta_is_refused(bad_eta):
    with pytest.raises(ValueError, match=r"eta=.*outside \(eps, 1\)"):
        nj.project_conv(jnp.zeros((3, 3, 2, 2)), jnp.zeros(2), eps=0.1, eta=bad_eta)


@pytest.mark.parametrize(
    "shape, message",
    [((2, 2, 3, 3), "even"), ((3, 5, 2, 2), "square"), ((3, 3, 2, 4), "C_in=2, C_out=4"), ((3, 3), "HWIO")],
)
def test_bad_conv_kernel_shapes_are_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        nj.project_conv(jnp.zeros(shape), jnp.zeros(shape[-1:]), eps=0.1, eta=0.5)


def test_mismatched_delta_is_refused():
    with pytest.raises(ValueError, match=r"delta must have shape \(3,\)"):
        nj.project_conv(jnp.zeros((3, 3, 3, 3)), jnp.zeros(2), eps=0.1, eta=0.5)


def test_project_fc_huge_R_keeps_direction_without_overflow():
    """A diverging optimiser can produce R whose R^T R overflows; the projection
    still lands on the boundary with R's direction (float32, no x64 needed)."""
    R = jnp.asarray(np.random.default_rng(8).standard_normal((4, 4)) * 1e30, jnp.float32)
    P = np.asarray(nj.project_fc(R, eps=0.1), np.float64)
    assert np.all(np.isfinite(P))
    np.testing.assert_allclose(np.linalg.norm(P.T @ P, "fro"), 0.8, rtol=1e-5)
    np.testing.assert_allclose(
        P / np.linalg.norm(P),
        np.asarray(R, np.float64) / np.linalg.norm(np.asarray(R, np.float64)),
        rtol=1e-5,
        atol=1e-7,
    )
