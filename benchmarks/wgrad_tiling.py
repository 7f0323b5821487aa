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
CHUNKS = [1, 2, 3, 4, 5, 6, 8, 10]
STAGES = [1, 2, 3]


def apply(best: dict) -> None:
    """Sets ``fused_block``'s weight-gradient knobs from :func:`main`'s ``--best`` JSON."""
    from naisnet_jax import fused_block

    fused_block.WGRAD_CHUNKS = {int(c): v["chunks"] for c, v in best.items()}
    stages = {v["stages"] for v in best.values()}
    fused_block.WGRAD_STAGES = max(stages)  # one setting for every width: the larger if they differ


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--best", default=None, help="write the fastest setting per width here (JSON)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="batch 2, two steps, the interpreter: a CPU check")
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
    for H, W, C in SHAPES:
        config = fb.Config(interpret=args.smoke, tile_rows=fb.default_tiling(C)[0])
        layout = fb.Layout.of(H, W, 3, 3, config.tile_rows)
        rng = np.random.default_rng(0)
        xs, ss = (
            layout.to_buffer(jnp.asarray(rng.standard_normal((steps, batch, H, W, C)), jnp.float32)) for _ in range(2)
        )
        runs = fb._wgrad_runs(layout, C)
        kshape = (3, 3, C, C)
        ref, default_stages = None, fb.WGRAD_STAGES
        for stages in STAGES:
            for chunks in [c for c in CHUNKS if runs % c == 0]:
                fb.WGRAD_STAGES = stages
                fn = jax.jit(lambda a, b, chunks=chunks: fb.fused_weight_grad(layout, a, b, kshape, config, chunks))
                row = dict(shape=f"{H}x{W}x{C}", chunks=chunks, stages=stages, programs=steps * batch * chunks)
                try:
                    out = fn(xs, ss)
                    ref = out if ref is None else ref  # the first: chunks 1, stages 1
                    row["diff_vs_first"] = bench._rel(out, ref)
                    row["ms"] = 1e3 * bench._time(fn, (xs, ss), iters, repeats)
                except Exception as e:  # noqa: BLE001 - a setting that fails is reported, not fatal
                    _common.error_row(row, e)
                rows.append(row)
                timed = row.get("ms")
                if timed is not None and (str(C) not in best or timed < best[str(C)]["ms"]):
                    best[str(C)] = dict(chunks=chunks, stages=stages, ms=timed)
        fb.WGRAD_STAGES = default_stages
    columns = [
        ("shape", "shape", ""),
        ("chunks", "chunks", ""),
        ("stages", "stages", ""),
        ("programs", "programs", ""),
        ("ms", "ms", ".4f"),
        ("diff_vs_first", "diff vs chunks 1 stages 1", ".1e"),
    ]
    header = f"Weight-gradient kernel on {{device}}, batch {batch}, {steps} steps"
    _common.report(args.out, "wgrad_tiling", header, rows, columns)
    print("best:", json.dumps(best))
    if args.best:
        with open(args.best, "w") as f:
            json.dump(best, f)


if __name__ == "__main__":
    main()
