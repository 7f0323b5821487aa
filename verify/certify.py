"""Audit a checkpoint: is every NAIS block stable, and by how much?

For each block the audit computes, in float64:

* **parameter-level bounds** — dense: ``||R^T R||_F`` against Algorithm 1's
  ``delta``, the eigenvalues of ``A`` and the exact ``rho(I + h A)``; conv: the
  Gershgorin centre and radius of every output channel, Algorithm 2's budget
  and the resulting bound on ``||I + h A||_inf``, and the exact
  ``rho(I + h A)`` by matrix-free Arnoldi at the block's resolution;
* **Jacobians along real trajectories** — ``J = I + h diag(act'(.)) A`` at the
  states that real inputs visit: the largest spectral radius, and how often
  activations stay unsaturated (slope >= ``sigma_min``);
* **gains and equilibria** — the contraction factor (the theorem's worst case
  for the observed slopes, and the measured one), the input-output gain
  ``gamma = h ||B|| / (1 - rho_bar)`` next to the gain measured under random
  input perturbations (and a gain bound proved on the visited states), and
  for tanh blocks the equilibrium
  ``x* = -A^{-1}(B u + b)``, the residual of the unrolled state against it and
  the contraction ``||x_k - x*|| <= c^k ||x_0 - x*||`` in a norm where the proof
  holds (energy norm ``sqrt(e^T (-A) e)`` for dense blocks — the 2-norm is also
  reported, but need not contract once units saturate — and the infinity norm
  for conv blocks).

A block is **certified** when its parameters satisfy the projection's
sufficient condition (Lemma for Algorithm 1, Gershgorin for Algorithm 2, with
``h <= 1``) and every measured radius is below 1. Baseline blocks (plain
ResNet weights) are reported with their measured radii and are never
certified. The verifier reads checkpoints through
:mod:`naisnet_jax.checkpoint` and builds the model from its metadata; it never
imports the trainer.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import checkpoint as ckpt
from naisnet_jax.cell import activation_slope, conv_same
from naisnet_jax.projection import CONV_DELTA_KEY, CONV_KERNEL_KEY, FC_KEY, fc_delta, iter_state_blocks
from naisnet_jax.stability import conv_block_figures, dense_block_figures, effective_state_kernel, kernel_gershgorin

from .operators import conv_operator, jacobian_operator, operator_matrix
from .spectral import spectral_radius_info

SCHEMA = "naisnet-jax-certificate/1"
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """What the audit looks at and how strictly.

    ``data``: ``None`` reads test images of the checkpoint's own dataset;
    ``"random"`` uses standard normal inputs (labelled synthetic in the
    report); ``"none"`` skips everything that needs inputs.
    """

    samples: int = 64
    data: str | None = None
    data_dir: str | None = None
    sigma_min: float = 1e-2  # slopes below this count as saturated (outside the set P)
    rel_tol: float = 1e-5  # slack on parameter bounds: float32 round-off of the projection
    perturbation: float = 1e-3  # relative size of the input perturbations for the gain
    jacobian_samples: int = 1  # conv blocks: trajectory Jacobians measured with Arnoldi (worst first)
    exact_conv_radius: bool = True  # Arnoldi on I + h A of every conv block
    seed: int = 0


# ------------------------------------------------------------------------ helpers


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _finite_max(values, default=float("nan")) -> float:
    values = [float(v) for v in np.ravel(values) if np.isfinite(v)]
    return max(values) if values else default


def _versions() -> dict:
    import flax
    import jaxlib

    from naisnet_jax import __version__

    return {
        "naisnet_jax": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _build_model(meta: dict):
    from naisnet_jax import models

    try:
        return models.get_model(meta["model"], num_classes=meta["num_classes"], **meta["model_kwargs"])
    except (KeyError, TypeError, ValueError) as e:
        raise ckpt.CheckpointError(
            f"the checkpoint's metadata does not describe a model this version can build "
            f"(model={meta.get('model')!r}): {e}"
        ) from e


def _inputs(meta: dict, options: AuditOptions) -> tuple[np.ndarray, str]:
    """A float64 sample of normalised inputs, and a description of where it came from."""
    shape = tuple(meta["input_shape"])
    if options.data in ("random", "none"):
        rng = np.random.default_rng(options.seed)
        n = options.samples if options.data == "random" else 1
        return rng.standard_normal((n,) + shape), (
            f"synthetic: {n} standard normal inputs" if options.data == "random" else "none"
        )
    from naisnet_jax import data as data_lib

    name = options.data or meta["dataset"]
    if name not in data_lib.DATASET_NAMES:
        raise ckpt.CheckpointError(
            f"dataset {name!r} is unknown (valid: {', '.join(data_lib.DATASET_NAMES)}); "
            f"pass --data=random or --data=none"
        )
    data_dir = options.data_dir or meta.get("config", {}).get("data_dir")
    ds = data_lib.load_dataset(name, data_dir=data_dir, limit_test=options.samples)
    images = ds.test_images[: options.samples].astype(np.float64) / 255.0
    mean, std = _f64(meta["channel_mean"]), _f64(meta["channel_std"])
    return (images - mean) / std, f"{name} test split: first {len(images)} images"


@dataclasses.dataclass
class _BlockRecord:
    """What one NAIS block saw in the forward pass."""

    u: Any = None  # block input
    drive: Any = None  # the input term actually added (after normalisation)
    drive_raw: Any = None  # output of the "input" layer (before normalisation)
    trajectory: Any = None  # (K, batch, ...) states x_1 .. x_K
    input_params: Any = None  # the "input" layer's params


def _record_forward(model, variables, x) -> tuple[dict, Any]:
    """Run the model once, recording every NAIS block's input, drive and states."""
    import flax.linen as nn

    records: dict[tuple, _BlockRecord] = {}

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        module, path = context.module, tuple(context.module.path)
        kind = type(module).__name__
        if kind == "ResNetConvBlock":
            records.setdefault(path, _BlockRecord()).u = args[0]
        elif kind in ("NaisDenseBlock", "NaisConvBlock"):
            rec = records.setdefault(path, _BlockRecord())
            rec.u = args[0]
            if isinstance(out, tuple):
                rec.trajectory = out[1]["trajectory"]
        elif path and path[-1] == "input":
            rec = records.setdefault(path[:-1], _BlockRecord())
            rec.drive_raw = out
            rec.drive = out if rec.drive is None else rec.drive
        elif path and path[-1] == "drive_norm":
            records.setdefault(path[:-1], _BlockRecord()).drive = out
        return out

    with nn.intercept_methods(interceptor):
        logits, aux = model.apply(variables, x, train=False, return_aux=True)
    return records, (logits, aux)


