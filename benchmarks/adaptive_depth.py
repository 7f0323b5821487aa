"""Benchmark: adaptive depth at inference that pays for the mean depth.

Target: adaptive time <= 1.25 x (mean depth / max_steps) x fixed time, where the fixed
time is the plain ``lax.scan`` of ``max_steps`` steps on the same batch.

1. The synthetic case: a dense NAIS block of width 256 (``A = -R^T R - eps I``,
   Algorithm 1), batch 1024, half the patterns easy (a small drive) and half hard (a
   large one), ``max_steps = 500``; ``tol`` is set by bisection so that the mean depth
   is 366.
2. A trained model: ``NaisNetFC`` (width 256) trained on scikit-learn's digits with the
   real trainer, then run on 1024 patterns with ``adaptive_tol`` set (by bisection) for
   a mean depth of half of ``max_steps``.
3. Streaming: 8 x 1024 patterns through ``unroll_adaptive_stream`` with 1024 slots,
   against 8 fixed scans; for the trained net, the net applied to all 8 x 1024 patterns
   at once with ``stream_slots=1024`` (the model option that streams a large batch).

Rows: ``unroll_adaptive`` as it was (a test every step), ``check_every`` c (a masked
``lax.scan`` of c steps between tests), with and without ``compact`` (running patterns
moved into halving buffers). Each XLA flag set runs in its own process.

    python benchmarks/adaptive_depth.py --out=runs/bench/adaptive_depth
    python benchmarks/adaptive_depth.py --out=/tmp/smoke --smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

TARGET = 1.25
FLAG_SETS = {
    "default": "",
    "cmdbuf_while": (
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,"
        "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1"
    ),
}
CHECKS = (1, 5, 10, 25, 50)


def _time(fn, *args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def _bisect_tol(mean_depth_of, target: float, lo=1e-8, hi=10.0, iters=40) -> float:
    """The tol whose mean depth is closest to ``target`` (depth falls as tol grows)."""
    import math

    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if mean_depth_of(mid) > target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def _row(name, case, seconds, share, fixed_s, fixed_unrolled_s):
    """A timed row: ``share`` (mean depth / max_steps, times batches streamed) of the fixed
    scan is the yardstick; also against the fixed scan unrolled by 10 (the stricter one)."""
    ratio = seconds / (share * fixed_s)
    return {
        "case": case,
        "name": name,
        "ms": 1000 * seconds,
        "ratio": ratio,
        "ratio_unrolled": seconds / (share * fixed_unrolled_s),
        "pass": ratio <= TARGET,
    }


def _rows_for(label, step, x0, inputs, *, max_steps, tol, repeats, fixed_s, fixed_unrolled_s, mean_depth):
    """Time unroll_adaptive's variants on one batch; ratio to the mean-depth share of fixed."""
    import jax

    import naisnet_jax as nj

    rows = []
    for check in CHECKS:
        for compact in (False, True):
            if check == 1 and compact:
                continue
            run = jax.jit(
                lambda x0, d, c=check, k=compact: nj.unroll_adaptive(
                    step, x0, inputs=d, tol=tol, max_steps=max_steps, check_every=c, compact=k
                )
            )
            seconds = _time(run, x0, inputs, repeats=repeats)
            name = f"{label}: check_every={check}{', compact' if compact else ''}"
            rows.append(_row(name, label, seconds, mean_depth / max_steps, fixed_s, fixed_unrolled_s))
    return rows


