"""Benchmark (GPU): the blocks' weight-gradient kernel, split between more programs and pipelined.

The fused path's weight gradient (:func:`naisnet_jax.fused_block.fused_weight_grad`) runs one
program (one or two warps) per step and pattern: 1,152 programs for NAIS-Net10's K - 1 = 9
steps at batch 128, about nine warps an SM, each loop iteration waiting on its loads. Two knobs:

- ``chunks``: each pattern's step split between that many programs over runs of its rows
  (``fused_block.WGRAD_CHUNKS``; more programs in flight, more partial sums to add);
- ``stages``: Triton's software pipelining of the loop over rows (``fused_block.WGRAD_STAGES``).

For NAIS-Net10's two fused shapes, every combination's time (best of ``--repeats`` runs of
``--iters`` calls) and its largest difference from one program and one stage (the setting
before session 24: the same sums in another order). ``--best=FILE`` writes the fastest setting per width as JSON, which
``train_step.py``'s variant ``nais10_fused_unroll10_wgrad_best`` reads (``WGRAD_BEST=FILE``).

Session 25: the kernel can also sum the drive's gradient ``sum_k s_k`` while it reads the
``s_k`` (``fused_weight_grad(..., sum_steps=True)``: a program takes a run of a pattern's rows
over every step; ``fused_block.WGRAD_SUM_CHUNKS``). Its rows (``mode`` "summed") are timed against
what they replace: the per-step kernel at its default setting plus XLA's sum of the ``s_k``
over the steps ("per step + XLA sum"). ``--sum-only`` times only these; ``--sum-tilings`` also
tries the summing kernel's ``(rows, warps)`` (``fused_block.WGRAD_SUM_TILINGS``), at two stages.

    python benchmarks/wgrad_tiling.py --out=$OUT/wgrad_tiling --best=$OUT/wgrad_best.json
    python benchmarks/wgrad_tiling.py --out=/tmp/smoke --smoke     # interpreter, CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = [(32, 32, 16), (16, 16, 32)]
CHUNKS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20]  # those that divide a state's runs of rows
STAGES = [1, 2, 3]
#: ``(rows, warps)`` of the summing kernel's programs tried with ``--sum-tilings``.
SUM_TILINGS = [(32, 1), (64, 1), (32, 2), (64, 2), (128, 4)]


def apply(best: dict) -> None:
    """Sets ``fused_block``'s weight-gradient knobs from :func:`main`'s ``--best`` JSON."""
    from naisnet_jax import fused_block

    per_step = {c: v for c, v in best.items() if c != "summed"}
    if per_step:
        fused_block.WGRAD_CHUNKS = {int(c): v["chunks"] for c, v in per_step.items()}
    summed = best.get("summed", {})
    if summed:
        fused_block.WGRAD_SUM_CHUNKS = {int(c): v["chunks"] for c, v in summed.items()}
        fused_block.WGRAD_SUM_TILINGS = {int(c): (v["rows"], v["warps"]) for c, v in summed.items() if "rows" in v}
    # one stage setting for every width and both kernels: the larger if they differ (the blocks
    # run only the summing kernel when fused_block.WGRAD_SUMS_STEPS is set)
    stages = {v["stages"] for v in (summed if summed and fused_block.WGRAD_SUMS_STEPS else per_step).values()}
    fused_block.WGRAD_STAGES = max(stages)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--best", default=None, help="write the fastest setting per width here (JSON)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="batch 2, two steps, the interpreter: a CPU check")
    parser.add_argument("--sum-only", action="store_true", help="only the summing kernel and what it replaces")
    parser.add_argument(
        "--sum-tilings",
        action="store_true",
        help="the summing kernel over (rows, warps) tilings too, two stages, chunks 1, 2, 4, 8",
    )
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: timing, errors
    import jax
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax import fused_block as fb

    batch, steps = (2, 2) if args.smoke else (args.batch, args.steps)
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    rows, best = [], {}

    def save_best():
        if args.best:
            os.makedirs(os.path.dirname(os.path.abspath(args.best)), exist_ok=True)
            with open(args.best, "w") as f:
                json.dump(best, f)

    for H, W, C in SHAPES:
        config = fb.Config(interpret=args.smoke, tile_rows=fb.default_tiling(C)[0])
        layout = fb.Layout.of(H, W, 3, 3, config.tile_rows)
        rng = np.random.default_rng(0)
        xs, ss = (
            layout.to_buffer(jnp.asarray(rng.standard_normal((steps, batch, H, W, C)), jnp.float32)) for _ in range(2)
        )
        runs = fb._wgrad_runs(layout, C)
        kshape = (3, 3, C, C)
        shape = f"{H}x{W}x{C}"
        default_stages = fb.WGRAD_STAGES

        def measure(fn, row, ref, key, best):
            try:
                out = fn(xs, ss)
                row["diff_vs_first"] = bench._rel(out[0], ref[0]) if ref is not None else 0.0
                if len(out) > 1 and ref is not None:
                    row["sum_diff"] = bench._rel(out[1], ref[1])
                row["ms"] = 1e3 * bench._time(fn, (xs, ss), iters, repeats)
            except Exception as e:  # noqa: BLE001 - a setting that fails is reported, not fatal
                _common.error_row(row, e)
                out = None
            rows.append(row)
            timed = row.get("ms")
            if timed is not None and key is not None and (key not in best or timed < best[key]["ms"]):
                best[key] = dict(chunks=row["chunks"], stages=row["stages"], ms=timed)
                if "rows" in row:
                    best[key].update(rows=row["rows"], warps=row["warps"])
                save_best()  # as it goes: a sweep cut short still leaves its best so far
            return out

        ref = None
        for stages in [] if args.sum_only else STAGES:
            for chunks in [c for c in CHUNKS if runs % c == 0]:
                fb.WGRAD_STAGES = stages
                fn = jax.jit(lambda a, b, chunks=chunks: (fb.fused_weight_grad(layout, a, b, kshape, config, chunks),))
                row = dict(shape=shape, mode="per step", chunks=chunks, stages=stages, programs=steps * batch * chunks)
                out = measure(fn, row, ref, str(C), best)
                ref = out if ref is None else ref  # the first: chunks 1, stages 1
        fb.WGRAD_STAGES = default_stages

        def with_sum(a, b):  # what the summing kernel replaces: the default kernel, XLA's sum over steps
            return fb.fused_weight_grad(layout, a, b, kshape, config), jnp.sum(layout.interior(b), axis=0)

        chunks = fb._chunks_of(runs, fb.WGRAD_CHUNKS.get(C, 1))
        row = dict(shape=shape, mode="per step + XLA sum", chunks=chunks, stages=default_stages)
        row["programs"] = steps * batch * chunks
        ref = measure(jax.jit(with_sum), row, None, None, best)
        default_tilings = dict(fb.WGRAD_SUM_TILINGS)
        tilings = SUM_TILINGS if args.sum_tilings else [fb._wgrad_rows(layout, C, sum_steps=True)]
        for tiling in tilings:
            fb.WGRAD_SUM_TILINGS = {**default_tilings, C: tiling}
            tiling = fb._wgrad_rows(layout, C, sum_steps=True)  # rows capped at the layout's tile
            sum_runs = fb._wgrad_runs(layout, C, sum_steps=True)
            for stages in [2] if args.sum_tilings else STAGES:
                for chunks in [c for c in ([1, 2, 4, 8] if args.sum_tilings else CHUNKS) if sum_runs % c == 0]:
                    fb.WGRAD_STAGES = stages

                    def summed(a, b, chunks=chunks):
                        dW, total = fb.fused_weight_grad(layout, a, b, kshape, config, chunks, sum_steps=True)
                        return dW, layout.interior(total)

                    row = dict(shape=shape, mode="summed", chunks=chunks, stages=stages, programs=batch * chunks)
                    row.update(rows=tiling[0], warps=tiling[1])
                    measure(jax.jit(summed), row, ref, str(C), best.setdefault("summed", {}))
        fb.WGRAD_STAGES = default_stages
        fb.WGRAD_SUM_TILINGS = default_tilings
    columns = [
        ("shape", "shape", ""),
        ("mode", "mode", ""),
        ("chunks", "chunks", ""),
        ("stages", "stages", ""),
        ("programs", "programs", ""),
        ("rows", "rows", ""),
        ("warps", "warps", ""),
        ("ms", "ms", ".4f"),
        ("diff_vs_first", "dW diff vs reference", ".1e"),
        ("sum_diff", "sum diff", ".1e"),
    ]
    header = f"Weight-gradient kernel on {{device}}, batch {batch}, {steps} steps"
    _common.report(args.out, "wgrad_tiling", header, rows, columns)
    print("best:", json.dumps(best))
    save_best()


if __name__ == "__main__":
    main()