# ------------------------------------------------------------------- dense blocks


def _dense_parameters(R: np.ndarray, *, eps: float, h: float, relaxed: bool, rel_tol: float) -> dict:
    """Algorithm 1's condition and the exact spectrum of ``I + h A`` (per step if untied)."""
    delta = fc_delta(eps, relaxed)
    Rs = R.reshape((-1,) + R.shape[-2:])
    figures = dense_block_figures(R, eps=eps, h=h)  # symmetric eigen-solver, worst over steps
    # independent check with the general (non-symmetric) eigen-solver
    rho_eigvals = [
        spectral_radius_info(np.eye(Rk.shape[1]) + h * (-Rk.T @ Rk - eps * np.eye(Rk.shape[1])), method="dense").radius
        for Rk in Rs
    ]
    A0 = -Rs[0].T @ Rs[0] - eps * np.eye(Rs.shape[-1])
    J0 = np.eye(len(A0)) + h * A0
    discs = (np.diag(J0), np.abs(J0).sum(axis=1) - np.abs(np.diag(J0)))
    interval = (1 - h * (2 * (1 - eps) + eps) if relaxed else 1 - h * (1 - eps), 1 - h * eps)
    ok = figures["frobenius_RtR"] <= delta * (1 + rel_tol)
    return {
        "condition": f"||R^T R||_F <= delta = {'2(1 - eps)' if relaxed else '1 - 2 eps'} = {delta:.6g}",
        "frobenius_RtR": figures["frobenius_RtR"],
        "delta": float(delta),
        "condition_holds": bool(ok),
        "eig_A": [figures["eig_A_min"], figures["eig_A_max"]],
        "lemma_interval_I_plus_hA": [float(interval[0]), float(interval[1])],
        "rho_I_plus_hA": figures["rho_I_plus_hA"],
        "rho_I_plus_hA_eigvals": float(max(rho_eigvals)),
        "_eigenvalues": np.linalg.eigvals(J0),
        "_discs": discs,
    }


