"""Session 21 record: one 64-row tile of a 32x32x16 conv step as Hopper ``wgmma`` in Pallas' Mosaic
GPU backend, with the float32 state split into two bfloat16 halves (not part of the package).

Why: the Triton block kernels (``naisnet_jax.fused_block``) are latency-bound at 28 to 38 us a
step (BENCHMARKS.md, "Where the step's time goes"). A kernel that keeps a pattern's state in
shared memory and feeds the tensor cores from there needs each tap's window at any row offset.
Mosaic GPU's ``wgmma`` reads an operand from shared memory only swizzled and (8, swizzle)-tiled,
so the offsets would have to be multiples of 8. It takes a left operand from registers at any
offset, but only in 8- or 16-bit types. So each float32 window is loaded from shared memory into
registers (WGMMA layout, any offset), split as ``hi = bf16(x)``, ``lo = bf16(x - hi)``, and
multiplied with the taps split the same way: ``hi w_hi + lo w_hi + hi w_lo``, three ``wgmma``s
per tap.

What this script shows on a CPU (JAX 0.10.2): the tile lowers (Lane semantics), and so does a
whole forward kernel of that form (``forward_kernel``: one pattern a program, its state double
buffered in shared memory, K steps of tiles, ReLU, the padding masked, every state and
pre-activation written out); and the split's error over float32 products of the tile's shape,
against float64:

    tile lowered for CUDA: 145007 characters of MLIR
    forward kernel (4 x 8x8x16, K = 2) lowered for CUDA: 388959 characters of MLIR
    rel. error vs float64: bf16 x1 2.8e-03, TF32 3.5e-04, bf16 x3 5.2e-06

The forward kernel here takes its pattern's blocks through shared memory (Pallas' automatic
copies), which holds only small states: at 32x32x16 a pattern's padded buffer is 82 KB, two of
them for the state fill most of an SM's 227 KB. At that size the inputs and outputs (``x_0``, the
drive, every ``x_k`` and ``z_k``) must move by TMA through small staging buffers: this Mosaic GPU
neither loads a global ref into registers in the WGMMA layout nor stores one there ("Only
optimized transfers to SMEM supported").

This file uses ``pallas_call`` with Mosaic GPU's ``CompilerParams``, which JAX 0.11 no longer lowers
(its Mosaic GPU kernels go through ``plgpu.kernel``, as ``benchmarks/wgmma_block.py`` does; that
one lowers on JAX 0.10.2 and 0.11.2). Pallas' Mosaic GPU interpreter cannot run the kernel (no
discharge rule for the ``wgmma`` accumulator), so its values and its speed still need a GPU: not
yet compiled or run there.

    python benchmarks/results/wgmma_tile_lowering_cpu.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

C, M, W = 16, 64, 34  # channels, rows of the tile (one wgmma M), padded width of a 32x32 state
OFFSETS = [(a - 1) * W + (b - 1) for a in range(3) for b in range(3)]  # the taps' row offsets
SLACK = W + 1
ROWS = 2 * SLACK + 128


def tile_kernel(x_ref, w_hi_ref, w_lo_ref, out_ref):
    """``out = sum_t x[S + off_t : + M] @ w_t`` with every product as three bf16 ``wgmma``s."""

    def body(acc_ref):
        for t, off in enumerate(OFFSETS):
            window = plgpu.layout_cast(x_ref[pl.ds(SLACK + off, M), :], plgpu.Layout.WGMMA)
            hi = window.astype(jnp.bfloat16)
            lo = (window - hi.astype(jnp.float32)).astype(jnp.bfloat16)
            plgpu.wgmma(acc_ref, hi, w_hi_ref.at[t])
            plgpu.wgmma(acc_ref, lo, w_hi_ref.at[t])
            plgpu.wgmma(acc_ref, hi, w_lo_ref.at[t])
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    out_ref[...] = pl.run_scoped(body, plgpu.ACC((M, C), jnp.float32))


def forward_kernel(
    offsets, tiles, slack, padded_width, image, steps, h, x0_ref, d_ref, w_hi_ref, w_lo_ref, xs_ref, zs_ref, state
):
    """Pattern ``program_id``'s K steps, ``x <- x + h relu(conv(x) + d)``, as ``fused_block``'s
    forward kernel computes them, with every tap's product as three bf16 ``wgmma``s."""
    (pad_h, pad_w), (height, width) = (1, 1), image
    centre = offsets.index(0)

    def inside(q0):
        q = q0 + plgpu.broadcasted_iota(jnp.int32, (M, C), 0, layout=plgpu.Layout.WGMMA)
        i, j = q // padded_width, q % padded_width
        return (i >= pad_h) & (i < pad_h + height) & (j >= pad_w) & (j < pad_w + width)

    for t in range(tiles):
        rows = pl.ds(slack + t * M, M)
        x = plgpu.layout_cast(x0_ref[0, rows, :], plgpu.Layout.WGMMA)
        state[0, rows, :] = x
        xs_ref[0, 0, rows, :] = x
    plgpu.commit_smem()  # a fence and the warpgroup's barrier: the next step reads other threads' rows

    def step(k, carry):
        src, dst = k % 2, 1 - k % 2
        for t in range(tiles):
            q0 = t * M
            rows = pl.ds(slack + q0, M)

            def products(acc_ref):
                centre_window = None
                for i, off in enumerate(offsets):
                    window = plgpu.layout_cast(state[src, pl.ds(slack + q0 + off, M), :], plgpu.Layout.WGMMA)
                    centre_window = window if i == centre else centre_window
                    hi = window.astype(jnp.bfloat16)
                    lo = (window - hi.astype(jnp.float32)).astype(jnp.bfloat16)
                    plgpu.wgmma(acc_ref, hi, w_hi_ref.at[i])
                    plgpu.wgmma(acc_ref, lo, w_hi_ref.at[i])
                    plgpu.wgmma(acc_ref, hi, w_lo_ref.at[i])
                plgpu.wgmma_wait(0)
                return acc_ref[...], centre_window

            acc, x = pl.run_scoped(products, plgpu.ACC((M, C), jnp.float32))
            z = acc + plgpu.layout_cast(d_ref[0, rows, :], plgpu.Layout.WGMMA)
            keep, zero = inside(q0), jnp.zeros_like(z)
            x_new = jnp.where(keep, x + h * jnp.maximum(z, 0.0), zero)
            state[dst, rows, :] = x_new
            xs_ref[k + 1, 0, rows, :] = x_new
            zs_ref[k, 0, rows, :] = jnp.where(keep, z, zero)
        plgpu.commit_smem()
        return carry

    jax.lax.fori_loop(0, steps, step, 0)


