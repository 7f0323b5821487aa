"""Benchmark: one tied conv NAIS block, fused Pallas kernels against XLA, at the CIFAR shapes.

The three stage shapes of NAIS-Net10 (batch 128, K = 10, ReLU): 32x32x16, 16x16x32 and
8x8x64. For each: the forward pass and the forward + backward pass (gradient of a fixed
linear function of ``x_K`` with respect to ``x_0``, the drive and the kernel) of

- ``xla_stacked_u10``: :func:`naisnet_jax.kernels.unroll_tied` (the stacked VJP),
  ``scan_unroll=10``: the best pure-XLA block of ``train_step.py``;
- ``fused_default``, ``fused_t{rows}_w{warps}[_loop][_tapsload]``:
  :func:`naisnet_jax.kernels.unroll_tied_conv` on the GPU at the default tiling for the
  state's width (``naisnet_jax.kernels.tuning.TILINGS``) and at each tiling (``_loop``: a step's tiles as a
  loop, not unrolled; ``_tapsload``: the kernel's taps loaded per tile, not once per program).

and, per shape, how far the fused kernels' values and gradients lie from XLA's at the
same (TF32) precision and from a float32 reference at the highest precision. Each time
is the best of ``--repeats`` runs of ``--iters`` calls, after a compile and a warm-up.

    python benchmarks/fused_block.py --out=runs/bench/fused_block
    python benchmarks/fused_block.py --out=/tmp/smoke --smoke     # interpreter, CPU, tiny
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SHAPES = [(32, 32, 16), (16, 16, 32), (8, 8, 64)]
TILINGS = [  # (rows per tile, warps, a step's tiles unrolled, taps loaded once per program)
    (None, None, True, None),  # the defaults for the state's width (kernels.tuning.TILINGS)
    (128, 4, True, True),
    (512, 8, True, True),
    (512, 16, True, True),
    (256, 8, True, False),
    (128, 8, True, True),
    (64, 4, True, True),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=None, help="comma-separated HxWxC (default: the three CIFAR stages)")
    parser.add_argument("--tilings", default=None, help="how many of the tilings to run, from the first (default all)")
    parser.add_argument("--smoke", action="store_true", help="interpreter on a CPU, batch 2, K = 2, one tiling")
    args = parser.parse_args(argv)
    _common.importable()
    import functools

    import jax

    from naisnet_jax.kernels import KernelPolicy, conv_op, unroll_tied, unroll_tied_conv

    os.makedirs(args.out, exist_ok=True)
    batch, steps, tilings, shapes = args.batch, args.steps, TILINGS, SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]
        except ValueError:
            raise SystemExit(f"--shapes={args.shapes!r}: expected comma-separated HxWxC, e.g. 32x32x16") from None
        if any(len(sh) != 3 for sh in shapes):
            raise SystemExit(f"--shapes={args.shapes!r}: expected comma-separated HxWxC, e.g. 32x32x16")
    if args.tilings:
        tilings = TILINGS[: int(args.tilings)]
    interpret = False
    if args.smoke:
        batch, steps, tilings, shapes, interpret = 2, 2, [(64, 4, True, None)], [(8, 8, 16)], True
        args.iters, args.repeats = 1, 1
    rows = []
    for shape in shapes:
        x0, drive, kernel, cot = _common.conv_block_inputs(batch, shape)
        xla = functools.partial(unroll_tied, conv_op, steps=steps, h=1.0, activation="relu", scan_unroll=10)
        variants = {"xla_stacked_u10": lambda a, b, c, f=xla: f(a, b, c)}
        for rows_, warps, unrolled, hoist in tilings:
            name = "fused_default" if rows_ is None else f"fused_t{rows_}_w{warps}"
            name += ("" if unrolled else "_loop") + ("_tapsload" if hoist is False else "")
            policy = KernelPolicy(
                interpret=interpret, tile_rows=rows_, num_warps=warps, unroll_tiles=unrolled, hoist_taps=hoist
            )
            variants[name] = functools.partial(unroll_tied_conv, steps=steps, h=1.0, activation="relu", policy=policy)
        with jax.default_matmul_precision("highest"):
            ref_fwd, ref_grad = _common.block_functions(variants["xla_stacked_u10"])
            ref_y, ref_g = ref_fwd(x0, drive, kernel), ref_grad(x0, drive, kernel, cot)
        xla_y = xla_g = None
        for name, run in variants.items():
            row = dict(name=name, shape="x".join(map(str, shape)), batch=batch, steps=steps)
            try:
                fwd, grad = _common.block_functions(run)
                y, g = fwd(x0, drive, kernel), grad(x0, drive, kernel, cot)
                if name == "xla_stacked_u10":
                    xla_y, xla_g = y, g
                row["err_vs_highest"] = max(
                    [_common.rel_error(y, ref_y)] + [_common.rel_error(a, b) for a, b in zip(g, ref_g)]
                )
                if xla_y is not None:
                    row["err_vs_xla"] = max(
                        [_common.rel_error(y, xla_y)] + [_common.rel_error(a, b) for a, b in zip(g, xla_g)]
                    )
                row["forward_ms"] = 1e3 * _common.best_time(fwd, (x0, drive, kernel), args.iters, args.repeats)
                row["train_ms"] = 1e3 * _common.best_time(grad, (x0, drive, kernel, cot), args.iters, args.repeats)
            except Exception as e:  # a tiling the compiler refuses is a row, not the end
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(row, flush=True)
    for shape in {r["shape"] for r in rows}:
        base = next((r for r in rows if r["shape"] == shape and r["name"] == "xla_stacked_u10"), None)
        for r in rows:
            if r["shape"] == shape and base and "train_ms" in r and "train_ms" in base:
                r["speedup_train"] = base["train_ms"] / r["train_ms"]
                r["speedup_forward"] = base["forward_ms"] / r["forward_ms"]
    columns = [
        ("shape", "state", "s"),
        ("name", "variant", "s"),
        ("forward_ms", "forward ms", ".3f"),
        ("train_ms", "fwd+bwd ms", ".3f"),
        ("speedup_forward", "x XLA fwd", ".2f"),
        ("speedup_train", "x XLA fwd+bwd", ".2f"),
        ("err_vs_xla", "rel err vs XLA", ".1e"),
        ("err_vs_highest", "rel err vs fp32 highest", ".1e"),
    ]
    text, md = _common.table(rows, columns)
    device = _common.device_summary()
    header = f"One tied conv NAIS block, batch {batch}, K = {steps}, ReLU, on {device['device_kind']}"
    _common.write_results(args.out, "fused_block", dict(device=device, rows=rows), header + "\n\n" + md)
    print(header)
    print(text)


if __name__ == "__main__":
    main()
