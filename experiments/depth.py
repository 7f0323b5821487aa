"""Section 5.3, pattern-dependent processing depth, on Fashion-MNIST and MNIST.

    python -m experiments.depth --workdir=runs/depth [--datasets=fashion_mnist_idx,mnist_pinned]
        [--epochs=N] [--smoke]

The paper trains a convolutional NAIS-Net on CIFAR-10 with the unrolling threshold 1e-4 and
tests it with the same threshold: every block stops a pattern's unroll once
``||x_k - x_{k-1}||_2 < 1e-4`` (over the block's whole feature map), so each test image takes
its own number of steps. CIFAR is not available on these machines; this runs the same protocol
on real Fashion-MNIST and real MNIST:

- model: ``NaisNetConv`` (``MODELS["naisnet_cifar10"]``'s architecture with two stages of one
  block: 8 filters at 28x28, then 16 filters at 14x14 after the stride-2 change), ReLU,
  ``h = 1``, ``eps = 0.01``, ``adaptive_tol = 1e-4``, at most ``max_steps = 40`` steps per
  block, so a pattern's depth (summed over the two blocks) lies in ``[2, 80]``. In a CPU probe
  (200 SGD steps of batch 32 on Fashion-MNIST) this model's blocks took 10-19 steps per
  pattern after 66 steps (class means 29.9 to 34.4 in total), then fewer, 2-6 after 200
  steps, never the cap; with ``h = 0.5`` the depths grew to that probe's cap of 30 steps.
  ``--h`` and ``--max_steps`` override both;
- training: ``naisnet_jax.train.train_and_evaluate`` (SGD, momentum 0.9, learning rate 0.05
  divided by 10 for the last of 5 epochs, batch 128; checkpoints every epoch, so a rerun
  resumes). Training unrolls with the bounded,
  differentiable masked scan (``unroll_adaptive_bounded``: each pattern frozen once it stops);
- test: logits from the ``lax.while_loop`` form (``train=False``), which stops each pattern at
  the same threshold; per-pattern depths of every block from the masked scan with the same
  parameters (``return_aux=True``, which the models document as giving the ``while_loop``'s
  values and depths) -- the two forms' predictions are compared and the count of disagreements
  reported.

Outputs under ``--workdir``: per dataset ``<dataset>/`` (the run: checkpoints, metrics),
``<dataset>_depth_hist.png`` (depth histogram per class), ``<dataset>_depth_grid.png`` (test
images grouped by the depth they took, the paper's figure 5), ``<dataset>_accuracy_vs_depth.png``
(test accuracy per depth bin); ``results.json`` and ``results.md`` for all datasets. ``--smoke``
is a tiny size for a CPU check (256 / 128 examples, 4/8 filters, 6 steps per block, 1 epoch).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from experiments.sweep_report import USER_ERRORS, check_workdir, exit_with_error, join_cluster, script_version
from naisnet_jax import distributed

TOL = 1e-4
DATASETS = ("fashion_mnist_idx", "mnist_pinned")
#: The flags that set config fields, as their errors name them.
FLAG_OF_FIELD = {"num_epochs": "--epochs", "max_steps": "--max_steps", "h": "--h", "seed": "--seed"}
CLASS_NAMES = {
    "fashion_mnist_idx": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "mnist_pinned": tuple(str(d) for d in range(10)),
}


# ---------------------------------------------------------------------------------------------
# Configuration.


def get_config(dataset: str = "fashion_mnist_idx", *, smoke: bool = False):
    """The run's config: the default config with the depth experiment's overrides."""
    from naisnet_jax.configs import default

    config = default.get_config()
    config.dataset = dataset
    config.model = "naisnet_cifar10"  # NaisNetConv; the stages are overridden below
    config.model_kwargs = dict(stage_sizes=(1, 1), filters=(8, 16), activation="relu")
    config.h = 1.0
    config.eps = 0.01
    config.adaptive_tol = TOL
    config.max_steps = 40  # per block
    config.learning_rate = 0.05
    config.momentum = 0.9
    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_epochs = 5
    config.lr_boundaries_epochs = [4]
    config.steps_per_chunk = 117  # 468 steps per epoch = 4 chunks: one compiled program
    config.progress = False
    if smoke:
        config.model_kwargs = dict(stage_sizes=(1, 1), filters=(4, 8), activation="relu")
        config.max_steps = 6
        config.limit_train, config.limit_test = 256, 128
        config.batch_size, config.eval_batch_size = 64, 128
        config.num_epochs, config.lr_boundaries_epochs = 1, []
    return config


# ---------------------------------------------------------------------------------------------
# Depths of every test pattern.


def test_depths(state, images, mean, std, *, batch_size: int = 500) -> dict:
    """Runs the trained model over ``images`` (uint8 NHWC, host) in batches.

    Returns numpy arrays: ``logits`` ``(N, classes)`` from the ``while_loop`` form,
    ``logits_scan`` from the masked scan, and ``depth`` ``(num_blocks, N)`` int, the steps each
    pattern took in each block.
    """
    import jax

    from naisnet_jax import data as data_lib
    from naisnet_jax import train

    @jax.jit
    def run(variables, batch):
        x = data_lib.preprocess(batch, mean, std)
        logits = state.apply_fn(variables, x, train=False)  # lax.while_loop per block
        logits_scan, aux = state.apply_fn(variables, x, train=False, return_aux=True)
        return logits, logits_scan, aux["depth"]

    variables = train.state_variables(state)
    n = len(images)
    size = min(batch_size, n)
    outs = []
    for start in range(0, n, size):
        batch = np.asarray(images[start : start + size])
        real = len(batch)
        if real < size:  # pad the last batch so that one compiled program serves all
            batch = np.concatenate([batch, np.zeros((size - real, *batch.shape[1:]), batch.dtype)])
        logits, logits_scan, depth = jax.device_get(run(variables, batch))
        outs.append((logits[:real], logits_scan[:real], depth[:, :real]))
    return {
        "logits": np.concatenate([o[0] for o in outs]),
        "logits_scan": np.concatenate([o[1] for o in outs]),
        "depth": np.concatenate([o[2] for o in outs], axis=1).astype(int),
    }


def depth_bins(total: np.ndarray, max_bins: int = 8) -> list[tuple[int, int]]:
    """Up to ``max_bins`` contiguous inclusive depth ranges ``(lo, hi)`` of similar counts
    (quantiles of the depths, merged where depths repeat); they cover every depth."""
    total = np.asarray(total)
    values = np.unique(total)
    if len(values) <= max_bins:
        return [(int(v), int(v)) for v in values]
    edges = np.unique(np.quantile(total, np.linspace(0, 1, max_bins + 1), method="nearest"))
    bins, lo = [], int(values[0])
    for edge in edges[1:]:
        hi = int(edge)
        if hi >= lo and np.any((total >= lo) & (total <= hi)):
            bins.append((lo, hi))
            lo = hi + 1
    if lo <= values[-1]:
        bins.append((lo, int(values[-1])))
    return bins


def summarise(result: dict, labels: np.ndarray, *, max_steps: int, num_classes: int) -> dict:
    """Depth statistics, per class and per depth bin, and the two forms' agreement."""
    depth = result["depth"]
    total = depth.sum(axis=0)
    pred = result["logits"].argmax(-1)
    pred_scan = result["logits_scan"].argmax(-1)
    correct = pred == labels
    per_class = []
    for c in range(num_classes):
        d = total[labels == c]
        per_class.append(
            {
                "class": c,
                "count": int(len(d)),
                "depth_mean": float(d.mean()) if len(d) else None,
                "depth_std": float(d.std()) if len(d) else None,
                "depth_min": int(d.min()) if len(d) else None,
                "depth_max": int(d.max()) if len(d) else None,
                "accuracy": float(correct[labels == c].mean()) if len(d) else None,
            }
        )
    per_bin = []
    for lo, hi in depth_bins(total):
        inside = (total >= lo) & (total <= hi)
        per_bin.append(
            {"depth_lo": lo, "depth_hi": hi, "count": int(inside.sum()), "accuracy": float(correct[inside].mean())}
        )
    quart = np.quantile(total, [0.25, 0.75])
    shallow, deep = total <= quart[0], total >= quart[1]
    return {
        "num_test": int(len(labels)),
        "test_accuracy_while_loop": float(correct.mean()),
        "test_accuracy_masked_scan": float((pred_scan == labels).mean()),
        "prediction_disagreements": int((pred != pred_scan).sum()),
        "max_logit_difference": float(np.abs(result["logits"] - result["logits_scan"]).max()),
        "depth_mean": float(total.mean()),
        "depth_std": float(total.std()),
        "depth_min": int(total.min()),
        "depth_max": int(total.max()),
        "distinct_depths": int(len(np.unique(total))),
        "block_depth_mean": [float(v) for v in depth.mean(axis=1)],
        "block_depth_min": [int(v) for v in depth.min(axis=1)],
        "block_depth_max": [int(v) for v in depth.max(axis=1)],
        "fraction_at_cap": [float(v) for v in (depth >= max_steps).mean(axis=1)],
        "accuracy_shallowest_quarter": float(correct[shallow].mean()),
        "accuracy_deepest_quarter": float(correct[deep].mean()),
        "class_depth_spread": float(np.std([c["depth_mean"] for c in per_class if c["depth_mean"] is not None])),
        "per_class": per_class,
        "per_bin": per_bin,
    }


