"""The Triton engine of a dense block, and its entry point: a tied dense NAIS block's K steps in
one GPU kernel each way (Pallas, Triton; any CUDA GPU).

XLA runs a dense block ``x_{k+1} = x_k + h act(x_k A^T + drive)`` through ``lax.scan``:
every step is a small matrix product and an elementwise fusion forward, and about twice
that backward, each a few microseconds of launch latency at the widths of the paper's FC
nets (a 128 x 128 state matrix, a batch of 128), so a deep block is bound by launches. Its
compile time grows with ``K`` too: the products inside the loop bodies are fusions the
GPU autotuner compiles candidates for, which a one-step block (no loop) does not have.

Here one kernel runs the K forward steps and one the K backward steps. A dense block
treats every pattern on its own, so program ``i`` takes rows ``i * R .. (i + 1) * R`` of the
batch and keeps their state in registers from the first step to the last: no barrier, no
round trip to memory between steps (only the saved states and pre-activations are written).
The state matrix is read once per program. The weight gradient is the stacked product of
:mod:`naisnet_jax.kernels.stacked`, ``dA = sum_k s_k^T x_k``, summed by a third kernel over groups of
steps on the second stream (:func:`naisnet_jax.kernels.stacked.on_side_stream`); the backward kernel
sums the drive's gradient ``sum_k s_k`` as it goes. K changes only the kernels' loop bounds
and grids, and the autotuner has nothing to tune in them, so the compile time does not grow
with K.

Shapes. A width that is not a power of two (at least 16) is zero padded to one, and the batch
to a multiple of ``R``: a zero column of the state, of the drive and of ``A`` stays zero at
every step (``act(0) = 0`` for ReLU and tanh), and a zero row computes zeros, so the padding
changes no value and is cut off again. Widths up to :data:`MAX_WIDTH` (the state matrix must
fit in a program's shared memory).

:func:`unroll_tied_dense` is the entry point; it runs the kernels on a CUDA GPU (float32) and
otherwise falls back to :func:`naisnet_jax.kernels.stacked.unroll_tied`, whose values it
reproduces (``tests/test_triton_dense.py`` runs the kernels in Pallas' interpreter on the CPU,
in float64, against the plain loop).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from naisnet_jax.cell import check_dense_state, check_drive
from naisnet_jax.kernels import common
from naisnet_jax.kernels.common import act, check_tied, index, kernel_mode, pallas_triton, scaled_slope, sum_to_shape
from naisnet_jax.kernels.policy import DEFAULT, KernelPolicy, check_policy
from naisnet_jax.kernels.stacked import dense_op, on_side_stream, unroll_tied
from naisnet_jax.kernels.tuning import DENSE_ROWS, DENSE_WARPS, DENSE_WGRAD_PROGRAMS, DENSE_WGRAD_WARPS

Array = jax.Array

#: Widest state (after padding to a power of two) the kernels take: a 128 x 128 float32 state
#: matrix is 64 KiB of a program's shared memory; 256 x 256 would not fit.
MAX_WIDTH = 128


class Config(NamedTuple):
    """How the kernels run: in Pallas' interpreter or on the GPU, and their tiling."""

    interpret: bool = False
    block_rows: int = DENSE_ROWS
    num_warps: int = DENSE_WARPS


GPU = Config()  # the GPU kernels at the default tiling


