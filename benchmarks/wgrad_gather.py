"""Benchmark (GPU): the weight-gradient kernel with eight windows gathered into one wide product.

The blocks' weight gradient (``naisnet_jax.fused_block.fused_weight_grad``, ``sum_steps=True``)
is the largest item of NAIS-Net10's step after the block kernels: 36 calls of 0.13 to 0.18 ms on
the main stream, ~5.5 ms of a ~26 ms step on an H200 (session 26's profile). For every tile of
32 rows and every step it loads ``s_k`` and the nine windows of ``x_k`` and accumulates nine
``(C, rows) @ (rows, C)`` products: 16-wide at 16 channels, each with its own operand staging.
Session 26's anatomy found the products and their staging, not the loads from memory, to bound
it (``benchmarks/wgrad_anatomy.py``: 0.100 ms with no ``x`` loads at all, against a memory
floor of ~0.04 ms).

Here the first eight windows come in as one gathered load: their rows are ``q + r + offset_t``
(an integer index array), their channels a slice, so the load is ``(rows, 8, C)``, reshaped to
``(rows, 8 C)``; one product then covers eight taps (``s^T @ X``, ``(C, 8C)``), the ninth tap
stays on its own. Triton wants power-of-two shapes, so eight taps go together, not nine.

- ``as is``: the library's kernel;
- ``gather8, s^T X``: eight taps as one ``(C, rows) @ (rows, 8C)`` product;
- ``gather8, X^T s``: the same products the other way round, ``(8C, rows) @ (rows, C)``.

Each runs over the same tiling (rows, warps, programs) and masks only the edge tiles' windows as
the library does; their ``dW`` and ``sum_k s_k`` are checked against ``as is``.

Session 27 (H200, ``benchmarks/results/s27/c``): both forms are slower, 0.317 and 0.279 ms against
0.159 at 32x32x16, 0.268 and 0.242 against 0.125 at 16x16x32. Not landed.

    python benchmarks/wgrad_gather.py --out=$OUT/wgrad_gather
    python benchmarks/wgrad_gather.py --out=/tmp/wgrad_gather --smoke     # interpreter, CPU, tiny
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = [(32, 32, 16), (16, 16, 32)]
MODES = ["as is", "gather8, s^T X", "gather8, X^T s"]
GATHERED = 8  # taps in the wide product (a power of two, as Triton's shapes must be)


def kernel(layout, offsets, steps, rows, chunks, mode, xs_ref, s_ref, wide_ref, last_ref, sum_ref):
    """``fused_block._weight_grad_sum_kernel`` with taps ``0 .. 7`` as one wide product."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _edge_split, _index, _rows_in

    p = _index(pl.program_id(0))
    n, c = p // chunks, p % chunks
    S, C = layout.slack, s_ref.shape[-1]
    end = S + layout.tiles * layout.tile_rows
    count = layout.tiles * layout.tile_rows // rows // chunks
    first = c * count
    width = layout.padded_width
    t = lax.broadcasted_iota(jnp.int32, (1, GATHERED), 1)
    wide_offsets = (t // 3 - 1) * width + (t % 3 - 1)  # offsets[:8], as Layout.offsets(3, 3) orders them
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    transposed = mode == "gather8, X^T s"

    def body(masked):
        def run(i, carry):
            wide, last = carry
            q = S + (first + _index(i)) * rows
            ridx = q + r + wide_offsets  # (rows, 8): the window rows of taps 0 .. 7
            inside = ((ridx >= S) & (ridx < end))[:, :, None] if masked else None
            inside_last = _rows_in(q + offsets[-1], rows, S, end) if masked else None

            def step(k, carry):
                wide, last, total = carry
                k = _index(k)
                s = s_ref[k, n, pl.ds(q, rows)]
                x = xs_ref[k, n, ridx, :]  # (rows, 8, C)
                x8 = xs_ref[k, n, pl.ds(q + offsets[-1], rows)]
                if masked:
                    x = jnp.where(inside, x, jnp.zeros_like(x))
                    x8 = jnp.where(inside_last, x8, jnp.zeros_like(x8))
                x = x.reshape(rows, GATHERED * C)
                if transposed:
                    wide = wide + jnp.dot(x.T, s, preferred_element_type=x.dtype)
                else:
                    wide = wide + jnp.dot(s.T, x, preferred_element_type=x.dtype)
                last = last + jnp.dot(s.T, x8, preferred_element_type=x.dtype)
                return wide, last, total + s

            zero = jnp.zeros((rows, C), sum_ref.dtype)
            wide, last, total = lax.fori_loop(0, steps, step, (wide, last, zero))
            sum_ref[n, pl.ds(q, rows)] = total
            return wide, last

        return run

    a, b = _edge_split(layout, offsets, rows, first, count)
    shape = (GATHERED * C, C) if transposed else (C, GATHERED * C)
    carry = (jnp.zeros(shape, wide_ref.dtype), jnp.zeros((C, C), last_ref.dtype))
    carry = lax.fori_loop(_index(0), _index(a), body(True), carry)
    carry = lax.fori_loop(_index(a), _index(b), body(False), carry)
    wide, last = lax.fori_loop(_index(b), _index(count), body(True), carry)
    wide_ref[p] = wide
    last_ref[p] = last


def variant(layout, kernel_shape, config, mode):
    """``(xs, ss) -> (dW, sum_k s_k)`` for ``mode`` (``"as is"``: the library's function)."""
    import fused_block as bench  # benchmarks/fused_block.py: the weight-gradient benchmarks' helpers
    import jax
    import jax.numpy as jnp

    from naisnet_jax import fused_block as fb

    if mode == "as is":
        return bench.wgrad_library(layout, kernel_shape, config)
    C = kernel_shape[-1]
    rows, warps = fb._wgrad_rows(layout, C, sum_steps=True)
    chunks = fb._chunks_of(fb._wgrad_runs(layout, C, sum_steps=True), fb.WGRAD_SUM_CHUNKS.get(C, 1))
    offsets = layout.offsets(*kernel_shape[:2])
    assert kernel_shape[:2] == (3, 3), kernel_shape

    def run(xs, ss):
        steps, N = ss.shape[:2]
        P = N * chunks
        body = functools.partial(kernel, layout, offsets, steps, rows, chunks, mode)
        wide_shape = (P, GATHERED * C, C) if mode == "gather8, X^T s" else (P, C, GATHERED * C)
        out_shape = (
            jax.ShapeDtypeStruct(wide_shape, ss.dtype),
            jax.ShapeDtypeStruct((P, C, C), ss.dtype),
            jax.ShapeDtypeStruct(ss.shape[1:], ss.dtype),
        )
        call = fb._pallas(body, out_shape, P, config, num_warps=warps, num_stages=fb.WGRAD_STAGES)
        wide, last, total = call(xs, ss)
        wide = jnp.sum(wide, axis=0)
        if mode == "gather8, X^T s":  # (8 C_in, C_out) -> (8, C_in, C_out)
            taps = wide.reshape(GATHERED, C, C)
        else:  # (C_out, 8 C_in) -> (8, C_in, C_out)
            taps = jnp.transpose(wide.reshape(C, GATHERED, C), (1, 2, 0))
        taps = jnp.concatenate([taps, jnp.sum(last, axis=0).T[None]], axis=0)
        return taps.reshape(kernel_shape), layout.interior(total)

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

    batch, steps = (2, 2) if args.smoke else (args.batch, args.steps)
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    rows = []
    for H, W, C in SHAPES:
        config, layout, xs, ss = bench.wgrad_setup((H, W, C), batch, steps, args.smoke)
        ref = None
        for mode in MODES:
            row = dict(shape=f"{H}x{W}x{C}", mode=mode)
            make = functools.partial(variant, layout, (3, 3, C, C), config, mode)
            ref = bench.wgrad_row(row, make, (xs, ss), ref, iters, repeats)
            rows.append(row)
    bench.ratios_to(rows, "vs_as_is", lambda r: r["mode"] == "as is")
    columns = [
        ("shape", "shape", ""),
        ("mode", "kernel", ""),
        ("ms", "ms", ".4f"),
        ("vs_as_is", "x as is", ".2f"),
        ("dW_diff", "dW diff vs as is", ".1e"),
        ("sum_diff", "sum diff", ".1e"),
        ("finite", "finite", ""),
    ]
    header = f"The weight-gradient kernel, eight windows as one product, batch {batch}, {steps} steps, on {{device}}"
    _common.report(args.out, "wgrad_gather", header, rows, columns)


if __name__ == "__main__":
    main()
