"""The stacked VJP: a tied NAIS block's K steps with a hand-written VJP (one weight-gradient op
for all K), in plain JAX on any backend; the fallback of the fused engines.

For a tied block ``x_{k+1} = x_k + h act(op(x_k, W) + drive)``, with ``op`` linear
in each argument (``x @ A.T`` or ``conv(x, C)``), reverse mode by ``lax.scan``
computes the weight gradient ``sum_k op_W^T(x_k, s_k)`` as K small operations, one
per step. Because ``op`` treats patterns independently, the same sum is one
operation over the K states stacked on the batch axis::

    dW = op_W^T(stack(x_0 .. x_{K-1}), stack(s_0 .. s_{K-1}))   # batch K * B

where ``s_k = h act'(z_k) g_{k+1}`` is the gradient at the pre-activation and
``g_k`` the gradient at ``x_k``. The reverse loop then carries only the input
gradients ``g_k = g_{k+1} + op_x^T(s_k, W)``; on a GPU the weight gradient runs on a
second stream, beside that loop (:func:`on_side_stream`). Residuals are either stored in the
forward pass (``"store"``: the states and the activation's residual) or
recomputed from ``(x_0, drive, W)`` in the backward pass (``"recompute"``: a
block's memory is then only its input).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from naisnet_jax.cell import ACTIVATIONS, conv_same
from naisnet_jax.checks import check_choice
from naisnet_jax.kernels import common
from naisnet_jax.kernels.common import check_tied, sum_to_shape

Array = jax.Array
RESIDUALS = ("store", "recompute")


def on_side_stream(f: Callable, enabled: bool | None = None) -> Callable:
    """``f`` as a computation XLA runs on a second CUDA stream (``compute_on("gpu_stream:1")``),
    started where its inputs are ready and awaited where its outputs are used; the values
    are ``f``'s. ``enabled=None``: on a GPU backend; elsewhere, or with a JAX without the
    function form of ``compute_on``, ``f`` itself. Off the input-gradient chain, a weight gradient
    there overlaps that chain's latency-bound kernels."""
    if enabled is None:
        enabled = common.gpu_backend()
    if not enabled:
        return f
    try:
        from jax.experimental import compute_on as co
    except ImportError:  # pragma: no cover - older JAX
        return f
    # JAX 0.11: compute_on(f, *, compute_type, out_memory_spaces); 0.10: compute_on2 (same).
    wrap = getattr(co, "compute_on2", None) or co.compute_on
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is None:  # pragma: no cover - older JAX: compute_on is a context manager only
        return f
    try:
        return wrap(f, compute_type="gpu_stream:1", out_memory_spaces=space.Device)
    except TypeError:  # pragma: no cover - a context-manager-only compute_on
        return f


def side_stream_conv(lhs: Array, rhs: Array, *args, **kwargs) -> Array:
    """``lax.conv_general_dilated(lhs, rhs, *args, **kwargs)`` with a kernel gradient that feeds
    only the optimiser, so it can run off the input-gradient chain: on the second stream
    (:func:`on_side_stream`) on a GPU; elsewhere the plain
    convolution. A drop-in for ``flax.linen.Conv(conv_general_dilated=...)``: the fast paths
    (``block_vjp`` other than ``"autodiff"``) give it to their blocks' drive convolutions."""

    def conv(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, *args, **kwargs)

    side = common.gpu_backend()
    if not side:
        return conv(lhs, rhs)

    @jax.custom_vjp
    def f(lhs, rhs):
        return conv(lhs, rhs)

    def f_fwd(lhs, rhs):
        return conv(lhs, rhs), (lhs, rhs)

    def f_bwd(res, g):
        lhs, rhs = res
        (d_lhs,) = jax.linear_transpose(lambda a: conv(a, rhs), lhs)(g)
        return d_lhs, on_side_stream(_weight_grad(conv), side)(lhs, g, rhs)

    f.defvjp(f_fwd, f_bwd)
    return f(lhs, rhs)


def dense_op(x: Array, A: Array) -> Array:
    """``x @ A.T``: the dense block's state operator."""
    return jnp.matmul(x, A.T)


def conv_op(x: Array, kernel: Array) -> Array:
    """``conv(x, kernel)``: the conv block's state operator (stride 1, SAME)."""
    return conv_same(x, kernel)


def _residual(activation: str, z: Array) -> Array:
    """What the backward pass needs of ``act'(z)``: the sign mask (ReLU) or ``tanh(z)``."""
    return z > 0 if activation == "relu" else jnp.tanh(z)


