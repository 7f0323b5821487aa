"""Benchmark (GPU): where the weight-gradient kernel's time goes, by taking parts of it away.

Session 26 (H200, ``benchmarks/results/s26/a``): without masks the kernel took 0.149 against 0.196
ms at 32x32x16, so the library now masks only the edge tiles' windows
(``fused_block._edge_split``), and "as is" below is that kernel (0.158 ms in call ``b``). The
figures that follow are from before.

The blocks' weight gradient (``naisnet_jax.fused_block.fused_weight_grad`` with ``sum_steps=True``,
the default since session 25) takes 0.197 ms at 32x32x16 and 0.154 ms at 16x16x32 on an H200
(batch 128, 9 steps): 36 of them are ~6 ms of NAIS-Net10's ~26.4 ms step, on the main stream.
What they move (the saved ``x_k`` and ``s_k``, ~150 MB a block) takes ~40 us at the card's
bandwidth, and their products, as TF32 on the tensor cores, a few us. So most of the time is
neither. Each tile of 32 rows loads ``s_k``, transposes it for the products, loads the nine
windows of ``x_k`` (each masked at the buffer's ends), and accumulates nine ``(C, rows) @ (rows,
C)`` products.

This script times the kernel as it is, then with one part taken away at a time. The values are
wrong on purpose, except the first row's and the row with ``s`` given transposed:

- ``as is``: the library's kernel (its own code path);
- ``no masks``: the windows not masked;
- ``centre window``: one load of ``x_k`` a tile, used for all nine products;
- ``s given transposed``: ``s_k^T`` read from a ``(K, N, C, rows)`` buffer, made beforehand and
  outside the timing, instead of transposed in registers (what a backward kernel that wrote
  ``s_k`` transposed would allow; the values are right);
- ``no products``: loads and masks only; each window is summed over its rows into the
  accumulators;
- ``products on s only``: no ``x`` loads; the nine products take ``s_k`` as their window too.

    python benchmarks/wgrad_anatomy.py --out=$OUT/wgrad_anatomy
    python benchmarks/wgrad_anatomy.py --out=/tmp/wgrad_anatomy --smoke     # interpreter, CPU, tiny
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = [(32, 32, 16), (16, 16, 32)]
MODES = ["as is", "no masks", "centre window", "s given transposed", "no products", "products on s only"]


def kernel(layout, offsets, steps, rows, chunks, mode, xs_ref, s_ref, st_ref, dw_ref, sum_ref):
    """``fused_block._weight_grad_sum_kernel`` with the part ``mode`` names taken away (or, for
    ``"s given transposed"``, ``s_k^T`` read from ``st_ref``)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _index

    p = _index(pl.program_id(0))
    n, c = p // chunks, p % chunks
    S, C = layout.slack, dw_ref.shape[-1]
    end = S + layout.tiles * layout.tile_rows
    count = layout.tiles * layout.tile_rows // rows // chunks

    def tile(i, acc):
        q = S + (c * count + _index(i)) * rows
        r = q + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        masks = {off: (r + off >= S) & (r + off < end) for off in offsets}

        def step(k, carry):
            acc, total = carry
            k = _index(k)
            s = s_ref[k, n, pl.ds(q, rows)]
            sT = st_ref[k, n, :, pl.ds(q, rows)] if mode == "s given transposed" else s.T
            centre = xs_ref[k, n, pl.ds(q, rows)] if mode == "centre window" else None
            out = []
            for acc_t, off in zip(acc, offsets):
                if mode == "products on s only":
                    x = s
                elif centre is not None:
                    x = centre
                else:
                    x = xs_ref[k, n, pl.ds(q + off, rows)]
                if mode not in ("no masks", "products on s only"):
                    x = jnp.where(masks[off], x, jnp.zeros_like(x))
                if mode == "no products":
                    out.append(acc_t + jnp.sum(x, axis=0)[None, :])
                else:
                    out.append(acc_t + jnp.dot(sT, x, preferred_element_type=x.dtype))
            return tuple(out), total + s

        acc, total = lax.fori_loop(0, steps, step, (acc, jnp.zeros((rows, C), sum_ref.dtype)))
        sum_ref[n, pl.ds(q, rows)] = total
        return acc

    zero = jnp.zeros((C, C), dw_ref.dtype)
    acc = lax.fori_loop(0, count, tile, tuple(zero for _ in offsets))
    for t, acc_t in enumerate(acc):
        dw_ref[p, t] = acc_t


def variant(layout, kernel_shape, config, mode):
    """``(xs, ss, sts) -> (dW, sum_k s_k)`` for ``mode`` (``"as is"``: the library's function)."""
    import fused_block as bench  # benchmarks/fused_block.py: the weight-gradient benchmarks' helpers
    import jax

    from naisnet_jax import fused_block as fb

    if mode == "as is":
        return bench.wgrad_library(layout, kernel_shape, config)
    C = kernel_shape[-1]
    rows, warps = fb._wgrad_rows(layout, C, sum_steps=True)
    chunks = fb._chunks_of(fb._wgrad_runs(layout, C, sum_steps=True), fb.WGRAD_SUM_CHUNKS.get(C, 1))
    offsets = layout.offsets(*kernel_shape[:2])

    def run(xs, ss, sts):
        steps, N = ss.shape[:2]
        body = functools.partial(kernel, layout, offsets, steps, rows, chunks, mode)
        parts = jax.ShapeDtypeStruct((N * chunks, len(offsets), C, C), ss.dtype)
        out_shape = (parts, jax.ShapeDtypeStruct(ss.shape[1:], ss.dtype))
        call = fb._pallas(body, out_shape, N * chunks, config, num_warps=warps, num_stages=fb.WGRAD_STAGES)
        dWparts, total = call(xs, ss, sts)
        return fb._kernel_of_parts(dWparts, kernel_shape), layout.interior(total)

    return jax.jit(run)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="batch 2, two steps, the interpreter: a CPU check")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: the weight-gradient benchmarks' helpers
    import jax.numpy as jnp

    batch, steps = (2, 2) if args.smoke else (args.batch, args.steps)
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    rows = []
    for H, W, C in SHAPES:
        config, layout, xs, ss = bench.wgrad_setup((H, W, C), batch, steps, args.smoke, nan_slack=False)
        sts = jnp.swapaxes(ss, -1, -2)  # (K, N, C, rows): s_k^T, made outside the timing
        ref = None
        for mode in MODES:
            row = dict(shape=f"{H}x{W}x{C}", mode=mode)
            make = functools.partial(variant, layout, (3, 3, C, C), config, mode)
            ref = bench.wgrad_row(row, make, (xs, ss, sts), ref, iters, repeats)
            rows.append(row)
    bench.ratios_to(rows, "vs_as_is", lambda r: r["mode"] == "as is")
    columns = [
        ("shape", "shape", ""),
        ("mode", "kernel", ""),
        ("ms", "ms", ".4f"),
        ("vs_as_is", "x as is", ".2f"),
        ("dW_diff", "dW diff vs as is", ".1e"),
    ]
    header = f"The weight-gradient kernel with parts taken away, batch {batch}, {steps} steps, on {{device}}"
    _common.report(args.out, "wgrad_anatomy", header, rows, columns)


if __name__ == "__main__":
    main()
