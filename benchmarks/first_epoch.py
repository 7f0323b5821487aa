"""Benchmark: the first epoch of ``naisnet-train`` against a steady one, cold and cached.

Runs the trainer twice, each in a fresh process, on one compilation cache directory that starts
empty: the first run compiles every program ("cold", a machine's first run), the second reads
them ("cached", every later run). Each trains ``--epochs`` epochs of the CIFAR NAIS-Net10 config
(``src/naisnet_jax/configs/cifar10_naisnet.py``, a constant learning rate, the trainer's defaults
otherwise: the fast path on a GPU) on ``--dataset``. The table gives each run's first epoch, its
steady epoch (the median of the later ones), the difference, and its first chunk of steps, whose
time includes compiling the training program. Target: the first epoch of a first run on a new
machine (the cold run, its cache empty) at most :data:`TARGET_OVER_STEADY` seconds over a steady
one; the cached run, every later run's case, is reported beside it.

    python benchmarks/first_epoch.py --out=$OUT/first_epoch            # MNIST (make mnist)
    python benchmarks/first_epoch.py --out=/tmp/first_epoch --smoke     # a tiny net on digits, a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

#: the most a cold run's first epoch may cost over a steady one, in seconds
TARGET_OVER_STEADY = 30.0
CONFIG = os.path.join(_common.ROOT, "src", "naisnet_jax", "configs", "cifar10_naisnet.py")
SMOKE = (  # with --config.dataset=digits
    "--config.model=naisnet_conv_tiny",
    "--config.limit_train=256",
    "--config.limit_test=100",
    "--config.batch_size=32",
    "--config.eval_batch_size=100",
    "--config.augment=False",
    "--config.steps_per_chunk=4",
)


def train_once(workdir: str, cache: str, *, dataset: str, epochs: int, smoke: bool) -> dict:
    """One trainer process; its epochs' and first chunk's seconds, read from its workdir."""
    cmd = [
        sys.executable,
        "-m",
        "naisnet_jax.train_cli",
        f"--config={CONFIG}",
        f"--config.dataset={dataset}",
        f"--config.num_epochs={epochs}",
        "--config.lr_boundaries_epochs=[]",
        "--config.progress=False",
        f"--workdir={workdir}",
        f"--compilation_cache={cache}",
        *(SMOKE if smoke else ()),
    ]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # this run's cache only
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(_common.ROOT, "src"), _common.ROOT, env.get("PYTHONPATH")) if p
    )
    with open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"), "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    _common.importable()
    from naisnet_jax.metric_writers import read_jsonl

    epochs_s = [r["epoch_seconds"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]
    first = read_jsonl(os.path.join(workdir, "scalars.jsonl"))[0]
    steady = statistics.median(epochs_s[1:])
    return {
        "epoch_seconds": epochs_s,
        "first_epoch_s": epochs_s[0],
        "steady_epoch_s": steady,
        "over_steady_s": epochs_s[0] - steady,
        "first_chunk_steps": first["step"],
        "first_chunk_s": first["step"] / first["train/steps_per_second"],
    }


def _device() -> dict:
    """The device summary from a child process (the trainers need the card's memory)."""
    code = "import json, _common; print(json.dumps(_common.device_summary()))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True
    )
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"device_kind": "unknown", "script": _common.script()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dataset", default="mnist_pinned")
    parser.add_argument("--epochs", type=int, default=3, help="epochs a run (at least 2: one first, one steady)")
    parser.add_argument("--smoke", action="store_true", help="a tiny conv NAIS-Net on 256 digits")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        raise SystemExit(f"--epochs={args.epochs}: expected at least 2 (a first epoch and a steady one)")
    os.makedirs(args.out, exist_ok=True)
    cache = os.path.join(args.out, "cache")
    dataset = "digits" if args.smoke else args.dataset
    rows = []
    for run in ("cold", "cached"):
        workdir = os.path.join(args.out, run)
        shutil.rmtree(workdir, ignore_errors=True)  # each run starts afresh, never resumes
        if run == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        row = dict(run=run, **train_once(workdir, cache, dataset=dataset, epochs=args.epochs, smoke=args.smoke))
        rows.append(row)
        print(f"{run}: first epoch {row['first_epoch_s']:.1f} s, steady {row['steady_epoch_s']:.1f} s", flush=True)
    cold, cached = rows[0]["over_steady_s"], rows[-1]["over_steady_s"]
    verdict = {
        "run": "cold",
        "over_steady_s": cold,
        "target_s": TARGET_OVER_STEADY,
        "pass": cold <= TARGET_OVER_STEADY,
        "cached_over_steady_s": cached,
    }
    device = _device()
    text, md = _common.table(
        rows,
        [
            ("run", "run", ""),
            ("first_epoch_s", "first epoch s", ".1f"),
            ("steady_epoch_s", "steady epoch s", ".1f"),
            ("over_steady_s", "over steady s", ".1f"),
            ("first_chunk_s", "first chunk s", ".1f"),
            ("first_chunk_steps", "its steps", ""),
        ],
    )
    line = (
        f"cold first epoch (empty cache) {cold:.1f} s over a steady one (target <= {TARGET_OVER_STEADY:g} s): "
        f"{'PASS' if verdict['pass'] else 'FAIL'}; reading the cache {cached:.1f} s"
    )
    head = (
        f"device: {device.get('device_kind')}; script {device.get('script')}; CIFAR NAIS-Net10 config"
        f"{' (smoke: naisnet_conv_tiny)' if args.smoke else ''} on {dataset}, {args.epochs} epochs a run"
    )
    _common.write_results(
        args.out, "first_epoch", {"device": device, "rows": rows, "verdict": verdict}, f"{head}\n\n{md}\n\n{line}"
    )
    print()
    print(head)
    print(text)
    print(line)


if __name__ == "__main__":
    main()
