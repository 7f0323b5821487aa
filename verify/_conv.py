"""Audit of convolutional NAIS blocks, batched over blocks of one shape (a stage's 18).

Proof (Condition 1 for the float32 kernel with its centre taps): Gershgorin row
bounds ``|1 + h s c| + h s r`` (``r`` the exact off-centre sum, ``c`` the centre
tap), in float64 with their own rounding bounded. Estimates: the radius of
``I + h A`` at the block's resolution (Arnoldi, all blocks of a shape side by
side; dense eigvals for small states) and of trajectory Jacobians. Measured:
slopes, norms, gains and equilibria along the sampled inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax.cell import ACTIVATIONS, activation_slope, conv_same
from naisnet_jax.stability import kernel_gershgorin

from ._common import Block, all_finite, gain, group, map_groups, perturbation
from ._numerics import U64, float32_h, gamma, jit
from .arnoldi import arnoldi_eigs_batch, stack_operators
from .certificate import ConvParameters, Equilibrium, Spectrum, Trajectory
from .operators import conv_operator, jacobian_operator, operator_matrix
from .spectral import dense_spectral_result, dense_spectrum

_HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------ the proof


def row_bound(kernels, h, s):
    """Proven upper bound on ``max_c |1 + h s c_c| + h s r_c`` over channels (and leading axes
    but the first): the Gershgorin bound on ``||I + h s A||_inf`` for a scalar slope ``s``.

    ``kernels`` is ``(B, ..., k, k, C, C)`` float64 holding float32 values; ``h``, ``s`` are
    ``(B,)``. The float64 sum of the ``m = k k C`` taps is within ``gamma(m)`` of exact, and
    the final ``|.| + .`` within ``gamma(8)`` of its operands' sizes; both are added. JAX
    arrays stay in JAX (jit, vmap); numpy arrays are computed with numpy.
    """
    xp = jnp if isinstance(kernels, jax.Array) else np
    centres, radii = kernel_gershgorin(kernels)
    k, C = kernels.shape[-4], kernels.shape[-1]
    radii = radii * (1 + gamma(k * k * C + 2))
    hs = xp.reshape(xp.asarray(h) * xp.asarray(s), (-1,) + (1,) * (centres.ndim - 1))
    value = xp.abs(1 + hs * centres) + hs * radii
    value = value + gamma(8) * (1 + hs * xp.abs(centres) + hs * radii)
    return xp.max(xp.reshape(value, (value.shape[0], -1)), axis=1)


def worst_row_bound(kernels: np.ndarray, h: float, sigma: float) -> float:
    """``max over s in {sigma, 1}`` of :func:`row_bound` for one block (its kernels stacked on
    the first axis): ``||I + h diag(s) A||_inf`` is convex in each slope, so an end wins."""
    kernels = np.asarray(kernels, np.float64)[None]
    return float(max(row_bound(kernels, h, sigma)[0], row_bound(kernels, h, 1.0)[0]))


def _proof(kernels, deltas, h, eps, eta, sigma, relu, learn_delta):
    """Algorithm 2's condition and Condition 1, per block; all inputs batched on axis 0.

    Elementwise sums over the parameters (float64, numpy: no compilation for what costs
    microseconds); the device does the operator work."""
    centres, radii = kernel_gershgorin(kernels)
    k, C = kernels.shape[-4], kernels.shape[-1]
    flat = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731
    radii_up = radii * (1 + gamma(k * k * C + 2))
    budget = 1 - eps[:, None, None] - np.abs(deltas)  # float64, within 2u of exact
    condition = np.all(flat(radii_up <= budget - 4 * U64), axis=1)
    delta_ok = np.all(flat(np.abs(deltas) <= (1 - eta)[:, None, None]), axis=1)
    condition = condition & np.where(learn_delta, delta_ok, True)
    inf_bound = row_bound(kernels, h, np.ones_like(h))
    rho_bar = np.where(relu, inf_bound, np.maximum(row_bound(kernels, h, sigma), inf_bound))
    return {
        "centre_min": np.min(flat(centres), 1),
        "centre_max": np.max(flat(centres), 1),
        "radius_max": np.max(flat(radii), 1),
        "budget_min": np.min(flat(budget), 1),
        "ratio": np.max(flat(radii / budget), 1),
        "condition": condition,
        "inf_bound": inf_bound,
        "rho_bar": rho_bar,
    }


def _steps(x):
    """A tied kernel ``(k, k, C, C)`` as one step ``(1, k, k, C, C)``."""
    x = np.asarray(x)
    return x if x.ndim == 5 else x[None]


# ------------------------------------------------------------- parameter figures


def parameters(blocks: list[Block], options) -> dict[int, tuple[ConvParameters, Spectrum | None]]:
    groups = group(blocks, lambda b: (_steps(b.p32.operator).shape, _hw(b)))
    out = {}
    for part in map_groups(functools.partial(_group_parameters, options=options), groups):
        out.update(part)
    return out


def _group_parameters(members: list[Block], options) -> dict[int, tuple[ConvParameters, Spectrum | None]]:
    out = {}
    kernels = np.stack([np.asarray(_steps(b.p32.operator), np.float64) for b in members])  # (G, S, k, k, C, C)
    deltas = np.stack([np.reshape(np.asarray(b.p32.factor, np.float64), (-1, kernels.shape[-1])) for b in members])
    arr = lambda f: np.asarray([f(b.p32) for b in members], np.float64)  # noqa: E731
    h = arr(lambda p: float32_h(p.h))
    proof = _proof(
        kernels,
        deltas,
        h,
        arr(lambda p: p.eps),
        arr(lambda p: p.eta),
        np.full(h.shape, options.sigma_min),
        np.asarray([b.p32.activation == "relu" for b in members]),
        np.asarray([b.p32.learn_delta for b in members]),
    )
    finite = [all_finite(k) for k in kernels]  # a kernel that overflowed has no spectrum to estimate
    good = [i for i in range(len(members)) if finite[i]]
    radii = (
        _radius_estimates([members[i] for i in good], kernels[good], h[good], options)
        if options.estimate_conv_radius and good
        else {}
    )
    centres, disc_r = kernel_gershgorin(kernels[:, 0])
    for i, b in enumerate(members):
        hw = _hw(b)
        est = radii.get(b.index)
        params = ConvParameters(
            condition="per channel c: centre = -1 - delta_c, radius_c <= 1 - eps - |delta_c|"
            + (", |delta_c| <= 1 - eta" if b.p32.learn_delta else ""),
            centres=(float(proof["centre_min"][i]), float(proof["centre_max"][i])),
            radius_max=float(proof["radius_max"][i]),
            budget_min=float(proof["budget_min"][i]),
            radius_over_budget_max=float(proof["ratio"][i]),
            condition_holds=bool(proof["condition"][i]),
            inf_norm_bound_I_plus_hA=float(proof["inf_bound"][i]),
            rho_bar_bound=float(proof["rho_bar"][i]),
            condition1_proven=bool(proof["inf_bound"][i] < 1),
            state_shape=None if hw is None else (hw[0], hw[1], int(kernels.shape[-1])),
            rho_I_plus_hA=None if est is None else est["radius"],
            rho_method=None if est is None else est["method"],
            rho_residual=None if est is None else est["residual"],
            rho_converged=None if est is None else est["converged"],
            steps=int(kernels.shape[1]),
        )
        if not finite[i]:
            out[b.index] = (params, None)
            continue
        hb = float(h[i])
        eig = () if est is None else est["eigenvalues"]
        spectrum = Spectrum(
            eigenvalues=tuple(complex(z) for z in eig),
            all_eigenvalues=bool(est and est["all"]),
            disc_centres=tuple(float(c) for c in 1 + hb * centres[i]),
            disc_radii=tuple(float(r) for r in hb * disc_r[i]),
            bound=params.inf_norm_bound_I_plus_hA,
            bound_label="||I + hA||_inf",
        )
        out[b.index] = (params, spectrum)
    return out


def _hw(b: Block):
    states = b.p32.states
    return None if states is None else (int(states.shape[-3]), int(states.shape[-2]))


def _radius_estimates(members, kernels, h, options) -> dict[int, dict]:
    """rho(I + h A) of every (block, step) at the block's resolution; worst step per block."""
    hw = _hw(members[0])
    if hw is None:
        return {}
    S, C = kernels.shape[1], kernels.shape[-1]
    n = hw[0] * hw[1] * C
    ops, owners, keys = [], [], []
    ones = np.ones(n)
    for i, b in enumerate(members):
        for s in range(S):
            ops.append(jacobian_operator(conv_operator(kernels[i, s], hw + (C,)), ones, float(h[i])))
            owners.append(b.index)
            keys.append(jax.random.fold_in(b.key, s))
    results = []
    if n <= options.dense_max_n:
        for op in ops:
            res, eig = dense_spectrum(np.asarray(operator_matrix(op, n)), iterations=n)
            results.append((res.radius, res.eigenvalue, res.residual, True, "dense", eig))
    else:
        for res in arnoldi_eigs_batch(stack_operators(ops), n, keys=jnp.stack(keys)):
            theta = complex(res.eigenvalues[0])
            results.append(
                (abs(theta), theta, res.residual, res.converged, "arnoldi", np.array([theta, np.conj(theta)]))
            )
    out: dict[int, dict] = {}
    for owner, (radius, _, residual, converged, method, eig) in zip(owners, results):
        prev = out.get(owner)
        if prev is None or radius > prev["radius"]:
            out[owner] = {
                "radius": float(radius),
                "residual": float(residual),
                "method": method,
                "converged": bool(converged and (prev is None or prev["converged"])),
                "eigenvalues": eig,
                "all": method == "dense",
            }
        else:
            prev["converged"] = prev["converged"] and bool(converged)
    return out