def _padded_width(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _forward_kernel(steps, h, activation, save, rows, x0_ref, d_ref, at_ref, x_ref, *saved):
    """Program ``i`` runs its ``rows`` patterns' K steps, the state held in registers.
    ``save``: write every state ``x_k`` and pre-activation ``z_k`` (k < K) for the backward."""
    from jax.experimental import pallas as pl

    r = pl.ds(index(pl.program_id(0)) * rows, rows)
    at, d = at_ref[...], d_ref[r, :]

    def step(k, x):
        z = jnp.dot(x, at, preferred_element_type=x.dtype) + d
        if save:
            k = index(k)
            saved[0][k, r, :] = x
            saved[1][k, r, :] = z
        return x + h * act(activation, z)

    x_ref[r, :] = lax.fori_loop(0, steps, step, x0_ref[r, :])


def _backward_kernel(steps, h, activation, rows, g_ref, zs_ref, a_ref, g0_ref, ss_ref, dd_ref):
    """Program ``i`` carries its patterns' gradient from ``x_K`` back to ``x_0``: for k = K-1 .. 0,
    ``s_k = h act'(z_k) g_{k+1}`` (written out), ``g_k = g_{k+1} + s_k A``; and ``sum_k s_k``."""
    from jax.experimental import pallas as pl

    r = pl.ds(index(pl.program_id(0)) * rows, rows)
    a = a_ref[...]

    def step(i, carry):
        g, dd = carry
        k = steps - 1 - index(i)
        s = scaled_slope(activation, h, zs_ref[k, r, :], g)
        ss_ref[k, r, :] = s
        return g + jnp.dot(s, a, preferred_element_type=s.dtype), dd + s

    g = g_ref[r, :]
    g, dd = lax.fori_loop(0, steps, step, (g, jnp.zeros_like(g)))
    g0_ref[r, :] = g
    dd_ref[r, :] = dd


def _pad(a: Array, rows: int, cols: int) -> Array:
    return jnp.pad(a, [(0, rows - a.shape[-2]), (0, cols - a.shape[-1])])


def _padded_shape(x0: Array, config: Config) -> tuple[int, int]:
    B, N = x0.shape
    R = config.block_rows
    return -(-B // R) * R, _padded_width(N)


def fused_forward(x0, drive, A, *, steps, h, activation, save=True, config=GPU):
    """The block on padded arrays: ``x_K``, and with ``save`` every ``x_k`` and ``z_k`` for
    ``k < K`` (each ``(K, B', N')``, ``B'`` and ``N'`` the padded batch and width)."""
    Bp, Np = _padded_shape(x0, config)
    x0p = _pad(x0, Bp, Np)
    dp = _pad(jnp.broadcast_to(drive, x0.shape).astype(x0.dtype), Bp, Np)
    atp = _pad(A.T.astype(x0.dtype), Np, Np)
    body = functools.partial(_forward_kernel, steps, h, activation, save, config.block_rows)
    state = jax.ShapeDtypeStruct((Bp, Np), x0.dtype)
    saved = jax.ShapeDtypeStruct((steps, Bp, Np), x0.dtype)
    out_shape = (state, saved, saved) if save else (state,)
    return pallas_triton(body, out_shape, Bp // config.block_rows, config)(x0p, dp, atp)


def fused_backward(g, zs, A, *, steps, h, activation, config=GPU):
    """``(g_0, s_0 .. s_{K-1}, sum_k s_k)`` on padded arrays, from the gradient ``g`` at ``x_K``."""
    Bp, Np = zs.shape[1:]
    body = functools.partial(_backward_kernel, steps, h, activation, config.block_rows)
    out_shape = (
        jax.ShapeDtypeStruct((Bp, Np), g.dtype),
        jax.ShapeDtypeStruct((steps, Bp, Np), g.dtype),
        jax.ShapeDtypeStruct((Bp, Np), g.dtype),
    )
    return pallas_triton(body, out_shape, Bp // config.block_rows, config)(
        _pad(g, Bp, Np), zs, _pad(A.astype(g.dtype), Np, Np)
    )


def _weight_grad_kernel(rows, sub, xs_ref, ss_ref, out_ref):
    """Program ``p`` sums ``s^T x`` over its ``rows`` stacked rows, ``sub`` at a time."""
    from jax.experimental import pallas as pl

    p = index(pl.program_id(0))

    def body(j, acc):
        r = pl.ds(p * rows + index(j) * sub, sub)
        return acc + jnp.dot(ss_ref[r, :].T, xs_ref[r, :], preferred_element_type=acc.dtype)

    n = out_ref.shape[-1]
    out_ref[p, :, :] = lax.fori_loop(0, rows // sub, body, jnp.zeros((n, n), out_ref.dtype))


def _steps_per_program(steps: int) -> int:
    """The most steps, a divisor of ``steps``, that leaves at least :data:`DENSE_WGRAD_PROGRAMS` programs
    (or one step a program)."""
    most = max(1, steps // DENSE_WGRAD_PROGRAMS)
    return max(d for d in range(1, most + 1) if steps % d == 0)


def fused_weight_grad(xs: Array, ss: Array, config: Config = GPU) -> Array:
    """``sum_k s_k^T x_k`` (padded, ``(N', N')``) from the saved states and the backward kernel's
    ``s_k``: partial sums over groups of steps in one kernel, then their sum.

    A kernel rather than one ``dot_general`` over the K * B stacked rows: XLA's autotuner would
    tune that product for each K (its reduction grows with K: split-K candidates), which made
    the dense step's compile time grow with K (``BENCHMARKS.md``); a Pallas kernel is compiled
    as written, with nothing to tune, and K changes only its loop bounds and grid."""
    steps, Bp, Np = ss.shape
    group = _steps_per_program(steps)
    sub = min(64, Bp & -Bp)  # the largest power of two dividing the padded batch (>= 16)
    body = functools.partial(_weight_grad_kernel, group * Bp, sub)
    out_shape = jax.ShapeDtypeStruct((steps // group, Np, Np), ss.dtype)
    parts = pallas_triton(body, out_shape, steps // group, config, num_warps=DENSE_WGRAD_WARPS)(
        xs.reshape(-1, Np), ss.reshape(-1, Np)
    )
    return jnp.sum(parts, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(x0, drive, A, steps, h, activation, config):
    (x,) = fused_forward(x0, drive, A, steps=steps, h=h, activation=activation, save=False, config=config)
    return x[: x0.shape[0], : x0.shape[1]]


def _fused_fwd(x0, drive, A, steps, h, activation, config):
    x, xs, zs = fused_forward(x0, drive, A, steps=steps, h=h, activation=activation, config=config)
    return x[: x0.shape[0], : x0.shape[1]], (xs, zs, drive, A)


def _fused_bwd(steps, h, activation, config, res, g):
    xs, zs, drive, A = res
    B, N = g.shape
    g0, ss, dd = fused_backward(g, zs, A, steps=steps, h=h, activation=activation, config=config)
    weight_grad = functools.partial(fused_weight_grad, config=config)
    dA = on_side_stream(weight_grad, False if config.interpret else None)(xs, ss)
    d_drive = sum_to_shape(dd[:B, :N], drive.shape).astype(drive.dtype)
    return g0[:B, :N], d_drive, dA[:N, :N].astype(A.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def kernel_supported(x0: Array, A: Array) -> str | None:
    """``None`` if the fused kernels take this block, else why not (in words)."""
    if x0.ndim != 2 or A.ndim != 2:
        return f"expected a state (batch, width) and a (width, width) matrix, got shapes {x0.shape} and {A.shape}"
    N = x0.shape[-1]
    if A.shape != (N, N):
        return f"the state matrix {A.shape} must map the state's {N} values to {N}"
    if _padded_width(N) > MAX_WIDTH:
        return f"the width must be at most {MAX_WIDTH}, got {N}"
    return None


def unroll_tied_dense(
    x0: Array,
    drive: Array,
    A: Array,
    *,
    steps: int,
    h: float = 1.0,
    activation: str = "tanh",
    scan_unroll: int | bool = 1,
    policy: KernelPolicy = DEFAULT,
) -> Array:
    """``x_K`` of a tied dense NAIS block; the fused Pallas kernels where they run.

    Plain-Python meaning (values and gradients equal those of this loop)::

        x = x0
        for k in range(steps):
            x = x + h * act(x @ A.T + drive)
        return x

    ``drive`` broadcasts to ``x0`` (its gradient has its own shape). ``policy``
    (:class:`naisnet_jax.kernels.KernelPolicy`): by default the GPU kernels when the block fits
    them (:func:`kernel_supported`) on a CUDA GPU, else the stacked pure-JAX VJP
    (:func:`naisnet_jax.kernels.stacked.unroll_tied`, with ``scan_unroll``); its ``interpret``
    (``True``: the kernels in Pallas' interpreter), ``strict``, ``block_rows`` and ``num_warps``
    force or tune them. The products run at the
    default precision (TF32 on an NVIDIA GPU, as XLA's; ``jax_default_matmul_precision`` set to
    ``"highest"`` makes them float32).
    """
    x0, drive, A, h = check_tied("unroll_tied_dense", x0, drive, A, steps, h, activation, scan_unroll)
    check_dense_state(x0.shape, A.shape)
    check_drive(x0.shape, drive.shape)
    policy = check_policy(policy)
    why = kernel_supported(x0, A)
    runs_here = common.gpu_kernels_available(x0)
    mode = kernel_mode("unroll_tied_dense", policy.interpret, why, runs_here, strict=policy.strict)
    if mode is None:
        return unroll_tied(dense_op, x0, drive, A, steps=steps, h=h, activation=activation, scan_unroll=scan_unroll)
    config = Config(mode, policy.block_rows or DENSE_ROWS, policy.num_warps or DENSE_WARPS)
    return _fused(x0, drive, A, steps, h, activation, config)
