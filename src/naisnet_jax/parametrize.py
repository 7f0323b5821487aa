"""Stable parametrisations of the state operators.

Dense blocks store a factor ``R`` of shape ``(r, n)`` with ``r <= n`` and use

    A = -R.T @ R - eps * I,

which is symmetric negative definite with every eigenvalue in
``[-(||R.T R||_2 + eps), -eps]``.

Convolutional blocks store an HWIO kernel ``(k, k, C, C)`` and a vector
``delta`` of shape ``(C,)``; the kernel used in the forward pass has the centre
tap of each channel's own filter fixed at ``-1 - delta_c``, so those taps are
governed by ``delta`` and never by the stored kernel.

Both functions accept leading axes (one per unrolled step for untied weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from naisnet_jax.cell import check_kernel_shape
from naisnet_jax.checks import check_finite, check_number

Array = jax.Array


EPS_MIN = 1e-6
"""Smallest ``eps`` accepted anywhere (configs, models, projections).

The parameters run in float32, whose resolution near 1 is ``2^-24 ~ 6e-8``
(half an ulp of 1). ``eps`` is the margin that keeps ``A = -R^T R - eps I``
negative definite and the conv budget ``1 - eps - |delta|`` below 1, and it is
added to numbers of size up to 1: the diagonal of ``R^T R`` (at most
``||R^T R||_F <= 1``) and the centre tap ``-1 - delta``. Below about ten ulps
the shift is lost in rounding: at ``eps = 1e-8`` the float32
``-R^T R - eps I`` of a wide ``R`` (fewer rows than columns) has
``rho(I + A) = 1 + 8e-9``. ``1e-6`` is about 17 of those half-ulps. The floor
makes the intent representable; it is not a proof: the verifier audits the
float32 operator the model actually runs and certifies only what it proves.
"""


def check_eps(eps: float, name: str = "eps") -> float:
    """``eps`` must lie in ``[EPS_MIN, 0.5)`` (see :data:`EPS_MIN` for the floor)."""
    check_number(name, eps, 0.0, 0.5, lo_open=True, hi_open=True)
    if float(eps) < EPS_MIN:
        raise ValueError(
            f"{name}={eps!r} is below the float32 floor EPS_MIN={EPS_MIN:g} (the margin it gives would be "
            f"lost in float32 rounding); use eps in [{EPS_MIN:g}, 0.5)."
        )
    return eps


def fc_state_matrix(R: Array, eps: float) -> Array:
    """``A = -R^T R - eps I`` for ``R`` of shape ``(..., r, n)``; returns ``(..., n, n)``."""
    check_eps(eps)
    R = jnp.asarray(R)
    if R.ndim < 2:
        raise ValueError(f"R must have shape (..., r, n); got shape {R.shape}.")
    check_finite("R", R)
    n = R.shape[-1]
    gram = jnp.einsum("...ri,...rj->...ij", R, R, precision=jax.lax.Precision.HIGHEST)
    return -gram - eps * jnp.eye(n, dtype=R.dtype)


def centre_mask(shape: tuple[int, ...], dtype=jnp.float32) -> Array:
    """Mask of the taps ``[p, p, c, c]`` of an HWIO ``(k, k, C, C)`` kernel."""
    check_kernel_shape(shape)
    k, _, c, _ = shape[-4:]
    p = (k - 1) // 2
    mask = jnp.zeros((k, k, c, c), dtype).at[p, p].set(jnp.eye(c, dtype=dtype))
    return jnp.broadcast_to(mask, shape)


def zero_delta(kernel_shape: tuple[int, ...], dtype=jnp.float32) -> Array:
    """``delta = 0`` for a state kernel of shape ``(..., k, k, C, C)``: zeros of ``(..., C)``
    (a block without a learnable delta: centre taps exactly ``-1``)."""
    check_kernel_shape(kernel_shape)
    return jnp.zeros(tuple(kernel_shape[:-4]) + tuple(kernel_shape[-1:]), dtype)


def conv_state_kernel(kernel: Array, delta: Array) -> Array:
    """The state kernel with centre taps ``kernel[p, p, c, c] = -1 - delta[c]``.

    ``kernel`` is ``(..., k, k, C, C)`` and ``delta`` is ``(..., C)`` with the
    same leading axes. The result does not depend on the stored centre taps.
    """
    check_kernel_shape(kernel.shape)
    c = kernel.shape[-1]
    if delta.shape[-1:] != (c,) or delta.shape[:-1] != kernel.shape[:-4]:
        raise ValueError(
            f"delta must have shape {kernel.shape[:-4] + (c,)} to match the state "
            f"kernel of shape {kernel.shape}; got {delta.shape}."
        )
    mask = centre_mask(kernel.shape, kernel.dtype)
    # (..., C) -> (..., 1, 1, 1, C): broadcast over the tap axes; on the centre
    # taps [p, p, c, c] the value for output channel c is -1 - delta[c].
    centre = (-1.0 - delta)[..., None, None, None, :]
    return kernel * (1 - mask) + centre * mask