def forward_call(batch, height, width, steps, h=1.0):
    """The forward kernel over ``fused_block.Layout``'s buffers, ``(batch, rows, 16)``, for a 3x3 kernel."""
    padded_width = width + 2
    slack = padded_width + 1
    tiles = -(-((height + 2) * padded_width) // M)
    rows = tiles * M + 2 * slack
    offsets = [(a - 1) * padded_width + (b - 1) for a in range(3) for b in range(3)]
    body = functools.partial(forward_kernel, offsets, tiles, slack, padded_width, (height, width), steps, h)
    taps = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    one = plgpu.BlockSpec((1, rows, C), lambda n: (n, 0, 0))
    return rows, pl.pallas_call(
        body,
        grid=(batch,),
        in_specs=[one, one, plgpu.BlockSpec(transforms=taps), plgpu.BlockSpec(transforms=taps)],
        out_specs=[
            plgpu.BlockSpec((steps + 1, 1, rows, C), lambda n: (0, n, 0, 0)),
            plgpu.BlockSpec((steps, 1, rows, C), lambda n: (0, n, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((steps + 1, batch, rows, C), jnp.float32),
            jax.ShapeDtypeStruct((steps, batch, rows, C), jnp.float32),
        ],
        scratch_shapes=[plgpu.SMEM((2, rows, C), jnp.float32)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )


def tile_call():
    taps = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # 16 bf16 columns: 32 B
    return pl.pallas_call(
        tile_kernel,
        out_shape=jax.ShapeDtypeStruct((M, C), jnp.float32),
        in_specs=[
            plgpu.BlockSpec(memory_space=plgpu.SMEM),
            plgpu.BlockSpec(transforms=taps),
            plgpu.BlockSpec(transforms=taps),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )


def split_errors(seed: int = 0) -> dict:
    """Relative max error against float64 of one bf16 product, TF32 and the three-product split."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4096, 9 * C)).astype(np.float32)
    w = (0.1 * rng.standard_normal((9 * C, C))).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)

    def bf16(a):
        return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    def tf32(a):  # round to nearest on the 10-bit mantissa
        bits = (a.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64)

    x_hi, w_hi = bf16(x), bf16(w)
    x_lo, w_lo = bf16(x - x_hi), bf16(w - w_hi)
    variants = {
        "bf16 x1": x_hi @ w_hi,
        "TF32": tf32(x) @ tf32(w),
        "bf16 x3": x_hi @ w_hi + x_lo @ w_hi + x_hi @ w_lo,
    }
    scale = np.max(np.abs(ref))
    return {name: float(np.max(np.abs(v - ref)) / scale) for name, v in variants.items()}


if __name__ == "__main__":
    x = jax.ShapeDtypeStruct((ROWS, C), jnp.float32)
    w = jax.ShapeDtypeStruct((9, C, C), jnp.bfloat16)
    text = jax.jit(tile_call()).trace(x, w, w).lower(lowering_platforms=("cuda",)).as_text()
    print(f"tile lowered for CUDA: {len(text)} characters of MLIR")
    rows, forward = forward_call(4, 8, 8, steps=2)
    buf = jax.ShapeDtypeStruct((4, rows, C), jnp.float32)
    text = jax.jit(forward).trace(buf, buf, w, w).lower(lowering_platforms=("cuda",)).as_text()
    print(f"forward kernel (4 x 8x8x16, K = 2) lowered for CUDA: {len(text)} characters of MLIR")
    print("rel. error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in split_errors().items()))
