"""Benchmark: one process of n GPUs against n processes of one GPU each, on one host.

The same training, the CIFAR NAIS-Net10 on its fast path (``block_vjp="fused"``,
``scan_unroll=10``) through the trainer's own chunk (``train.make_train_chunk`` over a
``Mesh`` of every device: state and dataset replicated, each batch split over the devices,
augmentation and projection included), run twice side by side:

- **one process** that sees all n GPUs;
- **n processes** of one GPU each (``CUDA_VISIBLE_DEVICES``), joined by
  :func:`naisnet_jax.distributed.initialize` into one run on JAX's multi-controller runtime.

Each records the loss of ``--steps`` steps one at a time from the same start, twice: with
float32 products (``jax.default_matmul_precision("float32")``: XLA's convolutions and the
project's kernels at that precision, so the two runs differ by float32 rounding alone, in the
all-reduces' order and the convolution algorithms) and at the default precision the fast step
trains at (TF32 products on an NVIDIA GPU). It then times ``--repeats`` chunks of ``--steps``
steps (best of) at the default precision for images/s. A third run, the one process again
(``--control``, curves only), shows how far the one process differs from itself: at TF32, XLA's
autotuner may pick another convolution algorithm in each process, and a difference that large
between the one process and the n is not the runtime's. Target: the n-process throughput within
5% of the one process's; the curves are reported, step 0 (the same forward pass on the same
state) apart.

    python benchmarks/multiprocess.py --out=runs/bench/multiprocess        # every GPU of the host
    python benchmarks/multiprocess.py --out=/tmp/smoke --smoke             # 2 x 2 CPU devices, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

FAST = {"block_vjp": "fused", "scan_unroll": 10}
TARGET = 0.95  # n processes' images/s over one process's, at least


def measure(args) -> dict:
    """One process's part of a run (``args.processes`` of them): the loss curve and images/s."""
    _common.importable()
    from naisnet_jax import distributed

    if args.processes > 1:
        cluster = distributed.Cluster(f"127.0.0.1:{args.port}", args.processes, args.process_id)
        distributed.initialize(cluster)
    import jax
    import ml_collections
    import numpy as np

    from naisnet_jax import data as data_lib
    from naisnet_jax import sweep, train

    config = _common.cifar_config()
    config.model = args.model
    config.model_kwargs = ml_collections.ConfigDict(args.kwargs)
    config.batch_size = args.batch
    mesh = train.make_mesh()
    rng = np.random.default_rng(0)  # the same images on every process
    n = args.steps * args.batch
    shape = (args.size, args.size, 3)
    images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.int32)
    data = train.replicate(data_lib.put_on_device(images, labels), mesh)
    mean, std = data_lib.channel_stats(images)
    model = train.build_model(config, 10, batch_axis=train.batch_norm_axis(mesh))
    initial = jax.device_get(train.create_train_state(config, model, shape, steps_per_epoch=args.steps))
    chunk = train.make_train_chunk(mean, std, augment=True, mesh=mesh)
    rows = np.asarray(data_lib.epoch_batches(jax.random.PRNGKey(0), n, args.batch))
    key = train.replicate(jax.random.PRNGKey(1), mesh)

    def run(state, first: int, count: int):
        part = train.replicate(rows[first : first + count], mesh)
        return chunk(
            state, data, part, key, train.replicate(np.int32(count), mesh), train.replicate(np.int32(first), mesh)
        )

    def curve() -> list[float]:
        """The loss of each of ``--steps`` steps, a step at a time, from the start."""
        state, losses = train.replicate(initial, mesh), []  # the chunk takes (donates) the state it is given
        for step in range(args.steps):
            state, m = run(state, step, 1)
            losses.append(float(m["loss"]))
        return losses

    t0 = time.perf_counter()
    with jax.default_matmul_precision("float32"):  # traced (and compiled) anew at this precision
        losses_float32 = curve()
    losses = curve()
    record = {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "device": sweep.device_description(),
        "script": _common.script(),
        "global_batch": args.batch,
        "losses_float32": losses_float32,
        "losses": losses,
        "curve_seconds": time.perf_counter() - t0,
    }
    if not args.time:
        return record
    best = float("inf")
    for _ in range(args.repeats + 1):  # the first compiles the chunk of --steps steps
        state = train.replicate(initial, mesh)
        t = time.perf_counter()
        _, m = run(state, 0, args.steps)
        jax.block_until_ready(m)
        best = min(best, time.perf_counter() - t)
    return record | {"ms_per_step": 1000 * best / args.steps, "images_per_s": args.batch * args.steps / best}


