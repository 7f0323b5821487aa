"""Benchmark (Hopper GPU): the wgmma block kernels inside models, against the Triton ones.

Two questions, one run:

1. **Values.** A tied conv block (K = 10) under ``vmap`` over 3 seeds, as a sweep runs it: value
   and gradients (``x_0``, drive, kernel) of ``<x_K, cotangent>`` with ``engine="wgmma"`` and
   ``engine="triton"``, each against the stacked pure-JAX VJP at the highest matmul precision
   (relative max error); and the vmapped wgmma gradients against each seed run alone. At 16 and
   32 channels, ReLU and tanh; at 64, ReLU (the wide path: states and ``s_k`` saved as images, the
   kernel gradient by XLA).
2. **The NAIS-Net10 step** (``block_vjp="fused"``, ``scan_unroll=10``, batch 128, float32),
   both engines compiled in one process and timed in alternating rounds of 10 steps (best and
   median ms a step), with the losses of the first 30 steps from the same state.
3. **Precision.** The gradient of NAIS-Net10's training loss (batch 64, training mode) by the
   fast path and by autodiff through ``lax.scan``, under ``jax.default_matmul_precision`` of
   ``"float32"``, ``"highest"`` and the default (TF32 on these cards), each against autodiff in
   float64: the global relative error ``|g - g_64| / |g_64|`` over every parameter and the worst
   leaf's. Above TF32 the fast path takes exact kernels, so it must be as accurate as autodiff at
   the same precision: at most :data:`PRECISION_RATIO` times autodiff's error, plus
   :data:`PRECISION_FLOOR`. Two forms: the shipped one (``x(0) = 0``), whose gradients grow
   towards the input at initialisation and amplify every rounding (float32 autodiff itself is
   far from float64 there; the rows say how far), and the start ``x(0) = u``, where nothing explodes and the test
   is sharp.

    python benchmarks/hopper_checks.py --out=$OUT/hopper_checks
    python benchmarks/hopper_checks.py --out=/tmp/hc --smoke   # CPU: lowers the two engines only
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def value_rows(batch: int, steps: int, seeds: int = 3) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from naisnet_jax.kernels import KernelPolicy, conv_op, unroll_tied, unroll_tied_conv

    rows = []
    for H, C in ((32, 16), (16, 32), (8, 64)):
        for activation in ("relu", "tanh") if C < 64 else ("relu",):  # 64 channels: ReLU only
            k = jax.random.split(jax.random.key(0), 4)
            x0 = jax.random.normal(k[0], (seeds, batch, H, H, C))
            drive = jax.random.normal(k[1], (seeds, batch, H, H, C))
            kernel = 0.02 * jax.random.normal(k[2], (seeds, 3, 3, C, C))
            kernel = kernel.at[:, 1, 1].add(-0.4 * jnp.eye(C))
            cot = jax.random.normal(k[3], (seeds, batch, H, H, C))

            def grads(run):
                return jax.value_and_grad(lambda a, b, c, t: jnp.vdot(run(a, b, c), t), argnums=(0, 1, 2))

            stacked = functools.partial(unroll_tied, conv_op, steps=steps, h=1.0, activation=activation)
            with jax.default_matmul_precision("highest"):
                want = jax.jit(jax.vmap(grads(stacked)))(x0, drive, kernel, cot)
            row = dict(state=f"{H}x{H}x{C}", activation=activation)
            for engine in ("wgmma", "triton"):
                policy = KernelPolicy(interpret=False, engine=engine)
                run = functools.partial(unroll_tied_conv, steps=steps, h=1.0, activation=activation, policy=policy)
                got = jax.jit(jax.vmap(grads(run)))(x0, drive, kernel, cot)
                row[f"{engine}_value"] = _common.rel_error(got[0], want[0])
                row[f"{engine}_grads"] = max(_common.rel_error(a, b) for a, b in zip(got[1], want[1]))
                if engine == "wgmma":
                    one = jax.jit(grads(run))
                    alone = [one(x0[i], drive[i], kernel[i], cot[i]) for i in range(seeds)]
                    row["wgmma_vmap_vs_alone"] = max(
                        _common.rel_error(got[1][j][i], alone[i][1][j]) for i in range(seeds) for j in range(3)
                    )
            rows.append(row)
            print(row, flush=True)
    return rows


def step_rows(batch: int, rounds: int, chunk: int = 10) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import train_step as ts

    compiled, losses = {}, {}
    for engine in ("wgmma", "triton"):  # the same initial state (same seed), each engine its model
        spec = dict(model=ts.N10, kwargs=dict(block_vjp="fused", scan_unroll=10, kernel_engine=engine))
        _, _, state = ts.model_and_state(spec, False)
        x, y = ts.fixed_batch(batch)
        f = ts.training_chunk(chunk)
        t0 = time.perf_counter()
        st = jax.tree.map(jnp.copy, state)
        c = f.lower(st, x, y).compile()
        compile_s = time.perf_counter() - t0
        traj = []
        for _ in range(3):
            st, loss = c(st, x, y)
            traj.append(float(loss))
        compiled[engine] = [c, st, compile_s]
        losses[engine] = traj
    times = {engine: [] for engine in compiled}
    for _ in range(rounds):
        for engine, entry in compiled.items():
            c, st, _ = entry
            t0 = time.perf_counter()
            st, loss = c(st, x, y)
            jax.block_until_ready(loss)
            times[engine].append((time.perf_counter() - t0) / chunk * 1e3)
            entry[1] = st
    rows = []
    for engine, (_, _, compile_s) in compiled.items():
        row = dict(
            engine=engine,
            best_ms=min(times[engine]),
            median_ms=statistics.median(times[engine]),
            images_per_s=batch / min(times[engine]) * 1e3,
            compile_s=compile_s,
            losses=losses[engine],
        )
        rows.append(row)
        print(row, flush=True)
    return rows


#: above TF32 the fast path's gradient error against float64 is at most this many times autodiff's
PRECISION_RATIO = 2.0
#: ... plus this much (float32 accuracy over 540 steps, where autodiff's own error is tiny)
PRECISION_FLOOR = 1e-6
#: the NAIS-Net10 forms of the precision check: the shipped start and x(0) = u
PRECISION_FORMS = {"x(0) = 0 (shipped)": {}, "x(0) = u": {"initial_state": "input"}}


def precision_rows(batch: int, smoke: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import train_step as ts
    from naisnet_jax.verify import x64_scope

    from naisnet_jax import train

    x, y = ts.fixed_batch(batch)

    def grads(state, dtype=jnp.float32):
        def cast(tree):
            return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

        def loss(params):
            variables = {"params": params, "batch_stats": cast(state.batch_stats)}
            logits, _ = state.apply_fn(variables, x.astype(dtype), train=True, mutable=["batch_stats"])
            return jnp.mean(train.cross_entropy(logits, y))

        return [np.asarray(a, np.float64) for a in jax.tree.leaves(jax.jit(jax.grad(loss))(cast(state.params)))]

    rows = []
    for form, extra in PRECISION_FORMS.items():
        states = {
            "autodiff": ts.model_and_state(dict(model=ts.N10, kwargs=extra), smoke)[2],
            "fast path": ts.model_and_state(dict(model=ts.N10, kwargs={**extra, **ts.FAST}), smoke)[2],
        }
        with x64_scope():
            want = grads(states["autodiff"], jnp.float64)
        leaf_norms = [np.sqrt(np.sum(b * b)) for b in want]
        norm = np.sqrt(sum(n * n for n in leaf_norms))
        for precision in ("float32", "highest", None):
            errors = {}
            for path, state in states.items():
                with jax.default_matmul_precision(precision):
                    got = grads(state)
                diffs = [np.sqrt(np.sum((a - b) ** 2)) for a, b in zip(got, want)]
                worst = max(d / max(n, 1e-30) for d, n in zip(diffs, leaf_norms))
                errors[path] = error = float(np.sqrt(sum(d * d for d in diffs)) / norm)
                fast = path == "fast path"
                row = dict(
                    form=form,
                    precision=precision or "default",
                    path=path,
                    global_rel=error,
                    worst_leaf_rel=float(worst),
                    x_autodiff=error / errors["autodiff"] if fast and errors["autodiff"] > 0 else None,
                    met=(
                        error <= PRECISION_RATIO * errors["autodiff"] + PRECISION_FLOOR
                        if fast and precision is not None
                        else None
                    ),
                )
                rows.append(row)
                print(row, flush=True)
    return rows


def smoke() -> None:
    """Both engines lower for CUDA here (the GPU build, without a GPU)."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax.kernels import KernelPolicy, unroll_tied_conv

    x = jax.ShapeDtypeStruct((4, 16, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 16, 16), jnp.float32)
    for engine in ("wgmma", "triton"):
        run = functools.partial(unroll_tied_conv, steps=3, policy=KernelPolicy(interpret=False, engine=engine))
        text = jax.jit(run).trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
        print(f"{engine}: forward lowered for CUDA, {len(text)} characters")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128, help="batch of the NAIS-Net10 step")
    parser.add_argument("--value-batch", type=int, default=16, help="batch of each seed in the value checks")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--smoke", action="store_true", help="lower both engines for CUDA only (any machine)")
    parser.add_argument("--skip-values", action="store_true")
    parser.add_argument("--skip-steps", action="store_true", help="leave out the timed step")
    parser.add_argument("--skip-precision", action="store_true", help="leave out the precision check")
    parser.add_argument("--precision-batch", type=int, default=64, help="batch of the precision check")
    args = parser.parse_args(argv)
    _common.importable()
    if args.smoke:
        smoke()
        return
    os.makedirs(args.out, exist_ok=True)
    if not _common.hopper_here(args.out, "hopper_checks"):
        return
    values = [] if args.skip_values else value_rows(args.value_batch, args.steps)
    steps = [] if args.skip_steps else step_rows(args.batch, args.rounds)
    precision = [] if args.skip_precision else precision_rows(args.precision_batch)
    device = _common.device_summary()
    text_v, md_v = _common.table(
        values,
        [
            ("state", "state", "s"),
            ("activation", "act", "s"),
            ("wgmma_value", "wgmma value", ".1e"),
            ("wgmma_grads", "wgmma grads", ".1e"),
            ("triton_value", "triton value", ".1e"),
            ("triton_grads", "triton grads", ".1e"),
            ("wgmma_vmap_vs_alone", "wgmma vmap vs alone", ".1e"),
        ],
    )
    text_s, md_s = _common.table(
        steps,
        [
            ("engine", "engine", "s"),
            ("best_ms", "best ms/step", ".2f"),
            ("median_ms", "median ms/step", ".2f"),
            ("images_per_s", "images/s (best)", ".0f"),
            ("compile_s", "compile s", ".1f"),
        ],
    )
    text_p, md_p = _common.table(
        precision,
        [
            ("form", "form", "s"),
            ("precision", "matmul precision", "s"),
            ("path", "path", "s"),
            ("global_rel", "global rel. error", ".1e"),
            ("worst_leaf_rel", "worst leaf", ".1e"),
            ("x_autodiff", "x autodiff's", ".2f"),
            ("met", f"<= {PRECISION_RATIO:g} x autodiff's + {PRECISION_FLOOR:.0e}", ""),
        ],
    )
    header = (
        f"wgmma against Triton block kernels on {device['device_kind']}: relative max error against the stacked"
        f" VJP at highest precision (vmap over 3 seeds, batch {args.value_batch}, K = {args.steps}), and the"
        f" NAIS-Net10 step (batch {args.batch}, fused, unroll 10, {args.rounds} alternating rounds of 10 steps);"
        f" the NAIS-Net10 gradient (batch {args.precision_batch}, training mode) against float64 autodiff"
    )
    _common.write_results(
        args.out,
        "hopper_checks",
        dict(device=device, values=values, steps=steps, precision=precision),
        f"{header}\n\n{md_v}\n\n{md_s}\n\n{md_p}",
    )
    print(header)
    print(text_v)
    print(text_s)
    print(text_p)


if __name__ == "__main__":
    main()