def _dense_trajectory(R, rec: _BlockRecord, *, eps, h, activation, options) -> dict:
    """Jacobians ``I + h diag(s) A`` at every visited state, gains and equilibria."""
    R = _f64(R)
    untied = R.ndim == 3
    K = rec.trajectory.shape[0]
    As = [-(Rk.T @ Rk) - eps * np.eye(R.shape[-1]) for Rk in R.reshape((-1,) + R.shape[-2:])]
    drive = _f64(rec.drive)  # (batch, n) or (batch, K n) untied
    batch, n = drive.shape[0], R.shape[-1]
    drives = np.moveaxis(drive.reshape(batch, K, n), 1, 0) if untied else np.broadcast_to(drive, (K, batch, n))
    X = np.concatenate([np.zeros((1, batch, n)), _f64(rec.trajectory)])  # x_0 .. x_K
    A_k = (lambda k: As[k]) if untied else (lambda k: As[0])
    pre = np.stack([X[k] @ A_k(k).T + drives[k] for k in range(K)])  # (K, batch, n)
    slopes = np.asarray(activation_slope(activation, jnp.asarray(pre)))
    # rho(I + h S A): S A is similar to S^1/2 A S^1/2 (symmetric), so the
    # eigenvalues are real and eigvalsh is exact.
    def radii(s):
        root = np.sqrt(s)
        out = np.empty((K, batch))
        for k in range(K):
            sym = root[k][:, :, None] * A_k(k)[None] * root[k][:, None, :]
            out[k] = np.max(np.abs(1 + h * np.linalg.eigvalsh(sym)), axis=-1)
        return out

    in_P = np.all(slopes >= options.sigma_min, axis=-1)
    out = {
        "states": int(K * batch),
        # Condition 1 is over the unsaturated set P: slopes clipped to [sigma_min, 1]
        "rho_J_max": float(radii(np.maximum(slopes, options.sigma_min)).max()),
        # raw slopes: a fully saturated unit has slope ~0 and J an eigenvalue ~1
        "rho_J_max_raw": float(radii(slopes).max()),
        "unsaturated_fraction": float(np.mean(slopes >= options.sigma_min)),
        "states_in_P_fraction": float(np.mean(in_P)),
        "slope_min": float(slopes.min()),
    }
    lam_min_M = min(-np.linalg.eigvalsh(A).max() for A in As)  # smallest eigenvalue of -A
    lam_max_M = max(-np.linalg.eigvalsh(A).min() for A in As)
    sigma = max(float(slopes.min()), options.sigma_min)
    out["rho_bar_theorem"] = float(max(abs(1 - h * lam_max_M), 1 - h * sigma * lam_min_M))
    out["rho_bar_measured"] = out["rho_J_max"]
    # gain: ||B||_2 of the input layer (per step if untied)
    kernel = _f64(rec.input_params["kernel"])
    Bs = np.moveaxis(kernel.reshape(kernel.shape[0], K, n), 1, 0) if untied else kernel[None]
    b_norm = max(np.linalg.norm(Bk, 2) for Bk in Bs)
    out.update(_gains(out, b_norm, h, norm="2"))
    gain, sigma_both = _dense_io_gain(As, Bs, rec, K=K, h=h, activation=activation, options=options)
    # Proved on the visited region: in the energy norm ||e||_M (M = -A) a step
    # contracts by c (see _dense_equilibrium) and the input adds at most
    # h sqrt(lam_max) ||B|| ||w||; back to the 2-norm costs sqrt(lam_max / lam_min).
    # (Untied weights change the energy norm every step: no such bound.)
    c = _energy_contraction(h, sigma_both, lam_min_M, lam_max_M)
    out["io_gain_measured"] = gain
    if not untied:
        out["gamma_bound"] = float(h * b_norm * np.sqrt(lam_max_M / lam_min_M) / (1 - c)) if c < 1 else float("inf")
        out["io_gain_within_bound"] = bool(gain <= out["gamma_bound"] * (1 + 1e-9))
    if activation == "tanh" and not untied:
        out["equilibrium"] = _dense_equilibrium(As[0], drive, X, pre, h=h, lam_min=lam_min_M, lam_max=lam_max_M)
    return out


def _gains(out: dict, b_norm: float, h: float, *, norm: str) -> dict:
    def gamma(rho):
        return float(h * b_norm / (1 - rho)) if rho < 1 else float("inf")

    return {
        f"B_norm_{norm}": float(b_norm),
        "gamma_theorem": gamma(out["rho_bar_theorem"]),
        "gamma_measured": gamma(out["rho_bar_measured"]),
    }


def _energy_contraction(h: float, sigma: float, lam_min: float, lam_max: float) -> float:
    """Per-step contraction of ``e -> (I + h D A) e`` in the energy norm for diagonal
    ``D`` in ``[sigma, 1]`` (``lam_*``: extreme eigenvalues of ``M = -A``)."""
    return float(np.sqrt(max(0.0, 1 - h * (2 - h * lam_max) * sigma * lam_min))) if h * lam_max < 2 else 1.0


def _dense_io_gain(As, Bs, rec, *, K, h, activation, options) -> tuple[float, float]:
    """``max ||x_K(u + w) - x_K(u)||_2 / ||w||_2`` over the sample, ``w`` random and
    small; and the smallest activation slope met on either trajectory."""
    from naisnet_jax.cell import ACTIVATIONS

    act = ACTIVATIONS[activation]
    u = _f64(rec.u)
    rng = np.random.default_rng(options.seed + 1)
    w = rng.standard_normal(u.shape)
    w *= options.perturbation * np.linalg.norm(u, axis=1, keepdims=True).clip(1e-12) / np.linalg.norm(w, axis=1, keepdims=True)
    drive = _f64(rec.drive)
    batch, n = u.shape[0], As[0].shape[0]
    untied = len(As) > 1
    x, xp = np.zeros((batch, n)), np.zeros((batch, n))
    slope_min = np.inf
    for k in range(K):
        A = As[k] if untied else As[0]
        d = drive.reshape(batch, K, n)[:, k] if untied else drive
        dw = w @ (Bs[k] if untied else Bs[0])
        pre, pre_p = x @ A.T + d, xp @ A.T + d + dw
        slope_min = min(slope_min, float(np.min(activation_slope(activation, jnp.asarray(np.stack([pre, pre_p]))))))
        x = x + h * np.asarray(act(pre))
        xp = xp + h * np.asarray(act(pre_p))
    return float(np.max(np.linalg.norm(xp - x, axis=1) / np.linalg.norm(w, axis=1))), slope_min


