"""Spectral core of the verifier against numpy float64 references.

Soundness: the kernel Gershgorin bound is never below the true radius of I + hA, computed with
`numpy.linalg.eigvals` from a conv matrix written out by a plain loop; Arnoldi, dense and FFT
spectra agree with that reference. Teeth: unstable kernels are reported unstable.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from naisnet_jax.verify import bounds as G
from naisnet_jax.verify import operators as O
from naisnet_jax.verify import spectral as S
from references import loop_conv_matrix, rho
from scipy.optimize import linear_sum_assignment

SHAPES = [(c, k, hw) for c in (1, 2, 3) for k in (3, 5) for hw in (5, 6, 7)]


def random_kernel(rng, c, k, off_sum, centre=(-2.0, 0.3)):
    """A state kernel: random centres in `centre`, other taps with absolute sum `off_sum` per
    output channel (the Gershgorin radius), random signs and sizes."""
    p = (k - 1) // 2
    K = rng.standard_normal((k, k, c, c))
    K[p, p][np.eye(c, dtype=bool)] = 0.0
    K *= off_sum / np.abs(K).sum(axis=(0, 1, 2))
    K[p, p] += np.diag(rng.uniform(*centre, size=c))
    return K


def nonnormal(rng, n):
    A = rng.standard_normal((n, n)) / np.sqrt(n)
    return A + 5.0 * np.triu(rng.standard_normal((n, n)), 1) / np.sqrt(n)


def complex_dominant(rng, n):
    """Similarity transform (non-orthogonal) of blockdiag(1.5 * rotation, radius ~0.8 rest)."""
    D = rng.standard_normal((n, n)) * 0.8 / np.sqrt(n)
    theta = rng.uniform(0.3, 2.8)
    D[:2, :] = 0
    D[:, :2] = 0
    D[:2, :2] = 1.5 * np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    Sm = np.eye(n) + 0.5 * rng.standard_normal((n, n)) / np.sqrt(n)
    return Sm @ D @ np.linalg.inv(Sm)


# ----------------------------------------------------------------------------- operators


@pytest.mark.parametrize("c,k,hw", SHAPES[::4] + [(2, 5, 5)])
def test_conv_matrix_matches_conv_and_loop(c, k, hw):
    rng = np.random.default_rng(c * 100 + k * 10 + hw)
    K = rng.standard_normal((k, k, c, c))
    M = np.asarray(O.conv_matrix(K, (hw, hw)))
    np.testing.assert_allclose(M, loop_conv_matrix(K, hw, hw), atol=1e-13)
    X = rng.standard_normal((3, hw, hw, c))
    Y = jax.lax.conv_general_dilated(
        jnp.asarray(X), jnp.asarray(K), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    for x, y in zip(X, np.asarray(Y)):
        np.testing.assert_allclose(M @ x.reshape(-1), y.reshape(-1), rtol=1e-12, atol=1e-12)
    Mc = np.asarray(O.conv_matrix(K, (hw, hw, c), padding="CIRCULAR"))
    np.testing.assert_allclose(Mc, loop_conv_matrix(K, hw, hw, circular=True), atol=1e-13)


def test_conv_matrix_rectangular_image_and_channels():
    rng = np.random.default_rng(1)
    K = rng.standard_normal((3, 3, 2, 4))
    M = np.asarray(O.conv_matrix(K, (4, 6)))
    assert M.shape == (4 * 6 * 4, 4 * 6 * 2)
    np.testing.assert_allclose(M, loop_conv_matrix(K, 4, 6), atol=1e-13)


def test_operator_matrix_and_jacobian_operator():
    rng = np.random.default_rng(2)
    n = 37
    A = rng.standard_normal((n, n))
    s = rng.uniform(0, 1, n)
    J = np.asarray(O.operator_matrix(O.jacobian_operator(A, s, 0.3), n, chunk=8))
    np.testing.assert_allclose(J, np.eye(n) + 0.3 * np.diag(s) @ A, atol=1e-13)
    K = rng.standard_normal((3, 3, 2, 2))
    s_img = rng.uniform(0, 1, (5, 5, 2))
    Jc = O.operator_matrix(O.jacobian_operator(O.conv_operator(K, (5, 5)), s_img, 0.7), 50)
    ref = np.eye(50) + 0.7 * np.diag(s_img.reshape(-1)) @ loop_conv_matrix(K, 5, 5)
    np.testing.assert_allclose(np.asarray(Jc), ref, atol=1e-13)


# ----------------------------------------------------------------------------- dense / auto


def test_spectral_radius_dense_matches_numpy_on_conv_operators():
    """A few hundred stable and unstable conv Jacobians through the operator (auto) path."""
    rng = np.random.default_rng(3)
    radii = []
    for trial in range(216):
        c, k, hw = SHAPES[trial % len(SHAPES)]
        K = random_kernel(rng, c, k, off_sum=rng.uniform(0.05, 2.0))
        h = rng.uniform(0.1, 1.0)
        ref = rho(np.eye(hw * hw * c) + h * loop_conv_matrix(K, hw, hw))
        op = O.jacobian_operator(O.conv_operator(K, (hw, hw)), np.ones(hw * hw * c), h)
        got = S.spectral_radius(op, n=hw * hw * c)
        assert abs(got - ref) <= 1e-6 * ref
        radii.append(ref)
    assert min(radii) < 1 < max(radii)  # both stable and unstable operators were checked


def test_spectral_radius_matrix_input_and_info():
    rng = np.random.default_rng(4)
    for n in (1, 2, 7, 30, 80):
        for _ in range(20):
            A = rng.standard_normal((n, n)) * rng.uniform(0.1, 3)
            lam = np.linalg.eigvals(A)
            info = S.spectral_radius_info(jnp.asarray(A))
            assert info.method == "dense" and info.converged and info.iterations == 0
            assert abs(info.radius - np.max(np.abs(lam))) <= 1e-12 * max(1, info.radius)
            assert np.min(np.abs(lam - info.eigenvalue)) <= 1e-12 * max(1, info.radius)
            assert info.residual <= 1e-9 * max(1.0, np.linalg.norm(A, 2))


def test_spectral_radius_argument_errors():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        S.spectral_radius(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="n"):
        S.spectral_radius(lambda v: v)
    with pytest.raises(ValueError, match="method"):
        S.spectral_radius(np.eye(3), method="qr")
    A = np.random.default_rng(0).standard_normal((60, 60))
    info = S.spectral_radius_info(A, method="arnoldi", krylov_dim=4, max_restarts=0)
    assert not info.converged
    with pytest.raises(RuntimeError, match="did not converge"):
        S.spectral_radius(A, method="arnoldi", krylov_dim=4, max_restarts=0)


# ----------------------------------------------------------------------------- Arnoldi


@pytest.mark.parametrize("n", [60, 150, 400])
def test_arnoldi_matches_dense_on_random_nonnormal_and_complex(n):
    rng = np.random.default_rng(n)
    makers = [
        lambda: rng.standard_normal((n, n)) / np.sqrt(n),
        lambda: nonnormal(rng, n),
        lambda: complex_dominant(rng, n),
    ]
    for trial in range(6):
        A = makers[trial % 3]()
        lam = np.linalg.eigvals(A)
        ref = np.max(np.abs(lam))
        info = S.spectral_radius_info(A, method="arnoldi")
        assert info.method == "arnoldi" and info.converged
        assert abs(info.radius - ref) <= 1e-6 * ref, (trial, info, ref)
        assert np.min(np.abs(lam - info.eigenvalue)) <= 1e-6 * ref
        assert info.residual <= 1e-8 * ref
        if trial % 3 == 2:
            assert abs(info.eigenvalue.imag) > 0.1  # a complex dominant pair was found


def test_arnoldi_on_conv_operators_matches_dense():
    rng = np.random.default_rng(5)
    for c, k, hw in [(3, 3, 7), (3, 5, 7), (2, 3, 6)]:
        for off_sum in (0.3, 1.0, 2.5):
            K = random_kernel(rng, c, k, off_sum)
            n = hw * hw * c
            op = O.jacobian_operator(O.conv_operator(K, (hw, hw)), rng.uniform(0, 1, n), 0.8)
            ref = rho(np.asarray(O.operator_matrix(op, n)))
            got = S.spectral_radius(op, n=n, method="arnoldi")
            assert abs(got - ref) <= 1e-6 * ref


def test_arnoldi_top_k_and_breakdown():
    rng = np.random.default_rng(6)
    A = nonnormal(rng, 120)
    lam = np.linalg.eigvals(A)
    lam = lam[np.argsort(-np.abs(lam))]
    res = S.arnoldi_eigs(O.dense_operator(A), 120, k=4, krylov_dim=40)
    assert res.converged and res.eigenvectors.shape == (4, 120)
    np.testing.assert_allclose(np.abs(res.eigenvalues), np.abs(lam[:4]), rtol=1e-6)
    # Happy breakdown: the start vector spans an invariant subspace (eigenvalue 1); the search
    # must go on and still find the dominant eigenvalue 3 exactly.
    D = np.diag([1.0, 3.0, -2.0, 0.5, 0.0, 2.5])
    res = S.arnoldi_eigs(O.dense_operator(D), 6, krylov_dim=4, v0=jnp.eye(6)[0])
    assert res.converged and abs(res.eigenvalues[0] - 3.0) <= 1e-12
    # Krylov space as large as the space: exact after one cycle.
    B = rng.standard_normal((5, 5))
    info = S.spectral_radius_info(B, method="arnoldi")
    assert info.converged and abs(info.radius - rho(B)) <= 1e-12 * rho(B)
    assert S.spectral_radius(np.zeros((4, 4)), method="arnoldi") == 0.0


# ----------------------------------------------------------------------------- power


def test_power_norm_estimate_is_two_norm():
    rng = np.random.default_rng(7)
    for n in (20, 50):
        for _ in range(5):
            A = nonnormal(rng, n)
            est = S.power_norm_estimate(O.dense_operator(A), n)
            two = np.linalg.norm(A, 2)
            np.testing.assert_allclose(est, two, rtol=1e-6)
            assert est >= rho(A)
    K = random_kernel(rng, 2, 3, off_sum=1.0)
    M = loop_conv_matrix(K, 6, 6)
    est = S.power_norm_estimate(O.conv_operator(K, (6, 6)), 72)
    np.testing.assert_allclose(est, np.linalg.norm(M, 2), rtol=1e-6)
    assert est >= rho(M)


# ----------------------------------------------------------------------------- FFT


def match_multisets(a, b):
    cost = np.abs(a.reshape(-1)[:, None] - b.reshape(-1)[None, :])
    i, j = linear_sum_assignment(cost)
    return float(cost[i, j].max())


@pytest.mark.parametrize("c,k,hw", [(1, 3, 5), (2, 3, 6), (3, 5, 5), (3, 3, 7), (2, 5, 7)])
def test_fft_spectrum_is_the_circular_conv_spectrum(c, k, hw):
    rng = np.random.default_rng(8 + c + k + hw)
    K = rng.standard_normal((k, k, c, c))
    fft = S.fft_conv_spectrum(K, (hw, hw))
    assert fft.shape == (hw, hw, c)
    dense = np.linalg.eigvals(loop_conv_matrix(K, hw, hw, circular=True))
    assert match_multisets(fft, dense) <= 1e-9 * np.max(np.abs(dense))
    # Rectangular torus as well.
    fft = S.fft_conv_spectrum(K, (hw, hw + 2))
    dense = np.linalg.eigvals(loop_conv_matrix(K, hw, hw + 2, circular=True))
    assert match_multisets(fft, dense) <= 1e-9 * np.max(np.abs(dense))


# ----------------------------------------------------------------------------- Gershgorin


def test_conv_gershgorin_is_sound_for_stable_and_unstable_kernels():
    rng = np.random.default_rng(9)
    below, above = 0, 0
    for trial in range(216):
        c, k, hw = SHAPES[trial % len(SHAPES)]
        K = random_kernel(rng, c, k, off_sum=rng.uniform(0.05, 1.5))
        h = rng.uniform(0.05, 1.0)
        A = loop_conv_matrix(K, hw, hw)
        lam = np.linalg.eigvals(A)
        centres, radii = (np.asarray(t) for t in G.gershgorin(K))
        dist = np.abs(lam[:, None] - centres[None, :]) - radii[None, :]
        assert np.all(dist.min(axis=1) <= 1e-9 * (1 + np.abs(lam)))  # in the union of discs
        bound = G.conv_inf_norm_bound(K, h)
        true = rho(np.eye(A.shape[0]) + h * A)
        assert bound >= true * (1 - 1e-12)
        s = rng.uniform(0, 1, A.shape[0])
        assert max(1.0, bound) >= rho(np.eye(A.shape[0]) + h * np.diag(s) @ A) * (1 - 1e-12)
        below += bound < 1
        above += true > 1
    assert below > 10 and above > 10


def test_gershgorin_teeth_projected_kernel_certified_and_positive_centre_rejected():
    """Algorithm 2's set (centre -1, off-tap sum 0.9) is certified; a centre of +0.5 is not.

    With every diagonal entry of I + A equal to 1.5, the mean eigenvalue is 1.5 (trace), so the
    rejected operator really is unstable.
    """
    rng = np.random.default_rng(10)
    for c, k in [(1, 3), (3, 3), (2, 5)]:
        p = (k - 1) // 2
        K = rng.standard_normal((k, k, c, c))
        K[p, p][np.eye(c, dtype=bool)] = 0.0
        K *= 0.9 / np.abs(K).sum(axis=(0, 1, 2))
        K[p, p] -= np.eye(c)
        np.testing.assert_allclose(np.asarray(G.gershgorin(K)[1]), 0.9, rtol=1e-13)
        assert G.conv_inf_norm_bound(K, 1.0) <= 0.9 + 1e-12
        assert rho(np.eye(36 * c) + loop_conv_matrix(K, 6, 6)) < 1
        K[p, p] += 1.5 * np.eye(c)
        assert G.conv_inf_norm_bound(K, 1.0) > 1
        assert rho(np.eye(36 * c) + loop_conv_matrix(K, 6, 6)) >= 1.5 - 1e-12


def test_gershgorin_values_batch_axes_and_dense():
    rng = np.random.default_rng(11)
    K = rng.standard_normal((4, 3, 3, 3, 3))  # untied: 4 steps
    centres, radii = G.gershgorin(K)
    assert centres.shape == radii.shape == (4, 3)
    for step in range(4):
        for c in range(3):
            assert centres[step, c] == K[step, 1, 1, c, c]
            expected = np.abs(K[step, :, :, :, c]).sum() - abs(K[step, 1, 1, c, c])
            np.testing.assert_allclose(radii[step, c], expected, rtol=1e-13)
    worst = max(G.conv_inf_norm_bound(K[i], 0.5) for i in range(4))
    assert G.conv_inf_norm_bound(K, 0.5) == pytest.approx(worst, rel=1e-15)
    A = rng.standard_normal((9, 9))
    dc, dr = (np.asarray(t) for t in G.dense_gershgorin(A))
    np.testing.assert_allclose(dc, np.diag(A))
    np.testing.assert_allclose(dr, np.abs(A).sum(1) - np.abs(np.diag(A)), rtol=1e-13)
    lam = np.linalg.eigvals(A)
    assert np.all((np.abs(lam[:, None] - dc[None, :]) - dr[None, :]).min(axis=1) <= 1e-12)


@pytest.mark.parametrize(
    "shape,pattern",
    [
        ((4, 4, 2, 2), "odd square filter"),
        ((3, 5, 2, 2), "odd square filter"),
        ((3, 3, 2, 3), "square channels"),
        ((3, 3, 2), "HWIO"),
    ],
)
def test_bad_kernel_shapes_raise(shape, pattern):
    K = np.zeros(shape)
    with pytest.raises(ValueError, match=pattern) as err:
        G.gershgorin(K)
    assert str(shape) in str(err.value)
    with pytest.raises(ValueError, match=pattern):
        G.conv_inf_norm_bound(K)
    if len(shape) == 4 and shape[2] == shape[3]:
        with pytest.raises(ValueError, match=pattern):
            O.conv_operator(K, (5, 5))
        with pytest.raises(ValueError, match=pattern):
            S.fft_conv_spectrum(K, (5, 5))
    with pytest.raises(ValueError, match="h must be"):
        G.conv_inf_norm_bound(np.zeros((3, 3, 1, 1)), h=0.0)


@pytest.mark.slow
def test_arnoldi_large_conv_operator_residual():
    """n = 16384 (32x32 images, 16 channels): converged with a small true residual."""
    K = jax.random.normal(jax.random.PRNGKey(0), (3, 3, 16, 16)) * 0.1
    n = 32 * 32 * 16
    op = O.jacobian_operator(O.conv_operator(K, (32, 32)), jnp.ones(n), 0.5)
    info = S.spectral_radius_info(op, n=n)
    assert info.method == "arnoldi" and info.converged
    assert info.residual <= 1e-8 * info.radius
    assert info.radius <= S.power_norm_estimate(op, n) * (1 + 1e-9)
