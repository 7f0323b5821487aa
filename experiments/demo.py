"""The main job: train the paper's FC NAIS-Net on real Fashion-MNIST, audit it, show it.

``make demo`` runs ``python -m experiments.demo --workdir=runs/demo``. It
trains (resuming if the workdir holds a checkpoint), prints test accuracy and
the stability figures of the trained block, writes the training curves and
the per-iteration loss plot as PNG files, and ends with the verifier's audit
of the checkpoint it wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/demo", "Where checkpoints, metrics and figures go.")
flags.DEFINE_integer("epochs", None, "Override the number of epochs.")
flags.DEFINE_bool("fresh", False, "Delete the workdir first instead of resuming.")


def plot_curves(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(epochs, [r["train_loss"] for r in records], "o--", label="train")
    axes[0].plot(epochs, [r["test_loss"] for r in records], "o-", label="test")
    axes[0].set(title="cross-entropy loss", xlabel="epoch")
    axes[1].plot(epochs, [r["train_accuracy"] for r in records], "o--", label="train")
    axes[1].plot(epochs, [r["test_accuracy"] for r in records], "o-", label="test")
    axes[1].set(title="accuracy", xlabel="epoch")
    axes[2].plot(epochs, [r["rho_max"] for r in records], "o-", color="C3")
    axes[2].axhline(1.0, color="k", lw=0.8, ls=":")
    axes[2].set(title=r"max $\rho(I + hA)$ over blocks", xlabel="epoch")
    for ax in axes[:2]:
        ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_per_step_loss(losses, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(range(1, len(losses) + 1), losses, "o-", ms=3)
    ax.set(
        xlabel="unroll step i",
        ylabel="test cross-entropy of x(i)",
        title="Loss of each unroll step through the classifier",
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from experiments.configs import fashion_mnist_demo
    from naisnet_jax import stability, train

    t0 = time.time()
    workdir = FLAGS.workdir
    if FLAGS.fresh and os.path.isdir(workdir):
        shutil.rmtree(workdir)
    config = fashion_mnist_demo.get_config()
    if FLAGS.epochs is not None:
        config.num_epochs = FLAGS.epochs
    config.progress = sys.stderr.isatty()
    print(
        f"Training {config.model} (one NAIS block, K=30, h={config.h}, eps={config.eps}) on "
        f"{config.dataset} for {config.num_epochs} epochs in {workdir} ...",
        flush=True,
    )
    result = train.train_and_evaluate(config, workdir)
    state = result["state"]
    t_train = time.time() - t0

    records = [json.loads(line) for line in open(os.path.join(workdir, train.METRICS_FILE))]
    curves = os.path.join(workdir, "training_curves.png")
    plot_curves(records, curves)
    losses = train.per_step_loss(state, result["test_data"], result["mean"], result["std"])
    per_step = os.path.join(workdir, "per_step_loss.png")
    plot_per_step_loss(losses, per_step)
    best = int(losses.argmin()) + 1

    print()
    print(
        f"test accuracy     {result['test_accuracy']:.4f}  (train {result['train_accuracy']:.4f}, "
        f"gap {result['generalisation_gap']:+.4f})"
    )
    print(
        f"per-step loss     x(1): {losses[0]:.3f} -> x({len(losses)}): {losses[-1]:.3f} "
        f"(lowest at step {best}: {losses[best - 1]:.3f})"
    )
    print("stability (from the parameters):")
    for name, f in stability.block_figures(state.params, eps=config.eps, h=config.h).items():
        if f["kind"] == "dense":
            print(
                f"  {name}: ||R^T R||_F = {f['frobenius_RtR']:.4f} <= 1 - 2 eps = {1 - 2 * config.eps:.4f}; "
                f"eig(A) in [{f['eig_A_min']:.4f}, {f['eig_A_max']:.4f}]; rho(I + hA) = {f['rho_I_plus_hA']:.6f}"
            )
        else:
            print(f"  {name}: ||I + hA||_inf <= {f['inf_norm_bound_I_plus_hA']:.6f}")
    print(f"figures           {curves}, {per_step}")

    exit_code = 0
    try:
        from naisnet_jax.verify import audit_and_report
    except ImportError:
        audit_and_report = None
    if audit_and_report is not None:
        print("\nAudit of the checkpoint (naisnet-verify):", flush=True)
        exit_code = audit_and_report(
            os.path.join(workdir, train.CHECKPOINT_DIR),
            json_path=os.path.join(workdir, "certificate.json"),
            figures_dir=os.path.join(workdir, "audit"),
        )
    print(f"\ndemo wall time    {time.time() - t0:.1f} s (training and evaluation {t_train:.1f} s)")
    sys.exit(exit_code)


if __name__ == "__main__":
    app.run(_main)