# ---------------------------------------------------------------------------------------------
# Figures.


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_histograms(total, labels, names, path, *, title, dpi=110):
    plt = _pyplot()
    fig, axes = plt.subplots(2, 5, figsize=(15, 5.5), sharex=True)
    edges = np.arange(total.min(), total.max() + 2) - 0.5
    for c, ax in enumerate(axes.ravel()):
        if c >= len(names):
            ax.axis("off")
            continue
        d = total[labels == c]
        ax.hist(d, bins=edges, color=f"C{c}")
        ax.set_title(f"{names[c]} (mean {d.mean():.1f})" if len(d) else names[c], fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("depth (steps, all blocks)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_grid(images, total, labels, names, path, *, title, groups=5, per_group=6, dpi=110):
    """Figure 5: for every class, rows of test images from the shallowest to the deepest
    depth group (quantile groups of that class's depths), each row labelled with its range."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 5, figsize=(16, 8))
    h, w = images.shape[1:3]
    for c, ax in enumerate(axes.ravel()):
        ax.set_xticks([])
        ax.set_yticks([])
        idx = np.flatnonzero(labels == c)
        if c >= len(names) or len(idx) == 0:
            ax.axis("off")
            continue
        order = idx[np.argsort(total[idx], kind="stable")]
        rows = [r for r in np.array_split(order, groups) if len(r)]
        canvas = np.ones((len(rows) * (h + 2), per_group * (w + 2))) * 255
        ticks, tick_labels = [], []
        for i, row in enumerate(rows):
            picks = row[np.linspace(0, len(row) - 1, min(per_group, len(row))).astype(int)]
            for j, k in enumerate(picks):
                canvas[i * (h + 2) : i * (h + 2) + h, j * (w + 2) : j * (w + 2) + w] = images[k, ..., 0]
            ticks.append(i * (h + 2) + h / 2)
            lo, hi = int(total[row].min()), int(total[row].max())
            tick_labels.append(f"{lo}" if lo == hi else f"{lo}-{hi}")
        ax.imshow(canvas, cmap="gray_r" if images.mean() < 128 else "gray", vmin=0, vmax=255)
        ax.set_yticks(ticks)
        ax.set_yticklabels(tick_labels, fontsize=8)
        ax.set_title(names[c], fontsize=10)
    fig.supylabel("depth range of the row (steps, all blocks)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_accuracy(per_bin, path, *, title, dpi=110):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [
        f"{b['depth_lo']}" if b["depth_lo"] == b["depth_hi"] else f"{b['depth_lo']}-{b['depth_hi']}" for b in per_bin
    ]
    acc = [b["accuracy"] for b in per_bin]
    bars = ax.bar(range(len(per_bin)), acc, color="C0")
    for bar, b in zip(bars, per_bin):
        ax.text(
            bar.get_x() + bar.get_width() / 2, bar.get_height(), f"n={b['count']}", ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(range(len(per_bin)))
    ax.set_xticklabels(labels)
    ax.set(xlabel="depth bin (steps, all blocks)", ylabel="test accuracy", ylim=(0, 1.05), title=title)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# One dataset, all datasets, the table.


def with_overrides(config, *, epochs: int | None = None, data_dir: str | None = None, overrides: dict | None = None):
    """``config`` with the command's overrides set: config fields, the epochs (the drops past the
    last epoch dropped) and the data folder."""
    for field, value in (overrides or {}).items():
        config[field] = value
    if epochs is not None:
        config.num_epochs = epochs
        config.lr_boundaries_epochs = [e for e in config.lr_boundaries_epochs if e < epochs]
    if data_dir is not None:
        config.data_dir = data_dir
    return config


def run_dataset(
    dataset: str,
    workdir: str,
    *,
    smoke: bool = False,
    epochs: int | None = None,
    data_dir: str | None = None,
    config=None,
    overrides: dict | None = None,
) -> dict:
    """Trains (or resumes) and analyses one dataset; writes its three figures. ``overrides``
    sets config fields (e.g. ``h``, ``max_steps``)."""
    import jax

    from naisnet_jax import train

    config = get_config(dataset, smoke=smoke) if config is None else config
    config = with_overrides(config, epochs=epochs, data_dir=data_dir, overrides=overrides)
    t0 = time.time()
    result = train.train_and_evaluate(config, os.path.join(workdir, dataset), labels=FLAG_OF_FIELD)
    train_seconds = time.time() - t0
    test_data = result["test_data"]
    row = analyse_run(
        result["state"],
        np.asarray(jax.device_get(test_data.images)),
        np.asarray(jax.device_get(test_data.labels)),
        result["mean"],
        result["std"],
        config=config,
        dataset=dataset,
        workdir=workdir,
        dpi=50 if smoke else 110,
    )
    with open(os.path.join(workdir, dataset, train.METRICS_FILE)) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {
        **row,
        # the training loop's per-epoch test depth (masked scan), to see how depth moved
        "epoch_depth_mean": [r.get("depth_mean") for r in records],
        "epoch_test_accuracy": [r.get("test_accuracy") for r in records],
        "train_accuracy": result.get("train_accuracy"),
        "test_accuracy_train_loop": result.get("test_accuracy"),
        "train_seconds": train_seconds,
    }


def analyse_run(state, images, labels, mean, std, *, config, dataset, workdir, dpi=110) -> dict:
    """Depths of every test pattern, their summary and the three figures of one trained run."""
    t0 = time.time()
    depths = test_depths(state, images, mean, std, batch_size=config.eval_batch_size)
    names = CLASS_NAMES.get(dataset, tuple(str(c) for c in range(depths["logits"].shape[-1])))
    summary = summarise(depths, labels, max_steps=config.max_steps, num_classes=len(names))
    total = depths["depth"].sum(axis=0)
    prefix = os.path.join(workdir, dataset)
    tag = f"{dataset}: NAIS-Net, threshold {config.adaptive_tol:g}, max {config.max_steps}/block"
    if distributed.is_primary():  # of several processes, the primary one writes the figures
        plot_histograms(total, labels, names, f"{prefix}_depth_hist.png", title=tag, dpi=dpi)
        grid_title = f"Test images grouped by depth ({tag})"
        plot_grid(images, total, labels, names, f"{prefix}_depth_grid.png", title=grid_title, dpi=dpi)
        accuracy_title = f"Test accuracy against depth ({dataset})"
        plot_accuracy(summary["per_bin"], f"{prefix}_accuracy_vs_depth.png", title=accuracy_title, dpi=dpi)
        np.savez_compressed(
            f"{prefix}_depths.npz", depth=depths["depth"], labels=labels, predictions=depths["logits"].argmax(-1)
        )
    return {
        "dataset": dataset,
        "seed": config.seed,
        "class_names": list(names),
        "model": config.model,
        "model_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config.model_kwargs).items()},
        "adaptive_tol": config.adaptive_tol,
        "max_steps_per_block": config.max_steps,
        "h": config.h,
        "eps": config.eps,
        "epochs": config.num_epochs,
        "learning_rate": config.learning_rate,
        "batch_size": config.batch_size,
        "num_train": None if config.limit_train is None else int(config.limit_train),
        "analysis_seconds": time.time() - t0,
        **summary,
    }


def _what_this_shows(rows: list[dict]) -> str:
    parts = []
    for r in rows:
        caps = " / ".join(f"{100 * f:.0f}%" for f in r["fraction_at_cap"])
        deepest = max(r["per_class"], key=lambda c: c["depth_mean"] or 0)
        shallowest = min(r["per_class"], key=lambda c: c["depth_mean"] or 1e9)
        names = r["class_names"]
        parts.append(
            f"On {r['dataset']} the test patterns took {r['distinct_depths']} different depths "
            f"(from {r['depth_min']} to {r['depth_max']} steps over the two blocks, mean "
            f"{r['depth_mean']:.1f}, standard deviation {r['depth_std']:.1f}); "
            f"{caps} of the patterns hit the cap of {r['max_steps_per_block']} steps in block "
            f"1 / block 2. The class means range from {shallowest['depth_mean']:.1f} "
            f"({names[shallowest['class']]}) to {deepest['depth_mean']:.1f} "
            f"({names[deepest['class']]}). Accuracy is {100 * r['accuracy_shallowest_quarter']:.1f}% "
            f"on the shallowest quarter of the test set and "
            f"{100 * r['accuracy_deepest_quarter']:.1f}% on the deepest quarter. The while-loop "
            f"and masked-scan forms disagree on {r['prediction_disagreements']} of "
            f"{r['num_test']} predictions (largest logit difference "
            f"{r['max_logit_difference']:.2g}). Mean depth after each epoch: "
            + ", ".join(f"{d:.1f}" for d in r.get("epoch_depth_mean", []) if d is not None)
            + "."
        )
        if max(r["fraction_at_cap"]) > 0.5:
            parts.append(
                f"Most {r['dataset']} patterns stopped at the cap, not at the threshold, so these "
                "depths are truncated: rerun with a larger --max_steps (in a new workdir)."
            )
    return " ".join(parts)


def write_results(rows: list[dict], workdir: str, *, device: str, seconds: float) -> str:
    script = script_version()  # git, once
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"device": device, "script": script, "wall_seconds": seconds, "rows": rows}, f, indent=2)
    lines = [
        "| dataset | epochs | test acc (while loop) | train acc | depth mean +- std | "
        "depth range | distinct depths | at cap (block 1 / 2) | acc shallowest / deepest quarter "
        "| scan vs while disagreements | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        caps = " / ".join(f"{100 * f:.0f}%" for f in r["fraction_at_cap"])
        lines.append(
            f"| {r['dataset']} | {r['epochs']} | {r['test_accuracy_while_loop']:.4f} | "
            f"{r['train_accuracy']:.4f} | {r['depth_mean']:.1f} +- {r['depth_std']:.1f} | "
            f"{r['depth_min']}-{r['depth_max']} | {r['distinct_depths']} | {caps} | "
            f"{r['accuracy_shallowest_quarter']:.4f} / {r['accuracy_deepest_quarter']:.4f} | "
            f"{r['prediction_disagreements']} | {r['train_seconds']:.0f} |"
        )
    table = "\n".join(lines)
    per_class = []
    for r in rows:
        per_class.append(f"\nMean depth per class, {r['dataset']} (accuracy in brackets):\n")
        per_class.append("| " + " | ".join(r["class_names"]) + " |")
        per_class.append("|" + "---|" * len(r["class_names"]))
        per_class.append(
            "| " + " | ".join(f"{c['depth_mean']:.1f} ({100 * c['accuracy']:.0f}%)" for c in r["per_class"]) + " |"
        )
    first = rows[0]
    # A row without "seed" predates the field; the command then had no way to choose one: seed 0.
    text = (
        "# Section 5.3: pattern-dependent processing depth\n\n"
        f"Device: {device}; script {script}; wall time {seconds:.0f} s for the whole script. "
        "Model: NaisNetConv, "
        f"stages {first['model_kwargs'].get('stage_sizes')} of filters "
        f"{first['model_kwargs'].get('filters')}, {first['model_kwargs'].get('activation')}, "
        f"h = {first['h']}, eps = {first['eps']}, threshold {first['adaptive_tol']:g} in training "
        f"(masked scan) and at test (while loop), at most {first['max_steps_per_block']} steps "
        "per block; depth = steps summed over the blocks. One seed ("
        + ", ".join(sorted({f"{r['dataset']}: seed {r.get('seed', 0)}" for r in rows}))
        + "). The paper ran this on "
        "CIFAR-10, which these machines cannot obtain.\n\n"
        f"{table}\n" + "\n".join(per_class) + "\n\n"
        f"**What this shows.** {_what_this_shows(rows)}\n"
    )
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    return table


def run(
    workdir: str,
    datasets=DATASETS,
    *,
    smoke: bool = False,
    epochs: int | None = None,
    data_dirs: dict | None = None,
    overrides: dict | None = None,
) -> list[dict]:
    from naisnet_jax import sweep
    from naisnet_jax.configs import schema

    configs = {
        d: with_overrides(
            get_config(d, smoke=smoke), epochs=epochs, data_dir=(data_dirs or {}).get(d), overrides=overrides
        )
        for d in datasets
    }
    for config in configs.values():  # every config checked before anything is made or said
        schema.validate(config, labels=FLAG_OF_FIELD)
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    rows = []
    for dataset in datasets:
        print(f"== {dataset}", flush=True)
        rows.append(run_dataset(dataset, workdir, smoke=smoke, config=configs[dataset]))
    device = sweep.device_description()
    if not distributed.is_primary():  # of several processes, the primary one writes the report
        return rows
    table = write_results(rows, workdir, device=device, seconds=time.time() - t0)
    print(table)
    print(f"results: {workdir}/results.md; figures: {workdir}/*_depth_*.png")
    return rows


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Section 5.3: pattern-dependent depth.")
    parser.add_argument("--workdir", default="runs/depth")
    parser.add_argument(
        "--datasets", default=",".join(DATASETS), help="comma-separated: fashion_mnist_idx, mnist_pinned"
    )
    parser.add_argument("--epochs", type=int, default=None, help="override the epochs")
    parser.add_argument(
        "--max_steps", type=int, default=None, help="override the steps cap per block (default 40; a new workdir)"
    )
    parser.add_argument("--h", type=float, default=None, help="override h (default 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default 0; a new workdir a seed)")
    parser.add_argument("--fashion_dir", default=None, help="Fashion-MNIST IDX folder")
    parser.add_argument("--mnist_dir", default=None, help="folder of mnist.pkl.gz")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU check")
    for name, (kind, help_text) in distributed.CLUSTER_FLAGS.items():
        parser.add_argument(f"--{name}", type=kind, default=None, help=help_text)
    args = parser.parse_args(argv)
    check_workdir(args.workdir)
    try:
        join_cluster(args, args.workdir)
    except ValueError as e:
        exit_with_error(e)
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = sorted(set(datasets) - set(DATASETS))
    if unknown:
        exit_with_error(ValueError(f"--datasets has unknown names {unknown}; valid: {list(DATASETS)}"))
    data_dirs = {"fashion_mnist_idx": args.fashion_dir, "mnist_pinned": args.mnist_dir}
    if args.seed is not None and args.seed < 0:
        exit_with_error(ValueError(f"--seed must be >= 0, got {args.seed}"))
    overrides = {k: v for k, v in (("max_steps", args.max_steps), ("h", args.h), ("seed", args.seed)) if v is not None}
    try:
        run(args.workdir, datasets, smoke=args.smoke, epochs=args.epochs, data_dirs=data_dirs, overrides=overrides)
    except USER_ERRORS as e:  # a bad override, a missing data folder
        exit_with_error(e)


if __name__ == "__main__":
    main(sys.argv[1:])
