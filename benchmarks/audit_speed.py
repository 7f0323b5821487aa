"""Benchmark: how long the stability audit takes, and whether its figures are right.

Builds a conv NAIS-Net of the paper's CIFAR shape (3 stages x 18 blocks of 16/32/64 filters,
32x32x3 inputs, K = 10, ReLU), drives its state kernels onto the boundary of Algorithm 2's set
(as training leaves them), saves it as a checkpoint, then in a FRESH process (so "cold" includes
every compilation) audits it twice: cold, then warm; that process keeps its compiled programs in
a persistent compilation cache of its own (as ``naisnet-verify`` does in the user's cache folder),
and a second fresh process audits once more with them: "cold, cached", a user's next audit. Two
audits are timed: parameters only (proofs and the radius estimates of all 54 blocks) and the full
audit (plus trajectories, gains on 16 synthetic inputs). Wall and CPU seconds, per phase.

The figures are checked against a float64 reference computed block by block the way the
unbatched verifier did (one Arnoldi run per block, Gershgorin sums in numpy, one jitted
trajectory per block): largest relative difference per figure, target 1e-8.

    python benchmarks/audit_speed.py --out=DIR            # the full CIFAR shape
    python benchmarks/audit_speed.py --out=DIR --tiny     # a smoke test: a few minutes on a CPU
    python benchmarks/audit_speed.py --out=DIR --size=cifar_2x3   # real block shapes, 6 blocks

Writes DIR/audit_speed.json and .md (the table), DIR/audit_speed.png (phases), the certificates,
and resumes: finished steps (checkpoint, timed runs, reference) are kept and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = {
    "cifar": dict(stage_sizes=(18, 18, 18), filters=(16, 32, 64), steps=10, image=32, samples=16),
    "tiny": dict(stage_sizes=(2, 2, 2), filters=(4, 4, 8), steps=2, image=32, samples=4),
    # the real block shapes, 2 blocks a stage: per-block costs on a CPU in minutes
    "cifar_2x3": dict(stage_sizes=(2, 2, 2), filters=(16, 32, 64), steps=10, image=32, samples=16),
}
MODES = {"parameters": {"data": "none"}, "full": {"data": "random"}}


def _load(path, default=None):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return default


def _dump(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def write_checkpoint(path: str, size: dict, seed: int = 0) -> str:
    import jax
    import jax.numpy as jnp

    from naisnet_jax import checkpoint as ckpt
    from naisnet_jax import models
    from naisnet_jax.projection import project_params

    if ckpt.latest_step(path) is not None:
        return path
    eps, h = 0.01, 1.0
    kwargs = dict(stage_sizes=size["stage_sizes"], filters=size["filters"], steps=size["steps"], activation="relu")
    model = models.NaisNetConv(num_classes=10, eps=eps, h=h, **kwargs)
    shape = (size["image"], size["image"], 3)
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1,) + shape))
    # random state kernels well outside the set, then Algorithm 2: on the boundary, as after training
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 50.0 if "state_kernel" in jax.tree_util.keystr(p) else x, variables["params"]
    )
    params = project_params(params, eps=eps)
    meta = ckpt.CheckpointMetadata(
        model="naisnet_cifar10",
        num_classes=10,
        input_shape=shape,
        dataset="cifar10",
        channel_mean=(0.0, 0.0, 0.0),
        channel_std=(1.0, 1.0, 1.0),
        eps=eps,
        h=h,
        model_kwargs={k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        epoch=0,
    )
    mngr = ckpt.manager(path)
    ckpt.save(mngr, 0, {"params": params, "batch_stats": variables.get("batch_stats", {})}, meta)
    mngr.close()
    return path


# ------------------------------------------------------------------ worker: timed audits


def worker(args) -> None:
    """In a fresh process: audit ``args.mode`` twice (cold, warm), or once with the programs the
    first process cached (``args.cached``), and record the timings."""
    import jax
    from naisnet_jax.verify import AuditOptions, audit

    from naisnet_jax import compile_cache

    compile_cache.enable(os.path.join(args.out, f"jax_cache_{args.mode}"))
    size = SIZES[args.size]
    options = AuditOptions(samples=size["samples"], **MODES[args.mode])
    runs = []
    for label in ("cold, cached",) if args.cached else ("cold", "warm"):
        t0, c0 = time.perf_counter(), time.process_time()
        cert = audit(os.path.join(args.out, "checkpoint"), options)
        runs.append(
            {"run": label, "wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "phases": cert.timings}
        )
    with open(os.path.join(args.out, f"certificate_{args.mode}.json"), "w") as f:
        f.write(cert.to_json())
    device = jax.devices()[0]
    _dump(
        {
            "device": f"{device.device_kind} ({device.platform})",
            "runs": runs,
            "blocks": len(cert.blocks),
            "certified": cert.certified,
        },
        os.path.join(args.out, f"runs_{args.mode}{'_cached' if args.cached else ''}.json"),
    )


# ------------------------------------------------------------------ reference figures


def reference(args) -> None:
    """Float64 figures block by block, without the batched code path."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from naisnet_jax.verify import conv_operator, jacobian_operator, spectral_radius_info, x64_scope

    from naisnet_jax import checkpoint as ckpt
    from naisnet_jax.cell import activation_slope, conv_same
    from naisnet_jax.probe import AUDIT_COLLECTION, BlockProbe

    size = SIZES[args.size]
    out = _load(os.path.join(args.out, "reference.json"), {})
    with x64_scope():  # float64, highest matmul precision: as the verifier audits
        state, raw = ckpt.load(os.path.join(args.out, "checkpoint"))
        meta = ckpt.CheckpointMetadata.from_json(raw)
        model = meta.build_model()
        variables = {"params": state["params"], "batch_stats": state["batch_stats"]}
        x = np.random.default_rng(0).standard_normal((size["samples"],) + tuple(meta.input_shape))
        _, mutated = model.apply(variables, jnp.asarray(x), train=False, mutable=[AUDIT_COLLECTION])
        probes = jax.tree_util.tree_flatten_with_path(
            mutated[AUDIT_COLLECTION], is_leaf=lambda v: isinstance(v, BlockProbe)
        )[0]
        for path, p in probes:
            name = "/".join(str(getattr(k, "key", k)) for k in path[:-2])
            if name in out:
                continue
            K = np.asarray(p.operator, np.float64)
            C, k = K.shape[-1], K.shape[0]
            c = np.diagonal(K[k // 2, k // 2])
            r = np.abs(K).sum(axis=(0, 1, 2)) - np.abs(c)
            H, W = p.states.shape[2:4]
            h = float(np.float32(p.h))
            res = spectral_radius_info(
                jacobian_operator(conv_operator(jnp.asarray(K), (H, W, C)), jnp.ones(H * W * C), h), n=H * W * C
            )
            X = np.concatenate([np.asarray(p.x0)[None], np.asarray(p.states)])
            slopes, inf_norm = [], []
            ones = jnp.ones((1, H, W, C))
            off = np.abs(K).copy()
            off[k // 2, k // 2, range(C), range(C)] = 0
            rowsum = np.asarray(conv_same(ones, jnp.asarray(off)))[0]
            for step in range(X.shape[0] - 1):
                pre = conv_same(jnp.asarray(X[step]), jnp.asarray(K)) + jnp.asarray(p.drive)
                s = np.asarray(activation_slope(p.activation, pre))
                slopes.append(s)
                inf_norm.append(np.max(np.abs(1 + float(p.h) * s * c) + float(p.h) * s * rowsum, axis=(1, 2, 3)))
            slopes = np.stack(slopes)
            out[name] = {
                "inf_norm_bound_I_plus_hA": float(np.max(np.abs(1 + h * c) + h * r)),
                "rho_I_plus_hA": float(res.radius),
                "unsaturated_fraction": float(np.mean(slopes >= 1e-2)),
                "states_in_P_fraction": float(np.mean(np.all(slopes >= 1e-2, axis=(2, 3, 4)))),
                "inf_norm_J_max": float(np.max(inf_norm)),
            }
            _dump(out, os.path.join(args.out, "reference.json"))  # resume block by block


def compare(out_dir: str) -> dict:
    """Largest relative difference of each figure between the audit and the reference."""
    ref = _load(os.path.join(out_dir, "reference.json"), {})
    diffs = {}
    for mode in MODES:
        path = os.path.join(out_dir, f"certificate_{mode}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            cert = json.load(f)
        for b in cert["blocks"]:
            if b["name"] not in ref:
                continue
            figures = dict(b["parameter"], **(b["trajectory"] or {}))
            for key, want in ref[b["name"]].items():
                got = figures.get(key)
                if got is None:
                    continue
                rel = abs(float(got) - want) / max(abs(want), 1e-300)
                diffs[key] = max(diffs.get(key, 0.0), rel)
    return diffs


# ------------------------------------------------------------------ the command


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results directory (reused to resume)")
    parser.add_argument(
        "--tiny", action="store_true", help="a smoke test, a few minutes on a CPU (2+2+2 blocks, 4 inputs)"
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the float64 reference check")
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--cached", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--size", default=None, choices=list(SIZES), help="model size (default cifar; --tiny is --size=tiny)"
    )
    args = parser.parse_args(argv)
    args.size = args.size or ("tiny" if args.tiny else "cifar")
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        args.mode = args.worker
        return worker(args)
    if args.reference_worker:
        return reference(args)

    write_checkpoint(os.path.join(args.out, "checkpoint"), SIZES[args.size])
    me = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--size", args.size]
    for mode in MODES:  # each in a fresh process: "cold" includes every compilation
        if not os.path.exists(os.path.join(args.out, f"runs_{mode}.json")):
            subprocess.run(me + ["--worker", mode], check=True)
        if not os.path.exists(os.path.join(args.out, f"runs_{mode}_cached.json")):
            subprocess.run(me + ["--worker", mode, "--cached"], check=True)
    if not args.no_reference:
        subprocess.run(me + ["--reference-worker"], check=True)
    diffs = compare(args.out)
    rows = []
    device = None
    for mode in MODES:
        runs = _load(os.path.join(args.out, f"runs_{mode}.json"))
        device = runs["device"]
        cached = _load(os.path.join(args.out, f"runs_{mode}_cached.json"), {"runs": []})
        for r in runs["runs"] + cached["runs"]:
            rows.append(
                {
                    "audit": mode,
                    "run": r["run"],
                    "wall_s": r["wall"],
                    "cpu_s": r["cpu"],
                    "blocks": runs["blocks"],
                    "certified": runs["certified"],
                    "phases": {k: v for k, v in r["phases"].items()},
                }
            )
    result = {
        "device": device,
        "script": _common.script(),
        "size": args.size,
        **SIZES[args.size],
        "rows": rows,
        "max_relative_difference_vs_reference": diffs,
    }
    _dump(result, os.path.join(args.out, "audit_speed.json"))
    lines = [
        f"device: {device}; model: {args.size} shape, {rows[0]['blocks']} blocks, "
        f"{SIZES[args.size]['samples']} inputs; script {result['script']}",
        "",
        "| audit | run | wall s | CPU s | certified |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['audit']} | {r['run']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['certified']} |" for r in rows]
    full = [r for r in rows if r["audit"] == "full" and r["run"] in ("cold", "warm")]
    phases = [k for k in full[0]["phases"] if not k.endswith("(cpu)") and not k.startswith("total")]
    lines += [
        "",
        "| phase (full audit) | cold wall s | cold CPU s | warm wall s | warm CPU s |",
        "|---|---|---|---|---|",
    ]
    for ph in phases:
        lines.append(
            f"| {ph} | "
            + " | ".join(f"{r['phases'].get(ph, 0):.2f} | {r['phases'].get(ph + ' (cpu)', 0):.2f}" for r in full)
            + " |"
        )
    if diffs:
        lines += ["", "| figure | max relative difference vs float64 reference |", "|---|---|"]
        lines += [f"| {k} | {v:.2e} |" for k, v in sorted(diffs.items())]
    table = "\n".join(lines)
    with open(os.path.join(args.out, "audit_speed.md"), "w") as f:
        f.write(table + "\n")
    _plot(full, phases, os.path.join(args.out, "audit_speed.png"))
    print(table)


def _plot(full, phases, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    left = [0.0, 0.0]
    for ph in phases:
        widths = [r["phases"].get(ph, 0.0) for r in full]
        ax.barh([r["run"] for r in full], widths, left=left, label=ph)
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="wall seconds", title="full audit, by phase")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
