"""Section 5.1's ablation: the FC NAIS-Net against the nine 30-layer ResNet variants.

    python -m experiments.ablation --workdir=runs/ablation [--epochs=5] [--models=a,b,...]

Every model is trained with the same config (``experiments/configs/fashion_mnist_demo.py``:
real Fashion-MNIST, SGD with momentum 0.9, h = 0.1, 5 epochs) — only ``config.model``
changes — then evaluated: test/train accuracy, the loss of every layer's state through the
classifier (the paper's per-iteration loss analysis), and the verifier's parameter-level audit.
Writes ``results.json``, ``results.md`` and ``per_step_loss.png`` to the workdir; each model's
run (checkpoints, metrics) lives in its own sub-directory and resumes if interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/ablation", "Where every run and the results go.")
flags.DEFINE_integer("epochs", None, "Override the number of epochs.")
flags.DEFINE_list("models", None, "Subset of models (default: naisnet_mnist and the nine ResNet variants).")

# Paper label -> MODELS name; the switches are read off the label.
LABELS = {
    "NAIS-Net": "naisnet_mnist",
    "ResNet": "resnet",
    "ResNet-SH": "resnet_sh",
    "ResNet-NA": "resnet_na",
    "ResNet-BN": "resnet_bn",
    "ResNet-SH-NA": "resnet_sh_na",
    "ResNet-SH-BN": "resnet_sh_bn",
    "ResNet-NA-BN": "resnet_na_bn",
    "ResNet-SH-NA-BN": "resnet_sh_na_bn",
    "ResNet-SH-Stable": "resnet_sh_stable",
}


def run_one(label: str, model: str, workdir: str, epochs: int | None) -> dict:
    from experiments.configs import fashion_mnist_demo
    from naisnet_jax import train
    from naisnet_jax.verify import AuditOptions, audit

    config = fashion_mnist_demo.get_config()
    config.model = model
    config.progress = sys.stderr.isatty()
    if epochs is not None:
        config.num_epochs = epochs
    t0 = time.time()
    result = train.train_and_evaluate(config, workdir)
    seconds = time.time() - t0
    losses = train.per_step_loss(result["state"], result["test_data"], result["mean"], result["std"])
    report = audit(os.path.join(workdir, train.CHECKPOINT_DIR), AuditOptions(data="none"))
    radii = [b["parameter"].get("rho_I_plus_hA") for b in report["blocks"]]
    increases = [float(b - a) for a, b in zip(losses, losses[1:]) if b > a]
    return {
        "label": label,
        "model": model,
        "SH": "SH" in label or label == "NAIS-Net",
        "NA": "NA" in label.replace("NAIS", "") or label == "NAIS-Net",
        "BN": "BN" in label,
        "stable": "Stable" in label or label == "NAIS-Net",
        "test_accuracy": result["test_accuracy"],
        "train_accuracy": result["train_accuracy"],
        "generalisation_gap": result["generalisation_gap"],
        "per_step_loss": [float(v) for v in losses],
        "per_step_loss_increases": len(increases),
        "per_step_loss_largest_increase": max(increases, default=0.0),
        "rho_I_plus_hA_max": max((r for r in radii if r is not None), default=None),
        "certified": report["certified"],
        "train_seconds": seconds,
    }


def write_results(rows: list[dict], workdir: str) -> None:
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    lines = [
        "| model | SH | NA | BN | Stable | test acc | train acc | gap | loss x(1) | loss x(K) | "
        "loss increases | max rho(I + hA) | certified |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tick = lambda b: "x" if b else ""  # noqa: E731
    for r in rows:
        rho = "-" if r["rho_I_plus_hA_max"] is None else f"{r['rho_I_plus_hA_max']:.4f}"
        lines.append(
            f"| {r['label']} | {tick(r['SH'])} | {tick(r['NA'])} | {tick(r['BN'])} | {tick(r['stable'])} | "
            f"{r['test_accuracy']:.4f} | {r['train_accuracy']:.4f} | {r['generalisation_gap']:+.4f} | "
            f"{r['per_step_loss'][0]:.3f} | {r['per_step_loss'][-1]:.3f} | {r['per_step_loss_increases']} | "
            f"{rho} | {'yes' if r['certified'] else 'no'} |"
        )
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(rows):
        losses = r["per_step_loss"]
        style = dict(lw=2.5, color="k") if r["label"] == "NAIS-Net" else dict(lw=1.2, color=f"C{i % 10}")
        ax.plot(range(1, len(losses) + 1), losses, label=r["label"], **style)
    ax.set(xlabel="layer / unroll step i", ylabel="test cross-entropy of x(i)", yscale="log",
           title="Loss of each layer's state through the classifier")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    labels = list(LABELS)
    if FLAGS.models:
        unknown = set(FLAGS.models) - set(LABELS.values())
        if unknown:
            raise app.UsageError(f"--models has unknown names {sorted(unknown)}; valid: {list(LABELS.values())}")
        labels = [lab for lab in labels if LABELS[lab] in FLAGS.models]
    os.makedirs(FLAGS.workdir, exist_ok=True)
    rows = []
    for label in labels:
        print(f"== {label} ({LABELS[label]})", flush=True)
        rows.append(run_one(label, LABELS[label], os.path.join(FLAGS.workdir, LABELS[label]), FLAGS.epochs))
    write_results(rows, FLAGS.workdir)
    plot(rows, os.path.join(FLAGS.workdir, "per_step_loss.png"))
    print(f"results: {FLAGS.workdir}/results.md, {FLAGS.workdir}/per_step_loss.png")


if __name__ == "__main__":
    app.run(_main)