def _slope_times(activation: str, r: Array, g: Array) -> Array:
    """``act'(z) * g`` from the residual ``r`` (ReLU's slope at 0 is 0, as ``jax.nn.relu``)."""
    if activation == "relu":
        return jnp.where(r, g, jnp.zeros_like(g))
    return g * (1 - r) * (1 + r)  # 1 - tanh^2, in the form jax's own tanh rule uses


def _forward(op, x0, drive, W, steps, h, activation, scan_unroll, save):
    act = ACTIVATIONS[activation]

    def body(x, _):
        z = op(x, W) + drive
        x_next = x + h * act(z)
        return x_next, ((x, _residual(activation, z)) if save else None)

    return lax.scan(body, x0, None, length=steps, unroll=scan_unroll)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5, 6, 7, 8))
def _tied(op, x0, drive, W, steps, h, activation, residuals, scan_unroll):
    return _forward(op, x0, drive, W, steps, h, activation, scan_unroll, save=False)[0]


def _tied_fwd(op, x0, drive, W, steps, h, activation, residuals, scan_unroll):
    if residuals == "recompute":
        x = _forward(op, x0, drive, W, steps, h, activation, scan_unroll, save=False)[0]
        return x, (x0, drive, W, None)
    x, saved = _forward(op, x0, drive, W, steps, h, activation, scan_unroll, save=True)
    return x, (x0, drive, W, saved)


def _weight_grad(op):
    """``(stacked x, stacked s, W) -> op_W^T(x, s)``: the weight gradient over the stacked steps
    (``W`` gives only the shape and dtype)."""

    def grad(x, s, W):
        return jax.linear_transpose(lambda w: op(x, w), W)(s)[0]

    return grad


def _tied_bwd(op, steps, h, activation, residuals, scan_unroll, res, g):
    x0, drive, W, saved = res
    if saved is None:
        # Tie the recomputation to the incoming gradient (as jax.checkpoint does): without
        # this, XLA is free to run it, or merge it with the identical forward scan, right
        # after the forward pass, and every block's states are kept after all.
        (x0, drive, W), g = lax.optimization_barrier(((x0, drive, W), g))
        saved = _forward(op, x0, drive, W, steps, h, activation, scan_unroll, save=True)[1]
    xs, rs = saved
    op_x_t = jax.linear_transpose(lambda x: op(x, W), x0)

    def body(carry, r):
        """Plain meaning: for k = K-1 .. 0: s_k = h act'(z_k) g; g += op_x^T(s_k)."""
        g, d_drive = carry
        s = h * _slope_times(activation, r, g)
        (gx,) = op_x_t(s)
        return (g + gx, d_drive + s), s

    (g0, d_drive), ss = lax.scan(body, (g, jnp.zeros_like(g)), rs, reverse=True, unroll=scan_unroll)
    stacked_x = xs.reshape((-1,) + xs.shape[2:])  # (K * batch, ...)
    stacked_s = ss.reshape((-1,) + ss.shape[2:])
    dW = on_side_stream(_weight_grad(op))(stacked_x, stacked_s, W)
    return g0, sum_to_shape(d_drive, drive.shape).astype(drive.dtype), dW


_tied.defvjp(_tied_fwd, _tied_bwd)


def unroll_tied(
    op: Callable[[Array, Array], Array],
    x0: Array,
    drive: Array,
    W: Array,
    *,
    steps: int,
    h: float = 1.0,
    activation: str = "tanh",
    residuals: str = "store",
    scan_unroll: int | bool = 1,
) -> Array:
    """``x_K`` of a tied NAIS block, differentiated with one stacked weight-gradient op.

    Plain-Python meaning (values and gradients equal those of this loop)::

        x = x0
        for k in range(steps):
            x = x + h * act(op(x, W) + drive)
        return x

    ``op(x, W)`` must be linear in ``x`` and in ``W`` and act on every pattern
    (leading axis) on its own: :func:`dense_op` or :func:`conv_op`. ``h`` and
    ``activation`` are static. ``residuals="store"`` keeps the K states and the
    activation residuals from the forward pass; ``"recompute"`` keeps
    ``(x0, drive, W)`` only and reruns the forward scan in the backward pass.
    ``scan_unroll`` as in :func:`naisnet_jax.unroll.unroll`.
    """
    check_choice("residuals", residuals, RESIDUALS)
    x0, drive, W, h = check_tied("unroll_tied", x0, drive, W, steps, h, activation, scan_unroll)
    return _tied(op, x0, drive, W, steps, h, activation, residuals, scan_unroll)
