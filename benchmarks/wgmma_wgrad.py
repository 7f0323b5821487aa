"""Benchmark (prototype, not yet run on a GPU): a block's weight gradient on Hopper ``wgmma``.

The fused path's weight gradient is a Triton kernel (``naisnet_jax.fused_block.fused_weight_grad``:
one program of one or two warps per step and pattern, ``dW_t^T += s_k^T @ x_k(window t)`` tap by
tap in TF32); with the block kernels on ``wgmma`` (``naisnet_jax.hopper_block``) it is the largest
single item of NAIS-Net10's step on an H100: 36 calls of ~190 us, 6.9 ms a step
(``BENCHMARKS.md``, "The wgmma block kernels"). This is the same sum written for Pallas' Mosaic
GPU backend:

- one program (one warpgroup) per step and pattern, over the state's 64-row tiles; each tile's
  ``x_k`` rows with their halo (``64 + 2 S`` rows) and its ``s_k`` rows come in by TMA, one tile
  ahead through two slots;
- the tile's nine windows are loaded from shared memory into registers (any row offset), masked to
  the tiled rows, split into bfloat16 halves (``hopper_block.split_bf16``) and stored side by side
  as the patch matrix ``P`` (``64 x 9C``, padded to a multiple of 64 columns) in swizzled shared
  memory; ``s_k``'s tile is split and stored the same way;
- ``dW^T``-stacked ``(9C, C) += P^T @ s`` is three ``wgmma`` with ``P`` transposed as the left
  operand (the taps stacked along the product's M, which ``wgmma`` needs to be a multiple of
  64: one tap's ``C x C`` alone is too small), ``P_hi^T s_hi + P_lo^T s_hi + P_hi^T s_lo``;
- each program writes its ``(9C, C)`` partial sum; XLA sums them.

Outputs: ``dW`` (HWIO), as ``fused_weight_grad``'s, from the buffers the block kernels write. On a
GPU the script checks it against XLA's weight-gradient convolution over the stacked states at the
highest precision and times it against the Triton kernel; with ``--smoke`` (any machine) it only
lowers it for CUDA.

    python benchmarks/wgmma_wgrad.py --out=$OUT/wgmma_wgrad
    python benchmarks/wgmma_wgrad.py --out=/tmp/wgrad --smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

M = 64  # rows per tile: the reduction (K) of one product


def _padded(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def wgrad_kernel(layout, offsets, steps, xs_ref, ss_ref, out_ref, xbuf, sbuf, p_hi, p_lo, s_hi, s_lo, stage, bars):
    """Program ``(n, k)``: ``sum over tiles of P^T @ s`` for step ``k`` of pattern ``n``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import _load, split_bf16

    n, k = jax.lax.axis_index("n"), jax.lax.axis_index("k")
    S, C = layout.slack, sbuf.shape[-1]
    tiles = layout.tiles * layout.tile_rows // M
    span = layout.tiles * layout.tile_rows  # rows that hold the image (after the slack)
    halo = M + 2 * S
    mpad = p_hi.shape[-1]

    def fetch(j):  # tile j's x_k rows with their halo and its s_k rows into slot j % 2
        q0 = j * M
        plgpu.copy_gmem_to_smem(xs_ref.at[k, n, pl.ds(q0, halo)], xbuf.at[j % 2], bars.at[j % 2])
        plgpu.copy_gmem_to_smem(ss_ref.at[k, n, pl.ds(S + q0, M)], sbuf.at[j % 2], bars.at[j % 2])

    def tile(j, acc):
        slot = j % 2
        plgpu.barrier_wait(bars.at[slot])
        rows = plgpu.broadcasted_iota(jnp.int32, (M, C), 0, layout=plgpu.Layout.WGMMA)
        for t, off in enumerate(offsets):
            window = _load(xbuf, slot, pl.ds(S + off, M), slice(None))
            r = j * M + off + rows  # the window's rows, counted from the first tiled row
            window = jnp.where((r >= 0) & (r < span), window, jnp.zeros_like(window))
            hi, lo = split_bf16(window)
            p_hi[:, pl.ds(t * C, C)] = hi
            p_lo[:, pl.ds(t * C, C)] = lo
        hi, lo = split_bf16(_load(sbuf, slot, slice(None), slice(None)))
        s_hi[...] = hi
        s_lo[...] = lo
        plgpu.commit_smem()  # the stores are visible to wgmma, and every thread is done with the slot

        @pl.when(j + 2 < tiles)
        def _():
            fetch(j + 2)

        def products(acc_ref):
            plgpu.wgmma(acc_ref, p_hi.T, s_hi)
            plgpu.wgmma(acc_ref, p_lo.T, s_hi)
            plgpu.wgmma(acc_ref, p_hi.T, s_lo)
            plgpu.wgmma_wait(0)  # P and s are rewritten by the next tile

        return pl.run_state(products)(plgpu.ACC.init(acc))

    fetch(0)
    if tiles > 1:
        fetch(1)
    zero = plgpu.layout_cast(jnp.zeros((mpad, C), jnp.float32), plgpu.Layout.WGMMA)
    acc = jax.lax.fori_loop(0, tiles, tile, zero)
    stage[...] = acc
    plgpu.commit_smem()
    for s0 in range(0, mpad, 256):
        size = min(256, mpad - s0)
        plgpu.copy_smem_to_gmem(stage.at[pl.ds(s0, size)], out_ref.at[k, n, pl.ds(s0, size)])
    plgpu.wait_smem_to_gmem(0)


