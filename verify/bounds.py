"""Gershgorin discs read straight from conv kernels and dense matrices.

Gershgorin: every eigenvalue of a square matrix M lies in the union of the row discs
`{z : |z - M_rr| <= sum_{q != r} |M_rq|}`.

For a square-channel conv state kernel `K` (HWIO, odd k, `p = (k-1)//2`), stride 1, the row of the
operator matrix for output pixel `(y, x)`, channel `c` holds the diagonal `K[p, p, c, c]` (the
centre tap of channel c's own filter reads pixel (y, x) itself, so it is never padded away) and,
off the diagonal, `K[a, b, i, c]` for every other tap `(a, b, i)` whose source pixel
`(y + a - p, x + b - p)` lies in the image. Distinct taps read distinct entries, so the row's
off-diagonal absolute sum is at most `sum_{(a, b, i) != (p, p, c)} |K[a, b, i, c]|`, with equality
away from the border; under SAME zero padding the border rows lose taps and only get smaller.
(Under periodic padding on an image smaller than the filter, taps may share an entry; the triangle
inequality keeps the bound.) This is the paper's Lemma 2 argument, and Algorithm 2 enforces it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax.cell import check_kernel_shape, check_step_size
from naisnet_jax.checks import check_finite
from naisnet_jax.stability import conv_block_figures, kernel_gershgorin

Array = jax.Array


def gershgorin(kernel) -> tuple[Array, Array]:
    """Gershgorin discs `(centres, radii)` of a conv state operator, from its kernel alone.

    `centres[c] = K[p, p, c, c]` and `radii[c] = sum |K[a, b, i, c]|` over every tap feeding
    output channel c except that centre. Every eigenvalue of `X -> conv(X, K)` (SAME zero or
    periodic padding, any image size) lies in `union_c {|z - centres[c]| <= radii[c]}`.
    `kernel` is `(..., k, k, C, C)`; leading axes (untied per-step kernels) carry through, so
    `(K, k, k, C, C)` gives `(K, C)` arrays. Computed with jnp in the kernel's dtype. A kernel
    holding NaN or inf is refused (ValueError; traced values under `jit` cannot be checked).
    """
    kernel = jnp.asarray(kernel)
    check_kernel_shape(kernel.shape)
    check_finite("kernel", kernel, "; no Gershgorin discs")
    return kernel_gershgorin(kernel)


def conv_inf_norm_bound(kernel, h: float = 1.0) -> float:
    """Upper bound on `||I + h A||_inf`, hence on `rho(I + h A)`, from the kernel alone.

    Returns `max_c |1 + h centres[c]| + h radii[c]` (over leading axes too). The row of
    `I + h A` for pixel (y, x), channel c has diagonal `1 + h K[p, p, c, c]` and off-diagonal
    absolute sum at most `h radii[c]` (see the module docstring: border rows under zero padding
    only lose taps), so this bounds every absolute row sum, i.e. the infinity norm, and
    `rho <= ||.||_inf`. For the Jacobian `I + h diag(s) A` with slopes `s` in [0, 1], the row sum
    `|1 + h s centre| + h s radius` is convex in s, so `||J||_inf <= max(1, bound)`.
    Computed on the host in float64. A kernel holding NaN or inf is refused (ValueError).
    """
    h = float(check_step_size(h))
    kernel = np.asarray(kernel, dtype=np.float64)
    check_kernel_shape(kernel.shape)
    check_finite("kernel", kernel, "; no bound")
    return conv_block_figures(kernel, h=h)["inf_norm_bound_I_plus_hA"]


def dense_gershgorin(A) -> tuple[Array, Array]:
    """Row Gershgorin discs of a square matrix (or a stack `(..., n, n)`).

    `centres[r] = A[r, r]`, `radii[r] = sum_{q != r} |A[r, q]|`; every eigenvalue of A lies in
    their union. For a dense block's state matrix A (acting as `x @ A.T`), these are the discs of
    A itself; the discs of `I + h A` are `1 + h centres`, `h radii`. A matrix holding NaN or inf
    is refused (ValueError; traced values under `jit` cannot be checked).
    """
    A = jnp.asarray(A)
    if A.ndim < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"dense_gershgorin needs square matrices (..., n, n); got shape {A.shape}")
    check_finite("A", A, "; no Gershgorin discs")
    centres = jnp.diagonal(A, axis1=-2, axis2=-1)
    off = jnp.where(jnp.eye(A.shape[-1], dtype=bool), 0, jnp.abs(A))
    return centres, off.sum(axis=-1)