def _dense_equilibrium(A, drive, X, pre, *, h, lam_min, lam_max) -> dict:
    """``x* = -A^{-1} drive`` and the contraction of ``x_k - x*``.

    Energy norm ``E(e) = sqrt(e^T M e)``, ``M = -A``: with ``z = A e`` and the
    secant slopes ``D = tanh(z) / z`` in ``[sigma, 1]``, one step gives
    ``E'^2 <= E^2 - h (2 - h lam_max(M)) z^T D z`` and
    ``z^T D z >= sigma lam_min(M) E^2``, so ``E`` contracts by
    ``c = sqrt(1 - h (2 - h lam_max) sigma lam_min)`` per step.
    """
    x_star = -np.linalg.solve(A, drive.T).T  # (batch, n)
    E = X - x_star[None]  # (K+1, batch, n)
    M = -A
    energy = np.sqrt(np.maximum(np.einsum("kbi,ij,kbj->kb", E, M, E), 0))
    two = np.linalg.norm(E, axis=-1)
    z = pre  # A e_k, since A x* + drive = 0
    secant = np.where(np.abs(z) > 1e-12, np.tanh(z) / np.where(np.abs(z) > 1e-12, z, 1), 1.0)
    sigma = float(secant.min())
    c = _energy_contraction(h, sigma, lam_min, lam_max)
    k = np.arange(E.shape[0])[:, None]
    slack = 1e-9 * energy[0].max() + 1e-12
    energy_ok = bool(np.all(energy <= c ** k * energy[0][None] + slack))
    steps_up = np.diff(two, axis=0) > 1e-9 * two[:-1].clip(1e-300)
    scale = np.linalg.norm(x_star, axis=1).clip(1e-12)
    return {
        "residual_rel_max": float(np.max(two[-1] / scale)),
        "residual_energy_ratio_max": float(np.max(energy[-1] / energy[0].clip(1e-300))),
        "secant_slope_min": sigma,
        "contraction_energy_norm": c,
        "energy_norm_bound_holds": energy_ok,
        "two_norm_increases": int(steps_up.sum()),
        "two_norm_monotone": bool(not steps_up.any()),
    }


# -------------------------------------------------------------------- conv blocks


def _conv_parameters(kernel, delta, *, eps, eta, h, rel_tol, learn_delta: bool) -> dict:
    """Algorithm 2's condition read off the kernel, per output channel."""
    kernel = effective_state_kernel(kernel, delta)
    centres, radii = kernel_gershgorin(kernel)
    d = np.zeros_like(centres) if delta is None else _f64(delta)
    budget = 1 - eps - np.abs(d)
    ok_radius = bool(np.all(radii <= budget * (1 + rel_tol) + 1e-12))
    ok_delta = bool(np.all(np.abs(d) <= 1 - eta + 1e-12)) if learn_delta else True
    bound = conv_block_figures(kernel, h=h)["inf_norm_bound_I_plus_hA"]
    return {
        "condition": "per channel c: centre = -1 - delta_c, radius_c <= 1 - eps - |delta_c|"
        + (", |delta_c| <= 1 - eta" if learn_delta else ""),
        "centres": [float(centres.min()), float(centres.max())],
        "radius_max": float(radii.max()),
        "budget_min": float(budget.min()),
        "radius_over_budget_max": float(np.max(radii / budget)),
        "condition_holds": bool(ok_radius and ok_delta),
        "inf_norm_bound_I_plus_hA": bound,
        "_discs": (1 + h * centres.reshape(-1), h * radii.reshape(-1)),
    }


def _conv_radius(kernel: np.ndarray, hw: tuple[int, int], h: float, slopes=None, *, key):
    """Spectral radius of ``I + h diag(s) A`` for the conv operator at ``hw`` (Arnoldi)."""
    C = kernel.shape[-1]
    n = hw[0] * hw[1] * C
    op = conv_operator(jnp.asarray(kernel), hw + (C,))
    s = jnp.ones(n) if slopes is None else jnp.asarray(slopes).reshape(-1)
    return spectral_radius_info(jacobian_operator(op, s, h), n=n, key=key)


