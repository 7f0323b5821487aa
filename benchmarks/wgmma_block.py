"""Benchmark (Hopper GPU): one conv block's kernels, wgmma (``naisnet_jax.kernels.wgmma_split``,
``wgmma_tf32``) against Triton.

For each state shape NAIS-Net10 fuses (32x32x16, 16x16x32; ``--shapes``), batch 128, K = 10,
ReLU: the forward kernel (saving every state and pre-activation) and the backward kernel of
``naisnet_jax.kernels.triton_conv`` (TF32 products) and of ``naisnet_jax.kernels.wgmma_split`` with every
warpgroup count that divides the state's 64-row tiles and fits in shared memory (``--warpgroups``),
best time over repeats, and each one's values against the Triton kernels run in Pallas'
interpreter at the highest precision (relative max error of ``x_K``, the ``z_k``, ``g_0`` and the
``s_k``; the backward kernels all take the reference ``z_k``; for ReLU the wgmma forward saves
``1[z_k > 0]`` in place of ``z_k``, and its z column is the share of signs that differ). The table also prints the split
products' error on one tile against float64 (:func:`split_errors`). ``--smoke`` (any machine)
only lowers the wgmma kernels for CUDA.

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


def split_errors(seed: int = 0) -> dict:
    """Relative max error against float64 of float32 products of a tile's shape ((4096 x 144) @
    (144 x 16)) as one product of the truncated bfloat16 halves, as TF32 and as the kernels'
    three products."""
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax.kernels.wgmma_split import split_bf16

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4096, 144)).astype(np.float32)
    w = (0.1 * rng.standard_normal((144, 16))).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)

    def tf32(a):  # to nearest on the 10-bit mantissa
        bits = (a.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64)

    (x_hi, x_lo), (w_hi, w_lo) = (
        [np.asarray(v.astype(jnp.float32), np.float64) for v in split_bf16(jnp.asarray(a))] for a in (x, w)
    )
    variants = {
        "bf16 x1": x_hi @ w_hi,
        "TF32": tf32(x) @ tf32(w),
        "bf16 x3": x_hi @ w_hi + x_lo @ w_hi + x_hi @ w_lo,
    }
    scale = np.max(np.abs(ref))
    return {name: float(np.max(np.abs(v - ref)) / scale) for name, v in variants.items()}


def triton_config(C: int):
    """The Triton kernels' configuration at width ``C`` (its tiling decides the buffers' layout)."""
    from naisnet_jax.kernels import conv as fb
    from naisnet_jax.kernels.tuning import default_tiling

    rows, warps = default_tiling(C)
    if C > 32:  # an 8x8 state in two 64-row tiles, not one of 256 rows (the wgmma kernels' tiles)
        rows = 64
    return fb.GPU._replace(tile_rows=rows, num_warps=warps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--shapes", default="32x32x16,16x16x32", help="comma-separated HxWxC (C: 16 or 32; 64: the TF32 kernels only)"
    )
    parser.add_argument(
        "--warpgroups", default="1,2,3,4,5,6", help="warpgroups a pattern's program has (those dividing its tiles)"
    )
    parser.add_argument(
        "--dump",
        default=None,
        help="write Mosaic's PTX, SASS and ptxas report (its warnings say whether wgmma is serialized) under DIR",
    )
    parser.add_argument(
        "--engines", default="bf16x3,tf32", help="wgmma kernels: bf16x3 (wgmma_split), tf32 (wgmma_tf32)"
    )
    parser.add_argument("--smoke", action="store_true", help="lower the kernels for CUDA only (any machine)")
    args = parser.parse_args(argv)
    if args.dump:
        os.environ.update(_common.mosaic_dump_env(args.dump))
    _common.importable()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax.kernels import conv as fb
    from naisnet_jax.kernels import wgmma_split as hb
    from naisnet_jax.kernels import wgmma_tf32 as ht
    from naisnet_jax.kernels.common import Layout
    from naisnet_jax.kernels.wgmma_common import SMEM_BYTES, tiles_of

    os.makedirs(args.out, exist_ok=True)
    if not args.smoke and not _common.hopper_here(args.out, "wgmma_block"):
        return
    print("rel. error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in split_errors().items()))
    K = args.steps
    rows = []
    for shape in [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]:
        H, W, C = shape
        config = triton_config(C)
        layout = Layout.of(H, W, 3, 3, config.tile_rows)
        aligned = config._replace(tf32=True).layout(H, W, 3, 3)

        def fits(nw, tf32):  # the warpgroups divide the tiles, and the program fits in shared memory
            lay, need = (aligned, ht.smem_bytes(aligned, C, nw)) if tf32 else (layout, hb.smem_bytes(layout, C, nw))
            return tiles_of(lay) % nw == 0 and need <= SMEM_BYTES

        teams = [int(v) for v in args.warpgroups.split(",")]
        forward = {"triton_tf32": functools.partial(fb.fused_forward, steps=K, h=1.0, activation="relu", plan=config)}
        backward = {"triton_tf32": functools.partial(fb.fused_backward, steps=K, h=1.0, activation="relu", plan=config)}
        configs = {"triton_tf32": config}
        for nw in teams:
            for engine, tf32 in (("wgmma_bf16x3", False), ("wgmma_tf32_views", True)):
                if tf32 and "tf32" not in args.engines or not tf32 and "bf16x3" not in args.engines:
                    continue
                if not fits(nw, tf32) or not tf32 and C not in (16, 32):
                    continue
                wgmma = config._replace(warpgroups=nw, tf32=tf32)
                configs[f"{engine} {nw}wg"] = wgmma
                forward[f"{engine} {nw}wg"] = functools.partial(
                    fb.fused_forward, steps=K, h=1.0, activation="relu", plan=wgmma
                )
                backward[f"{engine} {nw}wg"] = functools.partial(
                    fb.fused_backward, steps=K, h=1.0, activation="relu", plan=wgmma
                )
        layouts = {k: c.layout(H, W, 3, 3) for k, c in configs.items()}  # TF32's rows: a multiple of 8
        forward = {k: jax.jit(lambda a, b, c, f=f: f(a, b, c)[1:]) for k, f in forward.items()}
        backward = {k: jax.jit(lambda g, z, c, f=f, k=k: f(layouts[k], g, z, c)) for k, f in backward.items()}
        if args.smoke:
            x = jax.ShapeDtypeStruct((args.batch, *shape), jnp.float32)
            w = jax.ShapeDtypeStruct((3, 3, C, C), jnp.float32)
            for key in [k for k in forward if k.startswith("wgmma")]:
                zs = jax.ShapeDtypeStruct((K, args.batch, layouts[key].rows, C), jnp.float32)
                for name, fn, args_ in (("forward", forward[key], (x, x, w)), ("backward", backward[key], (x, zs, w))):
                    text = fn.trace(*args_).lower(lowering_platforms=("cuda",)).as_text()
                    print(
                        f"{H}x{W}x{C} {name}, {key}, lowered for CUDA: {len(text)} characters of MLIR"
                        f" (batch {args.batch}, K = {K})"
                    )
            continue
        x0, drive, kernel, cot = _common.conv_block_inputs(args.batch, shape)
        # the reference: the Triton kernels in Pallas' interpreter, their products at the highest
        # precision, once for each layout (TF32's rows are a multiple of 8)
        refs = {}
        for tf32 in sorted({c.tf32 for c in configs.values()}):
            interpreted = config._replace(interpret=True, tf32=tf32)
            lay = interpreted.layout(H, W, 3, 3)
            with jax.default_matmul_precision("highest"):
                ref_xs, ref_zs = jax.jit(
                    lambda a, b, c, i=interpreted: fb.fused_forward(a, b, c, steps=K, h=1.0, activation="relu", plan=i)[
                        1:
                    ]
                )(x0, drive, kernel)
                ref_g0, ref_ss = jax.jit(
                    lambda g, z, c, i=interpreted, lay=lay: fb.fused_backward(
                        lay, g, z, c, steps=K, h=1.0, activation="relu", plan=i
                    )
                )(cot, ref_zs, kernel)
            refs[lay] = (ref_xs, ref_zs, ref_g0, ref_ss)
        for name in forward:
            row = dict(shape=f"{H}x{W}x{C}", name=name)
            layout = layouts[name]
            ref_xs, ref_zs, ref_g0, ref_ss = refs[layout]
            try:
                xs, zs = forward[name](x0, drive, kernel)
                row["err_xK_vs_highest"] = _common.rel_error(layout.interior(xs[-1]), layout.interior(ref_xs[-1]))
                if zs.dtype != ref_zs.dtype:  # ReLU's sign, saved in place of z: the share of signs that differ
                    signs = np.asarray(layout.interior(zs), np.float32) != (np.asarray(layout.interior(ref_zs)) > 0)
                    row["err_zs_vs_highest"] = float(np.mean(signs))
                else:
                    row["err_zs_vs_highest"] = _common.rel_error(layout.interior(zs), layout.interior(ref_zs))
                row["forward_ms"] = 1e3 * _common.best_time(
                    forward[name], (x0, drive, kernel), args.iters, args.repeats
                )
                g0, ss = backward[name](cot, ref_zs, kernel)  # both from the same (reference) z
                row["err_g0_vs_highest"] = _common.rel_error(layout.interior(g0), layout.interior(ref_g0))
                row["err_ss_vs_highest"] = _common.rel_error(layout.interior(ss), layout.interior(ref_ss))
                row["backward_ms"] = 1e3 * _common.best_time(
                    backward[name], (cot, ref_zs, kernel), args.iters, args.repeats
                )
            except Exception as e:  # a kernel the compiler refuses is a row, not the end
                _common.error_row(row, e)
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
    header = f"Block kernels of one block, batch {args.batch}, K = {K}, ReLU, on {{device}}"
    _common.report(args.out, "wgmma_block", header, rows, columns)


if __name__ == "__main__":
    main()