# ----------------------------------------------------------------- trajectories


@jit(static_argnames=("activation", "untied"))
def _visited(kernels, drives, x0, states, h, sigma_min, *, activation, untied):
    """Slopes and ``||J||_inf`` at every visited state of one block.

    ``kernels`` ``(K, k, k, C, C)`` (untied) or ``(k, k, C, C)``, ``drives`` ``(K, b, H, W, C)``
    or ``(b, H, W, C)``, ``x0`` and ``states`` ``x_1 .. x_K``. The row sums of ``|off-centre
    taps|`` are exact per pixel (a conv of ones), border rows included.
    """
    K = states.shape[0]
    kernels = kernels if untied else jnp.broadcast_to(kernels, (K,) + kernels.shape)
    drives = drives if untied else jnp.broadcast_to(drives, (K,) + drives.shape)
    X = jnp.concatenate([x0[None], states])
    pre = jax.vmap(lambda x, k, d: conv_same(x, k, precision=_HIGHEST) + d)(X[:-1], kernels, drives)
    slopes = activation_slope(activation, pre)
    K, k, C = kernels.shape[0], kernels.shape[1], kernels.shape[-1]
    p = k // 2
    mask = jnp.zeros((k, k, C, C)).at[p, p].set(jnp.eye(C))
    H, W = X.shape[2:4]
    rowsum = jax.vmap(lambda o: conv_same(jnp.ones((1, H, W, C)), o, precision=_HIGHEST)[0])(
        jnp.abs(kernels) * (1 - mask)
    )  # (K, H, W, C)
    centre = jnp.diagonal(kernels[:, p, p], axis1=-2, axis2=-1)  # (K, C)
    inf_norm = jnp.max(
        jnp.abs(1 + h * slopes * centre[:, None, None, None, :]) + h * slopes * rowsum[:, None], axis=(2, 3, 4)
    )  # (K, b)
    in_p = jnp.all(slopes >= sigma_min, axis=(2, 3, 4))  # (K, b)
    return {
        "slopes": slopes,
        "inf_norm": inf_norm,
        "in_p": in_p,
        "kernels": kernels,
        "drives": drives,
        "X": X,
        "unsaturated": jnp.mean(slopes >= sigma_min, dtype=jnp.float64),  # bool mean: float32 even in x64
        "slope_min": jnp.min(slopes),
    }