def _conv_trajectory(kernel, rec: _BlockRecord, *, eps, h, activation, options, key) -> dict:
    kernel = _f64(kernel)
    untied = kernel.ndim == 5
    K = rec.trajectory.shape[0]
    traj = jnp.asarray(rec.trajectory, jnp.float64)
    batch, H, W, C = traj.shape[1:]
    drive = jnp.asarray(rec.drive, jnp.float64)
    drives = jnp.moveaxis(drive.reshape(batch, H, W, K, C), 3, 0) if untied else jnp.broadcast_to(drive, (K,) + drive.shape)
    kernels = jnp.asarray(kernel if untied else np.broadcast_to(kernel, (K,) + kernel.shape))
    X = jnp.concatenate([jnp.zeros((1,) + traj.shape[1:], jnp.float64), traj])
    pre = jax.vmap(lambda x, k, d: conv_same(x, k, precision=_HIGHEST) + d)(X[:-1], kernels, drives)
    slopes = activation_slope(activation, pre)  # (K, batch, H, W, C)
    # ||I + h diag(s) A||_inf at every visited state, exact row sums incl. borders
    p = kernel.shape[-4] // 2
    mask = np.zeros(kernel.shape[-4:])
    mask[p, p] = np.eye(C)
    off = jnp.abs(kernels) * (1 - mask)
    rowsum = jax.vmap(lambda o: conv_same(jnp.ones((1, H, W, C)), o, precision=_HIGHEST)[0])(off)  # (K, H, W, C)
    centre = jnp.diagonal(kernels[:, p, p], axis1=-2, axis2=-1)  # (K, C)
    slopes_np = np.asarray(slopes)
    clipped = jnp.maximum(slopes, options.sigma_min)  # Condition 1's set P
    inf_norm = jnp.max(
        jnp.abs(1 + h * clipped * centre[:, None, None, None, :]) + h * clipped * rowsum[:, None], axis=(2, 3, 4)
    )  # (K, batch)
    in_P = np.all(slopes_np >= options.sigma_min, axis=(2, 3, 4))
    out = {
        "states": int(K * batch),
        "inf_norm_J_max": float(inf_norm.max()),
        "unsaturated_fraction": float(np.mean(slopes_np >= options.sigma_min)),
        "states_in_P_fraction": float(np.mean(in_P)),
        "slope_min": float(slopes_np.min()),
    }
    # exact radii of a few trajectory Jacobians (the worst by the inf-norm bound first)
    order = np.argsort(-np.asarray(inf_norm).ravel())[: options.jacobian_samples]
    radii = []
    for j, flat in enumerate(order):
        k, b = divmod(int(flat), batch)
        res = _conv_radius(np.asarray(kernels[k]), (H, W), h, np.asarray(clipped[k, b]), key=jax.random.fold_in(key, j))
        radii.append(res.radius)
    out["rho_J_sampled"] = [float(r) for r in radii]
    out["rho_J_max"] = float(max(radii)) if radii else None
    # worst ||I + h diag(s) A||_inf over s in [sigma, 1] (each row is convex in s, so an
    # end point wins): <= 1 - h sigma eps when Algorithm 2's condition holds, a bound always
    sigma = max(out["slope_min"], options.sigma_min)
    out["rho_bar_theorem"] = _conv_row_bound(kernels, h, sigma)
    out["rho_bar_measured"] = out["inf_norm_J_max"]  # a norm: contraction factor along the data
    # ||B||_inf of the input convolution (times the drive normalisation's scale)
    D = _f64(rec.input_params["kernel"])
    b_rows = np.abs(D).sum(axis=(0, 1, 2))  # per output channel
    if rec.drive is not rec.drive_raw and "drive_scale" in rec.input_params:
        b_rows = b_rows * np.abs(rec.input_params["drive_scale"])
    b_norm = float(b_rows.max())
    out.update(_gains(out, b_norm, h, norm="inf"))
    gain, sigma_both = _conv_io_gain(kernels, drives, rec, K=K, h=h, activation=activation, options=options)
    # Proved on the visited region: ||dx_{k+1}||_inf <= q ||dx_k||_inf + h ||B w||_inf
    q = _conv_row_bound(kernels, h, sigma_both)
    out["gamma_bound"] = float(h * b_norm / (1 - q)) if q < 1 else float("inf")
    out["io_gain_measured"] = gain
    out["io_gain_within_bound"] = bool(gain <= out["gamma_bound"] * (1 + 1e-9))
    if activation == "tanh" and not untied:
        out["equilibrium"] = _conv_equilibrium(kernels[0], drive, X, pre, h=h, eps=eps)
    return out


def _conv_row_bound(kernels, h: float, sigma: float) -> float:
    """``max over s in {sigma, 1}`` of the kernel's row bound on ``||I + h s A||_inf``."""
    centres, radii = kernel_gershgorin(np.asarray(kernels))
    return float(max(np.max(np.abs(1 + h * s * centres) + h * s * radii) for s in (sigma, 1.0)))


def _conv_io_gain(kernels, drives, rec, *, K, h, activation, options) -> tuple[float, float]:
    """``max ||x_K(u + w) - x_K(u)||_inf / ||w||_inf``: ``w`` enters through the
    input convolution (and the drive normalisation's scale), which are linear."""
    from naisnet_jax.cell import ACTIVATIONS

    act = ACTIVATIONS[activation]
    u = jnp.asarray(rec.u, jnp.float64)
    rng = np.random.default_rng(options.seed + 1)
    w = rng.standard_normal(u.shape)
    u_scale = np.max(np.abs(np.asarray(u)), axis=(1, 2, 3), keepdims=True).clip(1e-12)
    w = jnp.asarray(w * options.perturbation * u_scale / np.max(np.abs(w), axis=(1, 2, 3), keepdims=True))
    D = jnp.asarray(rec.input_params["kernel"], jnp.float64)
    stride = u.shape[1] // drives.shape[2]
    dw = conv_same(w, D, stride=stride, precision=_HIGHEST)
    if "drive_scale" in rec.input_params:
        dw = dw * jnp.asarray(rec.input_params["drive_scale"])
    C = kernels.shape[-1]
    if dw.shape[-1] != C:  # untied: K C outputs read as (K, C)
        dw = jnp.moveaxis(dw.reshape(dw.shape[:3] + (K, C)), 3, 0)
    else:
        dw = jnp.broadcast_to(dw, (K,) + dw.shape)

    def run(extra):
        def body(x, inputs):
            kernel, d, e = inputs
            pre = conv_same(x, kernel, precision=_HIGHEST) + d + e
            return x + h * act(pre), jnp.min(activation_slope(activation, pre))

        x, slopes = jax.lax.scan(body, jnp.zeros(drives.shape[1:], jnp.float64), (kernels, drives, extra))
        return x, jnp.min(slopes)

    (xp, sp), (x, s0) = run(dw), run(jnp.zeros_like(dw))
    gain = jnp.max(jnp.abs(xp - x), axis=(1, 2, 3)) / jnp.max(jnp.abs(w), axis=(1, 2, 3))
    return float(jnp.max(gain)), float(jnp.minimum(sp, s0))


