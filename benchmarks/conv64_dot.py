"""Benchmark (GPU): NAIS-Net10's 64-channel blocks with each step's convolution as one matrix product.

At 8x8x64 the blocks fall back to the stacked VJP (``naisnet_jax.block_vjp.unroll_tied``): every
step is a cuDNN convolution forward and one backward, ~8 and ~12 us each, and XLA's runtime
launches each such convolution from the host between its command buffers (CUDA graphs of the
fusions around it), which cuDNN's legacy convolutions cannot join. In session 25's profile of the
step on an H200 the main stream waited 2.7 ms a step before these 358 convolutions, about as
long as they ran (``benchmarks/results/s25/``).

Here each step's 3x3 SAME convolution is written as one matrix product over the nine shifted
copies of the state (im2col: ``(N H W, 9 C) @ (9 C, C)``), which XLA runs as a GEMM that can sit in a
command buffer; its input transpose is the same form with the kernel turned by 180 degrees and
its channels swapped, and the weight gradient over the stacked steps stays cuDNN's convolution
(``block_vjp.unroll_tied``'s ``transpose`` and ``weight_op`` hooks). The script checks the op
against ``conv_same`` and times a block alone (batch 128, K - 1 = 9 steps, forward and forward +
gradient) both ways; ``train_step.py``'s variant ``nais10_fused_unroll10_c64_dot`` runs the whole
step with it (:func:`patch`).

    python benchmarks/conv64_dot.py --out=$OUT/conv64_dot
    python benchmarks/conv64_dot.py --out=/tmp/conv64_dot --smoke     # CPU, tiny
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class Im2colConv:
    """``conv_same(x, W)`` (stride 1, zero padding, odd kernel) as one product over the shifted
    copies of ``x``; ``transpose`` its adjoint in ``x`` in the same form, ``weight_op`` the plain
    convolution (for the stacked weight gradient)."""

    def __call__(self, x, W):
        import jax.numpy as jnp

        kh, kw, ci, co = W.shape
        H, Wd = x.shape[-3:-1]
        pad = [(0, 0)] * (x.ndim - 3) + [(kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)]
        xp = jnp.pad(x, pad)
        cols = jnp.concatenate([xp[..., a : a + H, b : b + Wd, :] for a in range(kh) for b in range(kw)], axis=-1)
        return jnp.einsum("...k,ko->...o", cols, W.reshape(kh * kw * ci, co))

    def transpose(self, s, W):
        import jax.numpy as jnp

        return self(s, jnp.swapaxes(jnp.flip(W, (0, 1)), 2, 3))

    @property
    def weight_op(self):
        from naisnet_jax.block_vjp import conv_op

        return conv_op


IM2COL = Im2colConv()
CHANNELS = 64


def patch(channels: int = CHANNELS) -> None:
    """The tied conv blocks of ``channels`` channels that fall back to the stacked VJP run
    :data:`IM2COL` as their op (``train_step.py``'s ``c64="dot"``)."""
    from naisnet_jax import block_vjp, fused_block

    original = fused_block.unroll_tied

    def unroll_tied(op, x0, drive, W, **kw):
        if op is block_vjp.conv_op and x0.shape[-1] == channels:
            op = IM2COL
        return original(op, x0, drive, W, **kw)

    fused_block.unroll_tied = unroll_tied


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="batch 2, 8 channels, two steps (CPU)")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: inputs, timing, errors
    import jax

    from naisnet_jax.block_vjp import conv_op, unroll_tied

    batch, K, C = (2, 2, 8) if args.smoke else (args.batch, args.steps, CHANNELS)
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    x0, drive, kernel, cot = bench._inputs(batch, (8, 8, C))
    with jax.default_matmul_precision("highest"):
        ref_y = jax.jit(conv_op)(x0, kernel)
        ref_t = jax.jit(lambda s, W: jax.linear_transpose(lambda x: conv_op(x, W), s)(s)[0])(cot, kernel)
        ref = bench._functions(functools.partial(unroll_tied, conv_op, steps=K, h=1.0, activation="relu"))
        ref_fwd, ref_grad = ref[0](x0, drive, kernel), ref[1](x0, drive, kernel, cot)
    rows = []
    for name, op in (("cuDNN convolution", conv_op), ("im2col product", IM2COL)):
        row = dict(shape=f"8x8x{C}", name=name)
        try:
            with jax.default_matmul_precision("highest"):
                row["err_op"] = bench._rel(jax.jit(op)(x0, kernel), ref_y)
                if hasattr(op, "transpose"):
                    row["err_transpose"] = bench._rel(jax.jit(op.transpose)(cot, kernel), ref_t)
            run = functools.partial(unroll_tied, op, steps=K, h=1.0, activation="relu", scan_unroll=10)
            f, g = bench._functions(run)
            row["err_block"] = bench._rel(f(x0, drive, kernel), ref_fwd)
            row["err_grads"] = max(bench._rel(a, b) for a, b in zip(g(x0, drive, kernel, cot), ref_grad))
            row["forward_ms"] = 1e3 * bench._time(f, (x0, drive, kernel), iters, repeats)
            row["gradient_ms"] = 1e3 * bench._time(g, (x0, drive, kernel, cot), iters, repeats)
        except Exception as e:  # noqa: BLE001 - a path that fails is a row, not the end
            _common.error_row(row, e)
        rows.append(row)
        print(row, flush=True)
    columns = [
        ("shape", "state", "s"),
        ("name", "each step's convolution", "s"),
        ("forward_ms", "forward ms", ".3f"),
        ("gradient_ms", "forward + gradient ms", ".3f"),
        ("err_op", "op rel err", ".1e"),
        ("err_transpose", "transpose rel err", ".1e"),
        ("err_block", "x_K rel err", ".1e"),
        ("err_grads", "gradients rel err", ".1e"),
    ]
    header = f"A 64-channel block, batch {batch}, K = {K}, ReLU, unroll 10, on {{device}} (errors vs highest precision)"
    _common.report(args.out, "conv64_dot", header, rows, columns)


if __name__ == "__main__":
    main()
