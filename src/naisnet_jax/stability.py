"""Cheap, parameter-level stability figures of every NAIS block (host, float64).

These need only the parameters, not data: for dense blocks the exact spectrum
of the symmetric ``A = -R^T R - eps I`` (so ``rho(I + h A)`` is exact), for
conv blocks the Gershgorin bound on ``||I + h A||_inf`` read off the kernel
(an upper bound on ``rho(I + h A)``, exact radii are the verifier's job).
The trainer logs them every epoch; the verifier builds on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from naisnet_jax.projection import CONV_DELTA_KEY, CONV_KERNEL_KEY, FC_KEY, iter_state_blocks


def _as64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def dense_block_figures(R, *, eps: float, h: float) -> dict:
    """``||R^T R||_F``, the eigenvalue interval of ``A`` and ``rho(I + h A)``.

    ``R`` is ``(r, n)`` or ``(steps, r, n)`` (untied); figures are the worst
    over steps.
    """
    R = _as64(R)
    Rs = R.reshape((-1,) + R.shape[-2:])
    frob, lam_min, lam_max, rho = [], [], [], []
    for Rk in Rs:
        gram = Rk.T @ Rk
        lam = -np.linalg.eigvalsh(gram) - eps  # eigenvalues of A, real
        frob.append(np.linalg.norm(gram, "fro"))
        lam_min.append(lam.min())
        lam_max.append(lam.max())
        rho.append(np.max(np.abs(1.0 + h * lam)))
    return {
        "kind": "dense",
        "frobenius_RtR": float(max(frob)),
        "eig_A_min": float(min(lam_min)),
        "eig_A_max": float(max(lam_max)),
        "rho_I_plus_hA": float(max(rho)),
    }


def kernel_gershgorin(kernel):
    """Per output channel: the centre tap of its own filter, and the absolute sum
    of every other tap of every input channel feeding it (the Gershgorin discs of
    the conv operator; the one copy of this arithmetic, used by the trainer's
    figures and by the verifier).

    ``kernel`` is HWIO ``(..., k, k, C, C)``; returns two ``(..., C)`` arrays. A
    JAX array stays in JAX (and its dtype, so it jits and vmaps); anything else
    is computed in float64 numpy.
    """
    import jax

    if isinstance(kernel, jax.Array):
        import jax.numpy as xp
    else:
        xp, kernel = np, _as64(kernel)
    k, c = kernel.shape[-4], kernel.shape[-1]
    p = (k - 1) // 2
    centres = xp.diagonal(kernel[..., p, p, :, :], axis1=-2, axis2=-1)
    is_centre = np.zeros((k, k, c, c), bool)
    is_centre[p, p] = np.eye(c, dtype=bool)
    radii = xp.where(is_centre, 0, xp.abs(kernel)).sum(axis=(-4, -3, -2))
    return centres + 0, radii


def effective_state_kernel(kernel, delta=None) -> np.ndarray:
    """The kernel the forward pass uses, as float64 numpy: :func:`conv_state_kernel` (centre
    taps ``-1 - delta``, ``delta = 0`` when the block has none) in the parameters' dtype."""
    import jax.numpy as jnp

    from naisnet_jax.parametrize import conv_state_kernel, zero_delta

    kernel = jnp.asarray(kernel)
    delta = zero_delta(kernel.shape, kernel.dtype) if delta is None else jnp.asarray(delta)
    return _as64(conv_state_kernel(kernel, delta.astype(kernel.dtype)))


def conv_block_figures(kernel, *, h: float) -> dict:
    """Gershgorin figures of a conv state kernel (centre taps already set)."""
    centres, radii = kernel_gershgorin(kernel)
    bound = np.max(np.abs(1.0 + h * centres) + h * radii)
    return {
        "kind": "conv",
        "centre_min": float(centres.min()),
        "centre_max": float(centres.max()),
        "radius_max": float(radii.max()),
        "inf_norm_bound_I_plus_hA": float(bound),
    }


def block_figures(params: Any, *, eps: float, h: float) -> dict[str, dict]:
    """Figures for every NAIS block in a params tree, keyed by ``"a/b/c"`` path."""
    out = {}
    for path, node in iter_state_blocks(params):
        name = "/".join(path) or "<root>"
        if FC_KEY in node:
            out[name] = dense_block_figures(node[FC_KEY], eps=eps, h=h)
        else:
            delta = node.get(CONV_DELTA_KEY)
            out[name] = conv_block_figures(effective_state_kernel(node[CONV_KERNEL_KEY], delta), h=h)
    return out


def max_radius_bound(params: Any, *, eps: float, h: float) -> float:
    """Largest ``rho(I + h A)`` over blocks (exact for dense, Gershgorin bound
    for conv); ``nan`` when the tree has no NAIS block."""
    figures = block_figures(params, eps=eps, h=h)
    values = [f.get("rho_I_plus_hA", f.get("inf_norm_bound_I_plus_hA")) for f in figures.values()]
    return float(max(values)) if values else float("nan")