@jit(static_argnames=("activation", "stride"))
def _io_gain(kernels, drives, w, D, scale, h, *, activation, stride):
    """``max_b ||x_K(u + w) - x_K(u)||_inf / ||w||_inf``: ``w`` enters through the input
    convolution ``D`` (and the drive normalisation's ``scale``), which are linear. Also the
    smallest slope met on either trajectory."""
    act = ACTIVATIONS[activation]
    K, C = kernels.shape[0], kernels.shape[-1]
    dw = conv_same(w, D, stride=stride, precision=_HIGHEST) * scale
    dw = (
        jnp.moveaxis(dw.reshape(dw.shape[:3] + (K, C)), 3, 0)
        if dw.shape[-1] != C
        else jnp.broadcast_to(dw, (K,) + dw.shape)
    )

    def run(extra):
        def body(x, inputs):
            kernel, d, e = inputs
            pre = conv_same(x, kernel, precision=_HIGHEST) + d + e
            return x + h * act(pre), jnp.min(activation_slope(activation, pre))

        x, slopes = jax.lax.scan(body, jnp.zeros(drives.shape[1:], drives.dtype), (kernels, drives, extra))
        return x, jnp.min(slopes)

    (xp, sp), (x, s0) = run(dw), run(jnp.zeros_like(dw))
    ratio = jnp.max(jnp.abs(xp - x), axis=(1, 2, 3)) / jnp.max(jnp.abs(w), axis=(1, 2, 3))
    return jnp.max(ratio), jnp.minimum(sp, s0)