def launch(args, processes: int, devices: int, out: str, tag: str, time_it: bool = True) -> dict:
    """Run ``processes`` workers of ``devices // processes`` devices each; process 0's record, kept
    as ``worker_<processes>_<tag>.json`` (its loss curves only, untimed, where ``time_it`` is false)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per = devices // processes
    record = os.path.join(out, f"worker_{processes}_{tag}.json")
    procs = []
    for i in range(processes):
        env = dict(os.environ)
        if args.smoke:
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={per}")
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * per, (i + 1) * per))
        command = [sys.executable, os.path.abspath(__file__), "--worker", f"--out={out}", f"--record={record}"]
        command += [f"--processes={processes}"]
        command += [f"--process-id={i}", f"--port={port}", f"--steps={args.steps}", f"--repeats={args.repeats}"]
        command += [
            f"--batch={args.batch}",
            f"--model={args.model}",
            f"--size={args.size}",
            f"--kwargs={json.dumps(args.kwargs)}",
            "--time" if time_it else "--no-time",
        ]
        procs.append(subprocess.Popen(command, env=env))
    status = [p.wait(timeout=args.timeout) for p in procs]
    if any(status):
        raise SystemExit(f"{processes} process(es) of {per} device(s): exit status {status}")
    with open(record) as f:
        return json.load(f)


def differences(a: list[float], b: list[float]) -> dict:
    """How far two loss curves differ: at step 0 (the same forward pass on the same state) and at
    most over all the steps."""
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"step0": gaps[0], "largest": max(gaps), "at_step": gaps.index(max(gaps))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default 128 a device; 16 with --smoke)")
    parser.add_argument("--model", default="naisnet_cifar10")
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    parser.add_argument("--smoke", action="store_true", help="2 processes x 2 CPU devices, tiny model")
    parser.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the one process a second time (curves only) to show how far it differs from itself",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)  # where a worker's process 0 writes its record
    parser.add_argument("--time", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kwargs", default=json.dumps(FAST), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.kwargs = json.loads(args.kwargs) if isinstance(args.kwargs, str) else args.kwargs
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        record = measure(args)
        if args.process_id == 0:
            with open(args.record, "w") as f:
                json.dump(record, f, indent=1)
        return
    if args.smoke:
        args.model, args.size, args.steps, args.repeats, args.kwargs = "naisnet_conv_tiny", 8, 4, 1, {}
        devices = 4
    else:
        devices = int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU "))
        if devices < 2:
            raise SystemExit(f"this host has {devices} GPU(s); the benchmark needs at least 2")
    args.batch = args.batch or (16 if args.smoke else 128 * devices)
    one = launch(args, 1, devices, args.out, "one")
    many = launch(args, devices if not args.smoke else 2, devices, args.out, "processes")
    control = launch(args, 1, devices, args.out, "control", time_it=False) if args.control else None
    ratio = many["images_per_s"] / one["images_per_s"]
    rows = [
        {"name": f"1 process x {one['devices']} devices", "ips": one["images_per_s"], "ms": one["ms_per_step"]},
        {
            "name": f"{many['processes']} processes x {many['devices'] // many['processes']} device(s)",
            "ips": many["images_per_s"],
            "ms": many["ms_per_step"],
        },
    ]
    text, md = _common.table(rows, [("name", "run", ""), ("ips", "images/s", ".0f"), ("ms", "ms/step", ".2f")])
    curves = {}  # a pair's curve differences by precision, for each pair compared
    pairs = [("processes", many, f"{many['processes']} processes against the one")]
    pairs += [("control", control, "the one process against itself")] if control else []
    curve_rows = []
    for name, other, label in pairs:
        row = {"name": label}
        for precision, key in (("float32", "losses_float32"), ("default", "losses")):
            d = curves.setdefault(name, {})[precision] = differences(one[key], other[key])
            row |= {f"{precision}_0": d["step0"], f"{precision}_max": f"{d['largest']:.3g} ({d['at_step']})"}
        curve_rows.append(row)
    curve_text, curve_md = _common.table(
        curve_rows,
        [
            ("name", "loss curves", ""),
            ("float32_0", "float32 products: step 0", ".3g"),
            ("float32_max", "largest (step)", ""),
            ("default_0", "default precision: step 0", ".3g"),
            ("default_max", "largest (step)", ""),
        ],
    )
    summary = (
        f"{args.steps} steps, global batch {args.batch}, {args.model} {args.kwargs}, on {one['device']}; "
        f"first loss {one['losses'][0]:.4f}\n"
        f"throughput of the processes / the one process: {ratio:.3f} (target at least {TARGET}): "
        f"{'met' if ratio >= TARGET else 'missed'}"
    )
    result = {
        "host": _common.host_summary(),
        "script": _common.script(),
        "one_process": one,
        "processes": many,
        "control": control,
        "loss_differences": curves,
        "throughput_ratio": ratio,
        "target": TARGET,
    }
    with open(os.path.join(args.out, "multiprocess.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "multiprocess.md"), "w") as f:
        f.write(md + "\n\n" + curve_md + "\n\n" + summary.replace("\n", "\n\n") + "\n")
    print(text + "\n\n" + curve_text)
    print(summary)


if __name__ == "__main__":
    main()
