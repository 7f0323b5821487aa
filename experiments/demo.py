"""The main job: train the paper's FC NAIS-Net on real Fashion-MNIST, audit it, show it.

``make demo`` runs ``python -m experiments.demo --workdir=runs/demo``. It
trains (resuming if the workdir holds a checkpoint), prints test accuracy and
the stability figures of the trained block, writes the training curves and
the per-iteration loss plot as PNG files, and ends with the verifier's audit
of the checkpoint it wrote.

``--fresh`` starts over: it deletes what a run and this demo write in the workdir
(:func:`run_outputs`) and nothing else (an empty or missing workdir: nothing to
delete). It refuses, deleting nothing, a workdir that holds anything else, one that
holds a run's files but no run (no checkpoints and no metrics log), and one whose
lock another trainer holds. A bad command line (``--epochs=0``, a workdir that is a
file or cannot be written, a workdir in use) ends in one line ``error: ...`` on
stderr with exit status 2, before any data is read. The workdir goes through
``os.path.expanduser`` once, as ``naisnet-train``'s does.
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
flags.DEFINE_bool(
    "fresh",
    False,
    "Start over: delete the run's files in the workdir first (checkpoints, metrics, the demo's "
    "figures and certificate) instead of resuming; a workdir holding anything else is refused.",
)

EXIT_USAGE = 2  # bad command line or workdir: nothing was read, written or deleted
CURVES_FILE = "training_curves.png"
PER_STEP_FILE = "per_step_loss.png"
CERTIFICATE_FILE = "certificate.json"
AUDIT_DIR = "audit"


def run_outputs() -> tuple[str, ...]:
    """Every name a run (``naisnet-train``, this demo) writes at the top of its workdir, the
    directories with a trailing ``/``: all that ``--fresh`` may delete, but for the lock file,
    which stays (the next run takes it at once; deleting a lock file is how two processes come
    to hold one lock)."""
    from naisnet_jax import engine, metric_writers

    return (
        engine.CHECKPOINT_DIR + "/",
        engine.METRICS_FILE,
        metric_writers.SCALARS_FILE,
        metric_writers.TENSORBOARD_DIR + "/",  # naisnet-train --tensorboard
        engine.LOCK_FILE,
        CURVES_FILE,
        PER_STEP_FILE,
        CERTIFICATE_FILE,
        AUDIT_DIR + "/",
    )


class UsageError(Exception):
    """A bad command line or workdir; printed as ``error: <message>``, exit status 2."""


def _fail(message) -> None:
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _parse_flags(argv):
    """absl's flag parsing, with its errors in one line and exit status 2 (absl prints two lines
    and exits 1, the status of a failed run)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e} (see python -m experiments.demo --help)")


def check_command_line(workdir: str, epochs: int | None) -> None:
    """The checks of ``naisnet-train``'s command line, before anything is read or written."""
    from naisnet_jax.checks import check_int, check_output_dir

    try:
        if epochs is not None:
            check_int("--epochs", epochs)
        check_output_dir("--workdir", workdir)
    except ValueError as e:
        raise UsageError(e) from None


