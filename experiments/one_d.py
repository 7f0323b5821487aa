"""The supplement's 1-D analysis ("Analysis of 1D Activations"): scalar NAIS-Net maps.

    python -m experiments.one_d --workdir=runs/one_d [--smoke]

A scalar block ``x(k+1) = x(k) + h act(a x(k) + b u + c)`` with ``x(0) = 0``, ``h = 1``,
``b = 1``, ``c = 0`` (the supplement's setting) maps its input ``u`` to ``x_K(u)``. For each
case below, tanh and ReLU, ``K = 1 .. 100``, this computes the maps (with the package's own
``fc_step`` and unrolls, float64), with and without the stopping rule ``|x_k - x_{k-1}| <
tol`` (``tol = 0.95``, as the supplement uses for illustration), redraws the supplement's four
figures and checks its claims numerically on the grid of ``u``:

- *monotone*: every ``u -> x_K(u)`` is non-decreasing (with the stopping rule: on every piece
  where the depth is constant, i.e. between jumps);
- *increasing at 0* (tanh): slope at ``u = 0`` positive for every ``K``;
- *slope <= gain*: every difference quotient is at most the steady-state gain ``|b| / |a|``;
- *converges*: ``|x_K(u) - x*(u)|`` shrinks strictly at every step ``K -> K + 1`` for every
  ``u`` until it is within rounding of 0, where ``x*`` is the equilibrium map reached from 0
  (tanh: ``-(b u + c) / a``; ReLU: ``max(b u + c, 0) / |a|``).

Cases (eigenvalue ``1 + h a`` of the scalar Jacobian ``I + h A`` at the origin):

- ``unstable``: ``a = 1`` (eigenvalue 2) and ``a = -3`` (eigenvalue -2), the "non-autonomous
  ResNet" of the supplement's first figure;
- ``stable_fc``: ``a = -0.1`` and ``a = -0.5`` (eigenvalues 0.9, 0.5, critically damped: inside
  Algorithm 1's set ``a in (-1, 0)``);
- ``stable_conv``: ``a = -1.5`` and ``a = -1.9`` (eigenvalues -0.5, -0.9: outside Algorithm 1's
  set, inside Algorithm 2's ``a in [-2 + eta, -eta]`` for ``eta <= 0.1``);
- ``stopping``: the ``stable_fc`` values with the stopping rule.

The supplement does not print its values of ``a`` or its range of ``u``; these are ours (the
ReLU gain ``2^100 ~ 1.3e30`` of ``a = 1`` at ``K = 100`` matches the figure's ``10^30``). Writes
``results.json``, ``results.md`` and one PNG per figure to ``--workdir``, the results naming the
script's commit and the device; it takes seconds on a CPU, so a rerun simply recomputes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.sweep_report import USER_ERRORS, check_workdir, exit_with_error, script_version
from naisnet_jax.cell import fc_step
from naisnet_jax.unroll import unroll, unroll_adaptive, unroll_adaptive_bounded

CASES = {
    "unstable": (1.0, -3.0),
    "stable_fc": (-0.1, -0.5),
    "stable_conv": (-1.5, -1.9),
    "stopping": (-0.1, -0.5),
}
ACTIVATIONS = ("tanh", "relu")
STOP_TOL = 0.95
MAX_STEPS = 100
U_RANGE = (-3.0, 3.0)
PLOT_STEPS = (1, 2, 3, 5, 10, 20, 50, 100)
CLAIMS = ("monotone", "increasing_at_0", "slope_below_gain", "converges")


# ---------------------------------------------------------------------------------------------
# The maps.


def scalar_maps(a, u, *, activation, max_steps=MAX_STEPS, h=1.0, b=1.0, c=0.0, tol=None):
    """``x_K(u)`` for ``K = 1 .. max_steps``: ``(maps, depth)``, both ``(max_steps, len(u))``.

    Plain-Python meaning, for each ``u`` on its own::

        x, maps, depths, stopped, d = 0.0, [], [], False, 0
        for k in range(max_steps):
            if not stopped:
                x_new = x + h * act(a * x + b * u + c)
                d += 1
                stopped = tol is not None and abs(x_new - x) < tol
                x = x_new
            maps.append(x); depths.append(d)

    Without ``tol`` this is ``unroll`` (``lax.scan``) of the package's ``fc_step`` with ``A =
    [[a]]``; with ``tol`` it is ``unroll_adaptive_bounded`` (the masked scan, whose frozen
    trajectory holds every cap ``K`` at once; its last row equals ``unroll_adaptive``'s
    ``while_loop``, which ``stopping_rule_agrees`` checks).
    """
    u = jnp.asarray(u, jnp.result_type(float))
    xs, final_depth = _trajectory(a, u, b, c, activation=activation, max_steps=max_steps, h=h, tol=tol)
    depth = np.minimum(np.arange(1, max_steps + 1)[:, None], np.asarray(final_depth)[None])
    return np.asarray(xs[..., 0]), depth


@functools.partial(jax.jit, static_argnames=("activation", "max_steps", "h", "tol"))
def _trajectory(a, u, b, c, *, activation, max_steps, h, tol):
    """The states ``x_1 .. x_K`` ``(K, len(u), 1)`` and each pattern's depth (compiled once per
    activation, length and threshold; ``a``, ``u``, ``b``, ``c`` are traced)."""
    x0, step = _scalar_step(a, u, activation=activation, h=h, b=b, c=c)
    if tol is None:
        _, xs = unroll(step, x0, steps=max_steps, trajectory=True)
        return xs, jnp.full(u.shape, max_steps, jnp.int32)
    _, depth, xs = unroll_adaptive_bounded(step, x0, tol=tol, max_steps=max_steps, trajectory=True)
    return xs, depth


@functools.partial(jax.jit, static_argnames=("activation", "max_steps", "h", "tol"))
def _while_loop(a, u, b, c, *, activation, max_steps, h, tol):
    x0, step = _scalar_step(a, u, activation=activation, h=h, b=b, c=c)
    return unroll_adaptive(step, x0, tol=tol, max_steps=max_steps)


def _scalar_step(a, u, *, activation, h, b, c):
    """``x0 = 0`` of shape ``(len(u), 1)`` and ``x -> fc_step(x, b u + c, [[a]])``."""
    dtype = u.dtype
    drive = (b * u + c).astype(dtype)[:, None]
    A = jnp.reshape(jnp.asarray(a, dtype), (1, 1))
    step = functools.partial(fc_step, drive=drive, A=A, h=h, activation=activation)
    return jnp.zeros_like(drive), step


def stopping_rule_agrees(a, u, *, activation, max_steps, tol, h=1.0, b=1.0, c=0.0) -> bool:
    """Whether the masked scan's last row and depth equal the ``while_loop``'s exactly."""
    u = jnp.asarray(u, jnp.result_type(float))
    maps, depth = scalar_maps(a, u, activation=activation, max_steps=max_steps, tol=tol, h=h, b=b, c=c)
    x, d = _while_loop(a, u, b, c, activation=activation, max_steps=max_steps, h=h, tol=tol)
    return bool(np.array_equal(np.asarray(x[:, 0]), maps[-1]) and np.array_equal(d, depth[-1]))


def equilibrium_map(a, u, *, activation, b=1.0, c=0.0):
    """The state reached from 0 as ``K -> infinity`` for ``a < 0``: tanh ``-(b u + c) / a``
    (the zero of ``a x + b u + c``), ReLU ``max(b u + c, 0) / |a|`` (for ``b u + c <= 0`` the
    update is 0 from the start)."""
    z = b * np.asarray(u, np.float64) + c
    return -z / a if activation == "tanh" else np.maximum(z, 0.0) / abs(a)


# ---------------------------------------------------------------------------------------------
# The claims.


@dataclasses.dataclass
class Claims:
    """The supplement's claims on one case, measured on a grid (``None``: not applicable)."""

    monotone: bool
    increasing_at_0: bool | None
    slope_below_gain: bool
    converges: bool | None
    gain: float
    max_slope: float  # the largest difference quotient over all K (within pieces)
    min_slope: float
    slope_at_0_min: float | None
    error_k1: float | None  # sup_u |x_K - x*| at K = 1 and at the last K
    error_last: float | None
    jumps: int  # discontinuities at the last K (stopping rule only)


