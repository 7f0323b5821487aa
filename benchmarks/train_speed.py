"""Benchmark: training throughput of the CIFAR-shaped networks of section 5.2.

NAIS-Net1 (each of the 54 blocks unrolled once), NAIS-Net10 (ten times) and the
single-convolution ResNet, batch 128 of 32x32x3 images with augmentation, SGD with
momentum and the stability projection after every step, the whole epoch as
``lax.scan`` chunks inside ``jit`` (exactly the trainer's step). The images are
synthetic (throughput does not depend on their content); after the timed steps
every NAIS block is checked against the projection's bound. Prints a table last
and writes ``train_speed.json`` under ``--out``.

    python benchmarks/train_speed.py --out=/tmp/bench [--models=naisnet_cifar1,resnet_cifar]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from audit_speed import _importable


def bench(model_name: str, *, steps: int, batch: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from experiments.configs import cifar10_naisnet
    from naisnet_jax import data as data_lib
    from naisnet_jax import train
    from naisnet_jax.stability import max_radius_bound

    config = cifar10_naisnet.get_config()
    config.model = model_name
    config.batch_size = batch
    rng = np.random.default_rng(0)
    n = steps * batch
    images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.int32)
    data = data_lib.put_on_device(images, labels)
    mean, std = data_lib.channel_stats(images)
    model = train.build_model(config, 10)
    state = train.create_train_state(config, model, (32, 32, 3), steps_per_epoch=steps)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    chunk = train.make_train_chunk(mean, std, augment=True)
    idx = data_lib.epoch_batches(jax.random.PRNGKey(0), n, batch)
    t0 = time.perf_counter()
    state, metrics = chunk(state, data, idx, jax.random.PRNGKey(1))
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        state, metrics = chunk(state, data, idx, jax.random.PRNGKey(2 + r))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    best = min(times)
    return {
        "model": model_name,
        "parameters": int(n_params),
        "batch": batch,
        "steps_timed": steps,
        "compile_and_first_chunk_s": compile_s,
        "ms_per_step": 1000 * best / steps,
        "images_per_s": steps * batch / best,
        "peak_memory_gib": stats.get("peak_bytes_in_use", float("nan")) / 2**30,
        "loss": float(metrics["loss"]),
        "rho_max_after": max_radius_bound(state.params, eps=config.eps, h=config.h),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="naisnet-bench-"))
    parser.add_argument("--models", default="naisnet_cifar1,naisnet_cifar10,resnet_cifar")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed chunk")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _importable()
    import jax

    os.makedirs(args.out, exist_ok=True)
    if args.one:  # one model per process: the device's peak-memory counter never resets
        row = bench(args.one, steps=args.steps, batch=args.batch, repeats=args.repeats)
        with open(os.path.join(args.out, f"train_speed_{args.one}.json"), "w") as f:
            json.dump(row, f)
        return
    rows = []
    for name in args.models.split(","):
        subprocess.run(
            [
                sys.executable,
                __file__,
                f"--one={name}",
                f"--out={args.out}",
                f"--steps={args.steps}",
                f"--batch={args.batch}",
                f"--repeats={args.repeats}",
            ],
            check=True,
        )
        with open(os.path.join(args.out, f"train_speed_{name}.json")) as f:
            rows.append(json.load(f))
        with open(os.path.join(args.out, "train_speed.json"), "w") as f:
            json.dump(rows, f, indent=2)
    device = jax.devices()[0]
    print(
        f"\ndevice: {device.device_kind} ({device.platform}); batch {args.batch}, best of {args.repeats} chunks "
        f"of {args.steps} steps, augmentation and projection included"
    )
    print(
        f"{'model':18s} {'params':>9s} {'compile s':>9s} {'ms/step':>8s} {'images/s':>9s} {'peak GiB':>8s} "
        f"{'rho_max':>8s}"
    )
    for r in rows:
        print(
            f"{r['model']:18s} {r['parameters']:9d} {r['compile_and_first_chunk_s']:9.1f} {r['ms_per_step']:8.2f} "
            f"{r['images_per_s']:9.0f} {r['peak_memory_gib']:8.2f} {r['rho_max_after']:8.4f}"
        )


if __name__ == "__main__":
    main()
