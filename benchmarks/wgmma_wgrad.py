"""Benchmark (prototype, slower than Triton in session 23): a weight gradient on Hopper ``wgmma``.

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


def wgrad_kernel(
    layout, offsets, steps_per, double, xs_ref, ss_ref, out_ref, xbuf, sbuf, p_hi, p_lo, s_hi, s_lo, stage, bars
):
    """Program ``(n, b)``: ``sum over (step, tile) of P^T @ s`` for pattern ``n``'s steps
    ``b * steps_per ..`` (``steps_per`` of them). ``double``: ``P`` and ``s`` in two slots, so a
    tile's products run while the next tile's patch matrix is built."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import _load, split_bf16

    n, b = jax.lax.axis_index("n"), jax.lax.axis_index("b")
    S, C = layout.slack, sbuf.shape[-1]
    tiles = layout.tiles * layout.tile_rows // M
    span = layout.tiles * layout.tile_rows  # rows that hold the image (after the slack)
    halo = M + 2 * S
    mpad = p_hi.shape[-1]
    items = steps_per * tiles  # (step, tile) pairs, step by step

    def fetch(i):  # item i's x_k rows with their halo and its s_k rows into slot i % 2
        k, q0 = b * steps_per + i // tiles, (i % tiles) * M
        plgpu.copy_gmem_to_smem(xs_ref.at[k, n, pl.ds(q0, halo)], xbuf.at[i % 2], bars.at[i % 2])
        plgpu.copy_gmem_to_smem(ss_ref.at[k, n, pl.ds(S + q0, M)], sbuf.at[i % 2], bars.at[i % 2])

    def run(acc_ref):
        def item(i, carry):
            slot = i % 2
            ps = slot if double else 0
            plgpu.barrier_wait(bars.at[slot])
            rows = plgpu.broadcasted_iota(jnp.int32, (M, C), 0, layout=plgpu.Layout.WGMMA)
            for t, off in enumerate(offsets):
                window = _load(xbuf, slot, pl.ds(S + off, M), slice(None))
                r = (i % tiles) * M + off + rows  # the window's rows, counted from the first tiled row
                window = jnp.where((r >= 0) & (r < span), window, jnp.zeros_like(window))
                hi, lo = split_bf16(window)
                p_hi[ps, :, pl.ds(t * C, C)] = hi
                p_lo[ps, :, pl.ds(t * C, C)] = lo
            hi, lo = split_bf16(_load(sbuf, slot, slice(None), slice(None)))
            s_hi[ps] = hi
            s_lo[ps] = lo
            plgpu.commit_smem()  # the stores are visible to wgmma; every thread is done with the slot

            @pl.when(i + 2 < items)
            def _():
                fetch(i + 2)

            a_hi, a_lo = p_hi.at[ps].T, p_lo.at[ps].T
            plgpu.wgmma(acc_ref, a_hi, s_hi.at[ps])
            plgpu.wgmma(acc_ref, a_lo, s_hi.at[ps])
            plgpu.wgmma(acc_ref, a_hi, s_lo.at[ps])
            # the slot written next must be free: one slot, every product done; two, this tile's
            # three may still run (the previous tile's, on the other slot, are done)
            plgpu.wgmma_wait(3 if double else 0)
            return carry

        jax.lax.fori_loop(0, items, item, 0)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    fetch(0)
    if items > 1:
        fetch(1)
    acc = pl.run_scoped(run, plgpu.ACC((mpad, C), jnp.float32))
    stage[...] = acc
    plgpu.commit_smem()
    for s0 in range(0, mpad, 256):
        size = min(256, mpad - s0)
        plgpu.copy_smem_to_gmem(stage.at[pl.ds(s0, size)], out_ref.at[b, n, pl.ds(s0, size)])
    plgpu.wait_smem_to_gmem(0)


