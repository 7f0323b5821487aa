"""Benchmark (prototype, not yet run on a GPU): a conv block's kernels on Hopper ``wgmma``.

The Triton block kernels (``naisnet_jax.fused_block``) are latency-bound at 28 to 38 us a step
at 16 channels (BENCHMARKS.md, "Where the step's time goes"). These are the forward and backward
kernels written for Pallas' Mosaic GPU backend instead (``plgpu.kernel``, Lane semantics):

- one program (one warpgroup) per pattern, the state (forward) or ``s_k`` (backward)
  double-buffered in shared memory in ``fused_block.Layout``'s buffer layout (2 x 1,350 rows x
  64 B at 32x32x16);
- per 64-row tile, each of the nine taps' windows loaded from shared memory into registers at
  its row offset, split into ``hi = bf16(x)`` and ``lo = bf16(x - hi)``, and multiplied with the
  taps (split the same way) by three ``wgmma``s: ``hi w_hi + lo w_hi + hi w_lo``. Mosaic GPU's
  ``wgmma`` takes a shared-memory operand only swizzled and 8-row tiled and a register operand
  only in 8 or 16 bits, so this is how a window at any offset reaches the tensor cores. The split
  is more exact than TF32 (5.2e-6 against 3.5e-4 from float64: :func:`split_errors`, which
  ``--smoke`` prints);
- forward: the drive held in registers for all K steps (it does not change), ``x_0`` and the
  drive brought in by TMA, every state ``x_k`` sent out by TMA from shared memory after its step,
  every pre-activation ``z_k`` through a two-slot staging buffer;
- backward: the gradient ``g`` in registers for all K steps, the transposed convolution over
  ``s_k``'s windows (taps mirrored and transposed), each ``z_{k-1}`` tile brought in by TMA one
  tile ahead, every ``s_k`` sent out by TMA.

Their inputs and outputs are ``fused_block.fused_forward``'s and ``fused_backward``'s, so either
can stand in for the Triton kernel beside the other kernels (the weight gradient stays Triton's).
On a GPU the script checks the values against the highest precision (the Triton kernels in
Pallas' interpreter) and times both against the Triton kernels; with ``--smoke`` (any machine)
it only lowers them for CUDA. Both widths NAIS-Net10 runs on these kernels are covered:
32x32x16 and 16x16x32 (``--shapes``). The tiles are unrolled (at 32x32x16, K = 10: 3.2 MB of MLIR
forward, 6.6 MB backward), so the first compile on a GPU may be slow.

    python benchmarks/wgmma_block.py --out=$OUT/wgmma_block
    python benchmarks/wgmma_block.py --out=/tmp/wgmma --smoke
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

M = 64  # rows per wgmma tile (the instruction's M)
TMA_ROWS = 256  # a TMA box has at most 256 rows


def _chunks(start: int, stop: int, size: int = TMA_ROWS) -> list[tuple[int, int]]:
    return [(s, min(size, stop - s)) for s in range(start, stop, size)]


def _load(ref, *idx):
    """``ref[idx]`` from shared memory into registers in the WGMMA layout. Rows of 16 float32
    (64 B) load without bank conflicts; wider rows have no conflict-free pattern in Mosaic GPU
    ("Failed to synthesize a transfer pattern that avoids bank conflicts"), so they load without
    that guarantee."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    optimized = ref.shape[-1] * 4 <= 64
    kwargs = dict(layout=plgpu.Layout.WGMMA, optimized=optimized)
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:  # JAX 0.10
        return plgpu.load(ref, idx, **kwargs)
    return plgpu.load(ref.at[idx], **kwargs)  # JAX 0.11 deprecates a separate index


