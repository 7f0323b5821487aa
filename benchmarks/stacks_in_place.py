"""Benchmark (prototype; measured in session 27, slower): the stacked VJP's stacks written in place.

With its scan unrolled (``scan_unroll=10``), the stacked VJP (``naisnet_jax.block_vjp``, the
64-channel blocks of NAIS-Net10's fused step) stacks the K states ``x_k`` in the forward pass
and the K ``s_k`` in the backward pass for its one weight-gradient convolution. JAX lowers an
unrolled scan's outputs as one concatenation of the K values. In session 26's profile
(``benchmarks/results/s26/``) XLA ran all 72 of them (~10 us each, ~0.8 ms) on the main stream at
the very end of the backward pass, then waited ~0.7 ms for the weight gradients on the second
stream, which could start only after them. Making the stacks early with optimisation barriers
moved that cost instead of removing it (26.11 against 25.93 ms on an H200).

Here the scan carries the stacks and each step writes its value into them
(``lax.dynamic_update_index_in_dim``): no concatenation is left, and XLA can do each update in
place, beside the step that makes the value. ``patch()`` swaps this into ``block_vjp`` (the
forward pass's ``_forward`` with ``save=True`` and the backward pass); ``train_step.py``'s
variant ``nais10_fused_unroll10_stacks_in_place`` runs it in the step. ``--smoke`` (a CPU) checks
values and gradients against the unpatched path and the plain loop in float64, and counts the
concatenations and in-place updates in XLA's optimised program (CPU) before and after.

Measured in the step (session 27, H200, ``benchmarks/results/s27/a``): **26.48 against 25.71 ms**
for the default. Not landed.

    python benchmarks/stacks_in_place.py --out=/tmp/stacks_in_place --smoke
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def _forward(op, x0, drive, W, steps, h, activation, scan_unroll, save):
    """``block_vjp._forward`` with the saved ``(xs, rs)`` written into stacks the scan carries."""
    import jax.numpy as jnp
    from jax import lax

    from naisnet_jax import block_vjp as bv

    if not save:
        return _ORIGINAL["_forward"](op, x0, drive, W, steps, h, activation, scan_unroll, save)
    act = bv.ACTIVATIONS[activation]
    r_dtype = bv._residual(activation, x0).dtype

    def body(carry, k):
        x, xs, rs = carry
        z = op(x, W) + drive
        xs = lax.dynamic_update_index_in_dim(xs, x, k, 0)
        rs = lax.dynamic_update_index_in_dim(rs, bv._residual(activation, z), k, 0)
        return (x + h * act(z), xs, rs), None

    stacks = (jnp.zeros((steps,) + x0.shape, x0.dtype), jnp.zeros((steps,) + x0.shape, r_dtype))
    (x, xs, rs), _ = lax.scan(body, (x0, *stacks), jnp.arange(steps), unroll=scan_unroll)
    return x, (xs, rs)


def _tied_bwd(op, steps, h, activation, residuals, scan_unroll, res, g):
    """``block_vjp._tied_bwd`` with the ``s_k`` written into a stack the scan carries."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from naisnet_jax import block_vjp as bv

    x0, drive, W, saved = res
    if saved is None:
        (x0, drive, W), g = lax.optimization_barrier(((x0, drive, W), g))
        saved = bv._forward(op, x0, drive, W, steps, h, activation, scan_unroll, save=True)[1]
    xs, rs = saved
    op_x_t = jax.linear_transpose(lambda x: op(x, W), x0)

    def body(carry, inputs):
        g, d_drive, ss = carry
        r, k = inputs
        s = h * bv._slope_times(activation, r, g)
        (gx,) = op_x_t(s)
        return (g + gx, d_drive + s, lax.dynamic_update_index_in_dim(ss, s, k, 0)), None

    carry = (g, jnp.zeros_like(g), jnp.zeros((steps,) + g.shape, g.dtype))
    (g0, d_drive, ss), _ = lax.scan(body, carry, (rs, jnp.arange(steps)), reverse=True, unroll=scan_unroll)
    stacked_x = xs.reshape((-1,) + xs.shape[2:])
    stacked_s = ss.reshape((-1,) + ss.shape[2:])
    dW = bv.on_side_stream(bv._weight_grad(op))(stacked_x, stacked_s, W)
    return g0, bv._sum_to_shape(d_drive, drive.shape).astype(drive.dtype), dW


