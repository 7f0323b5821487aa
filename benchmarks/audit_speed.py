"""Benchmark: how long the stability audit takes.

Builds a conv NAIS-Net of the paper's CIFAR shape (3 stages x 18 blocks,
16/32/64 filters, 32x32x3 inputs, K = 10), projects its parameters, writes it
as a checkpoint, and times ``naisnet_jax.verify.audit`` on it twice: the
parameter-level audit with the exact ``rho(I + h A)`` of every block (matrix-
free Arnoldi at each block's resolution), and the full audit with trajectory
Jacobians, gains and equilibria on synthetic inputs. Optionally also times the
audit of an existing checkpoint (e.g. the demo's). Prints a table last and
writes the certificates as JSON under ``--out``.

    python benchmarks/audit_speed.py --out=/tmp/bench [--checkpoint=runs/demo/checkpoints]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _importable():
    """Run from a checkout without installing: src/ on the path, verify/ as naisnet_jax.verify."""
    sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]
    import naisnet_jax

    if not any(os.path.isdir(os.path.join(p, "verify")) for p in naisnet_jax.__path__):
        naisnet_jax.__path__.append(ROOT)


def write_cifar_checkpoint(path: str, *, model_name: str, stage_sizes, activation: str, seed: int = 0) -> str:
    import jax
    import jax.numpy as jnp

    from naisnet_jax import checkpoint as ckpt
    from naisnet_jax import models
    from naisnet_jax.projection import project_params

    eps, h = 0.01, 1.0
    kwargs = {"eps": eps, "h": h, "activation": activation}
    if stage_sizes is not None:
        kwargs["stage_sizes"] = tuple(stage_sizes)
    model = models.get_model(model_name, num_classes=10, **kwargs)
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 32, 32, 3)))
    # random state kernels well outside the set, then Algorithm 2: the audit sees
    # kernels on the boundary of the Gershgorin set, as after training
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 50.0 if "state_kernel" in jax.tree_util.keystr(p) else x, variables["params"])
    params = project_params(params, eps=eps)
    mngr = ckpt.manager(path)
    meta = {
        "model": model_name, "model_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "num_classes": 10, "input_shape": [32, 32, 3], "dataset": "cifar10",
        "channel_mean": [0.0, 0.0, 0.0], "channel_std": [1.0, 1.0, 1.0],
        "eps": eps, "eta": 0.5, "h": h, "relaxed": False, "config": {}, "epoch": 0,
    }
    ckpt.save(mngr, 0, {"params": params, "batch_stats": variables.get("batch_stats", {})}, meta)
    mngr.close()
    return path


def timed_audit(path, options):
    from naisnet_jax.verify import audit

    t0 = time.perf_counter()
    report = audit(path, options)
    return time.perf_counter() - t0, report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="naisnet-bench-"))
    parser.add_argument("--model", default="naisnet_cifar10")
    parser.add_argument("--stage-sizes", type=int, nargs=3, default=None, help="override (18, 18, 18)")
    parser.add_argument("--activation", default="relu")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--checkpoint", default=None, help="also audit this checkpoint (its own data)")
    args = parser.parse_args(argv)
    _importable()
    import jax

    from naisnet_jax.verify import AuditOptions
    from naisnet_jax.verify.report import write_json

    os.makedirs(args.out, exist_ok=True)
    device = jax.devices()[0]
    rows = []
    if args.checkpoint:
        for label, opts in [("checkpoint, full audit", AuditOptions())]:
            seconds, report = timed_audit(args.checkpoint, opts)
            write_json(dict(report), os.path.join(args.out, "checkpoint_certificate.json"))
            rows.append((label, args.checkpoint, report["summary"]["blocks"], seconds, report["certified"],
                         report["summary"]["rho_I_plus_hA_max"]))
    path = write_cifar_checkpoint(os.path.join(args.out, "cifar_ckpt"), model_name=args.model,
                                  stage_sizes=args.stage_sizes, activation=args.activation)
    for label, opts in [
        ("CIFAR shape, parameters + exact rho", AuditOptions(data="none")),
        (f"CIFAR shape, full ({args.samples} inputs)", AuditOptions(data="random", samples=args.samples)),
    ]:
        run = 0
        for run in range(2):  # first run includes compilation
            seconds, report = timed_audit(path, opts)
            rows.append((label + (" (warm)" if run else " (cold)"), args.model, report["summary"]["blocks"], seconds,
                         report["certified"], report["summary"]["rho_I_plus_hA_max"]))
        write_json(dict(report), os.path.join(args.out, f"cifar_{opts.data}_certificate.json"))
    with open(os.path.join(args.out, "audit_speed.json"), "w") as f:
        json.dump([dict(zip(["what", "model", "blocks", "seconds", "certified", "rho_max"], r)) for r in rows], f, indent=2)
    print(f"\ndevice: {device.device_kind} ({device.platform})")
    print(f"{'what':44s} {'model':16s} {'blocks':>6s} {'seconds':>9s} {'certified':>9s} {'max rho(I+hA)':>14s}")
    for what, model, blocks, seconds, certified, rho in rows:
        print(f"{what:44s} {os.path.basename(str(model).rstrip('/'))[:16]:16s} {blocks:6d} {seconds:9.2f} {str(certified):>9s} {rho:14.6f}")


if __name__ == "__main__":
    main()