def _conv_equilibrium(kernel, drive, X, pre, *, h, eps) -> dict:
    """``x*`` with ``conv(x*, C) + drive = 0`` and the inf-norm contraction of ``x_k - x*``.

    ``x*`` is the fixed point of ``x <- x + (conv(x) + drive)`` (a contraction
    by ``||I + A||_inf <= 1 - eps``); the error of the returned ``x*`` is at
    most ``||conv(x*) + drive||_inf / eps``.
    """

    def residual(x):
        return conv_same(x, kernel, precision=_HIGHEST) + drive

    def cond(c):
        i, x, r = c
        return jnp.logical_and(i < 200_000, r > 1e-13)

    def body(c):
        i, x, _ = c
        x = x + residual(x)
        return i + 1, x, jnp.max(jnp.abs(residual(x)))

    x0 = jnp.zeros_like(drive)
    iters, x_star, res = jax.lax.while_loop(cond, body, (0, x0, jnp.max(jnp.abs(residual(x0)))))
    E = X - x_star[None]
    inf = jnp.max(jnp.abs(E), axis=(2, 3, 4))  # (K+1, batch)
    z = np.asarray(pre)
    secant = np.where(np.abs(z) > 1e-12, np.tanh(z) / np.where(np.abs(z) > 1e-12, z, 1), 1.0)
    sigma = float(secant.min())
    c = _conv_row_bound(kernel, h, sigma)
    k = jnp.arange(E.shape[0])[:, None]
    q = _conv_row_bound(kernel, 1.0, 1.0)  # ||I + A||_inf: the fixed-point map's contraction
    error_bound = float(res) / (1 - q) if q < 1 else float("inf")
    ok = bool(jnp.all(inf <= c ** k * inf[0][None] + 2 * error_bound + 1e-12))
    scale = jnp.max(jnp.abs(x_star), axis=(1, 2, 3)).clip(1e-12)
    return {
        "x_star_error_bound_inf": error_bound,
        "solver_iterations": int(iters),
        "residual_rel_max": float(jnp.max(inf[-1] / scale)),
        "secant_slope_min": sigma,
        "contraction_inf_norm": float(c),
        "inf_norm_bound_holds": ok,
    }


# ---------------------------------------------------------------- baseline blocks


def _bn_scale(batch_stats, params, name):
    """Eval-mode BatchNorm's multiplier ``gamma / sqrt(var + eps)`` (None without BN)."""
    from naisnet_jax.models import BN_EPSILON

    if name not in params or name not in batch_stats:
        return None
    return _f64(params[name]["scale"]) / np.sqrt(_f64(batch_stats[name]["var"]) + BN_EPSILON)


def _baseline_blocks(params, batch_stats, records, h, key) -> list[dict]:
    """Plain ResNet weights: spectral radius of each residual map's linear part.

    Dense layers: ``rho(I + h diag(g) W_k)`` with ``g`` the BatchNorm multiplier
    when the layer has one; conv blocks of unchanged shape: ``rho(I + diag(g) C)``
    by Arnoldi at the block's resolution.
    """
    reason = "baseline: plain ResNet weights with no stability parametrisation"
    blocks = []
    if "W" in params:  # ResNetFC without the stable parametrisation
        W = _f64(params["W"])
        Ws = W.reshape((-1,) + W.shape[-2:])
        layers = max(len(Ws), sum(1 for k in params if k.startswith("bn")))
        radii, Js = [], []
        for k in range(layers):
            Wk = Ws[k % len(Ws)]
            g = _bn_scale(batch_stats, params, f"bn{k}")
            Jk = np.eye(len(Wk)) + h * (Wk if g is None else g[:, None] * Wk)
            radii.append(spectral_radius_info(Jk, method="dense").radius)
            Js.append(Jk)
        J = Js[int(np.argmax(radii))]  # the figure shows the worst layer
        blocks.append({
            "name": "W", "kind": "dense-baseline", "reason": reason,
            "parameter": {"layers": layers, "rho_I_plus_hA": float(max(radii)),
                          "rho_per_layer": [float(r) for r in radii],
                          "_eigenvalues": np.linalg.eigvals(J),
                          "_discs": (np.diag(J), np.abs(J).sum(axis=1) - np.abs(np.diag(J)))},
        })
    for name, node in params.items():
        if not (isinstance(node, dict) and "conv" in node):
            continue
        entry = {"name": name, "kind": "conv-baseline", "reason": reason, "parameter": {}}
        kernel = _f64(node["conv"]["kernel"])
        rec = records.get((name,))
        if "shortcut" in node or kernel.shape[-2] != kernel.shape[-1] or rec is None:
            entry["parameter"]["note"] = "changes width or resolution: no square state map"
        else:
            g = _bn_scale(batch_stats.get(name, {}), node, "bn")
            scaled = kernel if g is None else kernel * g
            hw = tuple(rec.u.shape[1:3])
            res = _conv_radius(scaled, hw, 1.0, key=key)
            c, r = kernel_gershgorin(scaled)
            entry["parameter"].update({
                "rho_I_plus_hA": float(res.radius), "rho_method": res.method,
                "rho_converged": bool(res.converged),
                "inf_norm_bound_I_plus_hA": float(np.max(np.abs(1 + c) + r)),
                "_discs": (1 + c.reshape(-1), r.reshape(-1)),
                "_eigenvalues": np.array([res.eigenvalue, np.conj(res.eigenvalue)]),
                "_all_eigenvalues": False,
            })
        blocks.append(entry)
    for b in blocks:
        b["certified"] = False
    return blocks


