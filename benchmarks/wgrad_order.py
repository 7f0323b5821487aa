"""Benchmark (GPU): the weight-gradient kernel's registers, occupancy and loop order.

Session 26's profile (``benchmarks/results/s26/a/profile``, H200) gives the summing
weight-gradient kernel (``fused_block._weight_grad_sum_kernel``) at 32x32x16 as 254 registers a
thread, 24 KiB of shared memory and one warp a program: at most 8 programs an SM, 12.5% of the
SM's warps. Its 1,024 programs (8 a pattern, batch 128) are then one wave of 8 warps an SM, and
splitting the rows further (more programs a pattern) only adds a second wave. With so few warps
each one waits on its loads and products in turn: a tile's step takes ~4 us against the memory
floor's ~1 us.

The registers go to the nine windows of ``x_k`` loaded for a tile's step (16 a thread each at
32 rows and one warp), the nine ``(C, C)`` accumulators (8 each) and the tile's ``sum_k s_k`` (16).
This script tries kernels that hold fewer windows at once (:class:`Spec`), and two other orders:

- ``taps``: the taps taken ``taps`` at a time, each group its own loop over the steps (``9``
  is the library's order; ``3`` or ``1`` hold three windows or one, and read ``s_k`` again for
  each group: from the L1 or L2 cache, a tile's ``s_k`` being 2 KiB);
- ``rows``: 16-row tiles instead of 32, halving every tile-sized register;
- ``chunks``: programs a pattern, so that the smaller programs fill the SMs (the largest divisor
  of a state's runs of rows up to it).

Every variant's ``dW`` and ``sum_k s_k`` are checked against the library's kernel (with NaN in
the slack rows, which the edge tiles' masks must keep out).

Session 27 (H200, ``benchmarks/results/s27/d``, ``e``, ``g``, ``h``): every variant is slower than
the library's kernel (0.157 to 0.163 ms at 32x32x16, 0.124 to 0.126 at 16x16x32), the closest the
taps shared between three programs at 16x16x32 (0.146) and 16-row tiles at 32x32x16 (0.176).
Sharing the taps out took the registers to 168 and 111 a thread and the occupancy to 18.75% and
25% (Nsight Compute), with no gain: ``BENCHMARKS.md``, "Session 27", says what bounds the kernel.

    python benchmarks/wgrad_order.py --out=$OUT/wgrad_order
    # one kernel three times, nothing timed, for Nsight Compute (``--run=library`` or a spec):
    ncu -k regex:kernel_tap --launch-skip 1 --launch-count 1 --section Occupancy \
        python benchmarks/wgrad_order.py --out=/tmp/x --run="32,16,('programs', 32, 1, 8, 3)"
    python benchmarks/wgrad_order.py --out=/tmp/wgrad_order --smoke     # interpreter, CPU, tiny
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = [(32, 32, 16), (16, 16, 32)]


class Spec(NamedTuple):
    """A kernel to time: ``order`` one of

    - ``"loops"``: :func:`kernel`, the taps ``taps`` at a time, a loop over the steps for each
      group (``taps=9`` is the library's order);
    - ``"steps outer"``: :func:`kernel_steps_outer`, the steps outside the tiles;
    - ``"programs"``: :func:`kernel_tap_programs`, ``9 // taps`` programs a tile, ``taps`` each;

    on ``rows``-row tiles, ``warps`` warps and ``chunks`` programs a pattern (the largest divisor
    of a state's runs of rows up to it). ``products`` (``"loops"`` only): ``"tf32"`` (the
    library's), ``"bf16x3"`` (each operand split into two bfloat16 halves, three products: more
    accurate than TF32, and 16-bit operands, which the tensor cores' operand loads can transpose)
    or ``"bf16"`` (one product of the high halves: less accurate than TF32, timed only to bound
    what the operands' type costs)."""

    order: str
    rows: int
    warps: int
    chunks: int
    taps: int = 9
    products: str = "tf32"


#: ``None``: the library's kernel and tiling.
VARIANTS = [
    None,
    *(Spec("programs", 32, 1, chunks, taps) for taps in (3, 1) for chunks in (8, 4, 2)),
    Spec("programs", 32, 2, 4, 3),
    Spec("programs", 64, 2, 4, 3),
    *(Spec("steps outer", *t) for t in ((32, 1, 8), (32, 1, 16), (32, 2, 8), (64, 2, 8), (16, 1, 16))),
    Spec("loops", 32, 1, 8, products="bf16x3"),
    Spec("loops", 32, 1, 8, products="bf16"),
    *(Spec("loops", rows, warps, 8, products="bf16x3") for rows, warps in ((32, 2), (64, 2), (64, 4))),
    Spec("loops", 16, 1, 8),
    Spec("loops", 16, 1, 16),
    *(
        Spec("loops", rows, 1, chunks, taps)
        for taps in (3, 1)
        for rows, chunks in ((32, 8), (32, 16), (16, 16), (16, 32))
    ),
    *(Spec("loops", 32, 2, 8, taps) for taps in (9, 3, 1)),
    Spec("loops", 16, 2, 16, 3),
]


def _products(acc, s, xs_ref, k, n, q, offsets, inside, products):
    """``fused_block._tap_products`` with the products in ``products`` precision."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _tap_products

    if products == "tf32":
        return _tap_products(acc, s, xs_ref, k, n, q, offsets, inside)
    bf16, f32 = jnp.bfloat16, jnp.float32

    def halves(a):
        hi = a.astype(bf16)
        return hi, (a - hi.astype(f32)).astype(bf16)

    (s_hi, s_lo), rows = halves(s.T), s.shape[0]
    out = []
    for t, (acc_t, off) in enumerate(zip(acc, offsets)):
        x = xs_ref[k, n, pl.ds(q + off, rows)]
        if inside is not None:
            x = jnp.where(inside(t), x, jnp.zeros_like(x))
        x_hi, x_lo = halves(x)
        acc_t = acc_t + jnp.dot(s_hi, x_hi, preferred_element_type=f32)
        if products == "bf16x3":
            acc_t = acc_t + jnp.dot(s_lo, x_hi, preferred_element_type=f32)
            acc_t = acc_t + jnp.dot(s_hi, x_lo, preferred_element_type=f32)
        out.append(acc_t)
    return tuple(out)


def kernel(layout, offsets, steps, rows, chunks, group, products, xs_ref, s_ref, dw_ref, sum_ref):
    """``fused_block._weight_grad_sum_kernel`` with the taps ``group`` at a time, a loop over the
    steps for each group (the first group also sums ``s_k``)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _index, _sum_tiles

    p = _index(pl.program_id(0))
    n, c = p // chunks, p % chunks
    C = s_ref.shape[-1]

    def tile(q, acc, inside):
        acc = list(acc)
        total = jnp.zeros((rows, C), sum_ref.dtype)
        for g0 in range(0, len(offsets), group):
            taps = slice(g0, g0 + group)
            first = g0 == 0

            # the group's masks: tap g0 + t's, as inside(t) numbers the taps of all nine
            mine = None if inside is None else (lambda t, g0=g0: inside(g0 + t))

            def step(k, carry, taps=taps, first=first, mine=mine):
                part, total = carry
                k = _index(k)
                s = s_ref[k, n, pl.ds(q, rows)]
                part = _products(part, s, xs_ref, k, n, q, offsets[taps], mine, products)
                return part, (total + s if first else total)

            part, total = lax.fori_loop(0, steps, step, (tuple(acc[taps]), total))
            acc[taps] = part
        sum_ref[n, pl.ds(q, rows)] = total
        return tuple(acc)

    _sum_tiles(layout, offsets, rows, c, chunks, p, dw_ref, tile)


def kernel_steps_outer(layout, offsets, steps, rows, chunks, xs_ref, s_ref, dw_ref, sum_ref):
    """The library's kernel with its loops swapped: the steps outside, the program's tiles
    inside. A program's working set while it runs a step is then its run of rows with their
    halo (~13 KB at 32x32x16), ~13 MB for all 1,024 programs: it stays in L2, so a tile's
    windows find the rows its neighbour loaded. With the tiles outside (the library's order) a
    program goes through all nine steps (~80 KB) before the next tile reuses its halo, and
    Nsight Compute measured an L2 hit rate of 50%, with twice the bytes read from DRAM that the
    states hold. The tiles' ``sum_k s_k`` go through ``sum_ref`` (read, added to, written back)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _index, _sum_over_tiles, _tap_products

    p = _index(pl.program_id(0))
    n, c = p // chunks, p % chunks
    count = layout.tiles * layout.tile_rows // rows // chunks

    def per_step(k, acc):
        k = _index(k)

        def tile(q, acc, inside):
            s = s_ref[k, n, pl.ds(q, rows)]
            before = sum_ref[n, pl.ds(q, rows)]
            sum_ref[n, pl.ds(q, rows)] = jnp.where(k == 0, s, before + s)
            return _tap_products(acc, s, xs_ref, k, n, q, offsets, inside)

        return _sum_over_tiles(layout, offsets, rows, c * count, count, acc, tile)

    acc = tuple(jnp.zeros(dw_ref.shape[-2:], dw_ref.dtype) for _ in offsets)
    acc = lax.fori_loop(0, steps, per_step, acc)
    for t, acc_t in enumerate(acc):
        dw_ref[p, t] = acc_t


def kernel_tap_programs(layout, offsets, steps, rows, chunks, G, xs_ref, s_ref, dw_ref, sum_ref):
    """The library's kernel with the taps shared out between programs: program ``(n, c, g)``
    takes the taps of kernel rows ``g``, ``g + G``, .. (``G`` 3: one kernel row, three taps; ``G``
    9: one tap), so it holds 9 / G windows and accumulators instead of nine, and the SM can hold
    more programs (the library's 255 registers a thread allow eight). Each program loads the
    tile's ``s_k`` (9 / G times as many ``s`` loads in all); the first ``g`` writes
    ``sum_k s_k``."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _index, _sum_tiles, _tap_products

    p = _index(pl.program_id(0))
    pc, g = p // G, p % G
    n, c = pc // chunks, pc % chunks
    C = s_ref.shape[-1]
    width = layout.padded_width
    if G == 3:  # kernel row g: taps (g - 1) width + (-1, 0, 1)
        mine = [(g - 1) * width + dx for dx in (-1, 0, 1)]
    else:  # tap g of nine
        mine = [(g // 3 - 1) * width + (g % 3 - 1)]

    def tile(q, acc, inside):
        def step(k, carry):
            acc, total = carry
            k = _index(k)
            s = s_ref[k, n, pl.ds(q, rows)]
            return _tap_products(acc, s, xs_ref, k, n, q, mine, inside), total + s

        acc, total = lax.fori_loop(0, steps, step, (acc, jnp.zeros((rows, C), sum_ref.dtype)))

        @pl.when(g == 0)
        def _():
            sum_ref[n, pl.ds(q, rows)] = total

        return acc

    # its own taps' masks; the edge tiles are those of all nine taps, a superset of its own
    _sum_tiles(layout, offsets, rows, c, chunks, p, dw_ref, tile, taps=mine)


def variant(layout, kernel_shape, config, spec):
    """``(xs, ss) -> (dW, sum_k s_k)`` for ``spec`` (``None``: the library's function)."""
    import fused_block as bench  # benchmarks/fused_block.py: the weight-gradient benchmarks' helpers
    import jax

    from naisnet_jax import fused_block as fb

    if spec is None:
        return bench.wgrad_library(layout, kernel_shape, config)
    rows = min(spec.rows, layout.tile_rows)
    C = kernel_shape[-1]
    offsets = layout.offsets(*kernel_shape[:2])
    chunks = fb._chunks_of(layout.tiles * layout.tile_rows // rows, spec.chunks)  # the largest divisor up to it

    def run(xs, ss):
        steps, N = ss.shape[:2]
        P = N * chunks
        if spec.order == "programs":
            G = 9 // spec.taps  # programs a tile
            body = functools.partial(kernel_tap_programs, layout, offsets, steps, rows, chunks, G)
            out_shape = (
                jax.ShapeDtypeStruct((P * G, spec.taps, C, C), ss.dtype),
                jax.ShapeDtypeStruct(ss.shape[1:], ss.dtype),
            )
            call = fb._pallas(body, out_shape, P * G, config, num_warps=spec.warps, num_stages=fb.WGRAD_STAGES)
            parts, total = call(xs, ss)
            dW = fb._kernel_of_parts(parts.reshape((P, 9) + parts.shape[2:]), kernel_shape)
            return dW, layout.interior(total)
        if spec.order == "steps outer":
            body = functools.partial(kernel_steps_outer, layout, offsets, steps, rows, chunks)
        else:
            body = functools.partial(kernel, layout, offsets, steps, rows, chunks, spec.taps, spec.products)
        out_shape = (
            jax.ShapeDtypeStruct((P, len(offsets), C, C), ss.dtype),
            jax.ShapeDtypeStruct(ss.shape[1:], ss.dtype),
        )
        call = fb._pallas(body, out_shape, P, config, num_warps=spec.warps, num_stages=fb.WGRAD_STAGES)
        parts, total = call(xs, ss)
        return fb._kernel_of_parts(parts, kernel_shape), layout.interior(total)

    return jax.jit(run)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="only the variants of these orders or products (comma list)")
    parser.add_argument("--smoke", action="store_true", help="batch 2, two steps, the interpreter: a CPU check")
    parser.add_argument("--run", default=None, help="'H,C,spec': run one kernel three times, untimed (for a profiler)")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: the weight-gradient benchmarks' helpers
    import jax

    from naisnet_jax import fused_block as fb

    if args.run:
        H, C, spec = args.run.split(",", 2)
        H, C = int(H), int(C)
        spec = None if spec == "library" else Spec(*ast.literal_eval(spec))
        config, layout, xs, ss = bench.wgrad_setup((H, H, C), args.batch, args.steps, args.smoke, nan_slack=False)
        fn = variant(layout, (3, 3, C, C), config, spec)
        for _ in range(3):
            jax.block_until_ready(fn(xs, ss))
        return

    batch, steps = (2, 2) if args.smoke else (args.batch, args.steps)
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    variants = VARIANTS
    if args.only:
        keep = args.only.split(",")
        variants = [v for v in VARIANTS if v is None or v.order in keep or v.products in keep]
    variants = variants[:5] if args.smoke else variants
    rows = []
    for H, W, C in SHAPES:
        config, layout, xs, ss = bench.wgrad_setup((H, W, C), batch, steps, args.smoke)
        ref = None
        for spec in variants:
            chunks = fb._chunks_of(fb._wgrad_runs(layout, C, sum_steps=True), fb.WGRAD_SUM_CHUNKS.get(C, 1))
            shown = spec or Spec("loops", *fb._wgrad_rows(layout, C, sum_steps=True), chunks)
            rows_ = min(shown.rows, layout.tile_rows)
            shown = shown._replace(
                rows=rows_, chunks=fb._chunks_of(layout.tiles * layout.tile_rows // rows_, shown.chunks)
            )
            if spec is not None and any(r.get("spec") == (H, *shown) for r in rows):
                continue  # the same kernel as a row before (chunks rounded down to a divisor)
            row = dict(shape=f"{H}x{W}x{C}", kernel="library" if spec is None else "variant", **shown._asdict())
            row["spec"] = (H, *shown)
            make = functools.partial(variant, layout, (3, 3, C, C), config, spec)
            ref = bench.wgrad_row(row, make, (xs, ss), ref, iters, repeats)
            rows.append(row)
    bench.ratios_to(rows, "vs_library", lambda r: r["kernel"] == "library")
    columns = [
        ("shape", "shape", ""),
        ("kernel", "kernel", ""),
        ("order", "order", ""),
        ("taps", "taps", ""),
        ("rows", "rows", ""),
        ("warps", "warps", ""),
        ("chunks", "programs a pattern", ""),
        ("products", "products", ""),
        ("ms", "ms", ".4f"),
        ("vs_library", "x library", ".2f"),
        ("dW_diff", "dW diff", ".1e"),
        ("sum_diff", "sum diff", ".1e"),
        ("finite", "finite", ""),
    ]
    header = f"The weight-gradient kernel by loop order and tiling, batch {batch}, {steps} steps, on {{device}}"
    _common.report(args.out, "wgrad_order", header, rows, columns)


if __name__ == "__main__":
    main()
