"""Benchmark: compile time of the training step as the depth K grows.

For K = 1, 10, 100, 1000: a dense NAIS block (``NaisNetFC``, width 128) and a conv NAIS
block (``NaisNetConv`` with one block of 16 channels on 32x32x3), each the whole
``train.train_step`` (forward, backward, SGD, projection) at batch 128, lowered and
compiled in a fresh process after a warm-up compile of another shape (so one-time
start-up costs are not counted). K = 1000 must compile about as fast as K = 1: the row
``K=1000 / K=1`` must stay under 1.3.

The target rows (``dense``, ``conv``) are the blocks as a GPU trains them fastest,
``block_vjp="fused"``: a block's K steps are one Pallas kernel each way, so the program
does not change with K (on a CPU or TPU ``"fused"`` is the stacked VJP's ``lax.scan``).
The rows ``dense-autodiff`` and ``conv-autodiff`` (the default options, reverse mode through
``lax.scan``) are printed beside them without a target: XLA deletes a loop of one trip, so
their K = 1 is loop-free while every K > 1 has a forward and a backward loop, whose
products the GPU autotuner tunes once, a fixed cost (``BENCHMARKS.md``). The blocks start
at ``x_0 = u`` (``initial_state="input"``; the dense block on 8x16 inputs, 128 values), so
that every K applies the state matrix (with the paper's ``x_0 = 0`` a one-step block never
does, and XLA drops its products).

    python benchmarks/compile_time.py --out=runs/bench/compile_time
    python benchmarks/compile_time.py --out=/tmp/smoke --smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

DEPTHS = (1, 10, 100, 1000)
TARGET = 1.3
_DENSE = dict(model="naisnet_mnist", kwargs=dict(features=128, initial_state="input"), shape=(8, 16, 1))
_CONV = dict(
    model="naisnet_cifar10", kwargs=dict(stage_sizes=(1,), filters=(16,), initial_state="input"), shape=(32, 32, 3)
)
_FUSED = dict(block_vjp="fused")
BLOCKS = {  # the rows the target is read from: the GPU's fast path
    "dense": dict(_DENSE, kwargs=dict(_DENSE["kwargs"], **_FUSED)),
    "conv": dict(_CONV, kwargs=dict(_CONV["kwargs"], **_FUSED)),
}
REFERENCE = {"dense-autodiff": _DENSE, "conv-autodiff": _CONV}  # default options: no target
SPECS = {**BLOCKS, **REFERENCE}


def _names(repeats: int) -> list[str]:
    names = [f"{b}_K{k}_u1_r{r}" for r in range(repeats) for b in BLOCKS for k in DEPTHS]
    return names + [f"{b}_K{k}_u1_r0" for b in REFERENCE for k in DEPTHS]


def compile_once(block: str, depth: int, unroll: int, *, batch: int) -> dict:
    import jax
    import jax.numpy as jnp
    import ml_collections

    from naisnet_jax import train

    spec = SPECS[block]

    def lowered(steps, batch):
        config = _common.cifar_config()
        config.model = spec["model"]
        config.model_kwargs = ml_collections.ConfigDict(dict(spec["kwargs"], steps=steps, scan_unroll=unroll))
        model = train.build_model(config, 10)
        state = train.create_train_state(config, model, spec["shape"], steps_per_epoch=100)
        x = jnp.zeros((batch,) + spec["shape"], jnp.float32)
        y = jnp.zeros((batch,), jnp.int32)
        t0 = time.perf_counter()
        low = jax.jit(train.train_step, donate_argnums=(0,)).lower(state, (x, y))
        return low, time.perf_counter() - t0

    warm, _ = lowered(1, batch // 2)  # pays one-time costs (autotuner, PTX compiler start-up)
    warm.compile()
    low, trace_s = lowered(depth, batch)
    t0 = time.perf_counter()
    low.compile()
    return {
        "block": block,
        "depth": depth,
        "scan_unroll": unroll,
        "batch": batch,
        "trace_lower_s": trace_s,
        "compile_s": time.perf_counter() - t0,
        **_common.device_summary(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="processes per target row (min is kept)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="batch 8, K up to 100")
    parser.add_argument(
        "--budget", type=float, default=540, help="seconds for the whole run (a rerun resumes); 0: no limit"
    )
    parser.add_argument("--blocks", default=None, help=f"comma-separated rows to run, of {', '.join(SPECS)}")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _common.importable()
    os.makedirs(args.out, exist_ok=True)
    batch = 8 if args.smoke else args.batch
    if args.one:
        block, depth, unroll, _ = args.one.split("_")
        row = compile_once(block, int(depth[1:]), int(unroll[1:]), batch=batch)
        _common.write_row(args.out, args.one, row)
        return
    if args.smoke:
        args.repeats = 1
    names = _names(args.repeats)
    if args.blocks:
        blocks = args.blocks.split(",")
        unknown = [b for b in blocks if b not in SPECS]
        if unknown:
            raise SystemExit(f"--blocks={args.blocks!r}: unknown {unknown}; expected some of {', '.join(SPECS)}")
        names = [n for n in names if n.split("_")[0] in blocks]
    if args.smoke:
        names = [n for n in names if "_K1000_" not in n]
    rows = _common.run_variants(
        os.path.abspath(__file__),
        names,
        args.out,
        fresh=args.fresh,
        budget=args.budget or None,
        child_args=[f"--batch={batch}"] + (["--smoke"] if args.smoke else []),
        timeout_for=lambda n: args.timeout,
    )
    ok = [r for r in rows if "error" not in r]
    best = {}
    for r in ok:  # min over repeats
        key = (r["block"], r["depth"], r["scan_unroll"])
        if key not in best or r["compile_s"] < best[key]["compile_s"]:
            best[key] = dict(r, name=f"{r['block']} K={r['depth']}")
    table_rows = [best[k] for k in sorted(best)] + [r for r in rows if "error" in r]
    text, md = _common.table(
        table_rows, [("name", "step", ""), ("trace_lower_s", "trace+lower s", ".2f"), ("compile_s", "compile s", ".2f")]
    )
    verdicts = {}
    top = max(k for _, k, _ in best) if best else None
    for block in SPECS:
        one, deep = best.get((block, 1, 1)), best.get((block, top, 1))
        if one and deep and top > 1:
            ratio = deep["compile_s"] / one["compile_s"]
            if block in BLOCKS:
                verdicts[block] = {"ratio": ratio, "depth": top, "pass": ratio < TARGET}
                verdict = f"(target < {TARGET}): {'PASS' if ratio < TARGET else 'FAIL'}"
            else:
                verdict = "(default options: K = 1 compiles without a loop; no target)"
            line = f"{block}: compile K={top} / K=1 = {ratio:.2f} {verdict}"
            text += "\n" + line
            md += "\n\n" + line
    device = ok[0]["device_kind"] if ok else "?"
    head = f"device: {device}; training step at batch {batch}; min over {args.repeats} processes (target rows)"
    _common.write_results(args.out, "compile_time", {"rows": rows, "verdicts": verdicts}, head + "\n\n" + md)
    _plot(args.out, best)
    print()
    print(head)
    print(text)


def _plot(out, best):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not best:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for block in SPECS:
        pts = sorted((k, r["compile_s"]) for (b, k, _), r in best.items() if b == block)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=block + ("" if block in REFERENCE else " (fused)"))
    ax.set_xscale("log")
    ax.set_xlabel("K (steps)")
    ax.set_ylabel("compile time (s)")
    ax.set_title("Training-step compile time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "compile_time.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