_ORIGINAL: dict = {}


def patch(forward: bool = True, backward: bool = True) -> None:
    """Makes ``block_vjp``'s stacked VJP write its stacks in place: the states' and residuals'
    (``forward``), the ``s_k``'s (``backward``). Idempotent; :func:`unpatch` undoes it."""
    from naisnet_jax import block_vjp as bv

    if _ORIGINAL:
        return
    _ORIGINAL.update(_forward=bv._forward, _tied_bwd=bv._tied_bwd)
    if forward:
        bv._forward = _forward
    if backward:
        bv._tied.defvjp(bv._tied_fwd, _tied_bwd)


def unpatch() -> None:
    from naisnet_jax import block_vjp as bv

    if _ORIGINAL:
        bv._forward = _ORIGINAL.pop("_forward")
        bv._tied.defvjp(bv._tied_fwd, _ORIGINAL.pop("_tied_bwd"))


def _counts(text: str) -> dict:
    return dict(
        concatenate=len(re.findall(r"\bconcatenate\(", text)),
        dynamic_update_slice=len(re.findall(r"\bdynamic-update-slice\(", text)),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: values in float64, XLA's program counted")
    args = parser.parse_args(argv)
    _common.importable()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax.block_vjp import conv_op, unroll_tied

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    shape, K = ((2, 8, 8, 16), 4) if args.smoke else ((128, 8, 8, 64), 9)
    x0, drive, cot = (jnp.asarray(rng.standard_normal(shape)) for _ in range(3))
    kernel = jnp.asarray(0.1 * rng.standard_normal((3, 3, shape[-1], shape[-1])))
    rows = []
    for activation, residuals in (("relu", "store"), ("tanh", "store"), ("relu", "recompute")):

        def loss(x0, drive, kernel, activation=activation, residuals=residuals):
            y = unroll_tied(
                conv_op, x0, drive, kernel, steps=K, h=0.5, activation=activation, residuals=residuals, scan_unroll=10
            )
            return jnp.vdot(y, cot)

        def loop(x0, drive, kernel, activation=activation):  # the plain loop, autodiff
            act = jax.nn.relu if activation == "relu" else jnp.tanh
            x = x0
            for _ in range(K):
                x = x + 0.5 * act(conv_op(x, kernel) + drive)
            return jnp.vdot(x, cot)

        row = dict(activation=activation, residuals=residuals)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        before = _counts(grad.lower(x0, drive, kernel).compile().as_text())
        want = jax.grad(loop, argnums=(0, 1, 2))(x0, drive, kernel)
        errors = []
        for forward, backward in ((True, True), (True, False), (False, True)):
            patch(forward, backward)
            try:
                grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                got = grad(x0, drive, kernel)
                if forward and backward:
                    after = _counts(grad.lower(x0, drive, kernel).compile().as_text())
            finally:
                unpatch()
            errors += [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)]
        row["max_rel_err"] = max(errors)  # over both stacks in place, and each alone
        row.update({f"{k}_before": v for k, v in before.items()})
        row.update({f"{k}_after": v for k, v in after.items()})
        rows.append(row)
        print(row, flush=True)
        assert row["max_rel_err"] < 1e-12, row
    columns = [
        ("activation", "activation", "s"),
        ("residuals", "residuals", "s"),
        ("max_rel_err", "grads rel err vs loop", ".1e"),
        ("concatenate_before", "concat before", "d"),
        ("concatenate_after", "concat after", "d"),
        ("dynamic_update_slice_before", "DUS before", "d"),
        ("dynamic_update_slice_after", "DUS after", "d"),
    ]
    header = f"The stacked VJP's stacks in place, K = {K}, float64, XLA's program on {{device}}"
    _common.report(args.out, "stacks_in_place", header, rows, columns)


if __name__ == "__main__":
    main()