# ---------------------------------------------------------------------- the audit


def audit(checkpoint_dir: str, options: AuditOptions = AuditOptions(), *, step: int | None = None,
          progress: bool = False) -> dict:
    """Audit the checkpoint in ``checkpoint_dir`` and return the certificate (a dict).

    Raises :class:`naisnet_jax.checkpoint.CheckpointError` when the directory
    is not a usable naisnet-jax checkpoint.
    """
    t0 = time.time()
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        state, meta = ckpt.load(checkpoint_dir, step=step)
        _check_metadata(state, meta)
        report = _audit_loaded(state, meta, options, progress=progress)
    report["checkpoint"]["path"] = str(checkpoint_dir)
    report["seconds"] = time.time() - t0
    return report


_REQUIRED_METADATA = ("model", "model_kwargs", "num_classes", "input_shape", "dataset",
                      "channel_mean", "channel_std", "eps", "h")


def _check_metadata(state, meta: dict) -> None:
    missing = [k for k in _REQUIRED_METADATA if k not in meta]
    if missing:
        raise ckpt.CheckpointError(f"the checkpoint's metadata lacks {missing}; it was not written by naisnet-jax's trainer.")
    if not isinstance(state, dict) or "params" not in state:
        raise ckpt.CheckpointError("the checkpoint holds no 'params' tree.")