def check_claims(a, u, maps, depth, *, activation, b=1.0, stopping=False, rtol=1e-9) -> Claims:
    """Measures the claims on ``maps`` / ``depth`` from ``scalar_maps`` over the sorted grid
    ``u`` (which must contain 0 for the slope at the origin).

    With ``stopping``, slopes are taken only between neighbours of equal depth (the pieces
    between jumps) and convergence is not claimed (the rule stops short of ``x*`` by design).
    """
    u = np.asarray(u, np.float64)
    if np.any(np.diff(u) <= 0):
        raise ValueError("u must be strictly increasing")
    maps = np.asarray(maps, np.float64)
    gain = abs(b) / abs(a) if a != 0 else np.inf
    with np.errstate(over="ignore", invalid="ignore"):
        slopes = np.diff(maps, axis=1) / np.diff(u)[None]
    same_piece = np.diff(depth, axis=1) == 0 if stopping else np.ones(slopes.shape, bool)
    finite = np.isfinite(slopes)
    valid = same_piece & finite
    scale = max(1.0, float(np.nanmax(np.abs(np.where(finite, slopes, np.nan)))))
    monotone = bool(np.all(slopes[valid] >= -rtol * scale) and finite[same_piece].all())
    max_slope = float(np.max(np.where(valid, slopes, -np.inf)))
    min_slope = float(np.min(np.where(valid, slopes, np.inf)))
    if not finite[same_piece].all():
        max_slope = np.inf
    slope_below_gain = bool(max_slope <= gain * (1 + rtol) + rtol)

    increasing_at_0 = slope_at_0 = None
    if activation == "tanh":
        zero = int(np.argmin(np.abs(u)))
        if u[zero] != 0 or zero in (0, len(u) - 1):
            raise ValueError("the grid u must contain 0 inside it")
        central = (maps[:, zero + 1] - maps[:, zero - 1]) / (u[zero + 1] - u[zero - 1])
        if stopping:
            central = np.where(depth[:, zero + 1] == depth[:, zero - 1], central, np.nan)
        slope_at_0 = float(np.nanmin(central))
        increasing_at_0 = bool(np.nanmin(central) > 0)

    converges = error_k1 = error_last = None
    if a < 0 and not stopping:
        with np.errstate(over="ignore", invalid="ignore"):
            error = np.abs(maps - equilibrium_map(a, u, activation=activation, b=b)[None])
        error = np.where(np.isfinite(error), error, np.inf)
        # Strictly closer at every step, until within rounding of x*.
        reached = error[:-1] <= 1e-9 * (1.0 + np.abs(equilibrium_map(a, u, activation=activation, b=b)))[None]
        closer = error[1:] < error[:-1]
        converges = bool(np.all(closer | (reached & (error[1:] <= error[:-1] + 1e-12))))
        error_k1, error_last = float(error[0].max()), float(error[-1].max())
    elif a >= 0 and not stopping:
        converges = False  # no equilibrium map to converge to: x_K grows without bound
        error_k1 = error_last = None

    jumps = int(np.sum(np.diff(depth[-1]) != 0)) if stopping else 0
    return Claims(
        monotone=monotone,
        increasing_at_0=increasing_at_0,
        slope_below_gain=slope_below_gain,
        converges=converges,
        gain=gain,
        max_slope=max_slope,
        min_slope=min_slope,
        slope_at_0_min=slope_at_0,
        error_k1=error_k1,
        error_last=error_last,
        jumps=jumps,
    )


