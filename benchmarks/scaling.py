"""Benchmark: data-parallel scaling of the NAIS-Net10 training step over the GPUs of a host.

The trainer's own chunk (``train.make_train_chunk`` with a ``Mesh``: state and dataset
replicated, each batch sharded; augmentation and projection included; the step count passed
as the trainer passes it) on 1 device and on n:

- weak scaling: b images per device (global batch b x n); efficiency
  ``images/s(n) / (n x images/s(1))`` with one device at batch b;
- strong scaling: global batch b x n on n devices and on one; efficiency likewise.

``--per-device-batch`` is b (128 by default); ``--per-device-batch=128,256`` measures several in
one call (a card's throughput grows with its batch, which bounds strong scaling: see BENCHMARKS.md).

Targets: weak at least 95%; strong at least 90% on 2 GPUs and 85% on 4. ``--devices=2,4``
measures several n in one call; ``--batch-norm=global,device`` measures BatchNorm by the whole
batch (the default, one device's numbers) and by each device's rows
(``config.sync_batch_norm=False``). ``--model-kwargs`` (JSON) measures a variant, e.g.
``'{"block_vjp": "fused", "scan_unroll": 10}'``.

    python benchmarks/scaling.py --out=runs/bench/scaling            # on a machine with >= 2 GPUs
    python benchmarks/scaling.py --out=/tmp/smoke --smoke            # 2 CPU devices, tiny model
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

#: (mode, devices) -> least efficiency
TARGETS = {"weak": 0.95, ("strong", 2): 0.90, "strong": 0.85}


def target(mode: str, n: int) -> float:
    return TARGETS.get((mode, n), TARGETS[mode])


def run_key(devices: int, batch: int, norm: str) -> str:
    """The name of a measurement in ``scaling_runs.json`` (one device: BatchNorm is the same)."""
    return f"{devices}x{batch}" + ("" if norm == "global" or devices == 1 else "_device_bn")


def measure(
    n_devices: int,
    global_batch: int,
    *,
    model: str,
    model_kwargs: dict,
    steps: int,
    repeats: int,
    sync_batch_norm: bool = True,
) -> dict:
    import jax
    import ml_collections
    import numpy as np

    from naisnet_jax import data as data_lib
    from naisnet_jax import train

    config = _common.cifar_config()
    config.model = model
    config.model_kwargs = ml_collections.ConfigDict(model_kwargs)
    config.batch_size = global_batch
    mesh = train.make_mesh(n_devices)
    rng = np.random.default_rng(0)
    n = steps * global_batch
    images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.int32)
    data = train.replicate(data_lib.put_on_device(images, labels), mesh)
    mean, std = data_lib.channel_stats(images)
    model = train.build_model(config, 10, batch_axis=train.batch_norm_axis(mesh, sync_batch_norm))
    state = train.create_train_state(config, model, (32, 32, 3), steps_per_epoch=steps)
    state = train.replicate(state, mesh)
    chunk = train.make_train_chunk(mean, std, augment=True, mesh=mesh, sync_batch_norm=sync_batch_norm)
    idx = train.replicate(data_lib.epoch_batches(jax.random.PRNGKey(0), n, global_batch), mesh)
    key = train.replicate(jax.random.PRNGKey(1), mesh)
    count = train.replicate(np.int32(steps), mesh)
    t0 = time.perf_counter()
    state, metrics = chunk(state, data, idx, key, count)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state, metrics = chunk(state, data, idx, key, count)
        jax.block_until_ready(metrics)
        best = min(best, time.perf_counter() - t)
    return {
        "devices": n_devices,
        "global_batch": global_batch,
        "per_device_batch": global_batch // n_devices,
        "ms_per_step": 1000 * best / steps,
        "images_per_s": global_batch * steps / best,
        "compile_and_first_s": first,
        "loss": float(metrics["loss"]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="naisnet_cifar10")
    parser.add_argument("--model-kwargs", default="{}", help="JSON, e.g. '{\"scan_unroll\": 10}'")
    parser.add_argument(
        "--per-device-batch", default=None, help="images a device, or several: 128,256 (default 128; 8 with --smoke)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", default="all", help="device counts to scale to, e.g. 2,4 (default: all)")
    parser.add_argument("--batch-norm", default="global", help="global, device, or both: global,device")
    parser.add_argument("--smoke", action="store_true", help="2 CPU devices, tiny model, batch 8 per device")
    args = parser.parse_args(argv)
    if args.smoke:  # before jax starts
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.model, args.steps, args.repeats = "naisnet_conv_tiny", 2, 1
    _common.importable()
    import jax

    os.makedirs(args.out, exist_ok=True)
    kwargs = json.loads(args.model_kwargs)
    available = jax.device_count()
    counts = [available] if args.devices == "all" else sorted({int(d) for d in args.devices.split(",")})
    if any(not 1 <= d <= available for d in counts):
        parser.error(f"--devices={args.devices!r}: this host has {available} device(s)")
    try:
        batches = [int(b) for b in (args.per_device_batch or ("8" if args.smoke else "128")).split(",")]
    except ValueError:
        batches = []
    if not batches or any(b < 1 for b in batches):
        parser.error(f"--per-device-batch={args.per_device_batch!r}: expected positive integers, e.g. 128,256")
    norms = args.batch_norm.split(",")
    if any(b not in ("global", "device") for b in norms):
        parser.error(f"--batch-norm={args.batch_norm!r}: expected global, device or global,device")
    runs = {}
    path = os.path.join(args.out, "scaling_runs.json")
    if os.path.exists(path):  # resume
        with open(path) as f:
            runs = json.load(f)
    plan = []
    for b in batches:
        plan.append((1, b, "global"))
        for n in counts:
            plan += [(1, b * n, "global")] + [(n, b * n, norm) for norm in norms if n > 1]
    for devices, batch, norm in dict.fromkeys(plan):
        key = run_key(devices, batch, norm)
        if key not in runs:
            print(f"{devices} device(s), global batch {batch}, BatchNorm by {norm}", flush=True)
            runs[key] = measure(
                devices,
                batch,
                model=args.model,
                model_kwargs=kwargs,
                steps=args.steps,
                repeats=args.repeats,
                sync_batch_norm=norm == "global",
            )
            with open(path, "w") as f:
                json.dump(runs, f, indent=2)
    rows = []
    for b, n in itertools.product(batches, counts):
        for norm in norms if n > 1 else ["global"]:
            many = runs[run_key(n, b * n, norm)]
            for mode in ("weak", "strong"):
                one = runs[run_key(1, b if mode == "weak" else b * n, "global")]
                eff = many["images_per_s"] / (n * one["images_per_s"])
                rows.append(
                    {
                        "name": f"{mode}: 1 -> {n} devices"
                        + (f", {b} images a device" if len(batches) > 1 else "")
                        + (", BatchNorm per device" if norm == "device" else ""),
                        "images_per_s_1": one["images_per_s"],
                        "images_per_s_n": many["images_per_s"],
                        "batch_1": one["global_batch"],
                        "batch_n": many["global_batch"],
                        "efficiency": 100 * eff,
                        "target": 100 * target(mode, n),
                        "pass": eff >= target(mode, n) if n > 1 else None,
                    }
                )
    text, md = _common.table(
        rows,
        [
            ("name", "scaling", ""),
            ("batch_1", "batch (1)", "d"),
            ("images_per_s_1", "images/s (1)", ".0f"),
            ("batch_n", "batch (n)", "d"),
            ("images_per_s_n", "images/s (n)", ".0f"),
            ("efficiency", "efficiency %", ".1f"),
            ("target", "target %", ".0f"),
            ("pass", "met", ""),
        ],
    )
    head = (
        f"device: {jax.devices()[0].device_kind} x {available}; model {args.model} {kwargs or ''}; "
        f"per-device batch {', '.join(map(str, batches))}; best of {args.repeats} chunks of {args.steps} steps"
    )
    if counts == [1]:
        head += " (one device: nothing to scale; run on a machine with several GPUs)"
    _common.write_results(
        args.out, "scaling", {"runs": runs, "rows": rows, **_common.device_summary()}, head + "\n\n" + md
    )
    print()
    print(head)
    print(text)


if __name__ == "__main__":
    main()