def fused_weight_grad_wgmma(layout, xs, ss, kernel_shape):
    """``dW`` (HWIO) from the saved states ``xs`` and the ``s_k`` (buffers), as
    ``fused_block.fused_weight_grad`` (3x3 kernel)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    steps, N, _, C = ss.shape
    offsets = layout.offsets(3, 3)
    mpad = _padded(9 * C)
    halo = M + 2 * layout.slack
    swizzle = 2 * C  # bytes of a row of C bfloat16: P and s must share it
    tiled = (plgpu.TilingTransform((8, C)), plgpu.SwizzleTransform(swizzle))
    call = plgpu.kernel(
        functools.partial(wgrad_kernel, layout, offsets, steps),
        out_type=jax.ShapeDtypeStruct((steps, N, mpad, C), jnp.float32),
        scratch_types=[
            plgpu.SMEM((2, halo, C), jnp.float32),
            plgpu.SMEM((2, M, C), jnp.float32),
            plgpu.SMEM((M, mpad), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((M, mpad), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((M, C), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((M, C), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((mpad, C), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),
        ],
        grid=(N, steps),
        grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    parts = call(xs, ss)
    dw = jnp.sum(parts, axis=(0, 1))[: 9 * C]  # (9C_in, C_out): tap-major rows
    return dw.reshape(kernel_shape)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="32x32x16,16x16x32", help="comma-separated HxWxC (C: 16 or 32)")
    parser.add_argument("--smoke", action="store_true", help="lower the kernel for CUDA only (any machine)")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: inputs, timing, errors
    import jax
    import jax.numpy as jnp

    from naisnet_jax import fused_block as fb
    from naisnet_jax.block_vjp import _weight_grad, conv_op

    os.makedirs(args.out, exist_ok=True)
    if not args.smoke and not _common.hopper_here(args.out, "wgmma_wgrad"):
        return
    K, rows = args.steps, []
    for shape in [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]:
        H, W, C = shape
        tile_rows, warps = fb.default_tiling(C)
        config = fb.GPU._replace(tile_rows=tile_rows, num_warps=warps)
        layout = fb.Layout.of(H, W, 3, 3, tile_rows)
        wshape = (3, 3, C, C)
        variants = {
            "triton_tf32": jax.jit(lambda a, s: fb.fused_weight_grad(layout, a, s, wshape, config)),
            "wgmma_bf16x3": jax.jit(lambda a, s: fused_weight_grad_wgmma(layout, a, s, wshape)),
        }
        if args.smoke:
            xs = jax.ShapeDtypeStruct((K + 1, args.batch, layout.rows, C), jnp.float32)
            ss = jax.ShapeDtypeStruct((K, args.batch, layout.rows, C), jnp.float32)
            text = variants["wgmma_bf16x3"].trace(xs, ss).lower(lowering_platforms=("cuda",)).as_text()
            print(f"{H}x{W}x{C} weight gradient lowered for CUDA: {len(text)} characters (batch {args.batch}, K = {K})")
            continue
        # the buffers the block kernels write: states and s_k from the wgmma forward and backward
        x0, drive, kernel, cot = bench._inputs(args.batch, shape)
        wg = config._replace(warpgroups=1)
        _, xs, zs = fb.fused_forward(x0, drive, kernel, steps=K, h=1.0, activation="relu", config=wg)
        _, ss = fb.fused_backward(layout, cot, zs, kernel, steps=K, h=1.0, activation="relu", config=wg)
        with jax.default_matmul_precision("highest"):  # XLA's weight-gradient convolution, stacked
            x = layout.interior(xs[:K]).reshape((-1, H, W, C))
            s = layout.interior(ss).reshape((-1, H, W, C))
            want = jax.jit(lambda a, b: _weight_grad(conv_op)(a, b, jnp.zeros(wshape, jnp.float32)))(x, s)
        for name, fn in variants.items():
            row = dict(shape=f"{H}x{W}x{C}", name=name)
            try:
                row["err_vs_highest"] = bench._rel(fn(xs, ss), want)
                row["ms"] = 1e3 * bench._time(fn, (xs, ss), args.iters, args.repeats)
            except Exception as e:  # a kernel the compiler refuses is a row, not the end
                _common.error_row(row, e)
            rows.append(row)
            print(row, flush=True)
    if args.smoke:
        return
    columns = [
        ("shape", "state", "s"),
        ("name", "kernel", "s"),
        ("ms", "ms", ".3f"),
        ("err_vs_highest", "rel err vs highest", ".1e"),
    ]
    header = f"A block's weight gradient, batch {args.batch}, K = {K}, on {{device}}"
    _common.report(args.out, "wgmma_wgrad", header, rows, columns)


if __name__ == "__main__":
    main()