def _audit_loaded(state: dict, meta: dict, options: AuditOptions, *, progress: bool) -> dict:
    model = _build_model(meta)
    params = jax.tree.map(_f64, state["params"])
    batch_stats = state.get("batch_stats") or {}
    variables = {"params": params}
    if batch_stats:
        variables["batch_stats"] = jax.tree.map(_f64, batch_stats)
    # the network runs with the model's own eps, h (which training sets from the config)
    eps, h = float(getattr(model, "eps", meta["eps"])), float(getattr(model, "h", meta["h"]))
    eta, relaxed = float(getattr(model, "eta", meta.get("eta", 0.5))), bool(meta.get("relaxed", False))
    for field, used in (("eps", eps), ("h", h)):
        if not np.isclose(float(meta[field]), used, rtol=1e-12, atol=0):
            raise ckpt.CheckpointError(
                f"the metadata's {field}={meta[field]} disagrees with the model's {field}={used} "
                f"(model_kwargs); the network runs with the latter."
            )
    activation = getattr(model, "activation", "relu")
    learn_delta = bool(getattr(model, "learn_delta", False))
    key = jax.random.PRNGKey(options.seed)

    inputs, source = _inputs(meta, options)
    try:
        records, _ = _record_forward(model, variables, jnp.asarray(inputs))
    except (flax.errors.FlaxError, TypeError, ValueError) as e:
        raise ckpt.CheckpointError(
            f"the checkpoint's arrays do not fit the model its metadata describes "
            f"({meta['model']}, {meta['model_kwargs']}): {type(e).__name__}: {e}"
        ) from e
    use_data = options.data != "none"
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "checkpoint": {k: meta.get(k) for k in ("step", "epoch", "model", "model_kwargs", "dataset", "digest")},
        "versions": _versions(),
        "device": str(jax.devices()[0]),
        "precision": "float64, matmul precision HIGHEST",
        "hyperparameters": {"eps": eps, "eta": eta, "h": h, "relaxed": relaxed, "activation": activation},
        "tolerances": {
            "parameter_rel_tol": options.rel_tol, "sigma_min": options.sigma_min,
            "perturbation": options.perturbation, "arnoldi_rel_tol": 1e-10,
        },
        "data": {"source": source, "samples": int(len(inputs)) if use_data else 0},
        "blocks": [],
    }
    blocks = list(iter_state_blocks(params))
    iterator = blocks
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(blocks, desc="auditing blocks", unit="block", leave=False)
    for i, (path, node) in enumerate(iterator):
        name = "/".join(path) or (FC_KEY if FC_KEY in node else CONV_KERNEL_KEY)
        rec = records.get(tuple(path))
        if rec is not None and rec.input_params is None:
            rec.input_params = dict(node.get("input", {}))
            if "drive_norm" in node:  # eval-mode BatchNorm multiplies the drive by gamma / sqrt(var + eps)
                stats = _get_path(variables.get("batch_stats", {}), path)
                rec.input_params["drive_scale"] = _bn_scale(stats, node, "drive_norm")
        block_key = jax.random.fold_in(key, i)
        if FC_KEY in node:
            entry = {"name": name, "kind": "dense",
                     "parameter": _dense_parameters(_f64(node[FC_KEY]), eps=eps, h=h, relaxed=relaxed, rel_tol=options.rel_tol)}
            if rec is not None and rec.trajectory is not None and use_data:
                entry["trajectory"] = _dense_trajectory(node[FC_KEY], rec, eps=eps, h=h, activation=activation, options=options)
            elif use_data:
                entry["trajectory"] = {"skipped": "not a NAIS block with a recorded trajectory (e.g. ResNet-SH-Stable)"}
        else:
            kernel, delta = node[CONV_KERNEL_KEY], node.get(CONV_DELTA_KEY)
            entry = {"name": name, "kind": "conv",
                     "parameter": _conv_parameters(kernel, delta, eps=eps, eta=eta, h=h, rel_tol=options.rel_tol,
                                                   learn_delta=learn_delta)}
            eff = effective_state_kernel(kernel, delta)
            if rec is not None and options.exact_conv_radius:
                hw = tuple(rec.drive.shape[1:3])
                per_step = eff.reshape((-1,) + eff.shape[-4:])
                results = [_conv_radius(k_, hw, h, key=jax.random.fold_in(block_key, j)) for j, k_ in enumerate(per_step)]
                worst = max(results, key=lambda r: r.radius)
                entry["parameter"].update({
                    "state_shape": [int(hw[0]), int(hw[1]), int(eff.shape[-1])],
                    "rho_I_plus_hA": float(worst.radius),
                    "rho_method": worst.method,
                    "rho_residual": float(worst.residual),
                    "rho_converged": bool(all(r.converged for r in results)),
                })
                n = hw[0] * hw[1] * eff.shape[-1]
                if n <= 2048:  # small enough to show the whole spectrum
                    op = jacobian_operator(conv_operator(jnp.asarray(per_step[0]), hw + (eff.shape[-1],)), jnp.ones(n), h)
                    entry["parameter"]["_eigenvalues"] = np.linalg.eigvals(np.asarray(operator_matrix(op, n)))
                else:
                    entry["parameter"]["_eigenvalues"] = np.array([worst.eigenvalue, np.conj(worst.eigenvalue)])
                    entry["parameter"]["_all_eigenvalues"] = False
            if rec is not None and rec.trajectory is not None and use_data:
                entry["trajectory"] = _conv_trajectory(eff, rec, eps=eps, h=h, activation=activation,
                                                       options=options, key=block_key)
        _decide(entry, h)
        report["blocks"].append(entry)
    report["blocks"].extend(_baseline_blocks(params, variables.get("batch_stats", {}), records, h, key))
    nais = [b for b in report["blocks"] if b["kind"] in ("dense", "conv")]
    report["certified"] = bool(nais) and all(b["certified"] for b in report["blocks"])
    if not report["blocks"]:
        report["reason"] = "no blocks found"
    elif not nais:
        report["reason"] = "baseline model: no NAIS block to certify"
    else:
        failed = [b["name"] for b in report["blocks"] if not b["certified"]]
        report["reason"] = "every block certified stable" if not failed else f"not certified: {', '.join(failed)}"
    report["summary"] = {
        "blocks": len(report["blocks"]),
        "certified_blocks": sum(b["certified"] for b in report["blocks"]),
        "rho_I_plus_hA_max": _finite_max([b["parameter"].get("rho_I_plus_hA", np.nan) for b in report["blocks"]]),
        "rho_J_trajectory_max": _finite_max([b.get("trajectory", {}).get("rho_J_max", np.nan) for b in report["blocks"]]),
    }
    return report


def _get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _decide(entry: dict, h: float) -> None:
    """Certified iff the projection's sufficient condition holds, ``0 < h <= 1``,
    and no measured radius reaches 1."""
    par, traj = entry["parameter"], entry.get("trajectory", {})
    reasons = []
    if not par["condition_holds"]:
        reasons.append(f"projection condition violated ({par['condition']})")
    if not 0 < h <= 1:
        reasons.append(f"step size h={h} outside (0, 1]")
    rho = par.get("rho_I_plus_hA")
    if rho is not None and not rho < 1:
        reasons.append(f"rho(I + hA) = {rho:.6g} >= 1")
    if par.get("rho_converged") is False:
        reasons.append("Arnoldi did not converge")
    if traj.get("rho_J_max") is not None and not traj["rho_J_max"] < 1:
        reasons.append(f"a trajectory Jacobian has radius {traj['rho_J_max']:.6g} >= 1")
    if entry["kind"] == "conv" and rho is not None and rho > par["inf_norm_bound_I_plus_hA"] * (1 + 1e-8) + 1e-12:
        reasons.append("inconsistent: Arnoldi radius above the Gershgorin bound")
    entry["certified"] = not reasons
    entry["reason"] = "; ".join(reasons) if reasons else "projection condition holds and every measured radius < 1"
