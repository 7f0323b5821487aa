"""Benchmark: a sweep's seeds on one card, all side by side or a few at a time.

A sweep (``naisnet_jax.sweep``) runs the seeds a device holds as one program: by default all of
them side by side (``jax.vmap``), or, with ``config.seeds_at_once = k``, ``k`` side by side at a
time, the groups one after another (``k = 1``: one seed at a time, no ``vmap``). The computation is
the same (``tests/test_sweep.py``); the speed need not be: ``vmap`` over seeds turns each
convolution into a grouped one with a kernel per seed, and whether that beats running the seeds in
turn depends on how much of the card one seed's step already uses. This script measures the
training step of one section 5.2 row (``experiments/conv.py``'s config, the fused GPU path for a
NAIS net) for each ``k``, every ``k`` in a fresh process on one device, with the experiment's own
timing (``experiments.sweep_report.time_steps``: the epoch program cut to ``--steps`` steps, best
of 3 calls after a warm-up, plus one test evaluation).

The table gives, per ``k``: milliseconds a step of all the seeds, a step per seed, images per
second summed over the seeds, the speed against all side by side, and the row's projected
training time (its epochs at that rate plus one evaluation each; no compilation).

    python benchmarks/seeds_at_once.py --out=$OUT/seeds_at_once                 # NAIS-Net10, 4 seeds
    python benchmarks/seeds_at_once.py --out=$OUT/s --variant=naisnet1 --at-once=all,1
    python benchmarks/seeds_at_once.py --out=/tmp/seeds_at_once --smoke          # a tiny net, a CPU
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

COLUMNS = [
    ("name", "seeds at once", "s"),
    ("step_ms", "ms a step (all seeds)", ".2f"),
    ("seed_step_ms", "ms a seed-step", ".2f"),
    ("images_per_second", "seed-images/s", ".0f"),
    ("speed", "speed against all at once", ".3f"),
    ("eval_seconds", "evaluation s", ".2f"),
    ("projected_minutes", "row's training, min", ".1f"),
    ("compile_seconds", "compile s", ".0f"),
]


def at_once(name: str) -> int | None:
    """``"all"`` -> None (every seed side by side), ``"2"`` -> 2."""
    if name == "all":
        return None
    try:
        k = int(name)
    except ValueError:
        k = 0
    if k < 1:
        raise SystemExit(f"error: --at-once takes 'all' or whole numbers of at least 1, got {name!r}.")
    return k


def measure(variant: str, k: int | None, *, dataset: str, seeds: int, steps: int, smoke: bool) -> dict:
    """One ``k``: the row's config with ``seeds_at_once = k``, timed on the first device."""
    _common.importable()
    import jax

    from experiments import conv, sweep_report

    config = conv.make_config(variant, dataset=dataset, seeds=seeds, epochs=None, smoke=smoke, seeds_at_once=k)
    config.num_devices = 1
    config.progress = False
    t = sweep_report.time_steps(config, steps=steps)
    t["seed_step_ms"] = t["step_ms"] / t["seeds"]
    t["projected_minutes"] = t["projected_seconds"] / 60
    t.update(variant=variant, dataset=config.dataset, device=str(jax.devices()[0].device_kind))
    return t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="naisnet10", help="a row of experiments/conv.py")
    parser.add_argument("--dataset", default="fashion_mnist_idx")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--at-once", default="all,2,1", help="comma-separated: 'all' or a number of seeds")
    parser.add_argument("--steps", type=int, default=50, help="steps timed a call")
    parser.add_argument("--timeout", type=float, default=400, help="seconds for one k's process")
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole run (a rerun resumes)")
    parser.add_argument("--smoke", action="store_true", help="the row's tiny form on digits: a CPU")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.at_once.split(",")
    for name in names:
        at_once(name)
    if args.seeds < 1:
        raise SystemExit(f"error: --seeds must be at least 1, got {args.seeds}.")
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        row = measure(
            args.variant, at_once(args.one), dataset=args.dataset, seeds=args.seeds, steps=args.steps, smoke=args.smoke
        )
        _common.write_row(args.out, args.one, row)
        return
    child = [f"--variant={args.variant}", f"--dataset={args.dataset}", f"--seeds={args.seeds}", f"--steps={args.steps}"]
    rows = _common.run_variants(
        os.path.abspath(__file__),
        names,
        args.out,
        child_args=child + (["--smoke"] if args.smoke else []),
        timeout_for=lambda n: args.timeout,
        budget=args.budget or None,
        fresh=args.fresh,
    )
    base = next((r for r in rows if r.get("name") == "all" and "error" not in r), None)
    for r in rows:
        if "error" not in r and base is not None:
            r["speed"] = base["step_ms"] / r["step_ms"]
    header = (
        f"{args.variant} ({args.seeds} seeds) on {'digits (smoke)' if args.smoke else args.dataset}, one {{device}}: "
        f"best of 3 calls of {args.steps} steps, each k in its own process"
    )
    _common.report(args.out, "seeds_at_once", header, rows, COLUMNS)


if __name__ == "__main__":
    main()
