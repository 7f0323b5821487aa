"""Benchmark (GPU): XLA's cuDNN convolution fusions (``train.CONV_FUSION``) on and off.

A user turns them on with ``train.GPU_STEP_OPTIONS = train.CONV_FUSION`` (off by default: they
are experimental in XLA, and this script is their check). For each model below, both compilations of
``train_step.py``'s jitted chunk run in one process from the same state on the same batch: the
losses of ``--steps`` steps and the parameters after them (relative max difference, on against
off), then ``--rounds`` alternating timed rounds (best and median ms a step).

    python benchmarks/step_options.py --out=$OUT/step_options
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

CASES = ["nais10_fused_unroll10", "nais10_bf16_stacked_unroll10"]  # each compiles twice: ~2 min a model


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def compare(variant: str, *, batch: int, steps: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import train_step as ts

    from naisnet_jax import train

    spec = ts.VARIANTS[variant]
    ts.apply_spec(spec)
    _, _, state = ts._model_and_state(spec, False)
    x, y = ts._batch(batch)
    saved, previous = dict(train.CONV_FUSION), train.GPU_STEP_OPTIONS
    chunks = {}
    for name, options in (("on", saved), ("off", {})):
        train.GPU_STEP_OPTIONS = options  # read when the chunk's jax.jit is made
        chunks[name] = ts.training_chunk(steps)
    train.GPU_STEP_OPTIONS = previous
    row = dict(model=variant, options=", ".join(f"{k}={v}" for k, v in saved.items()) or "none")
    ends, losses = {}, {}
    for name, f in chunks.items():  # compile, then the same steps from the same state
        t = time.perf_counter()
        jax.block_until_ready(f(jax.tree.map(jnp.copy, state), x, y))
        row[f"compile_s_{name}"] = time.perf_counter() - t
        ends[name], losses[name] = f(jax.tree.map(jnp.copy, state), x, y)
    row["loss_on"], row["loss_off"] = float(losses["on"]), float(losses["off"])
    row["loss_rel_diff"] = abs(row["loss_on"] - row["loss_off"]) / abs(row["loss_off"])
    leaves = zip(jax.tree.leaves(ends["on"].params), jax.tree.leaves(ends["off"].params))
    row["params_rel_diff"] = max(_rel(a, b) for a, b in leaves)
    times = {"on": [], "off": []}
    states = {name: jax.tree.map(jnp.copy, state) for name in chunks}
    for _ in range(rounds):
        for name, f in chunks.items():
            t = time.perf_counter()
            states[name], loss = f(states[name], x, y)
            jax.block_until_ready(loss)
            times[name].append(1e3 * (time.perf_counter() - t) / steps)
    for name, ms in times.items():
        row[f"best_ms_{name}"], row[f"median_ms_{name}"] = min(ms), statistics.median(ms)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default=",".join(CASES), help="train_step.py variants (JAX)")
    args = parser.parse_args(argv)
    _common.importable()
    import jax

    os.makedirs(args.out, exist_ok=True)
    if jax.default_backend() != "gpu":
        print("step_options: the options are the GPU's; nothing to compare here")
        return
    rows = []
    for variant in args.models.split(","):
        try:
            row = compare(variant, batch=args.batch, steps=args.steps, rounds=args.rounds)
        except Exception as e:  # a model the compiler refuses is a row, not the end
            row = dict(model=variant)
            _common.error_row(row, e)
        rows.append(row)
        print(row, flush=True)
    columns = [
        ("model", "model", "s"),
        ("best_ms_on", "on: best ms", ".2f"),
        ("median_ms_on", "on: median", ".2f"),
        ("best_ms_off", "off: best ms", ".2f"),
        ("median_ms_off", "off: median", ".2f"),
        ("loss_rel_diff", "loss rel diff", ".1e"),
        ("params_rel_diff", "params rel diff", ".1e"),
        ("compile_s_on", "compile s on", ".1f"),
        ("compile_s_off", "compile s off", ".1f"),
    ]
    header = (
        f"The step's XLA options on against off, batch {args.batch}, {args.steps} steps a round, "
        f"{args.rounds} alternating rounds, on {{device}}"
    )
    _common.report(args.out, "step_options", header, rows, columns)


if __name__ == "__main__":
    main()
