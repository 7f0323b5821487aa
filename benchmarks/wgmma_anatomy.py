"""Benchmark (Hopper GPU): where a wgmma block kernel's time goes.

``naisnet_jax.hopper_block``'s forward and backward kernels at NAIS-Net10's two fused shapes
(batch 128, K = 10, ReLU, each at its default warpgroups), with the per-tile product
(``hopper_block._conv_tile``: nine windows loaded from shared memory, each split into bfloat16
``hi + lo``, three ``wgmma`` each) replaced by cheaper bodies. The bodies compute wrong values on
purpose; only their times count. Their differences say what each part costs:

- ``base``: the kernels as they are;
- ``cast_x3``: the windows rounded to bfloat16 (one conversion) in place of the bit-mask split,
  still three ``wgmma`` a tap: the split's cost is ``base - cast_x3``;
- ``split_x1``: the split, one ``wgmma`` a tap: two ``wgmma`` a tap cost ``base - split_x1``;
- ``load_once``: one window loaded and split per tile, its halves fed to all 27 ``wgmma``:
  the loads and splits of the other eight windows cost ``base - load_once``;
- ``no_wgmma``: the windows loaded and split, summed in registers, no ``wgmma``;
- ``empty``: the centre window only, no product: the kernel's frame (barriers, TMA, epilogue).

    python benchmarks/wgmma_anatomy.py --out=$OUT/wgmma_anatomy [--dump=DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

VARIANTS = ("base", "cast_x3", "split_x1", "load_once", "no_wgmma", "empty")


def conv_tile(kind: str):
    """A replacement for ``hopper_block._conv_tile`` (same signature and outputs' shapes)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax import hopper_block as hb

    original = hb._conv_tile
    if kind == "base":
        return original
    M = hb.M

    def body(buf, src, start, offsets, w_hi_ref, w_lo_ref, centre=None):
        C = buf.shape[-1]
        mid = offsets.index(0)

        def window(i):
            return hb._load(buf, src, pl.ds(start + offsets[i], M), slice(None))

        if kind == "empty":
            x = window(mid)
            return x, x
        if kind == "no_wgmma":
            total, kept = None, None
            for i in range(len(offsets)):
                x = window(i)
                kept = x if i == mid else kept
                hi, lo = hb.split_bf16(x)
                part = hi.astype(jnp.float32) + lo.astype(jnp.float32)
                total = part if total is None else total + part
            return total, kept

        def products(acc_ref):
            kept = None
            once = None
            for i in range(len(offsets)):
                if kind == "load_once":
                    if once is None:
                        x = window(mid)
                        once = (x, *hb.split_bf16(x))
                    x, hi, lo = once
                else:
                    x = window(i)
                    if kind == "cast_x3":
                        hi = lo = x.astype(jnp.bfloat16)
                    else:
                        hi, lo = hb.split_bf16(x)
                kept = x if i == mid else kept
                plgpu.wgmma(acc_ref, hi, w_hi_ref.at[i])
                if kind != "split_x1":
                    plgpu.wgmma(acc_ref, lo, w_hi_ref.at[i])
                    plgpu.wgmma(acc_ref, hi, w_lo_ref.at[i])
            plgpu.wgmma_wait(0)
            return acc_ref[...], kept

        return pl.run_scoped(products, plgpu.ACC((M, C), jnp.float32))

    return body


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="32x32x16,16x16x32", help="comma-separated HxWxC (C: 16 or 32)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dump", default=None, help="Mosaic's PTX, SASS, ptxas report (base kernels) under DIR")
    parser.add_argument("--smoke", action="store_true", help="lower the kernels for CUDA only (any machine)")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: inputs, timing
    import jax
    import jax.numpy as jnp
    from wgmma_block import triton_config

    from naisnet_jax import fused_block as fb
    from naisnet_jax import hopper_block as hb

    os.makedirs(args.out, exist_ok=True)
    if not args.smoke and not _common.hopper_here(args.out, "wgmma_anatomy"):
        return
    K = args.steps
    original = hb._conv_tile
    rows = []
    for shape in [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]:
        H, W, C = shape
        config = triton_config(C)
        layout = fb.Layout.of(H, W, 3, 3, config.tile_rows)
        nw = hb.choose_warpgroups(layout, C)
        config = config._replace(warpgroups=nw)
        x0, drive, kernel, cot = bench._inputs(args.batch, shape)
        for kind in args.variants.split(","):
            if kind not in VARIANTS:
                raise SystemExit(f"--variants: {kind!r} is not one of {VARIANTS}")
            row = dict(shape=f"{H}x{W}x{C}", warpgroups=nw, variant=kind)
            dump = _common.mosaic_dump_env(args.dump) if args.dump and kind == "base" else {}
            os.environ.update(dump)
            hb._conv_tile = conv_tile(kind)
            hb._forward_call.cache_clear()
            hb._backward_call.cache_clear()
            try:
                fwd = jax.jit(
                    lambda a, b, c: fb.fused_forward(a, b, c, steps=K, h=1.0, activation="relu", config=config)[1:]
                )
                bwd = jax.jit(
                    lambda g, z, c: fb.fused_backward(layout, g, z, c, steps=K, h=1.0, activation="relu", config=config)
                )
                if args.smoke:
                    zs = jax.ShapeDtypeStruct((K, args.batch, layout.rows, C), jnp.float32)
                    for name, fn, a in (("forward", fwd, (x0, drive, kernel)), ("backward", bwd, (cot, zs, kernel))):
                        text = fn.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
                        row[f"{name}_mlir_chars"] = len(text)
                else:
                    _, zs = fwd(x0, drive, kernel)
                    row["forward_ms"] = 1e3 * bench._time(fwd, (x0, drive, kernel), args.iters, args.repeats)
                    row["backward_ms"] = 1e3 * bench._time(bwd, (cot, zs, kernel), args.iters, args.repeats)
            except Exception as e:  # a kernel the compiler refuses is a row, not the end
                _common.error_row(row, e)
            finally:
                hb._conv_tile = original
                hb._forward_call.cache_clear()
                hb._backward_call.cache_clear()
                for key in dump:
                    os.environ.pop(key, None)
            rows.append(row)
            print(row, flush=True)
    if args.smoke:
        return
    columns = [
        ("shape", "state", "s"),
        ("warpgroups", "warpgroups", "d"),
        ("variant", "per-tile body", "s"),
        ("forward_ms", "forward ms", ".3f"),
        ("backward_ms", "backward ms", ".3f"),
    ]
    header = f"Anatomy of the wgmma block kernels, batch {args.batch}, K = {K}, ReLU, on {{device}}"
    _common.report(args.out, "wgmma_anatomy", header, rows, columns)


if __name__ == "__main__":
    main()
