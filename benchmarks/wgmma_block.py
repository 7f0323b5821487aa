"""Benchmark (prototype, not yet run on a GPU): a conv block's forward kernel on Hopper ``wgmma``.

The Triton block kernels (``naisnet_jax.fused_block``) are latency-bound at 28 to 38 us a step
at 16 channels (BENCHMARKS.md, "Where the step's time goes"). This is the forward kernel
written for Pallas' Mosaic GPU backend instead:

- one program (one warpgroup) per pattern, the pattern's state double-buffered in shared memory
  in ``fused_block.Layout``'s buffer layout (2 x 1,350 rows x 64 B at 32x32x16);
- per 64-row tile, each of the nine taps' windows loaded from shared memory into registers at
  its row offset, split into ``hi = bf16(x)`` and ``lo = bf16(x - hi)``, and multiplied with the
  taps (split the same way) by three ``wgmma``s: ``hi w_hi + lo w_hi + hi w_lo``. Mosaic GPU's
  ``wgmma`` takes a shared-memory operand only swizzled and 8-row tiled and a register operand
  only in 8 or 16 bits, so this is how a window at any offset reaches the tensor cores. The split
  is more exact than TF32 (5.2e-6 against 3.5e-4 from float64, in
  ``benchmarks/results/wgmma_tile_lowering_cpu.py``);
- the drive held in registers for all K steps (it does not change), ``x_0`` and the drive
  brought in by TMA, every state ``x_k`` sent out by TMA from shared memory after its step, every
  pre-activation ``z_k`` through a two-slot staging buffer.

Its outputs are ``fused_block.fused_forward``'s (``xs``, ``zs``), so the Triton backward and
weight-gradient kernels can take them. On a GPU the script checks the values against the Triton
forward kernel and a float32 reference at the highest precision and times both; with
``--smoke`` (any machine) it only lowers the kernel for CUDA.

    python benchmarks/wgmma_block.py --out=$OUT/wgmma_block
    python benchmarks/wgmma_block.py --out=/tmp/wgmma --smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

M = 64  # rows per wgmma tile (the instruction's M)
TMA_ROWS = 256  # a TMA box has at most 256 rows


def _chunks(start: int, stop: int, size: int = TMA_ROWS) -> list[tuple[int, int]]:
    return [(s, min(size, stop - s)) for s in range(start, stop, size)]


def forward_kernel(
    layout, offsets, steps, h, x0_ref, d_ref, taps_hi, taps_lo, xs_ref, zs_ref, state, zstage, w_hi_ref, w_lo_ref, bar
):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = jax.lax.axis_index("n")
    S, C = layout.slack, state.shape[-1]
    tiles = layout.tiles * layout.tile_rows // M
    centre = offsets.index(0)
    # whole buffers out, so that every TMA box starts 128-byte aligned in shared memory (the slack
    # rows go out as they are: nothing reads them, as with the Triton kernel's buffers)
    region = _chunks(0, layout.rows)

    def wgmma_layout(v):
        return plgpu.layout_cast(v, plgpu.Layout.WGMMA)

    def inside(q0):
        q = q0 + plgpu.broadcasted_iota(jnp.int32, (M, C), 0, layout=plgpu.Layout.WGMMA)
        i, j = q // layout.padded_width, q % layout.padded_width
        return (
            (i >= layout.pad_h)
            & (i < layout.pad_h + layout.height)
            & (j >= layout.pad_w)
            & (j < layout.pad_w + layout.width)
        )

    # x_0 into buffer 0, the drive into buffer 1 (free until step 0 writes it), then into registers
    plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)  # TMA swizzles them on the way in
    plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
    for s0, size in _chunks(0, layout.rows):
        plgpu.copy_gmem_to_smem(x0_ref.at[n, pl.ds(s0, size)], state.at[0, pl.ds(s0, size)], bar)
        plgpu.copy_gmem_to_smem(d_ref.at[n, pl.ds(s0, size)], state.at[1, pl.ds(s0, size)], bar)
    plgpu.barrier_wait(bar)
    drive = [wgmma_layout(state[1, pl.ds(S + t * M, M), :]) for t in range(tiles)]
    for s0, size in region:  # xs[0] = x_0
        plgpu.copy_smem_to_gmem(state.at[0, pl.ds(s0, size)], xs_ref.at[0, n, pl.ds(s0, size)])
    plgpu.commit_smem()  # every thread holds its drive before step 0 overwrites buffer 1

    def step(k, carry):
        src, dst = k % 2, 1 - k % 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # x_k's copy out of buffer dst is done
        for t in range(tiles):
            q0 = t * M
            rows = pl.ds(S + q0, M)

            def products(acc_ref, q0=q0):
                centre_window = None
                for i, off in enumerate(offsets):
                    window = wgmma_layout(state[src, pl.ds(S + q0 + off, M), :])
                    centre_window = window if i == centre else centre_window
                    hi = window.astype(jnp.bfloat16)
                    lo = (window - hi.astype(jnp.float32)).astype(jnp.bfloat16)
                    plgpu.wgmma(acc_ref, hi, w_hi_ref.at[i])
                    plgpu.wgmma(acc_ref, lo, w_hi_ref.at[i])
                    plgpu.wgmma(acc_ref, hi, w_lo_ref.at[i])
                plgpu.wgmma_wait(0)
                return acc_ref[...], centre_window

            acc, x = pl.run_scoped(products, plgpu.ACC((M, C), jnp.float32))
            z = acc + drive[t]
            keep, zero = inside(q0), jnp.zeros_like(z)
            state[dst, rows, :] = jnp.where(keep, x + h * jnp.maximum(z, 0.0), zero)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the staging slot's last copy has read it
            zstage[t % 2] = jnp.where(keep, z, zero)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(zstage.at[t % 2], zs_ref.at[k, n, rows])
        plgpu.commit_smem()  # x_{k+1} complete in buffer dst
        for s0, size in region:
            plgpu.copy_smem_to_gmem(state.at[dst, pl.ds(s0, size)], xs_ref.at[k + 1, n, pl.ds(s0, size)])
        return carry

    jax.lax.fori_loop(0, steps, step, 0)
    plgpu.wait_smem_to_gmem(0)


def fused_forward_wgmma(x0, drive, kernel, *, steps, h=1.0):
    """``(layout, xs, zs)`` as ``fused_block.fused_forward`` (3x3 kernel, ReLU, 16 channels)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.fused_block import Layout

    N, H, W, C = x0.shape
    layout = Layout.of(H, W, 3, 3)
    offsets = layout.offsets(3, 3)
    x0b = layout.to_buffer(x0)
    db = layout.to_buffer(jnp.broadcast_to(drive, x0.shape).astype(x0.dtype))
    taps = kernel.reshape(9, C, C).astype(jnp.float32)
    w_hi = taps.astype(jnp.bfloat16)
    w_lo = (taps - w_hi.astype(jnp.float32)).astype(jnp.bfloat16)
    swizzled = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # 16 bf16 columns: 32 B
    call = plgpu.kernel(
        functools.partial(forward_kernel, layout, offsets, steps, h),
        out_type=(
            jax.ShapeDtypeStruct((steps + 1, N, layout.rows, C), jnp.float32),
            jax.ShapeDtypeStruct((steps, N, layout.rows, C), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((2, layout.rows, C), jnp.float32),
            plgpu.SMEM((2, M, C), jnp.float32),
            plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled),
            plgpu.Barrier(num_arrivals=2 + 2 * len(_chunks(0, layout.rows))),
        ],
        grid=(N,),
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    xs, zs = call(x0b, db, w_hi, w_lo)
    return layout, xs, zs


def _rel(a, b):
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="lower the kernel for CUDA only (any machine)")
    args = parser.parse_args(argv)
    _common.importable()
    import jax
    import jax.numpy as jnp

    from naisnet_jax import fused_block as fb

    os.makedirs(args.out, exist_ok=True)
    shape = (args.batch, 32, 32, 16)
    run = jax.jit(lambda a, b, c: fused_forward_wgmma(a, b, c, steps=args.steps)[1:])
    if args.smoke:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        w = jax.ShapeDtypeStruct((3, 3, 16, 16), jnp.float32)
        text = run.trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
        print(f"lowered for CUDA: {len(text)} characters of MLIR (batch {args.batch}, K = {args.steps})")
        return
    import fused_block as bench  # benchmarks/fused_block.py

    x0, drive, kernel, _ = bench._inputs(args.batch, shape[1:])
    triton = jax.jit(
        lambda a, b, c: fb.fused_forward(a, b, c, steps=args.steps, h=1.0, activation="relu", config=fb.GPU)[1:]
    )
    rows = []
    # the reference: the same kernel in Pallas' interpreter, its products at the highest precision
    interpreted = fb.GPU._replace(interpret=True)
    with jax.default_matmul_precision("highest"):
        ref_xs, ref_zs = jax.jit(
            lambda a, b, c: fb.fused_forward(a, b, c, steps=args.steps, h=1.0, activation="relu", config=interpreted)[
                1:
            ]
        )(x0, drive, kernel)
    layout = fb.Layout.of(32, 32, 3, 3)
    for name, fn in (("triton_tf32", triton), ("wgmma_bf16x3", run)):
        row = dict(name=name)
        try:
            xs, zs = fn(x0, drive, kernel)
            row["err_xK_vs_highest"] = _rel(layout.interior(xs[-1]), layout.interior(ref_xs[-1]))
            row["err_zs_vs_highest"] = _rel(layout.interior(zs), layout.interior(ref_zs))
            row["forward_ms"] = 1e3 * bench._time(fn, (x0, drive, kernel), args.iters, args.repeats)
        except Exception as e:  # a kernel the compiler refuses is a row, not the end
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(row, flush=True)
    columns = [
        ("name", "forward kernel", "s"),
        ("forward_ms", "ms (saving xs, zs)", ".3f"),
        ("err_xK_vs_highest", "x_K rel err", ".1e"),
        ("err_zs_vs_highest", "z rel err", ".1e"),
    ]
    text, md = _common.table(rows, columns)
    device = _common.device_summary()
    header = f"Forward kernel of one 32x32x16 block, batch {args.batch}, K = {args.steps}, on {device['device_kind']}"
    _common.write_results(args.out, "wgmma_block", dict(device=device, rows=rows), header + "\n\n" + md)
    print(header)
    print(text)


if __name__ == "__main__":
    main()
