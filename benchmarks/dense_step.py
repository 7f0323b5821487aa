"""Benchmark: which speed options for a dense NAIS block's training step, by depth K.

The FC NAIS-Net of the default config (``naisnet_mnist``: one 128-unit tied block on 28x28
images, SGD with momentum and the projection after every step), batch 128, for each K the
four combinations of ``block_vjp`` (``"autodiff"``: reverse mode through the scan;
``"stacked"``: the hand-written VJP with one weight-gradient product for all K steps) and
``scan_unroll`` (1 or 10), and ``"fused"`` (the K steps one Pallas kernel each way on a CUDA
GPU, :mod:`naisnet_jax.kernels.triton_dense`; elsewhere ``"stacked"``), side by side in one process:
every variant compiled first, then
timed in alternating passes (chunks of jitted steps in one ``lax.scan``), the best pass kept.
The options do not change the maths: each row's first gradient is compared with the plain
one's (``autodiff``, unroll 1) on the same parameters and batch.

    python benchmarks/dense_step.py --out=/tmp/dense_step            # GPU: ~1 min
    python benchmarks/dense_step.py --out=/tmp/dense_step --smoke    # CPU, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

OPTIONS = [("autodiff", 1), ("autodiff", 10), ("stacked", 1), ("stacked", 10), ("fused", 1)]


def _state(K: int, block_vjp: str, unroll: int, features: int | None):
    import ml_collections

    from naisnet_jax import train
    from naisnet_jax.configs import default

    config = default.get_config()
    kwargs = dict(steps=K, block_vjp=block_vjp, scan_unroll=unroll)
    if features:
        kwargs["features"] = features
    config.model_kwargs = ml_collections.ConfigDict(kwargs)
    model = train.build_model(config, 10)
    return train.create_train_state(config, model, (28, 28, 1), steps_per_epoch=1000)


def _gradient(state, x, y):
    import jax
    import jax.numpy as jnp

    from naisnet_jax import train

    def loss(p):
        return jnp.mean(train.cross_entropy(state.apply_fn({"params": p}, x, train=True), y))

    return jax.jit(jax.grad(loss))(state.params)


def bench(Ks, *, batch: int, repeats: int, features: int | None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from train_step import training_chunk

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, 28, 28, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
    rows = []
    for K in Ks:
        n = max(1, min(20, 2000 // K))  # steps per timed chunk
        runs = []
        for vjp, unroll in OPTIONS:
            if unroll > K:
                continue
            state = _state(K, vjp, unroll, features)
            grad = _gradient(state, x, y)
            chunk = training_chunk(n)
            t0 = time.perf_counter()
            compiled = chunk.lower(state, x, y).compile()
            compile_s = time.perf_counter() - t0
            state, loss = compiled(state, x, y)
            jax.block_until_ready(loss)
            runs.append(
                dict(
                    K=K,
                    block_vjp=vjp,
                    scan_unroll=unroll,
                    compiled=compiled,
                    state=state,
                    grad=grad,
                    compile_s=compile_s,
                    times=[],
                )
            )
            print(f"[K={K} {vjp} unroll={unroll}] compiled in {compile_s:.1f} s", flush=True)
        for _ in range(repeats):  # alternating rounds: drifts of the card's clock hit every variant alike
            for r in runs:
                t = time.perf_counter()
                r["state"], loss = r["compiled"](r["state"], x, y)
                jax.block_until_ready(loss)
                r["times"].append((time.perf_counter() - t) / n)
        base = runs[0]
        ref = jax.tree.leaves(base["grad"])
        for r in runs:
            ms = 1000 * min(r["times"])
            diff = max(
                float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
                for a, b in zip(ref, jax.tree.leaves(r["grad"]))
            )
            rows.append(
                dict(
                    name=f"K{K}_{r['block_vjp']}_u{r['scan_unroll']}",
                    K=K,
                    block_vjp=r["block_vjp"],
                    scan_unroll=r["scan_unroll"],
                    ms_per_step=ms,
                    images_per_s=batch / ms * 1000,
                    speedup=1000 * min(base["times"]) / ms,
                    compile_s=r["compile_s"],
                    grad_rel_diff=diff,
                    rounds_ms=[1000 * t for t in r["times"]],
                )
            )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ks", default="10,30,100,1000", help="comma-separated depths K")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed rounds")
    parser.add_argument("--smoke", action="store_true", help="K = 2, 12; batch 8; 16 units: a CPU check")
    args = parser.parse_args(argv)
    _common.importable()
    try:
        Ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        raise SystemExit(f"--ks={args.ks!r}: expected comma-separated integers, e.g. 10,30,100") from None
    if not Ks or min(Ks) < 1:
        raise SystemExit(f"--ks={args.ks!r}: every K must be at least 1")
    if args.smoke:
        Ks, args.batch, features = [2, 12], 8, 16
    else:
        features = None
    os.makedirs(args.out, exist_ok=True)
    rows = bench(Ks, batch=args.batch, repeats=args.repeats, features=features)
    dev = _common.device_summary()
    cols = [
        ("K", "K", "d"),
        ("block_vjp", "block_vjp", ""),
        ("scan_unroll", "scan_unroll", "d"),
        ("ms_per_step", "ms/step", ".3f"),
        ("images_per_s", "images/s", ".0f"),
        ("speedup", "x autodiff, unroll 1", ".2f"),
        ("compile_s", "compile s", ".1f"),
        ("grad_rel_diff", "gradient rel. diff", ".1e"),
    ]
    text, md = _common.table(rows, cols)
    head = f"device: {dev.get('device_kind')}; batch {args.batch}; the FC NAIS-Net of the default config"
    _common.write_results(args.out, "dense_step", dict(rows=rows, batch=args.batch, **dev), head + "\n\n" + md)
    print()
    print(head)
    print(text)


if __name__ == "__main__":
    main()
