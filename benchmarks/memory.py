"""Benchmark: memory of the NAIS-Net training step as the depth K grows, with and without
rematerialisation, and the largest batch that fits.

Part 1: the CIFAR NAIS-Net (3 x 18 conv blocks) with K = 1, 10, 30, 100 steps per block,
``remat`` none / block / step (and the stacked custom VJP that recomputes), at batch
``--batch``: the allocator's peak per image while training (each variant in its own
process, so the peak is its own) and XLA's temporary buffers per image (its buffer
assignment, read at compile time). Part 2: for K = 10, the largest batch whose step
runs, by bisection with each probe in its own process, starting from the batch that
XLA's buffer sizes predict (per-image bytes x batch + the rest, against the device's
memory limit).

    python benchmarks/memory.py --out=runs/bench/memory
    python benchmarks/memory.py --out=/tmp/smoke --smoke
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

DEPTHS = (1, 10, 30, 100)
REMAT = {  # label -> model kwargs
    "none": {},
    "block": {"remat": "block"},
    "step": {"remat": "step"},
    "stacked_recompute": {"block_vjp": "stacked_recompute"},
    # the fast path of the speed benchmarks (train_step.py's nais10_fused_unroll10): the fused
    # block kernels on a GPU, each block from x_1, the 64-channel stage on the stacked VJP
    "fused": {"block_vjp": "fused", "scan_unroll": 10},
}
SEARCH = ("none", "block", "step", "fused")  # remat settings whose largest batch is searched (at K = 10)
# JAX's allocator takes 75% of the card by default; let it take nearly all (the limit reported
# by memory_stats()["bytes_limit"] follows), so that "largest batch" means the card's.
ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}


def _spec(depth: int, remat: str) -> dict:
    return dict(model="naisnet_cifar10", kwargs=dict(steps=depth, **REMAT[remat]))


def measure(spec, *, batch: int, smoke: bool, steps: int = 2) -> dict:
    """Compile and run ``steps`` training steps at ``batch``; peak and XLA buffer sizes."""
    import jax
    import train_step as ts

    _, _, state = ts.model_and_state(spec, smoke)
    x, y = ts.fixed_batch(batch)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.params))

    t0 = time.perf_counter()
    compiled = ts.training_chunk(steps).lower(state, x, y).compile()
    compile_s = time.perf_counter() - t0
    mem = _common.memory_analysis(compiled)
    row = {"batch": batch, "compile_s": compile_s, "memory_analysis": mem, "param_bytes": param_bytes}
    try:
        state, loss = compiled(state, x, y)
        jax.block_until_ready(loss)
        row["fits"] = True
        row["loss"] = float(loss)
    except Exception as e:  # RESOURCE_EXHAUSTED: the batch does not fit
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        row["fits"] = False
        row["oom"] = str(e).splitlines()[0][:300]
    peak = _common.peak_bytes()
    stats = jax.devices()[0].memory_stats() or {}
    row.update(
        {
            "peak_bytes": peak,
            "bytes_limit": float(stats.get("bytes_limit", math.nan)),
            # the step's own memory: the peak less parameters, momentum and the batch itself
            "peak_mib_per_image": (peak - 2 * param_bytes - x.nbytes) / batch / 2**20,
            "temp_mib_per_image": mem.get("temp_size_in_bytes", math.nan) / batch / 2**20,
            **_common.device_summary(),
        }
    )
    return row


def _variant_names() -> list[str]:
    names = [f"K{k}_{r}" for k in DEPTHS for r in ("none", "block", "step", "fused")]
    return names + ["K10_stacked_recompute", "K100_stacked_recompute"]


def _parse(name: str) -> tuple[int, str]:
    depth, remat = name.split("_", 1)
    return int(depth[1:]), remat


def _predict_largest(row: dict) -> int | None:
    """Largest batch from XLA's buffers: temporaries scale with the batch, arguments do not."""
    mem, limit = row.get("memory_analysis", {}), row.get("bytes_limit", math.nan)
    if not mem or not math.isfinite(limit):
        return None
    per_image = (
        mem.get("temp_size_in_bytes", 0) + mem.get("output_size_in_bytes", 0) - mem.get("alias_size_in_bytes", 0)
    ) / row["batch"]
    fixed = mem.get("argument_size_in_bytes", 0)
    return int((limit - fixed) / per_image) if per_image > 0 else None