def fused_weight_grad_wgmma(layout, xs, ss, kernel_shape, *, steps_per=1, double=False):
    """``dW`` (HWIO) from the saved states ``xs`` and the ``s_k`` (buffers), as
    ``fused_block.fused_weight_grad`` (3x3 kernel); one program per pattern and ``steps_per``
    steps."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    steps, N, _, C = ss.shape
    if steps % steps_per:
        raise ValueError(f"steps_per={steps_per} must divide the {steps} steps")
    mpad = _padded(9 * C)
    halo = M + 2 * layout.slack
    slots = 2 if double else 1
    tiled = (plgpu.TilingTransform((8, C)), plgpu.SwizzleTransform(2 * C))  # P and s share the swizzle
    call = plgpu.kernel(
        functools.partial(wgrad_kernel, layout, layout.offsets(3, 3), steps_per, double),
        out_type=jax.ShapeDtypeStruct((steps // steps_per, N, mpad, C), jnp.float32),
        scratch_types=[
            plgpu.SMEM((2, halo, C), jnp.float32),
            plgpu.SMEM((2, M, C), jnp.float32),
            plgpu.SMEM((slots, M, mpad), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((slots, M, mpad), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((slots, M, C), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((slots, M, C), jnp.bfloat16, transforms=tiled),
            plgpu.SMEM((mpad, C), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),
        ],
        grid=(N, steps // steps_per),
        grid_names=("n", "b"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    parts = call(xs, ss)
    dw = jnp.sum(parts, axis=(0, 1))[: 9 * C]  # (9 C_in, C_out): tap-major rows
    return dw.reshape(kernel_shape)


def emulate(layout, xs, ss, kernel_shape):
    """The kernel's index arithmetic in numpy, float64 and unsplit (halo slices, window offsets,
    masks, the tap-major patch matrix, the final reshape): ``--smoke`` checks it against XLA's
    weight-gradient convolution, which the GPU run cannot separate from Mosaic's semantics."""
    import numpy as np

    xs, ss = np.asarray(xs, np.float64), np.asarray(ss, np.float64)
    steps, N, _, C = ss.shape
    S, span = layout.slack, layout.tiles * layout.tile_rows
    tiles, halo, mpad = span // M, M + 2 * layout.slack, _padded(9 * C)
    acc = np.zeros((mpad, C))
    for k in range(steps):
        for n in range(N):
            for j in range(tiles):
                q0 = j * M
                xh, s = xs[k, n, q0 : q0 + halo], ss[k, n, S + q0 : S + q0 + M]
                P = np.zeros((M, mpad))
                for t, off in enumerate(layout.offsets(3, 3)):
                    r = q0 + off + np.arange(M)
                    P[:, t * C : (t + 1) * C] = xh[S + off : S + off + M] * ((r >= 0) & (r < span))[:, None]
                acc += P.T @ s
    return acc[: 9 * C].reshape(kernel_shape)


@functools.cache
def cached(layout, kernel_shape, steps_per=1, double=False):
    """``fused_weight_grad_wgmma`` for one configuration as one jitted function, so a model's
    blocks of one shape share one kernel (built once, as ``naisnet_jax.hopper_block`` does)."""
    import jax

    return jax.jit(
        functools.partial(
            fused_weight_grad_wgmma, layout, kernel_shape=tuple(kernel_shape), steps_per=steps_per, double=double
        )
    )


def patch_fused_block() -> None:
    """Makes ``naisnet_jax.fused_block`` take this kernel for the weight gradient of every block whose
    forward and backward run on the wgmma kernels (``train_step.py``'s ``wgrad="wgmma"``)."""
    from naisnet_jax import fused_block

    triton = fused_block.fused_weight_grad

    def weight_grad(layout, xs, ss, kernel_shape, config=fused_block.GPU):
        if config.warpgroups and tuple(kernel_shape[:2]) == (3, 3):
            return cached(layout, tuple(kernel_shape))(xs, ss)
        return triton(layout, xs, ss, kernel_shape, config)

    fused_block.fused_weight_grad = weight_grad


#: The variants a GPU run measures: (steps a program, P and s double-buffered).
VARIANTS = {"wgmma_bf16x3": (1, False), "wgmma_bf16x3 2 steps": (2, False), "wgmma_bf16x3 double": (1, True)}


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
        variants = {"triton_tf32": jax.jit(lambda a, s: fb.fused_weight_grad(layout, a, s, wshape, config))}
        for name, (per, double) in VARIANTS.items():
            variants[name] = jax.jit(
                functools.partial(fused_weight_grad_wgmma, layout, kernel_shape=wshape, steps_per=per, double=double)
            )
        if args.smoke:
            import numpy as np

            rng = np.random.default_rng(0)  # a small case: the emulation against XLA, in float64
            small = (3, 2, H, W, C)
            x = rng.standard_normal(small)
            s = rng.standard_normal(small[:2] + (H, W, C))
            want = _weight_grad(conv_op)(
                jnp.asarray(x.reshape((-1, H, W, C))), jnp.asarray(s.reshape((-1, H, W, C))), jnp.zeros(wshape)
            )
            got = emulate(layout, layout.to_buffer(jnp.asarray(x)), layout.to_buffer(jnp.asarray(s)), wshape)
            print(f"{H}x{W}x{C} the kernel's indexing (numpy) against XLA: {bench._rel(got, want):.1e}")
            xs = jax.ShapeDtypeStruct((K + 1, args.batch, layout.rows, C), jnp.float32)
            ss = jax.ShapeDtypeStruct((K, args.batch, layout.rows, C), jnp.float32)
            for name in VARIANTS:
                try:
                    text = variants[name].trace(xs, ss).lower(lowering_platforms=("cuda",)).as_text()
                    print(f"{H}x{W}x{C} {name}: lowered for CUDA, {len(text)} characters (batch {args.batch}, K = {K})")
                except Exception as e:  # shared memory, say: the GPU run records it as a FAILED row
                    print(f"{H}x{W}x{C} {name}: does not lower: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
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
