"""Audit of plain ResNet weights: reported with their radii, never certified.

Dense layers: ``rho(I + h diag(g_k) W_k)`` (``g_k`` the eval-mode BatchNorm
multiplier of layer ``k`` when it has one), dense eigen-solver. Conv blocks of
unchanged shape: ``rho(I + diag(g) C)`` at the block's resolution (Arnoldi,
blocks of one shape side by side) and the Gershgorin bound on its inf-norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._common import Block, all_finite, group, stack
from .arnoldi import arnoldi_eigs_batch, stack_operators
from .certificate import BaselineParameters, Spectrum
from .operators import conv_operator, jacobian_operator, operator_matrix
from .spectral import dense_spectral_result, spectral_radius_info

_OVERFLOW = "the float32 weights (times their BatchNorm scale) overflow float32: no radius"


def _product_finite(operator, scale) -> bool:
    """``operator * scale`` as the audit forms it (float32 times float32) stays finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        return all_finite(np.asarray(operator) * np.asarray(scale))


def dense(blocks: list[Block], options) -> dict[int, tuple[BaselineParameters, Spectrum]]:
    out = {}
    for b in blocks:
        p = b.p32
        W = np.asarray(p.operator, np.float64)
        Ws = W.reshape((-1,) + W.shape[-2:])
        g = None if p.scale is None else np.asarray(p.scale, np.float64).reshape(-1, W.shape[-1])
        layers = max(len(Ws), 0 if g is None else len(g))
        Js = []
        for k in range(layers):
            Wk = Ws[k % len(Ws)]
            Js.append(np.eye(len(Wk)) + p.h * (Wk if g is None else g[k][:, None] * Wk))
        if not all_finite(*Js):
            out[b.index] = (BaselineParameters(note=_OVERFLOW, layers=layers), None)
            continue
        radii = [spectral_radius_info(Jk, method="dense").radius for Jk in Js]
        J = Js[int(np.argmax(radii))]  # the figure shows the worst layer
        params = BaselineParameters(
            layers=layers,
            rho_I_plus_hA=float(max(radii)),
            rho_per_layer=tuple(float(r) for r in radii),
            rho_method="dense",
        )
        spectrum = Spectrum(
            eigenvalues=tuple(complex(z) for z in np.linalg.eigvals(J)),
            all_eigenvalues=True,
            disc_centres=tuple(float(c) for c in np.diag(J)),
            disc_radii=tuple(float(r) for r in np.abs(J).sum(axis=1) - np.abs(np.diag(J))),
        )
        out[b.index] = (params, spectrum)
    return out


def conv(blocks: list[Block], options) -> dict[int, tuple[BaselineParameters, Spectrum | None]]:
    from naisnet_jax.stability import kernel_gershgorin

    from ._conv import row_bound

    out = {}
    square = []
    for b in blocks:
        if not b.p32.square:
            out[b.index] = (BaselineParameters(note="changes width or resolution: no square state map"), None)
        elif not _product_finite(b.p32.operator, b.p32.scale):
            out[b.index] = (BaselineParameters(note=_OVERFLOW), None)
        else:
            square.append(b)
    for members in group(square, lambda b: (np.shape(b.p32.operator), np.shape(b.p32.u))):
        kernels = stack([np.asarray(b.p32.operator) * np.asarray(b.p32.scale) for b in members])  # diag(g) C
        H, W = (int(d) for d in np.shape(members[0].p32.u)[1:3])
        C = int(kernels.shape[-1])
        n = H * W * C
        ops = [jacobian_operator(conv_operator(k, (H, W, C)), jnp.ones(n), 1.0) for k in kernels]
        if n <= options.dense_max_n:
            results = []
            for op in ops:
                M = np.asarray(operator_matrix(op, n))
                res = dense_spectral_result(M, iterations=n)
                results.append((res.radius, True, "dense", np.linalg.eigvals(M)))
        else:
            keys = jnp.stack([b.key for b in members])
            results = [
                (
                    abs(complex(r.eigenvalues[0])),
                    r.converged,
                    "arnoldi",
                    np.array([r.eigenvalues[0], np.conj(r.eigenvalues[0])]),
                )
                for r in arnoldi_eigs_batch(stack_operators(ops), n, keys=keys)
            ]
        bounds = np.asarray(row_bound(kernels, jnp.ones(len(members)), jnp.ones(len(members))))
        centres, radii = jax.device_get(kernel_gershgorin(kernels))
        for i, b in enumerate(members):
            radius, converged, method, eig = results[i]
            params = BaselineParameters(
                rho_I_plus_hA=float(radius),
                rho_method=method,
                rho_converged=bool(converged),
                inf_norm_bound_I_plus_hA=float(bounds[i]),
            )
            spectrum = Spectrum(
                eigenvalues=tuple(complex(z) for z in eig),
                all_eigenvalues=method == "dense",
                disc_centres=tuple(float(c) for c in 1 + centres[i]),
                disc_radii=tuple(float(r) for r in radii[i]),
                bound=float(bounds[i]),
                bound_label="||I + diag(g) C||_inf",
            )
            out[b.index] = (params, spectrum)
    return out