def search_largest(script, out, remat, guess, *, probes, smoke, timeout, deadline) -> dict:
    """Bisection on the batch, one process per probe; returns the bracket found."""
    lo, hi, tried = 0, None, []
    b = max(8, guess // 8 * 8)
    for _ in range(probes):
        name = f"probe_K10_{remat}_b{b}"
        budget = None if deadline is None else deadline - time.time()
        rows = _common.run_variants(
            script,
            [name],
            out,
            child_args=["--smoke"] if smoke else [],
            timeout_for=lambda n: timeout,
            budget=budget,
            env_for=lambda n: ENV,
        )
        if "time budget" in rows[0].get("error", ""):
            break
        fits = rows[0].get("fits", False)  # a crash counts as "does not fit"
        tried.append((b, fits))
        if fits:
            lo = b
            b = b * 2 if hi is None else (lo + hi) // 2
        else:
            hi = b
            b = (lo + hi) // 2 if lo else b // 2
        b = max(8, b // 8 * 8)
        if hi is not None and hi - lo <= max(8, lo // 20):
            break
    return {"remat": remat, "largest_fitting": lo, "smallest_failing": hi, "probes": tried, "guess": guess}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--variants", default=None, help="comma-separated names K<depth>_<remat>")
    parser.add_argument("--probes", type=int, default=4, help="processes per largest-batch search")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--budget", type=float, default=540, help="seconds for the whole run (a rerun resumes); 0: no limit"
    )
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _common.importable()
    os.makedirs(args.out, exist_ok=True)
    batch = min(args.batch, 4) if args.smoke else args.batch
    if args.one:
        if args.one.startswith("probe_"):  # probe_K10_<remat>_b<batch>
            _, depth, rest = args.one.split("_", 2)
            remat, b = rest.rsplit("_b", 1)
            row = measure(_spec(int(depth[1:]), remat), batch=int(b), smoke=args.smoke, steps=1)
        else:
            depth, remat = _parse(args.one)
            row = measure(_spec(depth, remat), batch=batch, smoke=args.smoke)
            row.update(depth=depth, remat=remat)
        _common.write_row(args.out, args.one, row)
        return
    script = os.path.abspath(__file__)
    deadline = time.time() + args.budget if args.budget else None
    names = args.variants.split(",") if args.variants else _variant_names()
    if args.smoke:
        names = [n for n in names if _parse(n)[0] <= 10]
    rows = _common.run_variants(
        script,
        names,
        args.out,
        budget=args.budget or None,
        env_for=lambda n: ENV,
        child_args=[f"--batch={batch}"] + (["--smoke"] if args.smoke else []),
        fresh=args.fresh,
        timeout_for=lambda n: args.timeout,
    )
    searches = []
    on_gpu = any(r.get("platform") == "gpu" for r in rows)
    if not args.no_search and on_gpu:
        for remat in SEARCH:
            base = next(
                (r for r in rows if r.get("depth") == 10 and r.get("remat") == remat and "error" not in r), None
            )
            guess = _predict_largest(base) if base else None
            if guess:
                searches.append(
                    search_largest(
                        script,
                        args.out,
                        remat,
                        guess,
                        probes=args.probes,
                        smoke=args.smoke,
                        timeout=args.timeout,
                        deadline=deadline,
                    )
                )
    columns = [
        ("name", "variant", ""),
        ("depth", "K", "d"),
        ("remat", "remat", ""),
        ("peak_mib_per_image", "peak MiB/img", ".2f"),
        ("temp_mib_per_image", "XLA temp MiB/img", ".2f"),
        ("fits", "fits", ""),
        ("compile_s", "compile s", ".1f"),
    ]
    text, md = _common.table(rows, columns)
    lines = []
    for s in searches:
        lines.append(
            f"K=10, remat={s['remat']}: largest batch that fits {s['largest_fitting']}"
            f" (fails at {s['smallest_failing'] or '-'}; XLA-predicted {s['guess']};"
            f" probes {s['probes']})"
        )
    if not on_gpu:
        lines.append("largest-batch search skipped: no GPU memory limit on this platform")
    device = next((r.get("device_kind") for r in rows if "error" not in r), "?")
    head = f"device: {device}; batch {batch}; peak = allocator peak less parameters, momentum and batch"
    _common.write_results(
        args.out,
        "memory",
        {"rows": rows, "largest_batch": searches},
        head + "\n\n" + md + "\n\n" + "\n".join(f"- {line}" for line in lines),
    )
    _plot(args.out, rows)
    print()
    print(head)
    print(text)
    print("\n".join(lines))


def _plot(out, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r.get("fits")]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for remat in REMAT:
        pts = sorted(
            (r["depth"], r["peak_mib_per_image"] if math.isfinite(r["peak_mib_per_image"]) else r["temp_mib_per_image"])
            for r in ok
            if r.get("remat") == remat
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"remat={remat}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("K (steps per block)")
    ax.set_ylabel("MiB per image")
    ax.set_title("NAIS-Net training step memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
