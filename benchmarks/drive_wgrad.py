"""Benchmark (GPU): a drive convolution's kernel gradient, the fused weight-gradient kernel against cuDNN.

Every NAIS conv block outside a stage's first has a 3x3 SAME drive convolution ``conv(U, D)``
mapping C channels to C. Its kernel gradient feeds only the optimiser; XLA runs it as cuDNN's
TF32 weight-gradient convolution plus a tensor conversion and a workspace initialisation.
:func:`naisnet_jax.fused_block.conv_weight_grad` runs it on the fused path's own weight-gradient
kernel (one step, each pattern's rows split between up to ten programs), which
``block_vjp.side_stream_conv`` takes where it fits. For NAIS-Net10's two shapes at batch 128:

- ``xla``: ``jax.linear_transpose`` of ``lax.conv_general_dilated`` (cuDNN), default precision;
- ``fused``: ``conv_weight_grad``; ``fused_1chunk``: the same kernel with one program a pattern;

each the best of ``--repeats`` runs of ``--iters`` calls after a warm-up, and its error against
the same gradient at the highest precision (relative max).

    python benchmarks/drive_wgrad.py --out=$OUT/drive_wgrad
    python benchmarks/drive_wgrad.py --out=/tmp/smoke --smoke     # interpreter, CPU, tiny
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = [(32, 32, 16), (16, 16, 32)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="batch 2, the interpreter: a CPU check")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: timing, errors
    import jax
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax import fused_block as fb
    from naisnet_jax.cell import conv_same

    batch = 2 if args.smoke else args.batch
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    rows = []
    for H, W, C in SHAPES:
        rng = np.random.default_rng(0)
        lhs, g = (jnp.asarray(rng.standard_normal((batch, H, W, C)), jnp.float32) for _ in range(2))
        kshape = (3, 3, C, C)

        def xla(lhs, g, precision=None):
            with jax.default_matmul_precision(precision or "default"):
                return jax.linear_transpose(lambda k: conv_same(lhs, k), jnp.zeros(kshape, jnp.float32))(g)[0]

        config = fb.Config(interpret=args.smoke, tile_rows=fb.default_tiling(C)[0])
        layout = fb.Layout.of(H, W, 3, 3, config.tile_rows)

        def one_chunk(lhs, g):
            xs, ss = layout.to_buffer(lhs)[None], layout.to_buffer(g)[None]
            return fb.fused_weight_grad(layout, xs, ss, kshape, config, chunks=1)

        variants = {
            "xla": jax.jit(xla),
            "fused": jax.jit(functools.partial(fb.conv_weight_grad, kernel_shape=kshape, config=config)),
            "fused_1chunk": jax.jit(one_chunk),
        }
        ref = jax.jit(functools.partial(xla, precision="highest"))(lhs, g)
        runs = fb._wgrad_runs(layout, C)
        for name, fn in variants.items():
            row = dict(shape=f"{H}x{W}x{C}", variant=name, batch=batch)
            row["programs_a_pattern"] = dict(fused=fb._chunks_of(runs), fused_1chunk=1).get(name, "")
            try:
                row["err_vs_highest"] = bench._rel(fn(lhs, g), ref)
                row["ms"] = 1e3 * bench._time(fn, (lhs, g), iters, repeats)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                _common.error_row(row, e)
            rows.append(row)
    columns = [
        ("shape", "shape", ""),
        ("variant", "variant", ""),
        ("programs_a_pattern", "programs/pattern", ""),
        ("ms", "ms", ".4f"),
        ("err_vs_highest", "err vs highest", ".2e"),
    ]
    _common.report(args.out, "drive_wgrad", f"Drive kernel gradient on {{device}}, batch {batch}", rows, columns)


if __name__ == "__main__":
    main()
