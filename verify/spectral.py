"""Spectral radii of block state operators and Jacobians: dense, Arnoldi, power and FFT.

`rho(M) = max |lambda_i(M)|` decides Theorem 1's stability condition `rho(I + h diag(s) A) < 1`.

- dense: `numpy.linalg.eigvals` in float64 on the host; exact up to rounding (the reference).
- Arnoldi: matrix-free, for operators too large to write down. Only the operator's action
  `v -> A v` is used; the basis and the matvecs stay on the device, the small Hessenberg
  eigenproblem is solved on the host in float64. Krylov-Schur style thick restarts; many
  operators of one shape run side by side (`arnoldi_eigs_batch`). An ESTIMATE with a residual,
  never a proof.
- power: power iteration on `A^* A`, an estimate of `||A||_2` from below (not a bound, and
  not `rho(A)`).
- FFT: the exact spectrum of a convolution on the torus (periodic padding) only.

Operators are linear functions on flat vectors (see `operators.py`); the caller must make sure
they are linear: nothing here can tell a nonlinear function from a linear one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from naisnet_jax.cell import check_kernel_shape
from naisnet_jax.checks import check_choice, check_finite, check_int, check_number, check_positive

from ._numerics import jit
from .arnoldi import ArnoldiResult as ArnoldiResult
from .arnoldi import arnoldi_eigs
from .arnoldi import arnoldi_eigs_batch as arnoldi_eigs_batch
from .arnoldi import stack_operators as stack_operators
from .operators import as_operator, dense_operator, operator_matrix

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST
_METHODS = ("auto", "dense", "arnoldi")


class SpectralResult(NamedTuple):
    """How a spectral radius was obtained.

    `radius = |eigenvalue|`; `residual = ||A v - eigenvalue v|| / ||v||` for the computed
    eigenvector `v` of that eigenvalue (a backward error: the pair is exact for some `A + E`
    with `||E||_2 = residual`); `iterations` counts applications of the operator (0 when a
    matrix was given to the dense method); `method` is "dense" or "arnoldi".
    """

    radius: float
    eigenvalue: complex
    residual: float
    iterations: int
    method: str
    converged: bool


# ----------------------------------------------------------------------------- dense


def dense_spectral_result(A: np.ndarray, iterations: int) -> SpectralResult:
    """The dense method's `SpectralResult` of a matrix: radius from `numpy.linalg.eigvals`
    (float64), residual from two inverse-iteration steps."""
    return dense_spectrum(A, iterations)[0]


def dense_spectrum(A: np.ndarray, iterations: int) -> tuple[SpectralResult, np.ndarray]:
    """`dense_spectral_result` and every eigenvalue (one eigen-decomposition)."""
    A = np.asarray(A)
    A = A.astype(np.complex128 if np.iscomplexobj(A) else np.float64)
    check_finite("the matrix", A, "; no spectral radius")
    lam = np.linalg.eigvals(A)
    all_eigenvalues = lam
    i = int(np.argmax(np.abs(lam)))
    eigenvalue = complex(lam[i])
    n = A.shape[0]
    scale = max(np.linalg.norm(A, 1), np.finfo(np.float64).tiny)
    x = np.random.default_rng(0).standard_normal(n) + 0j
    for attempt in range(3):
        shift = eigenvalue + attempt * 1e3 * np.finfo(np.float64).eps * scale
        try:
            M = A - shift * np.eye(n)
            for _ in range(2):
                x = np.linalg.solve(M, x)
                x = x / np.linalg.norm(x)
            break
        except np.linalg.LinAlgError:
            continue
    residual = float(np.linalg.norm(A @ x - eigenvalue * x) / np.linalg.norm(x))
    if not np.isfinite(residual):  # inverse iteration overflowed: take the eigenvector directly
        lam, vecs = np.linalg.eig(A)
        x = vecs[:, int(np.argmin(np.abs(lam - eigenvalue)))]
        residual = float(np.linalg.norm(A @ x - eigenvalue * x) / np.linalg.norm(x))
    return SpectralResult(abs(eigenvalue), eigenvalue, residual, iterations, "dense", True), all_eigenvalues


def _is_matrix(op) -> bool:
    return (not callable(op) and hasattr(op, "shape")) or isinstance(op, (list, tuple))


def spectral_radius_info(
    op,
    *,
    n: int | None = None,
    method: str = "auto",
    dense_max_n: int = 2048,
    tol: float | None = None,
    krylov_dim: int | None = None,
    max_restarts: int = 500,
    key: Array | None = None,
) -> SpectralResult:
    """`rho(A) = max_i |lambda_i(A)|` with the eigenvalue, its residual and how it was computed.

    `op` is a square matrix (numpy or JAX) or a linear jittable function `v -> A v` on vectors of
    length `n`. `method="dense"`: `numpy.linalg.eigvals` in float64 (a function is first written
    out as a matrix, `n` applications); `"arnoldi"`: `arnoldi_eigs` to relative tolerance `tol`
    (its default: 1e-10 in float64);
    `"auto"`: dense when `n <= dense_max_n`, Arnoldi otherwise.

    Refused (ValueError): an empty or non-square matrix, one holding NaN or inf, and counts that
    are not integers in range (`n >= 1`, `dense_max_n >= 0`, `krylov_dim >= 1`,
    `max_restarts >= 0`; `tol > 0`).
    """
    check_choice("method", method, _METHODS)
    _check_counts(n=n, dense_max_n=dense_max_n, krylov_dim=krylov_dim, max_restarts=max_restarts, tol=tol)
    if _is_matrix(op):
        shape = tuple(np.shape(op))
        if len(shape) != 2 or shape[0] != shape[1]:
            raise ValueError(f"a matrix operand must be square; got shape {shape}")
        if shape[0] == 0:
            raise ValueError(
                f"op has shape {shape}: an empty matrix has no eigenvalues; expected a square matrix of size n >= 1"
            )
        if n is not None and n != shape[0]:
            raise ValueError(f"n={n} disagrees with the matrix of shape {shape}")
        n = shape[0]
        if method in ("auto", "dense"):
            return dense_spectral_result(np.asarray(op), iterations=0)
        fn = dense_operator(jnp.asarray(op))
    elif callable(op):
        if n is None:
            raise ValueError("n (the vector length) is required when op is a function")
        fn = as_operator(op)
        if method == "dense" or (method == "auto" and n <= dense_max_n):
            return dense_spectral_result(np.asarray(operator_matrix(fn, n)), iterations=n)
    else:
        raise TypeError(f"op must be a square matrix or a function v -> A v; got {type(op).__name__}")
    res = arnoldi_eigs(fn, n, k=1, krylov_dim=krylov_dim, tol=tol, max_restarts=max_restarts, key=key)
    eigenvalue = complex(res.eigenvalues[0])
    return SpectralResult(abs(eigenvalue), eigenvalue, res.residual, res.matvecs, "arnoldi", res.converged)


def _check_counts(*, n, dense_max_n, krylov_dim, max_restarts, tol) -> None:
    """The counts and the tolerance of `spectral_radius_info` (`None`: its default)."""
    if n is not None:
        check_int("n", n)
    check_int("dense_max_n", dense_max_n, 0)
    if krylov_dim is not None:
        check_int("krylov_dim", krylov_dim)
    check_int("max_restarts", max_restarts, 0)
    if tol is not None:
        check_positive("tol", tol)


def spectral_radius(
    op,
    *,
    n: int | None = None,
    method: str = "auto",
    dense_max_n: int = 2048,
    tol: float | None = None,
    krylov_dim: int | None = None,
    max_restarts: int = 500,
    key: Array | None = None,
) -> float:
    """`rho(A) = max_i |lambda_i(A)|` as a float; the arguments are `spectral_radius_info`'s.

    Raises RuntimeError if Arnoldi did not converge (an unconverged radius certifies nothing);
    `spectral_radius_info` returns it with `converged=False` instead.
    """
    res = spectral_radius_info(
        op,
        n=n,
        method=method,
        dense_max_n=dense_max_n,
        tol=tol,
        krylov_dim=krylov_dim,
        max_restarts=max_restarts,
        key=key,
    )
    if not res.converged:
        raise RuntimeError(
            f"Arnoldi did not converge after {res.iterations} matvecs (estimate {res.radius:.6g}, "
            f"residual {res.residual:.3g}); raise krylov_dim or max_restarts, or use "
            "spectral_radius_info for the unconverged estimate"
        )
    return res.radius


# ----------------------------------------------------------------------------- power


@jit
def _power_loop(op, v0: Array, tol: Array, max_iters: Array):
    real = jnp.finfo(v0.dtype).dtype

    def step(state):
        i, v, mu, _ = state
        av, pullback = jax.vjp(op, v)
        w = jnp.conj(pullback(jnp.conj(av))[0])  # A^* A v
        mu_new = jnp.linalg.norm(av).astype(real)
        v_new = w / jnp.maximum(jnp.linalg.norm(w), jnp.finfo(real).tiny).astype(w.dtype)
        return i + 1, v_new, mu_new, mu

    def keep_going(state):
        i, _, mu, mu_prev = state
        return (i < max_iters) & (jnp.abs(mu - mu_prev) > tol * mu)

    v0 = v0 / jnp.linalg.norm(v0)
    init = (jnp.asarray(0), v0, jnp.asarray(0.0, real), jnp.asarray(-1.0, real))
    i, _, mu, _ = lax.while_loop(keep_going, step, init)
    return mu, i


def power_norm_estimate(
    matvec: Callable[[Array], Array],
    n: int,
    *,
    tol: float = 1e-12,
    max_iters: int = 20000,
    key: Array | None = None,
    dtype=None,
) -> float:
    """ESTIMATE (from below) of the operator 2-norm `||A||_2 = sigma_max(A)`, by power iteration
    on `A^* A`. Not a bound.

    Iterates `v <- A^* A v / ||A^* A v||` (`A^*` through `jax.vjp`, so `matvec` must be linear
    and differentiable) and returns `||A v||` once it changes by less than `tol` relative.
    Every iterate is `||A v|| <= ||A||_2` for a unit `v`, so the value approaches the norm from
    below: it can be short of it (slowly converging when the two largest singular values are
    close), and it is an upper bound on `rho(A)` only up to that shortfall.

    A norm is not a spectral radius: `rho(A) <= ||A||_2`, with equality for normal `A` only; for
    the non-normal operators of conv blocks it can be far above `rho`, so a value >= 1 proves
    nothing about instability.

    Refused (ValueError): `n` or `max_iters` not a positive integer, `tol` not a finite number >= 0.
    """
    check_int("n", n)
    check_int("max_iters", max_iters)
    check_number("tol", tol, 0.0)
    op = as_operator(matvec)
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.zeros((), float).dtype
    key = jax.random.PRNGKey(1) if key is None else key
    v0 = jax.random.normal(key, (int(n),), dtype)
    mu, _ = _power_loop(op, v0, jnp.asarray(tol), jnp.asarray(max_iters))
    return float(mu)


def power_norm_bound(*args, **kwargs) -> float:
    """Deprecated name of :func:`power_norm_estimate` (it returns an estimate from below, not a
    bound)."""
    import warnings

    warnings.warn(
        "power_norm_bound is renamed power_norm_estimate: it returns an estimate of ||A||_2 from below, not a bound",
        DeprecationWarning,
        stacklevel=2,
    )
    return power_norm_estimate(*args, **kwargs)


# ----------------------------------------------------------------------------- FFT


def fft_conv_spectrum(kernel, image_hw) -> np.ndarray:
    """All `H*W*C` eigenvalues of the conv operator with PERIODIC padding, shape `(H, W, C)`.

    On the torus, `out[y, x, o] = sum_{a, b, i} K[a, b, i, o] X[(y+a-p) mod H, (x+b-p) mod W, i]`
    (cross-correlation, `p = (k-1)//2`). The Fourier modes `X[y, x, :] = v exp(2 pi j (f y / H +
    g x / W))` are invariant, acting on `v` by the C x C symbol
    `S(f, g) = sum_{a, b} K[a, b]^T exp(2 pi j (f (a-p) / H + g (b-p) / W))`,
    so the spectrum is the union over the H*W frequencies of `eig(S(f, g))`; entry
    `[f, g, :]` holds those. Computed in float64 / complex128 on the host.

    Exact ONLY for periodic padding. The SAME zero-padded conv of the NAIS blocks is a different
    (block-Toeplitz, non-normal) operator whose eigenvalues differ, and the periodic radius is not
    a bound on the SAME one: on 300 random kernels (C <= 3, k in {3, 5}, 5..8 px images) the
    periodic `rho(I + hA)` was below the SAME one 4 times, by up to 0.5%.
    """
    K = np.asarray(kernel)
    check_kernel_shape(K.shape, leading_axes=False)
    height, width = (check_int(f"image_hw[{i}]", int(s)) for i, s in enumerate(image_hw))
    K = K.astype(np.complex128)
    p = (K.shape[0] - 1) // 2
    offsets = np.arange(K.shape[0]) - p
    phase_y = np.exp(2j * np.pi * np.outer(np.arange(height), offsets) / height)
    phase_x = np.exp(2j * np.pi * np.outer(np.arange(width), offsets) / width)
    symbol = np.einsum("fa,gb,abio->fgoi", phase_y, phase_x, K)
    return np.linalg.eigvals(symbol)
