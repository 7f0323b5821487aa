"""A tied NAIS block's K steps with a hand-written VJP (one weight-gradient op for all K).

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

from naisnet_jax.cell import ACTIVATIONS, check_activation, check_step_size, conv_same
from naisnet_jax.checks import check_choice, check_int
from naisnet_jax.unroll import check_scan_unroll

Array = jax.Array
RESIDUALS = ("store", "recompute")

#: Run the weight gradients of the hand-written VJPs (and of the fast paths' drive
#: convolutions, :func:`side_stream_conv`) on a second GPU stream. Off the input-gradient
#: chain, they can then overlap its latency-bound kernels: NAIS-Net10's step 39.5 -> 38.5 ms
#: on an H200, then 41.2 -> 40.9 ms on an H100 with the drives' (``BENCHMARKS.md``). Read
#: when a model is traced.
SIDE_STREAM = True


def _gpu_backend() -> bool:
    return jax.default_backend() == "gpu"


def _side_stream_default() -> bool:
    """Whether weight gradients go to the second stream when not told: on a GPU backend with
    :data:`SIDE_STREAM` set."""
    return SIDE_STREAM and _gpu_backend()


def on_side_stream(f: Callable, enabled: bool | None = None) -> Callable:
    """``f`` as a computation XLA runs on a second CUDA stream (``compute_on("gpu_stream:1")``),
    started where its inputs are ready and awaited where its outputs are used; the values
    are ``f``'s. ``enabled=None``: on a GPU backend with :data:`SIDE_STREAM` set; elsewhere,
    or with a JAX without the function form of ``compute_on``, ``f`` itself."""
    if enabled is None:
        enabled = _side_stream_default()
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
    (:func:`on_side_stream`) on a GPU with :data:`SIDE_STREAM` set; elsewhere the plain
    convolution. A drop-in for ``flax.linen.Conv(conv_general_dilated=...)``: the fast paths
    (``block_vjp`` other than ``"autodiff"``) give it to their blocks' drive convolutions."""

    def conv(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, *args, **kwargs)

    side = _side_stream_default()
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


def _sum_to_shape(a: Array, shape: tuple[int, ...]) -> Array:
    """Sum the broadcast axes of ``a`` away so that it has ``shape``."""
    lead = a.ndim - len(shape)
    a = jnp.sum(a, axis=tuple(range(lead))) if lead else a
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return jnp.sum(a, axis=axes, keepdims=True) if axes else a


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
    return g0, _sum_to_shape(d_drive, drive.shape).astype(drive.dtype), dW


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


def check_tied(name, x0, drive, W, steps, h, activation, scan_unroll):
    """The common arguments of a tied block's unroll ``name``, checked: returns ``(x0, drive,
    W, h)`` with the arrays in one dtype and ``h`` a Python float (it must be static)."""
    check_int("steps", steps)
    check_step_size(h)
    check_activation(activation)
    check_scan_unroll(scan_unroll)
    if isinstance(h, jax.core.Tracer):
        raise ValueError(f"{name} needs a static step size h (a Python float), not a traced value.")
    dtype = jnp.result_type(x0, drive, W)
    return x0.astype(dtype), drive.astype(dtype), W.astype(dtype), float(h)