@jit
def _fixed_point(kernel, drive):
    """``x*`` with ``conv(x*, C) + drive = 0`` as the fixed point of ``x <- x + conv(x) + drive``.

    Plain-Python meaning: x = 0; while ||conv(x) + drive||_inf > 1e-13 (at most 200000 times):
    x = x + conv(x) + drive. A contraction by ``||I + A||_inf`` when that is below 1.
    """

    def residual(x):
        return conv_same(x, kernel, precision=_HIGHEST) + drive

    def cond(c):
        i, _, r = c
        return jnp.logical_and(i < 200_000, r > 1e-13)

    def body(c):
        i, x, _ = c
        x = x + residual(x)
        return i + 1, x, jnp.max(jnp.abs(residual(x)))

    x0 = jnp.zeros_like(drive)
    return jax.lax.while_loop(cond, body, (0, x0, jnp.max(jnp.abs(residual(x0)))))


def trajectories(blocks: list[Block], options) -> dict[int, Trajectory]:
    """Trajectory figures of every block; the Jacobian radii of a group's blocks in one batch."""

    def sig(b):
        return (
            _steps(b.p64.operator).shape,
            tuple(b.p64.states.shape),
            np.shape(b.p64.u),
            b.p64.untied,
            b.p64.activation,
        )

    out = {}
    for part in map_groups(functools.partial(_group_trajectories, options=options), group(blocks, sig)):
        out.update(part)
    return out


def _group_trajectories(members: list[Block], options) -> dict[int, Trajectory]:
    out = {}
    visited = [_visit(b, options) for b in members]
    ops, owners, keys = [], [], []
    for b, v in zip(members, visited):
        for j, (k, i) in enumerate(v["samples"]):
            ops.append(
                jacobian_operator(conv_operator(v["kernels"][k], v["shape"]), v["slopes"][k, i].reshape(-1), v["h"])
            )
            owners.append(b.index)
            keys.append(jax.random.fold_in(b.key, 1000 + j))
    radii: dict[int, list[float]] = {b.index: [] for b in members}
    if ops:
        n = int(np.prod(visited[0]["shape"]))
        if n <= options.dense_max_n:
            found = [dense_spectral_result(np.asarray(operator_matrix(op, n)), n).radius for op in ops]
        else:
            found = [
                abs(complex(r.eigenvalues[0]))
                for r in arnoldi_eigs_batch(stack_operators(ops), n, keys=jnp.stack(keys))
            ]
        for owner, r in zip(owners, found):
            radii[owner].append(float(r))
    for b, v in zip(members, visited):
        out[b.index] = _finish(b, v, radii[b.index], options)
    return out


def _visit(b: Block, options) -> dict:
    p = b.p64
    v = _visited(
        p.operator,
        p.drive,
        p.x0,
        p.states,
        float(p.h),
        options.sigma_min,
        activation=p.activation,
        untied=bool(p.untied),
    )
    inf_norm, in_p = np.asarray(v["inf_norm"]), np.asarray(v["in_p"])
    batch = in_p.shape[1]
    candidates = np.flatnonzero(in_p.ravel())  # the worst visited Jacobians inside P
    order = candidates[np.argsort(-inf_norm.ravel()[candidates], kind="stable")][: options.jacobian_samples]
    return dict(
        v,
        inf_norm=inf_norm,
        in_p=in_p,
        h=float(p.h),
        kernels_np=np.asarray(v["kernels"]),
        shape=tuple(int(d) for d in v["X"].shape[2:]),
        samples=[divmod(int(f), batch) for f in order],
    )