def analyse(*, grid_points=1201, max_steps=MAX_STEPS) -> list[dict]:
    """Every case x activation x ``a``: the maps and their claims. Rows for the table."""
    u = np.linspace(*U_RANGE, grid_points)
    rows = []
    for case, values in CASES.items():
        stopping = case == "stopping"
        tol = STOP_TOL if stopping else None
        for activation in ACTIVATIONS:
            for a in values:
                maps, depth = scalar_maps(a, u, activation=activation, max_steps=max_steps, tol=tol)
                claims = check_claims(a, u, maps, depth, activation=activation, stopping=stopping)
                row = {
                    "case": case,
                    "activation": activation,
                    "a": a,
                    "eigenvalue": 1 + a,
                    "tol": tol,
                    **dataclasses.asdict(claims),
                    "u": u,
                    "maps": maps,
                    "depth": depth,
                }
                if stopping:
                    row["while_loop_agrees"] = stopping_rule_agrees(
                        a, u, activation=activation, max_steps=max_steps, tol=tol
                    )
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Outputs.

EXPECTED = {  # what the supplement says, per case: claims that should hold (True) or break
    "stable_fc": "all hold",
    "stopping": "hold piecewise (between jumps)",
    "stable_conv": "tanh: monotone and converging, slope may pass the gain (oscillation); "
    "ReLU: the map is max(u, 0) for every a and K",
    "unstable": "broken: exploding slope / bifurcation (a > 0), non-monotone or uninformative (a < -2)",
}


