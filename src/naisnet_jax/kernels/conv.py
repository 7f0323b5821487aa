"""A tied conv block's fused path: its forward, its hand-written VJP and the entry point
:func:`unroll_tied_conv`, running the engine that :func:`naisnet_jax.kernels.policy.conv_plan`
picks (Triton, split-bfloat16 wgmma or TF32 wgmma) or the stacked VJP.

Every engine keeps a pattern's state in the padded-rows buffers of
:class:`naisnet_jax.kernels.common.Layout`, so the forward kernel's saved states and
pre-activations feed any backward kernel, and the Triton weight-gradient kernel
(:func:`naisnet_jax.kernels.triton_conv.weight_grad`) takes either engine's outputs. The
64-channel TF32 plan instead writes the states and ``s_k`` as images and takes the kernel's
gradient from XLA's convolution gradient over the stacked steps (cuDNN is fast at that width).

``tests/test_conv_kernels.py`` runs the Triton kernels in Pallas' interpreter on the CPU, in
float64, against the plain loop; the wgmma kernels are lowered for CUDA on the CPU there and
checked against the stacked VJP on a GPU (``benchmarks/hopper_checks.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from naisnet_jax.cell import check_conv_state, check_drive
from naisnet_jax.kernels import triton_conv
from naisnet_jax.kernels.common import check_tied, sum_to_shape, taps_of
from naisnet_jax.kernels.policy import DEFAULT, ConvPlan, KernelPolicy, check_policy, conv_plan
from naisnet_jax.kernels.stacked import conv_op, unroll_tied

Array = jax.Array
GPU = ConvPlan()  # the Triton kernels at the default tiling


def fused_forward(x0, drive, kernel, *, steps, h, activation, save=True, plan=GPU):
    """The block's states as buffers (``layout.interior`` gives the images).

    ``save=True`` returns ``(layout, xs, zs)``: every state ``x_0 .. x_K``, shape
    ``(K + 1, N, rows, C)`` (with the plan's ``xla_wgrad`` as images, the pair ``x_0 .. x_{K-1}``
    ``(K, N, H, W, C)`` and ``x_K`` ``(N, H, W, C)``: the TF32 wgmma kernels write them so), and
    every pre-activation ``z_0 .. z_{K-1}``, shape ``(K, N, rows, C)``.
    ``save=False`` returns ``(layout, x_K)`` only.
    """
    N, H, W, C = x0.shape
    kh, kw = kernel.shape[:2]
    layout = plan.layout(H, W, kh, kw)
    x0b = layout.to_buffer(x0)
    db = layout.to_buffer(jnp.broadcast_to(drive, x0.shape).astype(x0.dtype))
    taps = taps_of(kernel.astype(x0.dtype))
    if plan.warpgroups and not plan.interpret:
        out = plan.wgmma().fused_forward(
            layout,
            x0b,
            db,
            taps,
            steps=steps,
            h=h,
            activation=activation,
            save=save,
            warpgroups=plan.warpgroups,
            **(dict(interior=plan.xla_wgrad) if plan.tf32 else {}),
        )
        if save and plan.xla_wgrad:  # the split engine writes buffers only
            out = ((out[0], out[1]), out[2]) if plan.tf32 else (_states_apart(layout, out[0], steps), out[1])
        return (layout, *out) if save else (layout, out[0][0])
    out = triton_conv.forward(
        layout, layout.offsets(kh, kw), x0b, db, taps, steps=steps, h=h, activation=activation, save=save, config=plan
    )
    if save and plan.xla_wgrad:
        out = (_states_apart(layout, out[0], steps), out[1])
    return (layout, *out) if save else (layout, out[0][steps % 2])


def _states_apart(layout, xs, steps):
    """Buffers ``x_0 .. x_K`` as :func:`fused_forward` gives them with ``xla_wgrad``: images, the
    first ``K`` apart from ``x_K``."""
    images = layout.interior(xs)
    return images[:steps], images[steps]


def fused_backward(layout, g, zs, kernel, *, steps, h, activation, plan=GPU):
    """``(g_0, s_0 .. s_{K-1})`` as buffers from the gradient ``g`` at ``x_K`` (with the plan's
    ``xla_wgrad`` the ``s_k`` as images, as :func:`fused_forward`'s states)."""
    kh, kw = kernel.shape[:2]
    taps = taps_of(kernel.astype(g.dtype))
    if plan.warpgroups and not plan.interpret:
        g0, ss = plan.wgmma().fused_backward(
            layout,
            layout.to_buffer(g),
            zs,
            taps,
            steps=steps,
            h=h,
            activation=activation,
            warpgroups=plan.warpgroups,
            **(dict(interior=plan.xla_wgrad) if plan.tf32 else {}),
        )
        return (g0, layout.interior(ss)) if plan.xla_wgrad and not plan.tf32 else (g0, ss)
    g0, ss = triton_conv.backward(
        layout, layout.offsets(kh, kw), g, zs, taps, steps=steps, h=h, activation=activation, config=plan
    )
    return (g0, layout.interior(ss)) if plan.xla_wgrad else (g0, ss)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(x0, drive, kernel, steps, h, activation, plan):
    layout, x = fused_forward(x0, drive, kernel, steps=steps, h=h, activation=activation, save=False, plan=plan)
    return layout.interior(x)


def _fused_fwd(x0, drive, kernel, steps, h, activation, plan):
    layout, xs, zs = fused_forward(x0, drive, kernel, steps=steps, h=h, activation=activation, plan=plan)
    if plan.xla_wgrad:  # the states as images, x_K apart
        xs, x = xs
    else:
        x = layout.interior(xs[steps])
    return x, (xs, zs, drive, kernel)


def _fused_bwd(steps, h, activation, plan, res, g):
    """``dx0`` from the backward kernel; ``dW`` and ``d drive`` from the weight-gradient kernel,
    which sums ``s_k`` as it reads them (the 64-channel plan: XLA's convolution gradient and a sum)."""
    xs, zs, drive, kernel = res
    N, H, W, C = g.shape
    layout = plan.layout(H, W, kernel.shape[0], kernel.shape[1])
    g0, ss = fused_backward(layout, g, zs, kernel, steps=steps, h=h, activation=activation, plan=plan)
    if plan.xla_wgrad:  # dW = sum_k x_k * s_k as one convolution gradient over the stacked steps
        stacked = xs.reshape((-1, H, W, C))  # x_0 .. x_{K-1} and the s_k as images
        _, pull = jax.vjp(lambda w: conv_op(stacked, w), kernel)
        dW = pull(ss.reshape(stacked.shape).astype(stacked.dtype))[0]
        s_sum = jnp.sum(ss, axis=0)
    else:
        dW, s_sum = triton_conv.weight_grad(layout, xs, ss, kernel.shape, plan)
        s_sum = layout.interior(s_sum)
    d_drive = sum_to_shape(s_sum, drive.shape).astype(drive.dtype)
    return layout.interior(g0), d_drive, dW.astype(kernel.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def unroll_tied_conv(
    x0: Array,
    drive: Array,
    kernel: Array,
    *,
    steps: int,
    h: float = 1.0,
    activation: str = "relu",
    scan_unroll: int | bool = 1,
    policy: KernelPolicy = DEFAULT,
) -> Array:
    """``x_K`` of a tied conv NAIS block; the fused GPU kernels where they run.

    Plain-Python meaning (values and gradients equal those of this loop)::

        x = x0
        for k in range(steps):
            x = x + h * act(conv_same(x, kernel) + drive)
        return x

    ``policy`` (:class:`naisnet_jax.kernels.KernelPolicy`) says which engine runs the block; the
    default chooses by block and machine (:mod:`naisnet_jax.kernels.policy`): the GPU kernels on
    a CUDA GPU where the block fits them and they are the faster path (16 and 32 channels; 64
    with ReLU on a Hopper GPU), else the stacked VJP
    (:func:`naisnet_jax.kernels.stacked.unroll_tied`, with ``scan_unroll``); with
    ``interpret=True``, the Triton kernels in Pallas' interpreter. The
    kernels' products run at JAX's default matmul precision where it allows TF32 (as XLA's
    convolutions); where it asks for more (``jax.default_matmul_precision("float32")``) the
    wgmma engine splits them in bfloat16 halves (about 16 significant bits).
    """
    x0, drive, kernel, h = check_tied("unroll_tied_conv", x0, drive, kernel, steps, h, activation, scan_unroll)
    check_conv_state(x0.shape, kernel.shape)
    check_drive(x0.shape, drive.shape)
    plan = conv_plan(x0, kernel, activation, check_policy(policy))
    if plan is None:
        return unroll_tied(conv_op, x0, drive, kernel, steps=steps, h=h, activation=activation, scan_unroll=scan_unroll)
    return _fused(x0, drive, kernel, steps, h, activation, plan)