def _inside(layout, q0, C):
    """``(M, C)`` mask (WGMMA layout) of the tile's rows that are pixels of the image."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return layout.is_pixel(q0 + plgpu.broadcasted_iota(jnp.int32, (M, C), 0, layout=plgpu.Layout.WGMMA))


def split_bf16(x):
    """``(hi, lo)``: ``hi = bf16(x)``, ``lo = bf16(x - hi)``, so that ``hi + lo`` carries ``x`` to
    about 16 significant bits (in a kernel and outside it alike)."""
    import jax.numpy as jnp

    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def split_errors(seed: int = 0) -> dict:
    """Relative max error against float64 of float32 products of a tile's shape ((4096 x 144) @
    (144 x 16)) as one bf16 product, as TF32 and as the three-product split."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4096, 144)).astype(np.float32)
    w = (0.1 * rng.standard_normal((144, 16))).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)

    def tf32(a):  # round to nearest on the 10-bit mantissa
        bits = (a.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64)

    (x_hi, x_lo), (w_hi, w_lo) = ([np.asarray(v, np.float64) for v in split_bf16(a)] for a in (x, w))
    variants = {
        "bf16 x1": x_hi @ w_hi,
        "TF32": tf32(x) @ tf32(w),
        "bf16 x3": x_hi @ w_hi + x_lo @ w_hi + x_hi @ w_lo,
    }
    scale = np.max(np.abs(ref))
    return {name: float(np.max(np.abs(v - ref)) / scale) for name, v in variants.items()}


def _conv_tile(buf, src, start, offsets, w_hi_ref, w_lo_ref, centre=None):
    """``(sum_t window_t @ w_t, window_centre)`` for the tile at row ``start`` of ``buf[src]``, each
    product as three bf16 ``wgmma``s (``hi w_hi + lo w_hi + hi w_lo``)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = buf.shape[-1]

    def products(acc_ref):
        kept = None
        for i, off in enumerate(offsets):
            window = _load(buf, src, pl.ds(start + off, M), slice(None))
            kept = window if i == centre else kept
            hi, lo = split_bf16(window)
            plgpu.wgmma(acc_ref, hi, w_hi_ref.at[i])
            plgpu.wgmma(acc_ref, lo, w_hi_ref.at[i])
            plgpu.wgmma(acc_ref, hi, w_lo_ref.at[i])
        plgpu.wgmma_wait(0)
        return acc_ref[...], kept

    return pl.run_scoped(products, plgpu.ACC((M, C), jnp.float32))


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

    # x_0 into buffer 0, the drive into buffer 1 (free until step 0 writes it), then into registers
    plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)  # TMA swizzles them on the way in
    plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
    for s0, size in region:
        plgpu.copy_gmem_to_smem(x0_ref.at[n, pl.ds(s0, size)], state.at[0, pl.ds(s0, size)], bar)
        plgpu.copy_gmem_to_smem(d_ref.at[n, pl.ds(s0, size)], state.at[1, pl.ds(s0, size)], bar)
    plgpu.barrier_wait(bar)
    drive = [_load(state, 1, pl.ds(S + t * M, M), slice(None)) for t in range(tiles)]
    for s0, size in region:  # xs[0] = x_0
        plgpu.copy_smem_to_gmem(state.at[0, pl.ds(s0, size)], xs_ref.at[0, n, pl.ds(s0, size)])
    plgpu.commit_smem()  # every thread holds its drive before step 0 overwrites buffer 1

    def step(k, carry):
        src, dst = k % 2, 1 - k % 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # x_k's copy out of buffer dst is done
        for t in range(tiles):
            q0 = t * M
            rows = pl.ds(S + q0, M)

            acc, x = _conv_tile(state, src, S + q0, offsets, w_hi_ref, w_lo_ref, centre)
            z = acc + drive[t]
            keep, zero = _inside(layout, q0, C), jnp.zeros_like(z)
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


def triton_config(C: int):
    """The Triton kernels' configuration at width ``C`` (its tiling decides the buffers' layout)."""
    from naisnet_jax import fused_block as fb

    rows, warps = fb.default_tiling(C)
    return fb.GPU._replace(tile_rows=rows, num_warps=warps)


def _mosaic_call(body, layout, kernel, out_type, barriers, transposed):
    """``body`` as a Mosaic GPU kernel, one program (one warpgroup) per pattern, with the scratch both
    kernels use: the double buffer (``(2, rows, C)``), a two-slot ``(M, C)`` staging buffer, the
    split taps in swizzled shared memory, then ``barriers``. Returns ``f(*buffers)``, the split
    taps (``transposed``: each tap's ``C_out x C_in``, as the transposed convolution takes them)
    passed after the buffers."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = kernel.shape[-1]
    taps = kernel.reshape(9, C, C).astype(jnp.float32)
    if transposed:
        taps = jnp.swapaxes(taps, 1, 2)
    swizzled = _swizzled(C)
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((2, layout.rows, C), jnp.float32),
            plgpu.SMEM((2, M, C), jnp.float32),
            plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled),
            *barriers,
        ],
        grid=(out_type[0].shape[-3],),  # the patterns: every output is (..., N, rows, C)
        grid_names=("n",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    return lambda *buffers: call(*buffers, *split_bf16(taps))


def _swizzled(C: int):
    """Shared-memory transforms of a ``(C, C)`` bfloat16 tap for ``wgmma``: rows of ``2 C`` bytes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = min(128, 2 * C)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def fused_forward_wgmma(x0, drive, kernel, *, steps, h=1.0):
    """``(layout, xs, zs)`` as ``fused_block.fused_forward`` with the Triton kernels' layout at this
    width (3x3 kernel, ReLU; 16 or 32 channels: at 64 the split taps alone, 2 x 74 KB, leave no
    room for the state in shared memory, and the kernel does not lower)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.fused_block import Layout

    N, H, W, C = x0.shape
    layout = Layout.of(H, W, 3, 3, triton_config(C).tile_rows)
    offsets = layout.offsets(3, 3)
    x0b = layout.to_buffer(x0)
    db = layout.to_buffer(jnp.broadcast_to(drive, x0.shape).astype(x0.dtype))
    call = _mosaic_call(
        functools.partial(forward_kernel, layout, offsets, steps, h),
        layout,
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((steps + 1, N, layout.rows, C), jnp.float32),
            jax.ShapeDtypeStruct((steps, N, layout.rows, C), jnp.float32),
        ),
        barriers=[plgpu.Barrier(num_arrivals=2 + 2 * len(_chunks(0, layout.rows)))],
        transposed=False,
    )
    xs, zs = call(x0b, db)
    return layout, xs, zs


