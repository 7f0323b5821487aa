"""Benchmark (Hopper GPU): a conv step's windows as ``wgmma`` views, the experiment behind
``naisnet_jax.hopper_tf32``.

The wgmma block kernels (``naisnet_jax.hopper_block``) load each of a tile's nine windows from
shared memory into registers (any row offset), split it into bfloat16 halves and multiply from
registers. Session 23's anatomy put those loads and splits at about half of the kernels' time
(``BENCHMARKS.md``, "Session 28"). In ``wgmma``'s unswizzled layout a core matrix is 8 rows of
16 bytes, contiguous; with the state kept as bfloat16 *planes* of 8 channels (``(rows, 8)``,
16-byte rows), the window at row offset ``r`` is a shared-memory descriptor: start ``plane + 16 r``,
128 bytes between core matrices along M (8 positions), the plane stride along K (8 channels). No
loads, no splits: the halves are written once, when the state is.

Mosaic GPU's ``wgmma`` takes only swizzled operands, so the products here are built one level
down, inside ``plgpu.inline_mgpu``: each window's descriptor by ``mma_utils.encode_descriptor``
(no swizzle), the taps' by ``mma_utils.create_descriptor`` as Mosaic's own ``wgmma`` builds them,
the instructions by ``wgmma.wgmma_m64``.

Three kernels, one program per pattern, one warpgroup, every tile of a pattern's state:

- ``views``: the state's halves come in as planes ``(2, C / 8, rows, 8)`` bfloat16; each tile's
  ``z = sum_t window_t @ w_t`` as three products a tap (``hi w_hi + lo w_hi + hi w_lo``), the
  windows as views;
- ``tf32``: the float32 state itself as planes of 4 channels, one TF32 product a tap and 8
  channels (what ``hopper_tf32`` does);
- ``registers``: the library's bf16 x 3 way, the float32 state in shared memory, each window
  loaded and split (``hopper_block._conv_tile``).

Session 29 (H200, ``benchmarks/results/s29/a_window_views_h200``), a step: 13.9 / 6.3 / 2.9 us
(registers / views / tf32) at 32x32x16, 11.1 / 2.5 / 1.7 us at 16x16x32.

On a GPU the script checks each against a float64 convolution and times it at NAIS-Net10's
shapes (32x32x16, 16x16x32, batch 128); ``--smoke`` (any machine) lowers them for CUDA.

    python benchmarks/window_views.py --out=$OUT/window_views
    python benchmarks/window_views.py --out=/tmp/wv --smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

M = 64  # rows of a tile, the M of one wgmma
PLANE = 8  # channels of a plane: one core matrix's 16 bytes of bfloat16


def planes_of(buf):
    """``(N, rows, C)`` float32 -> ``(N, 2, C / 8, rows, 8)`` bfloat16: the hi and lo halves
    (``hopper_block.split_bf16``) as planes of 8 channels."""
    import jax.numpy as jnp

    from naisnet_jax.hopper_block import split_bf16

    N, rows, C = buf.shape
    halves = jnp.stack(split_bf16(buf), axis=1)  # (N, 2, rows, C)
    halves = jnp.pad(halves, ((0, 0), (0, 0), (0, _rows8(rows) - rows), (0, 0)))
    return jnp.moveaxis(halves.reshape(N, 2, _rows8(rows), C // PLANE, PLANE), 3, 2)


def _rows8(rows: int) -> int:
    """Rows of a plane: a multiple of 8, so that every TMA chunk of it moves a multiple of 128
    bytes (Mosaic GPU's rule for a warpgroup's copies)."""
    return -(-rows // 8) * 8


def _view_products(offsets, C, start):
    """The mgpu function of one tile's products: ``(ctx, planes, w_hi, w_lo) -> z`` (WGMMA
    layout), ``planes`` the ``(2, C / 8, rows, 8)`` bfloat16 halves in shared memory, the taps
    ``(9, C, C)`` split and swizzled as ``hopper_block`` keeps them; ``start`` the tile's first row."""
    from naisnet_jax import hopper_tf32

    # the modules, not the package's functions of the same names
    ir, _, _, _, _, mma_utils, utils, wgmma, _ = hopper_tf32._mgpu()

    swizzle = min(128, 2 * C)  # the taps' rows: C bfloat16
    k_group = swizzle // 2  # K of one wgmma_m64 call (its instructions: k_group / 16 of them)

    def products(ctx, planes, w_hi, w_lo):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        rows = ir.MemRefType(planes.type).shape[2]
        base = utils.memref_ptr(planes)
        issue = functools.partial(issue_products, w_hi, w_lo, i8, rows, base)
        return hopper_tf32.wgmma_sum(C, ir.BF16Type.get(), issue)  # the library's frame and JAX shim

    def issue_products(w_hi, w_lo, i8, rows, base, regs, types):
        plane_bytes = rows * PLANE * 2
        for t, off in enumerate(offsets):
            for half, w in ((0, w_hi), (1, w_hi), (0, w_lo)):  # hi w_hi + lo w_hi + hi w_lo
                # A, the window: K-major and unswizzled, core matrices of 8 rows x 16 B, 128 B
                # apart along M (8 positions), a plane apart along K (8 channels)
                offset = ((half * (C // PLANE)) * rows + start + off) * PLANE * 2
                a_desc = mma_utils.encode_descriptor(
                    utils.getelementptr(base, [offset], i8),
                    leading_byte_offset=plane_bytes,
                    stride_byte_offset=PLANE * PLANE * 2,
                    swizzle=None,
                )
                (b_desc, b_k_stride), _, b_fastest = mma_utils.create_descriptor(
                    utils.memref_slice(w, t),
                    swizzle=swizzle,
                    large_tile=(k_group, k_group),
                    group_size=(k_group, C),
                    logical_k_major=True,
                )
                regs[0:1] = wgmma.wgmma_m64(
                    regs[0:1],
                    a_desc,
                    b_desc,
                    swizzle=swizzle,
                    n=C,
                    **types,
                    a_transpose=False,
                    a_k_stride=2 * plane_bytes,  # the next 16 channels: two planes on
                    b_transpose=b_fastest != mma_utils.Dim.K,
                    b_k_stride=b_k_stride[1][0],
                )

    return products


def _tile_starts(layout):
    from naisnet_jax.hopper_block import tiles_of

    return [layout.slack + j * M for j in range(tiles_of(layout))]


def _each_tile(layout, copies, bar, stage, z_ref, n, tile, steps=1):
    """Every kernel's frame: every ``(gmem, smem)`` pair of ``copies`` in by TMA (the taps, the
    state, into both of its buffers), then each tile's ``z = tile(first row, buffer)`` out through
    the staging slot to ``z_ref[n, j]``. With ``steps > 1`` every tile's products are first
    computed ``steps - 1`` more times into the staging slot only, reading buffer ``k % 2`` at
    step ``k`` as a K-step kernel would (the difference of two ``steps`` is a step's cost with
    the copies in and out taken away)."""
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)

    def again(k, carry):  # reads buffer k % 2, as a K-step kernel's ping-pong buffers
        for q0 in _tile_starts(layout):
            stage[...] = tile(q0, k % 2)
        return carry

    jax.lax.fori_loop(0, steps - 1, again, 0)
    for j, q0 in enumerate(_tile_starts(layout)):
        stage[...] = tile(q0, 0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, z_ref.at[n, j])
        plgpu.wait_smem_to_gmem(0)


def views_kernel(layout, offsets, steps, planes_ref, w_hi_g, w_lo_g, z_ref, planes, w_hi, w_lo, stage, bar):
    """Pattern ``n``: every tile's ``z`` from the planes, the windows as descriptor views."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import _chunks, _swizzled

    n = jax.lax.axis_index("n")
    C = stage.shape[-1]
    swizzled = _swizzled(C)
    copies = [(w_hi_g, w_hi), (w_lo_g, w_lo)]
    for buf in range(2):
        for h in range(2):
            for g in range(C // PLANE):
                for s0, size in _chunks(0, planes.shape[3]):
                    copies.append((planes_ref.at[n, h, g, pl.ds(s0, size)], planes.at[buf, h, g, pl.ds(s0, size)]))

    def tile(q0, src):
        products = plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(), plgpu.RefType(swizzled), plgpu.RefType(swizzled)),
            return_type=plgpu.ShapeDtypeStruct((M, C), jnp.float32, layout=plgpu.Layout.WGMMA),
        )(_view_products(offsets, C, q0))
        return products(planes.at[src], w_hi, w_lo)

    _each_tile(layout, copies, bar, stage, z_ref, n, tile, steps)


def tf32_kernel(layout, offsets, steps, planes_ref, taps_g, z_ref, planes, taps, stage, bar):
    """Pattern ``n``: every tile's ``z`` from the float32 planes in TF32, the windows as views."""
    import jax
    from jax.experimental import pallas as pl

    from naisnet_jax import hopper_tf32 as ht
    from naisnet_jax.hopper_block import _chunks

    n = jax.lax.axis_index("n")
    C = stage.shape[-1]
    copies = [(taps_g, taps)]
    for buf in range(planes.shape[0]):
        for g in range(C // 4):
            for s0, size in _chunks(0, planes.shape[2]):
                copies.append((planes_ref.at[n, g, pl.ds(s0, size)], planes.at[buf, g, pl.ds(s0, size)]))

    def tile(q0, src):  # the library's products (hopper_tf32), the tile counted from the slack
        return ht._products(layout, offsets, planes, src if planes.shape[0] == 2 else 0, q0 - layout.slack, taps)

    _each_tile(layout, copies, bar, stage, z_ref, n, tile, steps)


def registers_kernel(layout, offsets, steps, x_ref, w_hi_g, w_lo_g, z_ref, buf, w_hi, w_lo, stage, bar):
    """Pattern ``n``: every tile's ``z`` as the library's kernels compute it (each window loaded
    from the float32 state and split, ``hopper_block._conv_tile``)."""
    import jax
    from jax.experimental import pallas as pl

    from naisnet_jax.hopper_block import _chunks, _conv_tile

    n = jax.lax.axis_index("n")
    copies = [(w_hi_g, w_hi), (w_lo_g, w_lo)]
    for b in range(2):
        copies += [(x_ref.at[n, pl.ds(s0, size)], buf.at[b, pl.ds(s0, size)]) for s0, size in _chunks(0, layout.rows)]
    _each_tile(
        layout, copies, bar, stage, z_ref, n, lambda q0, src: _conv_tile(buf, src, q0, offsets, w_hi, w_lo)[0], steps
    )


def tf32_planes_of(buf):
    """``(N, rows, C)`` float32 -> ``(N, C / 4, rows8, 4)``: the state as planes of 4 channels."""
    import jax.numpy as jnp

    N, rows, C = buf.shape
    padded = jnp.pad(buf, ((0, 0), (0, _rows8(rows) - rows), (0, 0)))
    return jnp.moveaxis(padded.reshape(N, _rows8(rows), C // 4, 4), 2, 1)


KINDS = ("registers", "views", "tf32")


def state_of(buf, which: str):
    """The kernel ``which``'s state argument from the buffer ``(N, rows, C)`` float32."""
    return {"registers": lambda b: b, "views": planes_of, "tf32": tf32_planes_of}[which](buf)


def build(layout, C: int, which: str, steps: int = 1):
    """``f(state, taps (9, C, C) float32) -> z (N, tiles, 64, C)``, the state ``state_of(buffer,
    which)``; every tile's products computed ``steps`` times (``_each_tile``)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import _chunks, _swizzled, split_bf16, tiles_of

    offsets = layout.offsets(3, 3)
    swizzled = _swizzled(C)

    def run(arg, taps):
        N = arg.shape[0]
        out_type = jax.ShapeDtypeStruct((N, tiles_of(layout), M, C), jnp.float32)
        if which == "tf32":
            from naisnet_jax.hopper_tf32 import taps_transforms

            body = functools.partial(tf32_kernel, layout, offsets, steps)
            rows = _rows8(layout.rows)
            buffers = 1 if C > 32 else 2  # 64 channels: the float32 taps take 147 KB
            scratch = [
                plgpu.SMEM((buffers, C // 4, rows, 4), jnp.float32),
                plgpu.SMEM((9, C, C), jnp.float32, transforms=taps_transforms(C)),
            ]
            loads = 1 + buffers * (C // 4) * len(_chunks(0, rows))
            args = (arg, jnp.swapaxes(taps.astype(jnp.float32), 1, 2))
        else:
            taps_smem = [plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled)] * 2
            if which == "views":
                body = functools.partial(views_kernel, layout, offsets, steps)
                rows = _rows8(layout.rows)
                state = plgpu.SMEM((2, 2, C // PLANE, rows, PLANE), jnp.bfloat16)
                loads = 2 + 4 * (C // PLANE) * len(_chunks(0, rows))
            else:
                body = functools.partial(registers_kernel, layout, offsets, steps)
                state = plgpu.SMEM((2, layout.rows, C), jnp.float32)
                loads = 2 + 2 * len(_chunks(0, layout.rows))
            scratch = [state, *taps_smem]
            args = (arg, *split_bf16(taps.astype(jnp.float32)))
        body.__name__ = f"window_{which}_kernel"
        call = plgpu.kernel(
            body,
            out_type=out_type,
            scratch_types=[*scratch, plgpu.SMEM((M, C), jnp.float32), plgpu.Barrier(num_arrivals=loads)],
            grid=(N,),
            grid_names=("n",),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        )
        return call(*args)

    return jax.jit(run)


def reference(layout, buf, taps):
    """Every tile's ``z`` in float64 (numpy): ``z[q] = sum_t buf[q + off_t] @ w_t`` for the tiled rows."""
    import numpy as np

    from naisnet_jax.hopper_block import tiles_of

    buf, taps = np.asarray(buf, np.float64), np.asarray(taps, np.float64)
    q = layout.slack + np.arange(tiles_of(layout) * M)
    z = sum(buf[:, q + off] @ taps[t] for t, off in enumerate(layout.offsets(3, 3)))
    return z.reshape(buf.shape[0], tiles_of(layout), M, buf.shape[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=11, help="products per tile in the second timing")
    parser.add_argument("--smoke", action="store_true", help="lower both kernels for CUDA only (any machine)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    parser.add_argument("--dump", default=None, help="every kernel's PTX, SASS and ptxas report under DIR")
    args = parser.parse_args(argv)
    _common.importable()
    if args.dump:
        os.environ.update(_common.mosaic_dump_env(args.dump))
    import fused_block as bench  # benchmarks/fused_block.py: _time, _rel
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax import fused_block as fb

    rows = []
    for H, C in ((32, 16), (16, 32), (8, 64)):
        layout = fb.Layout.of(H, H, 3, 3, 64 if C > 32 else fb.default_tiling(C)[0])  # 8x8: two 64-row tiles
        rng = np.random.default_rng(0)
        image = rng.standard_normal((args.batch, H, H, C)).astype(np.float32)
        buf = layout.to_buffer(jnp.asarray(image))  # zero padding and slack, as the kernels' buffers
        taps = jnp.asarray((0.1 * rng.standard_normal((9, C, C))).astype(np.float32))
        ref = None if args.smoke else reference(layout, buf, taps)
        for which in args.kinds.split(","):
            if which not in KINDS:
                raise SystemExit(f"--kinds: {which!r} is not one of {KINDS}")
            row = dict(shape=f"{H}x{H}x{C}", kernel=which)
            if C > 32 and which != "tf32":  # their bfloat16 halves and taps do not fit in shared memory
                continue
            arg = state_of(buf, which)
            f = build(layout, C, which)
            if args.smoke:
                g = build(layout, C, which, args.steps)
                texts = [k.trace(arg, taps).lower(lowering_platforms=("cuda",)).as_text() for k in (f, g)]
                row["lowered"] = all("mosaic_gpu" in text for text in texts)
            else:
                try:
                    row["err_vs_f64"] = bench._rel(f(arg, taps), ref)
                    row["ms"] = 1e3 * bench._time(f, (arg, taps), args.iters, args.repeats)
                    g = build(layout, C, which, args.steps)
                    row["err_steps"] = bench._rel(g(arg, taps), ref)
                    row["ms_steps"] = 1e3 * bench._time(g, (arg, taps), args.iters, args.repeats)
                    row["us_a_step"] = 1e3 * (row["ms_steps"] - row["ms"]) / (args.steps - 1)
                except Exception as e:  # a failure is a row, the other kernel still runs
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
    columns = [
        ("shape", "shape", ""),
        ("kernel", "windows", ""),
        ("ms", "ms", ".4f"),
        ("ms_steps", f"ms, {args.steps} steps", ".4f"),
        ("us_a_step", "us a further step", ".1f"),
        ("err_vs_f64", "rel err vs float64", ".1e"),
        ("err_steps", f"rel err, {args.steps} steps", ".1e"),
        ("lowered", "lowered for CUDA", ""),
        ("error", "error", ""),
    ]
    header = f"One conv step's products over every tile, batch {args.batch}, on {{device}}"
    _common.report(args.out, "window_views", header, rows, columns)


if __name__ == "__main__":
    main()
