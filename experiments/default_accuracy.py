"""How well the default config trains, over seeds: ``python -m experiments.default_accuracy --out=DIR``.

Trains ``naisnet_jax/configs/default.py`` unchanged (the paper's FC NAIS-Net on real
Fashion-MNIST, 20 epochs) once per seed, then writes ``DIR/results.json``,
``DIR/results.md`` and ``DIR/test_accuracy.png`` (test accuracy per epoch, one line per seed)
and prints the table. Each seed trains in ``DIR/seed<k>`` and resumes from its checkpoint, so
an interrupted run picks up where it stopped. ``--smoke`` runs a tiny version (digits, two
seeds, two epochs) in seconds on a CPU.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory (results, figures, one workdir per seed).", required=True)
flags.DEFINE_integer("seeds", 5, "Number of seeds (0 .. seeds-1).")
flags.DEFINE_bool("smoke", False, "Tiny run: digits, 2 seeds, 2 epochs, a small block.")


def _config(seed: int, smoke: bool):
    from naisnet_jax.configs import default

    config = default.get_config()
    config.seed = seed
    config.progress = sys.stderr.isatty()
    if smoke:
        config.dataset = "digits"
        config.num_epochs = 2
        config.model_kwargs.features = 16
        config.model_kwargs.steps = 5
    return config


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _summary(rows: list[dict]) -> dict:
    import numpy as np

    acc = np.array([r["test_accuracy"] for r in rows])
    loss = np.array([r["train_loss"] for r in rows])
    return {
        "seeds": len(rows),
        "test_accuracy_mean": float(acc.mean()),
        "test_accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
        "test_accuracy_min": float(acc.min()),
        "test_accuracy_max": float(acc.max()),
        "train_loss_mean": float(loss.mean()),
    }


def _markdown(rows: list[dict], summary: dict, config, *, device: str, script: str) -> str:
    lines = [
        f"Device: {device}; script {script}; seeds 0 to {len(rows) - 1}.",
        "",
        f"Default config: {config.model} on {config.dataset}, {config.num_epochs} epochs, h = {config.h}, "
        f"learning rate {config.learning_rate} (/10 at epochs {list(config.lr_boundaries_epochs)}), "
        f"batch {config.batch_size}.",
        "",
        "| seed | test acc | train loss | train acc | max rho(I + hA) | s / epoch |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['test_accuracy']:.4f} | {r['train_loss']:.4f} | {r['train_accuracy']:.4f} "
            f"| {r['rho_max']:.4f} | {r['seconds_per_epoch']:.2f} |"
        )
    lines.append(
        f"| mean ± std | {summary['test_accuracy_mean']:.4f} ± {summary['test_accuracy_std']:.4f} "
        f"| {summary['train_loss_mean']:.4f} | | | |"
    )
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from experiments.sweep_report import USER_ERRORS, exit_with_error
    from naisnet_jax import metric_writers, train
    from naisnet_jax.checks import check_int

    seeds = 2 if FLAGS.smoke else FLAGS.seeds
    try:
        check_int("--seeds", seeds)
        os.makedirs(FLAGS.out, exist_ok=True)
    except USER_ERRORS as e:  # no seed; --out names a file
        exit_with_error(e)
    rows, curves = [], {}
    for seed in range(seeds):
        config = _config(seed, FLAGS.smoke)
        workdir = os.path.join(FLAGS.out, f"seed{seed}")
        print(f"seed {seed}: {workdir}", flush=True)
        train.train_and_evaluate(config, workdir)  # resumes; a finished seed trains nothing
        records = metric_writers.read_jsonl(os.path.join(workdir, train.METRICS_FILE))
        last = records[-1]
        curves[seed] = [r["test_accuracy"] for r in records]
        rows.append(
            {
                "seed": seed,
                "test_accuracy": last["test_accuracy"],
                "train_loss": last["train_loss"],
                "train_accuracy": last["train_accuracy"],
                "rho_max": last["rho_max"],
                "seconds_per_epoch": _median([r["epoch_seconds"] for r in records[1:] or records]),  # first compiles
            }
        )
    summary = _summary(rows)
    from experiments.sweep_report import script_version
    from naisnet_jax import sweep

    device, script = sweep.device_description(), script_version()
    result = {
        "config": _config(0, FLAGS.smoke).to_dict(),
        "device": device,
        "script": script,
        "rows": rows,
        "summary": summary,
        "test_accuracy_per_epoch": curves,
    }
    with open(os.path.join(FLAGS.out, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = _markdown(rows, summary, _config(0, FLAGS.smoke), device=device, script=script)
    with open(os.path.join(FLAGS.out, "results.md"), "w") as f:
        f.write(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for seed, acc in curves.items():
        ax.plot(range(1, len(acc) + 1), acc, label=f"seed {seed}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_title("default config")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.out, "test_accuracy.png"), dpi=120)
    print(table, end="")


if __name__ == "__main__":
    from experiments.sweep_report import parse_flags

    app.run(main, flags_parser=parse_flags)