def synthetic(*, width, batch, max_steps, target_depth, repeats, seed=0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import naisnet_jax as nj

    rng = np.random.default_rng(seed)
    eps = 0.01
    R = nj.project_fc(jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32), eps=eps)
    A = nj.fc_state_matrix(R, eps)
    scale = np.where(np.arange(batch) % 2 == 0, 0.05, 1.0)[:, None]  # half easy, half hard
    drive = jnp.asarray(rng.standard_normal((batch, width)) * scale, jnp.float32)
    x0 = jnp.zeros((batch, width), jnp.float32)

    def step(x, d):
        return nj.fc_step(x, d, A)

    @jax.jit
    def depths(tol):  # the masked scan's depths (same as the while loop's), tol traced
        def body(carry, _):
            x, active, depth = carry
            x_new = step(x, drive)
            moved = jnp.sqrt(jnp.sum((x_new - x) ** 2, axis=1))
            depth = depth + active
            x = jnp.where(active[:, None], x_new, x)
            return (x, active & (moved >= tol) & (depth < max_steps), depth), None

        init = (x0, jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32))
        return jax.lax.scan(body, init, None, length=max_steps)[0][2]

    tol = _bisect_tol(lambda t: float(jnp.mean(depths(t))), target_depth)
    d = np.asarray(depths(tol))
    mean_depth = float(d.mean())
    fixed = jax.jit(lambda x0, dr: nj.unroll(lambda x: step(x, dr), x0, steps=max_steps))
    fixed_s = _time(fixed, x0, drive, repeats=repeats)
    fixed_u = jax.jit(lambda x0, dr: nj.unroll(lambda x: step(x, dr), x0, steps=max_steps, scan_unroll=10))
    fixed_unrolled_s = _time(fixed_u, x0, drive, repeats=repeats)
    info = {
        "case": "synthetic",
        "tol": tol,
        "mean_depth": mean_depth,
        "max_steps": max_steps,
        "easy_mean_depth": float(d[::2].mean()),
        "hard_mean_depth": float(d[1::2].mean()),
        "fraction_at_max": float((d == max_steps).mean()),
        "fixed_ms": 1000 * fixed_s,
        "fixed_unrolled_ms": 1000 * fixed_unrolled_s,
        "width": width,
        "batch": batch,
    }
    rows = _rows_for(
        "synthetic",
        step,
        x0,
        drive,
        max_steps=max_steps,
        tol=tol,
        repeats=repeats,
        fixed_s=fixed_s,
        fixed_unrolled_s=fixed_unrolled_s,
        mean_depth=mean_depth,
    )

    # streaming: 8 batches' worth of patterns through a fixed batch of slots
    n_batches = 8
    perm = rng.permutation(batch * n_batches) % batch
    drives = drive[perm]
    x0s = jnp.zeros((batch * n_batches, width), jnp.float32)
    stream_mean = float(d[perm].mean())
    fixed_all = n_batches * fixed_s
    for check in (10, 25):
        run = jax.jit(
            lambda x0s, ds, c=check: nj.unroll_adaptive_stream(
                step, x0s, ds, tol=tol, max_steps=max_steps, slots=batch, check_every=c
            )
        )
        seconds = _time(run, x0s, drives, repeats=max(1, repeats // 4))
        name = f"stream {n_batches}x{batch}, slots={batch}, check_every={check}"
        share = stream_mean / max_steps * n_batches
        rows.append(_row(name, "stream", seconds, share, fixed_s, fixed_unrolled_s))
    info["stream_fixed_ms"] = 1000 * fixed_all
    return info, rows


def trained(*, width, max_steps, batch, repeats, epochs):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from naisnet_jax import data as data_lib
    from naisnet_jax import models, train
    from naisnet_jax.configs import digits_tiny

    config = digits_tiny.get_config()
    config.model_kwargs.features = width
    config.model_kwargs.steps = 20
    config.h = 0.5
    config.num_epochs = epochs
    with tempfile.TemporaryDirectory() as workdir:
        out = train.train_and_evaluate(config, workdir)
    params = jax.device_get(out["state"].params)
    ds = data_lib.load_dataset("digits")
    every = np.concatenate([ds.train_images, ds.test_images])
    images = np.resize(every, (batch,) + every.shape[1:])
    x = data_lib.preprocess(jnp.asarray(images), out["mean"], out["std"])
    common = dict(num_classes=10, features=width, h=config.h, eps=config.eps)

    def model(**kw):
        return models.NaisNetFC(**common, **kw)

    @functools.cache
    def mean_depth(tol):
        m = model(adaptive_tol=tol, max_steps=max_steps)
        _, aux = jax.jit(functools.partial(m.apply, return_aux=True))({"params": params}, x)
        return float(jnp.mean(aux["depth"]))

    tol = _bisect_tol(mean_depth, max_steps / 2, iters=12)  # each probe compiles the model
    depth = mean_depth(tol)
    fixed_s = _time(jax.jit(model(steps=max_steps).apply), {"params": params}, x, repeats=repeats)
    fixed_unrolled = jax.jit(model(steps=max_steps, scan_unroll=10).apply)
    fixed_unrolled_s = _time(fixed_unrolled, {"params": params}, x, repeats=repeats)
    info = {
        "case": "trained",
        "tol": tol,
        "mean_depth": depth,
        "max_steps": max_steps,
        "fixed_ms": 1000 * fixed_s,
        "fixed_unrolled_ms": 1000 * fixed_unrolled_s,
        "test_accuracy": out["test_accuracy"],
        "batch": batch,
        "width": width,
    }
    rows = []
    for check in CHECKS:
        for compact in (False, True):
            if check == 1 and compact:
                continue
            m = model(adaptive_tol=tol, max_steps=max_steps, check_every=check, compact=compact)
            seconds = _time(jax.jit(m.apply), {"params": params}, x, repeats=repeats)
            name = f"trained: check_every={check}{', compact' if compact else ''}"
            rows.append(_row(name, "trained", seconds, depth / max_steps, fixed_s, fixed_unrolled_s))

    # streaming: the net applied to 8 batches' worth of patterns at once, stream_slots=batch
    n_batches = 8
    x_all = data_lib.preprocess(
        jnp.asarray(np.resize(every, (n_batches * batch,) + every.shape[1:])), out["mean"], out["std"]
    )
    m = model(adaptive_tol=tol, max_steps=max_steps)
    _, aux = jax.jit(functools.partial(m.apply, return_aux=True))({"params": params}, x_all)
    stream_depth = float(jnp.mean(aux["depth"]))
    info.update(stream_mean_depth=stream_depth, stream_fixed_ms=1000 * n_batches * fixed_s)
    for check in (10, 25):
        m = model(adaptive_tol=tol, max_steps=max_steps, stream_slots=batch, check_every=check)
        seconds = _time(jax.jit(m.apply), {"params": params}, x_all, repeats=max(1, repeats // 4))
        name = f"trained: stream {n_batches}x{batch}, stream_slots={batch}, check_every={check}"
        share = stream_depth / max_steps * n_batches
        rows.append(_row(name, "trained stream", seconds, share, fixed_s, fixed_unrolled_s))
    return info, rows


def run_all(smoke: bool, repeats: int) -> dict:
    if smoke:
        syn = synthetic(width=32, batch=64, max_steps=60, target_depth=44, repeats=2)
        tr = trained(width=32, max_steps=60, batch=64, repeats=2, epochs=1)
    else:
        syn = synthetic(width=256, batch=1024, max_steps=500, target_depth=366, repeats=repeats)
        tr = trained(width=256, max_steps=500, batch=1024, repeats=repeats, epochs=10)
    return {"cases": [syn[0], tr[0]], "rows": syn[1] + tr[1], **_common.device_summary()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flags", default=",".join(FLAG_SETS), help="XLA flag sets, one process each")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--budget", type=float, default=540, help="seconds for the whole run (a rerun resumes); 0: no limit"
    )
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _common.importable()
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        _common.write_row(args.out, args.one, run_all(args.smoke, args.repeats))
        return
    names = args.flags.split(",")
    results = _common.run_variants(
        os.path.abspath(__file__),
        names,
        args.out,
        budget=args.budget or None,
        fresh=args.fresh,
        child_args=[f"--repeats={args.repeats}"] + (["--smoke"] if args.smoke else []),
        env_for=lambda n: {"XLA_FLAGS": FLAG_SETS[n]} if FLAG_SETS[n] else {},
        timeout_for=lambda n: args.timeout,
    )
    text_all, md_all = [], []
    for res in results:
        if "error" in res:
            text_all.append(f"[{res['name']}] FAILED: {res['error']}")
            md_all.append(f"- {res['name']}: FAILED ({res['error']})")
            continue
        rows = [dict(r, name=r["name"]) for r in res["rows"]]
        text, md = _common.table(
            rows,
            [
                ("name", "variant", ""),
                ("ms", "ms", ".2f"),
                ("ratio", "t / (mean/max x fixed)", ".2f"),
                ("pass", f"<= {TARGET}", ""),
                ("ratio_unrolled", "same, fixed unrolled x10", ".2f"),
            ],
        )
        cases = "\n".join(
            f"{c['case']}: mean depth {c['mean_depth']:.1f} of {c['max_steps']} (tol {c['tol']:.3g}), "
            f"fixed scan {c['fixed_ms']:.2f} ms ({c['fixed_unrolled_ms']:.2f} ms unrolled x10)"
            for c in res["cases"]
        )
        head = f"XLA flags: {res['name']} ({FLAG_SETS.get(res['name']) or 'none'}); device {res['device_kind']}"
        text_all.append(head + "\n" + cases + "\n" + text)
        md_all.append(f"### {head}\n\n" + cases.replace("\n", "  \n") + "\n\n" + md)
    _common.write_results(args.out, "adaptive_depth", {"results": results}, "\n\n".join(md_all))
    print()
    print("\n\n".join(text_all))


if __name__ == "__main__":
    main()