def _finish(b: Block, v: dict, sampled: list[float], options) -> Trajectory:
    p = b.p64
    h, act, kernels, drives, X = v["h"], p.activation, v["kernels"], v["drives"], v["X"]
    inf_norm, in_p = v["inf_norm"], v["in_p"]
    slope_min = float(v["slope_min"])
    sigma = max(slope_min, options.sigma_min)
    worst = functools.partial(worst_row_bound, v["kernels_np"], h)
    out = dict(
        states=int(in_p.size),
        states_in_P_fraction=float(in_p.mean()),
        unsaturated_fraction=float(v["unsaturated"]),
        slope_min=slope_min,
        rho_J_max=float(max(sampled)) if sampled else None,
        rho_J_sampled=tuple(sampled),
        inf_norm_J_max=float(inf_norm.max()),
        inf_norm_J_max_in_P=float(inf_norm[in_p].max()) if in_p.any() else None,
        rho_bar_theorem=worst(sigma),
        rho_bar_measured=float(inf_norm.max()),  # a norm: the contraction factor along the data
    )
    if p.input_kernel is not None:
        D = jnp.asarray(p.input_kernel, jnp.float64)
        scale = jnp.ones(D.shape[-1]) if p.input_scale is None else jnp.asarray(p.input_scale, jnp.float64)
        b_norm = float(jnp.max(jnp.sum(jnp.abs(D), axis=(0, 1, 2)) * jnp.abs(scale)))
        u = np.asarray(p.u, np.float64)
        w = perturbation(u.shape, options.seed)
        u_scale = np.max(np.abs(u), axis=(1, 2, 3), keepdims=True).clip(1e-12)
        w = w * options.perturbation * u_scale / np.max(np.abs(w), axis=(1, 2, 3), keepdims=True)
        io_gain, sigma_both = _io_gain(
            kernels, drives, jnp.asarray(w), D, scale, h, activation=act, stride=int(p.input_stride)
        )
        q = worst(max(float(sigma_both), 0.0))
        gamma_bound = float(h * b_norm / (1 - q)) if q < 1 else float("inf")
        out.update(
            B_norm_inf=b_norm,
            gamma_theorem=gain(h, b_norm, out["rho_bar_theorem"]),
            gamma_measured=gain(h, b_norm, out["rho_bar_measured"]),
            io_gain_measured=float(io_gain),
            gamma_bound=gamma_bound,
            io_gain_within_bound=bool(float(io_gain) <= gamma_bound * (1 + 1e-9)),
        )
    if act == "tanh" and not p.untied:
        out["equilibrium"] = _equilibrium(kernels[0], drives[0], X, h)
    return Trajectory(**out)


@jit
def _equilibrium_core(kernel, drive, X):
    iters, x_star, res = _fixed_point(kernel, drive)
    inf = jnp.max(jnp.abs(X - x_star[None]), axis=(2, 3, 4))  # (K+1, batch)
    # z = A x_k + d = A (x_k - x*): the pre-activations along the trajectory
    z = jax.vmap(lambda x: conv_same(x, kernel, precision=_HIGHEST) + drive)(X[:-1])
    safe = jnp.where(jnp.abs(z) > 1e-12, z, 1.0)
    secant = jnp.where(jnp.abs(z) > 1e-12, jnp.tanh(z) / safe, 1.0)
    scale = jnp.clip(jnp.max(jnp.abs(x_star), axis=(1, 2, 3)), 1e-12)
    return iters, res, inf, jnp.min(secant), jnp.max(inf[-1] / scale)


def _equilibrium(kernel, drive, X, h) -> Equilibrium:
    """``x*`` and the inf-norm contraction ``||x_k - x*|| <= c^k ||x_0 - x*||`` with ``c`` the
    row bound at the smallest secant slope ``tanh(z)/z`` met (``z = A (x_k - x*)``)."""
    iters, res, inf, sigma, residual_rel = jax.device_get(_equilibrium_core(kernel, drive, X))
    sigma = float(sigma)
    kernel = np.asarray(kernel)
    c = worst_row_bound(kernel[None], h, sigma)
    q = worst_row_bound(kernel[None], 1.0, 1.0)  # ||I + A||_inf: the fixed-point map's contraction
    error_bound = float(res) / (1 - q) if q < 1 else float("inf")
    k = np.arange(inf.shape[0])[:, None]
    ok = bool(np.all(inf <= c**k * inf[0][None] + 2 * error_bound + 1e-12))
    return Equilibrium(
        residual_rel_max=float(residual_rel),
        secant_slope_min=sigma,
        x_star_error_bound_inf=error_bound,
        solver_iterations=int(iters),
        contraction_inf_norm=c,
        inf_norm_bound_holds=ok,
    )