def run_outputs_in(workdir: str) -> list[str]:
    """The entries of ``workdir`` that ``--fresh`` deletes (see :func:`run_outputs`).

    Raises :class:`UsageError`, having deleted nothing, when ``workdir`` holds anything else (a
    file of the user's, a symbolic link even under a run's name, or an earlier log a run kept
    beside its own: ``metrics.1.jsonl``, ``scalars.1.jsonl``), or holds entries
    but no run (neither ``checkpoints/`` nor ``metrics.jsonl``). A missing or empty workdir gives
    ``[]``."""
    from naisnet_jax import engine

    if not os.path.isdir(workdir):
        return []
    names = sorted(os.listdir(workdir))
    outputs = run_outputs()
    dirs = {n.rstrip("/") for n in outputs if n.endswith("/")}
    files = {n for n in outputs if not n.endswith("/")}

    def ours(name):
        path = os.path.join(workdir, name)
        if os.path.islink(path):
            return False
        return (name in dirs and os.path.isdir(path)) or (name in files and os.path.isfile(path))

    foreign = [n for n in names if not ours(n)]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(
            f"--fresh: --workdir={workdir!r} holds {shown}, which --fresh does not delete (a file of yours, or an "
            f"earlier log a run kept beside its own); it deletes only a run's files ({', '.join(outputs)}). "
            "Nothing was deleted: move those away or use another workdir."
        )
    removable = [n for n in names if n != engine.LOCK_FILE]
    if removable and engine.CHECKPOINT_DIR not in names and engine.METRICS_FILE not in names:
        raise UsageError(
            f"--fresh: --workdir={workdir!r} holds no run (no {engine.CHECKPOINT_DIR}/ or {engine.METRICS_FILE}), "
            f"only {', '.join(removable)}. Nothing was deleted: delete them yourself or use another workdir."
        )
    return removable


def prepare_workdir(workdir: str, fresh: bool) -> None:
    """Refuse a workdir another trainer holds (its lock taken as the trainer takes it, without
    waiting) and, with ``fresh``, delete the run in it under that lock. The lock is let go
    before training: the trainer takes it again."""
    from naisnet_jax import engine

    doomed = run_outputs_in(workdir) if fresh else []  # refusals first: nothing locked, nothing created
    if not os.path.isdir(workdir):
        return
    try:
        with engine.workdir_lock(workdir):
            if fresh:
                doomed = run_outputs_in(workdir)  # again, under the lock
            for name in doomed:
                path = os.path.join(workdir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
    except engine.WorkdirInUse as e:
        raise UsageError(f"{e}{' Nothing was deleted.' if fresh else ''}") from None


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
    t0 = time.time()
    workdir = os.path.expanduser(FLAGS.workdir)  # the one reading of the path, as naisnet-train's
    try:
        if not workdir.strip():
            raise UsageError("--workdir is empty; pass the directory for the checkpoints, metrics and figures.")
        check_command_line(workdir, FLAGS.epochs)
        prepare_workdir(workdir, FLAGS.fresh)
    except UsageError as e:
        _fail(e)

    from naisnet_jax import stability, train
    from naisnet_jax.configs import fashion_mnist_demo

    config = fashion_mnist_demo.get_config()
    if FLAGS.epochs is not None:
        config.num_epochs = FLAGS.epochs
    config.progress = sys.stderr.isatty()
    print(
        f"Training {config.model} (one NAIS block, K=30, h={config.h}, eps={config.eps}) on "
        f"{config.dataset} for {config.num_epochs} epochs in {workdir} ...",
        flush=True,
    )
    try:
        result = train.train_and_evaluate(config, workdir, labels={"num_epochs": "--epochs"})
    except train.TrainingDiverged as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        sys.exit(1)
    except (ValueError, FileNotFoundError, NotADirectoryError, ImportError, train.WorkdirInUse) as e:
        _fail(e)  # as naisnet-train: data, checkpoints, a missing extra, a trainer that came meanwhile
    state = result["state"]
    t_train = time.time() - t0

    records = [json.loads(line) for line in open(os.path.join(workdir, train.METRICS_FILE))]
    curves = os.path.join(workdir, CURVES_FILE)
    plot_curves(records, curves)
    losses = train.per_step_loss(state, result["test_data"], result["mean"], result["std"])
    per_step = os.path.join(workdir, PER_STEP_FILE)
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
            json_path=os.path.join(workdir, CERTIFICATE_FILE),
            figures_dir=os.path.join(workdir, AUDIT_DIR),
        )
    print(f"\ndemo wall time    {time.time() - t0:.1f} s (training and evaluation {t_train:.1f} s)")
    sys.exit(exit_code)


if __name__ == "__main__":
    app.run(_main, flags_parser=_parse_flags)