def _fmt(value, spec=".3g"):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    return format(value, spec)


def write_results(rows: list[dict], workdir: str, *, seconds: float, script: str, device: str) -> str:
    """``results.json`` and ``results.md`` in ``workdir``: the claims per case, with the script's
    commit (:func:`experiments.sweep_report.script_version`) and the device they ran on."""
    keep = [k for k in rows[0] if k not in ("u", "maps", "depth")]
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(
            {
                "script": script,
                "device": device,
                "seconds": seconds,
                "max_steps": int(rows[0]["maps"].shape[0]),
                "grid_points": int(len(rows[0]["u"])),
                "u_range": U_RANGE,
                "rows": [{k: r[k] for k in keep} for r in rows],
            },
            f,
            indent=2,
        )
    lines = [
        "| case | act | a | 1 + a | monotone | slope > 0 at 0 | max slope | gain 1/|a| | "
        "slope <= gain | converges to x* | sup error K=1 -> K=max | jumps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = "-" if r["error_k1"] is None else f"{r['error_k1']:.3g} -> {r['error_last']:.3g}"
        lines.append(
            f"| {r['case']} | {r['activation']} | {r['a']:g} | {r['eigenvalue']:g} | "
            f"{_fmt(r['monotone'])} | {_fmt(r['increasing_at_0'])} | {_fmt(r['max_slope'])} | "
            f"{_fmt(r['gain'])} | {_fmt(r['slope_below_gain'])} | {_fmt(r['converges'])} | "
            f"{err} | {r['jumps'] if r['case'] == 'stopping' else '-'} |"
        )
    table = "\n".join(lines)
    expected = "\n".join(f"- `{case}`: {text}" for case, text in EXPECTED.items())
    text = f"""# Supplement, analysis of 1-D activations

Scalar block x(k+1) = x(k) + tanh/relu(a x(k) + u), x(0) = 0, h = 1, u on a grid of
{len(rows[0]["u"])} points in {list(U_RANGE)}, K = 1 .. {rows[0]["maps"].shape[0]} (float64,
{seconds:.1f} s on {device}, script {script}). Stopping rule: |x_k - x_(k-1)| < {STOP_TOL}. Slopes are difference
quotients on the grid (within pieces of equal depth for the stopping rule).

{table}

What the supplement expects:
{expected}

**What this shows.** Inside Algorithm 1's set (a in (-1, 0)) every claim holds on the grid, for
both activations and every K: the maps are non-decreasing (tanh strictly at the origin), no
slope exceeds the steady-state gain |b|/|a|, and the distance to the equilibrium map shrinks at
every step. With the stopping rule the maps jump where the depth changes but keep these properties
between jumps. Outside it the claims break exactly as the supplement describes: a = 1 has
slopes up to 2^K (ReLU) and no equilibrium, a = -3 has a non-monotone tanh map and the
uninformative ReLU map max(u, 0); for a in (-2, -1) (Algorithm 2's wider set) the tanh maps
overshoot the gain while converging, and the ReLU map is max(u, 0) for every K.
"""
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    return table


def plot(rows: list[dict], workdir: str, *, dpi: int = 110) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "unstable": "Unstable scalar block (non-autonomous ResNet)",
        "stable_fc": "Stable scalar NAIS-Net (Algorithm 1's set)",
        "stable_conv": "Stable, outside Algorithm 1's set (Algorithm 2's)",
        "stopping": f"Stable, stopping rule |dx| < {STOP_TOL}",
    }
    paths = []
    for case, values in CASES.items():
        fig, axes = plt.subplots(len(values), 2, figsize=(10, 4 * len(values)), squeeze=False)
        for i, a in enumerate(values):
            for j, activation in enumerate(ACTIVATIONS):
                r = next(r for r in rows if (r["case"], r["activation"], r["a"]) == (case, activation, a))
                ax, u, maps = axes[i, j], r["u"], r["maps"]
                steps = [k for k in PLOT_STEPS if k <= len(maps)]
                colours = plt.cm.viridis(np.linspace(0, 1, len(steps)))
                for k, colour in zip(steps, colours):
                    y = maps[k - 1]
                    if case == "stopping":  # break the line at the jumps
                        y = np.where(np.r_[False, np.diff(r["depth"][k - 1]) != 0], np.nan, y)
                    ax.plot(u, y, color=colour, lw=1.2, label=f"K={k}")
                if a < 0:
                    ax.plot(u, equilibrium_map(a, u, activation=activation), "k--", lw=1, label="equilibrium x*")
                if np.nanmax(np.abs(maps)) > 1e4:
                    ax.set_yscale("symlog", linthresh=1.0)
                ax.set(title=f"{activation}, a = {a:g} (1 + a = {1 + a:g})", xlabel="u", ylabel="x_K(u)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7, ncol=2)
        fig.suptitle(titles[case])
        fig.tight_layout()
        path = os.path.join(workdir, f"one_d_{case}.png")
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        paths.append(path)
    return paths


def run(workdir: str, *, smoke: bool = False) -> list[dict]:
    import time

    from naisnet_jax.sweep import device_description

    jax.config.update("jax_enable_x64", True)  # scalar maps in float64
    script = script_version()  # before anything is written: the tree as the run found it
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    rows = analyse(grid_points=121 if smoke else 1201, max_steps=20 if smoke else MAX_STEPS)
    seconds = time.time() - t0
    table = write_results(rows, workdir, seconds=seconds, script=script, device=device_description())
    plot(rows, workdir, dpi=50 if smoke else 110)
    print(table)
    return rows


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="The supplement's 1-D analysis.")
    parser.add_argument("--workdir", default="runs/one_d")
    parser.add_argument("--smoke", action="store_true", help="121 grid points, K up to 20")
    args = parser.parse_args(argv)
    check_workdir(args.workdir)
    try:
        run(args.workdir, smoke=args.smoke)
    except USER_ERRORS as e:  # a folder under --workdir that cannot be written, say
        exit_with_error(e)
    print(f"results: {args.workdir}/results.md, {args.workdir}/one_d_*.png")


if __name__ == "__main__":
    main()