def backward_kernel(
    layout,
    offsets,
    steps,
    h,
    gk_ref,
    zs_ref,
    taps_hi,
    taps_lo,
    g0_ref,
    ss_ref,
    sbuf,
    zbuf,
    w_hi_ref,
    w_lo_ref,
    bar,
    zbar,
):
    """Pattern ``n``'s gradient from ``x_K`` back to ``x_0``, as ``fused_block``'s backward kernel:
    ``s_k = h relu'(z_k) g_{k+1}``, ``g_k = g_{k+1} + conv^T(s_k)`` (``offsets``: the mirrored taps;
    the taps transposed). ``g`` stays in registers, ``s_k`` double-buffered in shared memory (read
    as windows while ``s_{k-1}`` is written), each ``z_{k-1}`` tile brought in by TMA one tile
    ahead through two slots."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = jax.lax.axis_index("n")
    S, C = layout.slack, sbuf.shape[-1]
    tiles = layout.tiles * layout.tile_rows // M
    region = _chunks(0, layout.rows)

    def fetch_z(k, t):  # z_k's tile t into slot t % 2
        plgpu.copy_gmem_to_smem(zs_ref.at[k, n, pl.ds(S + t * M, M)], zbuf.at[t % 2], zbar.at[t % 2])

    def slope_tile(t, g):  # h relu'(z) g for the tile whose z is in its slot, masked
        plgpu.barrier_wait(zbar.at[t % 2])
        z = _load(zbuf, t % 2, slice(None), slice(None))
        return jnp.where(_inside(layout, t * M, C) & (z > 0), h * g, jnp.zeros_like(g))

    plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)
    plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
    for s0, size in region:  # g_K through buffer 1 into registers
        plgpu.copy_gmem_to_smem(gk_ref.at[n, pl.ds(s0, size)], sbuf.at[1, pl.ds(s0, size)], bar)
    plgpu.barrier_wait(bar)
    g = [_load(sbuf, 1, pl.ds(S + t * M, M), slice(None)) for t in range(tiles)]
    fetch_z(steps - 1, 0)
    for t in range(tiles):  # s_{K-1} into buffer 0
        if t + 1 < tiles:
            fetch_z(steps - 1, t + 1)
        sbuf[0, pl.ds(S + t * M, M), :] = slope_tile(t, g[t])
        plgpu.commit_smem()  # every thread is done with slot t % 2 before it is refilled
    for s0, size in region:
        plgpu.copy_smem_to_gmem(sbuf.at[0, pl.ds(s0, size)], ss_ref.at[steps - 1, n, pl.ds(s0, size)])

    def step(i, g, last=False):  # k = K-1-i: g_k from s_k (buffer i % 2), then s_{k-1} (the other)
        k = steps - 1 - i
        src, dst = i % 2, 1 - i % 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # s_{k+1}'s copy out of buffer dst is done
        if not last:
            fetch_z(k - 1, 0)
        g = list(g)
        for t in range(tiles):
            if not last and t + 1 < tiles:
                fetch_z(k - 1, t + 1)
            acc, _ = _conv_tile(sbuf, src, S + t * M, offsets, w_hi_ref, w_lo_ref)
            g[t] = jnp.where(_inside(layout, t * M, C), g[t] + acc, jnp.zeros_like(acc))
            if not last:
                sbuf[dst, pl.ds(S + t * M, M), :] = slope_tile(t, g[t])
                plgpu.commit_smem()
        if not last:
            plgpu.commit_smem()  # s_{k-1} complete
            for s0, size in region:
                plgpu.copy_smem_to_gmem(sbuf.at[dst, pl.ds(s0, size)], ss_ref.at[k - 1, n, pl.ds(s0, size)])
        return tuple(g)

    g = jax.lax.fori_loop(0, steps - 1, step, tuple(g))
    g = step(steps - 1, g, last=True)  # k = 0: g_0 only
    plgpu.commit_smem()
    buf = (steps - 1) % 2 + 0  # the buffer the last step read; the other one is free
    free = 1 - buf
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for t in range(tiles):
        sbuf[free, pl.ds(S + t * M, M), :] = g[t]
    plgpu.commit_smem()
    for s0, size in region:
        plgpu.copy_smem_to_gmem(sbuf.at[free, pl.ds(s0, size)], g0_ref.at[n, pl.ds(s0, size)])
    plgpu.wait_smem_to_gmem(0)


def fused_backward_wgmma(layout, g, zs, kernel, *, steps, h=1.0):
    """``(g_0, s_0 .. s_{K-1})`` as buffers, as ``fused_block.fused_backward`` (3x3, ReLU)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    N, C = g.shape[0], g.shape[-1]
    mirrored = [-off for off in layout.offsets(3, 3)]
    call = _mosaic_call(
        functools.partial(backward_kernel, layout, mirrored, steps, h),
        layout,
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((N, layout.rows, C), jnp.float32),
            jax.ShapeDtypeStruct((steps, N, layout.rows, C), jnp.float32),
        ),
        barriers=[
            plgpu.Barrier(num_arrivals=2 + len(_chunks(0, layout.rows))),
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
        ],
        transposed=True,
    )
    return call(layout.to_buffer(g), zs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="32x32x16,16x16x32", help="comma-separated HxWxC (C: 16 or 32)")
    parser.add_argument("--smoke", action="store_true", help="lower the kernels for CUDA only (any machine)")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: inputs, timing, errors
    import jax
    import jax.numpy as jnp

    from naisnet_jax import fused_block as fb

    os.makedirs(args.out, exist_ok=True)
    print("rel. error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in split_errors().items()))
    K = args.steps
    rows = []
    for shape in [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]:
        H, W, C = shape
        config = triton_config(C)
        layout = fb.Layout.of(H, W, 3, 3, config.tile_rows)
        forward = {
            "triton_tf32": functools.partial(fb.fused_forward, steps=K, h=1.0, activation="relu", config=config),
            "wgmma_bf16x3": functools.partial(fused_forward_wgmma, steps=K),
        }
        backward = {
            "triton_tf32": functools.partial(fb.fused_backward, steps=K, h=1.0, activation="relu", config=config),
            "wgmma_bf16x3": functools.partial(fused_backward_wgmma, steps=K),
        }
        forward = {k: jax.jit(lambda a, b, c, f=f: f(a, b, c)[1:]) for k, f in forward.items()}
        backward = {k: jax.jit(lambda g, z, c, f=f: f(layout, g, z, c)) for k, f in backward.items()}
        if args.smoke:
            x = jax.ShapeDtypeStruct((args.batch, *shape), jnp.float32)
            w = jax.ShapeDtypeStruct((3, 3, C, C), jnp.float32)
            zs = jax.ShapeDtypeStruct((K, args.batch, layout.rows, C), jnp.float32)
            for name, fn, args_ in (
                ("forward", forward["wgmma_bf16x3"], (x, x, w)),
                ("backward", backward["wgmma_bf16x3"], (x, zs, w)),
            ):
                text = fn.trace(*args_).lower(lowering_platforms=("cuda",)).as_text()
                print(
                    f"{H}x{W}x{C} {name} lowered for CUDA: {len(text)} characters of MLIR (batch {args.batch}, K = {K})"
                )
            continue
        x0, drive, kernel, cot = bench._inputs(args.batch, shape)
        # the reference: the Triton kernels in Pallas' interpreter, their products at the highest precision
        interpreted = config._replace(interpret=True)
        with jax.default_matmul_precision("highest"):
            ref_xs, ref_zs = jax.jit(
                lambda a, b, c: fb.fused_forward(a, b, c, steps=K, h=1.0, activation="relu", config=interpreted)[1:]
            )(x0, drive, kernel)
            ref_g0, ref_ss = jax.jit(
                lambda g, z, c: fb.fused_backward(
                    layout, g, z, c, steps=K, h=1.0, activation="relu", config=interpreted
                )
            )(cot, ref_zs, kernel)
        for name in forward:
            row = dict(shape=f"{H}x{W}x{C}", name=name)
            try:
                xs, zs = forward[name](x0, drive, kernel)
                row["err_xK_vs_highest"] = bench._rel(layout.interior(xs[-1]), layout.interior(ref_xs[-1]))
                row["err_zs_vs_highest"] = bench._rel(layout.interior(zs), layout.interior(ref_zs))
                row["forward_ms"] = 1e3 * bench._time(forward[name], (x0, drive, kernel), args.iters, args.repeats)
                g0, ss = backward[name](cot, ref_zs, kernel)  # both from the same (reference) z
                row["err_g0_vs_highest"] = bench._rel(layout.interior(g0), layout.interior(ref_g0))
                row["err_ss_vs_highest"] = bench._rel(layout.interior(ss), layout.interior(ref_ss))
                row["backward_ms"] = 1e3 * bench._time(backward[name], (cot, ref_zs, kernel), args.iters, args.repeats)
            except Exception as e:  # a kernel the compiler refuses is a row, not the end
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            print(row, flush=True)
    if args.smoke:
        return
    columns = [
        ("shape", "state", "s"),
        ("name", "kernels", "s"),
        ("forward_ms", "forward ms (saving xs, zs)", ".3f"),
        ("backward_ms", "backward ms", ".3f"),
        ("err_xK_vs_highest", "x_K rel err", ".1e"),
        ("err_zs_vs_highest", "z rel err", ".1e"),
        ("err_g0_vs_highest", "g_0 rel err", ".1e"),
        ("err_ss_vs_highest", "s rel err", ".1e"),
    ]
    text, md = _common.table(rows, columns)
    device = _common.device_summary()
    header = f"Block kernels of one block, batch {args.batch}, K = {K}, ReLU, on {device['device_kind']}"
    _common.write_results(args.out, "wgmma_block", dict(device=device, rows=rows), header + "\n\n" + md)
    print(header)
    print(text)


if __name__ == "__main__":
    main()
