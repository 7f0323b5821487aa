"""Section 5.1 at the paper's protocol: the FC NAIS-Net against the nine 30-layer ResNet variants.

    python -m experiments.ablation --dataset=mnist_pinned --workdir=runs/ablation_mnist
    python -m experiments.ablation --dataset=fashion_mnist_idx --workdir=runs/ablation_fmnist
    python -m experiments.ablation --time_steps=200 ...   # steps/s of each model on this device
    python -m experiments.ablation --hs=1,0.5,0.25,0.1,1/30 --workdir=runs/ablation_h   # against h
    python -m experiments.ablation --smoke --workdir=/tmp/ablation_smoke   # seconds, on a CPU

Every model is one sweep (``naisnet_jax.sweep``): ``--seeds`` seeds trained side by side with
the config ``src/naisnet_jax/configs/ablation_paper.py`` (SGD, momentum 0.9, learning rate 0.1,
150 epochs, standardised inputs, h = 1/30 unless ``--h`` or ``--hs``), then every seed exported, audited by
the verifier (parameter level, models with a NAIS block: NAIS-Net and ResNet-SH-Stable), and its
per-layer loss measured on the test set and on the training set. Writes to ``--workdir``:
``results.json`` / ``results.md`` (mean +- std over seeds, the paper's numbers beside ours),
``per_layer_loss.png`` (figure 3 left, both splits), ``neuron_trajectory.png`` (figure 3 right:
one neuron per class, NAIS-Net and ResNet-SH-Stable),
``test_accuracy.png`` (curves over epochs); each model's sweep lives in ``<workdir>/<model>``
and resumes; a finished model is read back from its ``summary.json``.

``--hs`` runs the whole comparison at several step sizes (the paper's ResNet takes full steps,
``h = 1``), each in ``<workdir>/h_<h>``, and writes ``results_h.md`` / ``results_h.json``
(accuracy, rank and divergences against h), ``accuracy_vs_h.png`` and ``per_layer_loss_h.png``.
Processes of one h each (one a GPU) can share the workdir; a last call with every h reports.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

from experiments import sweep_report
from experiments.sweep_report import (
    as_array,
    curve,
    define_cluster_flags,
    define_compilation_cache_flag,
    exit_with_error,
    pm,
    read_summary,
    row_training_seconds,
    script_version,
    start_experiment,
    stat_row,
    sweep_times,
    trained_on,
    training_time_text,
    write_summary,
)
from naisnet_jax import distributed
from naisnet_jax.configs import schema

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
# Test accuracy (%) the paper reports on MNIST (mean of 10 runs); the others are not given.
PAPER_MNIST = {"NAIS-Net": 97.28, "ResNet-SH-BN": 96.69, "ResNet-SH": 95.86}
#: The NAIS-Net's speed options (same maths): its 30 steps one Pallas kernel each way on a GPU
#: (``block_vjp="fused"``; elsewhere the stacked VJP with the steps unrolled in the program). Ten
#: seeds on one H100, Fashion-MNIST: 0.248 ms a step against 0.477 with only the unrolling, and a
#: compile of 3.1 s against 18.5 (``BENCHMARKS.md``).
NAIS_FAST = {"scan_unroll": True, "block_vjp": "fused"}

SMOKE_MODELS = ("naisnet_mnist", "resnet_sh_bn", "resnet_sh_stable")
RISE_TOL = 1e-6  # relative: a per-layer loss "rises" when loss[i+1] > loss[i] * (1 + RISE_TOL)
TRAJECTORY_SAMPLES = 3  # test images per class in the neuron trajectory figure
#: The two models of the paper's figure 3 (right), whose neuron trajectories every run records.
TRAJECTORY_MODELS = ("NAIS-Net", "ResNet-SH-Stable")


def switches(label: str) -> dict:
    nais = label == "NAIS-Net"
    parts = set(label.split("-")[1:])
    return {
        "SH": nais or "SH" in parts,
        "NA": nais or "NA" in parts,
        "BN": "BN" in parts,
        "Stable": nais or "Stable" in parts,
    }


def make_config(model: str, *, dataset: str, seeds: int, epochs: int | None, h: float | None, smoke: bool):
    import ml_collections

    from naisnet_jax.configs import ablation_paper

    config = ablation_paper.get_config()
    config.model = model
    config.dataset = dataset
    config.num_seeds = seeds
    config.progress = sys.stderr.isatty()
    if model.startswith("naisnet"):  # speed options, same maths: NAIS_FAST
        config.model_kwargs = ml_collections.ConfigDict(NAIS_FAST)
    if smoke:  # tiny sizes: digits, 8 units, 3 steps or layers, 2 epochs
        config.dataset = "digits" if dataset in ("mnist_pinned", "fashion_mnist_idx") else dataset
        config.limit_train, config.limit_test = 256, 100
        config.batch_size = config.eval_batch_size = 64
        config.num_epochs = 2
        config.checkpoint_every_epochs = 1
        depth_key = "steps" if model.startswith("naisnet") else "depth"
        config.model_kwargs.update({"features": 8, depth_key: 3})
    if epochs is not None:
        config.num_epochs = epochs
    if h is not None:
        config.h = h
    return config


# --------------------------------------------------------------------------- one model


def monotonicity(curves: np.ndarray) -> dict:
    """Per-layer loss curves ``(seeds, K)``: is each non-increasing, and how much does the
    mean curve rise where it rises (relative tolerance ``RISE_TOL`` for round-off)."""
    curves = np.asarray(curves, np.float64)
    rises = np.diff(curves, axis=1) > RISE_TOL * np.abs(curves[:, :-1])
    mean = curves.mean(axis=0)
    steps = np.diff(mean)
    up = steps > RISE_TOL * np.abs(mean[:-1])
    i_min = int(np.argmin(mean))
    return {
        "monotone_seeds": int(np.sum(~rises.any(axis=1))),
        "mean_curve_monotone": bool(not up.any()),
        "mean_curve_rises": int(up.sum()),
        "mean_curve_rise_layers": [int(i) + 2 for i in np.flatnonzero(up)],  # layer i+1 -> i+2 (1-based)
        "largest_rise": float(steps[up].max()) if up.any() else 0.0,
        "argmin_layer": i_min + 1,
        "min_loss": float(mean[i_min]),
        "rise_min_to_last": float(mean[-1] - mean[i_min]),
    }


def neuron_trajectories(result, samples: int = TRAJECTORY_SAMPLES) -> dict:
    """Seed 0's net: ``x_k`` of one neuron, ``k = 0..K``, for ``samples`` test images of every
    class, ``x_0`` the state the unroll starts from (NAIS-Net's zeros, a ResNet's embedding). The
    neuron is the one whose final state separates the classes most (largest variance of its
    per-class means of ``x_K`` over the first 2,000 test images)."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax import data as data_lib
    from naisnet_jax import train

    state = result.seed_state(0)
    variables = train.state_variables(state)
    labels = np.asarray(result.test_data.labels)
    n = min(2000, len(labels))
    x, _ = data_lib.get_batch(result.test_data, jnp.arange(n), mean=result.mean, std=result.std)
    _, aux = state.apply_fn(variables, x, train=False, return_aux=True)
    final = np.asarray(aux["trajectory"][-1], np.float64)  # (n, features)
    classes = sorted(set(labels[:n].tolist()))
    class_means = np.stack([final[labels[:n] == c].mean(axis=0) for c in classes])
    neuron = int(np.argmax(class_means.var(axis=0)))
    out = {"neuron": neuron, "classes": {}}
    for c in classes:
        idx = np.flatnonzero(labels == c)[:samples]
        xc, _ = data_lib.get_batch(result.test_data, jnp.asarray(idx), mean=result.mean, std=result.std)
        _, aux = state.apply_fn(variables, xc, train=False, return_aux=True)
        traj = np.asarray(jax.device_get(aux["trajectory"]))[:, :, neuron]  # (K, samples)
        x0 = np.asarray(jax.device_get(aux["initial_state"]))[:, neuron]
        traj = np.concatenate([x0[None], traj], axis=0)  # (K + 1, samples)
        out["classes"][str(c)] = traj.T.tolist()
    return out


def summarise(label: str, result, config, seconds: float) -> dict:
    from naisnet_jax import sweep

    ok = [r for r in result.runs if not r.diverged]
    row = {"label": label, "model": config.model, **switches(label)}
    for field in ("test_accuracy", "train_accuracy", "generalisation_gap", "test_loss"):
        row[field] = stat_row(result, field)
    row["seeds"] = list(result.seeds)
    row["diverged"] = result.num_diverged
    row["diverged_epochs"] = {str(r.seed): r.diverged_epoch for r in result.runs if r.diverged}
    has_nais = any(r.rho_max is not None for r in result.runs)
    row["has_nais_block"] = has_nais
    row["certified_seeds"] = sum(bool(r.certified) for r in result.runs)
    row["all_certified"] = bool(result.all_certified) if has_nais else None
    row["rho_max"] = max((r.rho_max for r in result.runs if r.rho_max is not None), default=None)
    for key, split, attr in (("", "test", "per_step_loss"), ("train_", "train", "per_step_train_loss")):
        curves = [getattr(r, attr) for r in ok if getattr(r, attr) is not None]
        if curves:
            curves = np.stack(curves)
            row[f"per_layer_{key}loss"] = {
                "split": split,
                "mean": curves.mean(0).tolist(),
                "std": curves.std(0).tolist(),
                "per_seed": curves.tolist(),
            }
            row[f"{key}monotonicity"] = monotonicity(curves)
    row["test_accuracy_curve"] = curve(result.history, "test_accuracy")
    row["train_accuracy_curve"] = curve(result.history, "train_accuracy")
    row["epochs"] = result.epoch
    row.update(sweep_times(result, seconds))
    row["device"] = sweep.device_description()
    row["script"] = script_version()
    return row


def flags_of_fields(h_flag: str = "--h") -> dict[str, str]:
    """The flags that set a sweep's config fields, as its errors name them (``h_flag``: where ``h``
    came from, ``--hs`` for a run over several steps)."""
    return {"num_epochs": "--epochs", "num_seeds": "--seeds", "h": h_flag}


def run_model(label: str, config, workdir: str, audit_options) -> dict:
    from naisnet_jax import sweep

    model_dir = os.path.join(workdir, config.model)
    summary_path = os.path.join(model_dir, "summary.json")
    row = read_summary(summary_path, config)
    if row is not None:
        print(f"== {label}: finished earlier, read from {summary_path}", flush=True)
        return row
    print(
        f"== {label} ({config.model}): {config.num_seeds} seeds x {config.num_epochs} epochs on {config.dataset}",
        flush=True,
    )
    t0 = time.time()
    result = sweep.train_sweep(
        config, model_dir, audit_options=audit_options, audit_baselines=False, labels=flags_of_fields()
    )
    row = summarise(label, result, config, time.time() - t0)
    if label in TRAJECTORY_MODELS:
        row["neuron_trajectory"] = neuron_trajectories(result)
    write_summary(summary_path, config, row)
    return row


# --------------------------------------------------------------------------- outputs


def table(rows: list[dict], *, paper: dict | None) -> str:
    tick = lambda b: "x" if b else ""  # noqa: E731
    head = (
        "| model | SH | NA | BN | Stable | test acc (%) | paper test acc (%) | train acc (%) | gap (pp) | "
        "diverged | certified | loss x(1) | loss x(K) | per-layer loss monotone (seeds) | mean-curve rises "
        "(largest) | train loss x(K) | train per-layer loss monotone (seeds) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        n_seeds = len(r["seeds"])
        cert = f"{r['certified_seeds']}/{n_seeds}" if r["has_nais_block"] else "n/a (no NAIS block)"
        paper_acc = "" if paper is None else (f"{paper[r['label']]:.2f}" if r["label"] in paper else "not reported")
        pl, tl = r.get("per_layer_loss"), r.get("per_layer_train_loss")
        mono = r.get("monotonicity")
        lines.append(
            f"| {r['label']} | {tick(r['SH'])} | {tick(r['NA'])} | {tick(r['BN'])} | {tick(r['Stable'])} | "
            f"{pm(r['test_accuracy'])} | {paper_acc} | {pm(r['train_accuracy'])} | "
            f"{pm(r['generalisation_gap'])} | {r['diverged']}/{n_seeds} | {cert} | "
            + (
                f"{pl['mean'][0]:.3f} | {pl['mean'][-1]:.3f} | {mono['monotone_seeds']}/{len(pl['per_seed'])} | "
                f"{mono['mean_curve_rises']} ({mono['largest_rise']:.2g}) |"
                if pl
                else "- | - | - | - |"
            )
            + (
                f" {tl['mean'][-1]:.3f} | {r['train_monotonicity']['monotone_seeds']}/{len(tl['per_seed'])} |"
                if tl
                else " - | - |"
            )
        )
    return "\n".join(lines)


def monotonicity_text(rows: list[dict], split: str = "test") -> str:
    key = "" if split == "test" else "train_"
    lines = []
    for r in rows:
        m = r.get(f"{key}monotonicity")
        if not m:
            continue
        if m["mean_curve_monotone"]:
            what = "non-increasing over every layer"
        else:
            what = (
                f"rises {m['mean_curve_rises']} times (largest step +{m['largest_rise']:.3g}); its minimum "
                f"{m['min_loss']:.4f} is at layer {m['argmin_layer']} and the last layer is "
                f"{m['rise_min_to_last']:+.4f} above it"
            )
        lines.append(
            f"- {r['label']}: mean per-layer {split} loss {what}; "
            f"{m['monotone_seeds']}/{len(r[f'per_layer_{key}loss']['per_seed'])} seeds monotone."
        )
    return "\n".join(lines)


def write_outputs(rows, workdir, *, header: dict, paper) -> str:
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    md = ["# Section 5.1: NAIS-Net against the ResNet variants", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += [
        "",
        "Mean ± std over the seeds that did not diverge (population std); a diverged seed is frozen at "
        "its last finite epoch and counted in 'diverged'. 'certified': seeds the verifier certifies stable. "
        "Per-layer loss: cross-entropy of each layer's state x(i) through the classifier, mean over seeds, "
        f"on the test set and on the training set; a rise is a step up by more than {RISE_TOL:g} relative.",
        "",
        table(rows, paper=paper),
        "",
        "Monotonicity of the per-layer loss:",
        "",
        monotonicity_text(rows, "test"),
        monotonicity_text(rows, "train"),
        "",
    ]
    text = "\n".join(md)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    return text


def line_color(i: int, n: int):
    """The colour of curve ``i`` of ``n``: matplotlib's ten-colour cycle, or twenty colours when
    there are more curves than ten (the tuned table's twelve rows)."""
    import matplotlib

    return f"C{i}" if n <= 10 else matplotlib.colormaps["tab20"](i % 20)


def per_layer_axes(ax, rows, key: str) -> None:
    """Figure 3 (left) on ``ax``: each model's mean per-layer loss ``row[key]`` with a band of one std."""
    for i, r in enumerate(rows):
        pl = r.get(key)
        if not pl:
            continue
        mean, std = np.asarray(pl["mean"]), np.asarray(pl["std"])
        layers = np.arange(1, len(mean) + 1)
        color = "k" if r["label"] == "NAIS-Net" else line_color(i, len(rows))
        ax.plot(layers, mean, color=color, lw=2.5 if color == "k" else 1.2, label=r["label"])
        ax.fill_between(layers, np.maximum(mean - std, 1e-6), mean + std, color=color, alpha=0.15, lw=0)
    ax.set(xlabel="layer / unroll step i", yscale="log")
    ax.grid(alpha=0.3, which="both")


def plot(rows, workdir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, split in zip(axes, ("per_layer_train_loss", "per_layer_loss"), ("training set", "test set")):
        per_layer_axes(ax, rows, key)
        ax.set(title=f"{split}: loss of each layer's state (mean ± std over seeds)")
    axes[0].set(ylabel="cross-entropy of x(i) through the classifier")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "per_layer_loss.png"), dpi=120)
    plt.close(fig)

    traced = [r for r in rows if r.get("neuron_trajectory")]  # one panel a row of TRAJECTORY_MODELS
    if traced:
        fig, axes = plt.subplots(1, len(traced), figsize=(7.5 * len(traced), 4.5), squeeze=False)
        for ax, r in zip(axes[0], traced):
            traj = r["neuron_trajectory"]
            for c, samples in traj["classes"].items():
                for j, t in enumerate(samples):
                    ax.plot(range(len(t)), t, color=f"C{int(c) % 10}", lw=1.2, label=f"class {c}" if j == 0 else None)
            ax.set(
                xlabel="unroll step k",
                ylabel=f"x_k[{traj['neuron']}]",
                title=f"{r['label']} (seed {r['seeds'][0]}): neuron {traj['neuron']}, "
                f"{TRAJECTORY_SAMPLES} test images per class",
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, "neuron_trajectory.png"), dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(rows):
        c = r["test_accuracy_curve"]
        ep = np.asarray(c["epochs"])
        mean, std = as_array(c["mean"]), as_array(c["std"])
        color = "k" if r["label"] == "NAIS-Net" else line_color(i, len(rows))
        ax.plot(ep, mean, color=color, lw=2 if color == "k" else 1, label=r["label"])
        ax.fill_between(ep, mean - std, mean + std, color=color, alpha=0.15, lw=0)
    ax.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy over epochs (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "test_accuracy.png"), dpi=120)
    plt.close(fig)


def short_table(rows, paper) -> str:
    lines = [f"{'model':<18} {'test acc (%)':>16} {'paper':>7} {'gap (pp)':>14} {'div':>4} {'cert':>6} {'mono':>5}"]
    for r in rows:
        n = len(r["seeds"])
        paper_acc = f"{paper[r['label']]:.2f}" if paper and r["label"] in paper else "-"
        cert = f"{r['certified_seeds']}/{n}" if r["has_nais_block"] else "n/a"
        mono = r.get("monotonicity")
        mono = f"{mono['monotone_seeds']}/{len(r['per_layer_loss']['per_seed'])}" if mono else "-"
        lines.append(
            f"{r['label']:<18} {pm(r['test_accuracy']):>16} {paper_acc:>7} "
            f"{pm(r['generalisation_gap']):>14} {r['diverged']:>4} {cert:>6} {mono:>5}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- timing


def time_models(labels, make, steps: int, workdir: str) -> None:
    from naisnet_jax import sweep

    rows = []
    for label in labels:
        config = make(LABELS[label])
        t = sweep_report.time_steps(config, steps=steps)
        t["label"] = label
        rows.append(t)
        print(
            f"{label:<18} {t['steps_per_second']:8.1f} steps/s  {t['step_ms']:6.3f} ms/step  "
            f"eval {t['eval_seconds']:.3f}s  compile {t['compile_seconds']:.1f}s  "
            f"projected {t['projected_seconds'] / 60:6.2f} min  kernels {sum(t['kernels'].values())}",
            flush=True,
        )
    total = sum(t["projected_seconds"] for t in rows)
    if not distributed.is_primary():
        return
    with open(os.path.join(workdir, "timing.json"), "w") as f:
        json.dump({"rows": rows, "projected_total_seconds": total}, f, indent=1)
    print(
        f"\nprojected training of all {len(rows)} models: {total / 60:.1f} min "
        f"({rows[0]['seeds']} seeds x {rows[0]['epochs']} epochs each) on {sweep.device_description()}"
    )


# --------------------------------------------------------------------------- the step h


def parse_h(text: str) -> float:
    """A step size from ``--hs``: a number or a fraction (``"0.25"``, ``"1/30"``), above 0."""
    from fractions import Fraction

    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        value = float("nan")
    if not value > 0:
        raise ValueError(f"--hs has {text!r}; expected a step size above 0, a number or a fraction such as 1/30")
    return value


def h_dir(workdir: str, h: float) -> str:
    """Where the sweeps of step ``h`` live: ``<workdir>/h_<h>`` (``h_0.0333333`` for 1/30)."""
    return os.path.join(workdir, f"h_{h:.6g}")


def ranks(rows: list[dict]) -> dict[str, int]:
    """Each model's rank by mean test accuracy over its seeds that did not diverge (1 = best);
    a model whose every seed diverged ranks last."""

    def key(r):
        mean = r["test_accuracy"]["mean"] if r["test_accuracy"]["n"] else None
        return -mean if mean is not None and np.isfinite(mean) else np.inf

    return {r["label"]: i + 1 for i, r in enumerate(sorted(rows, key=key))}


def _present(by_h: dict[float, list[dict]]) -> list[str]:
    """The labels with a row at some h, in the paper's order."""
    return [lab for lab in LABELS if any(r["label"] == lab for rows in by_h.values() for r in rows)]


def _h_grid(by_h: dict[float, list[dict]], cell) -> str:
    """Models down, one column per ``h`` (largest first); ``cell(row, h)`` fills a cell, ``row``
    being ``None`` where the model has no row at that ``h``."""
    hs = sorted(by_h, reverse=True)
    head = "| model | " + " | ".join(f"h = {h:.4g}" for h in hs) + " |"
    lines = [head, "|" + "---|" * (len(hs) + 1)]
    for label in _present(by_h):
        rows = [next((r for r in by_h[h] if r["label"] == label), None) for h in hs]
        lines.append(f"| {label} | " + " | ".join(cell(r, h) for r, h in zip(rows, hs)) + " |")
    return "\n".join(lines)


def h_table(by_h: dict[float, list[dict]]) -> str:
    """Models down, one column per ``h``: test accuracy (mean ± std), rank, diverged seeds."""
    rank = {h: ranks(rows) for h, rows in by_h.items()}

    def cell(r, h):
        if r is None:
            return ""
        div = f", {r['diverged']}/{len(r['seeds'])} diverged" if r["diverged"] else ""
        return f"{pm(r['test_accuracy'])} (#{rank[h][r['label']]}{div})"

    return _h_grid(by_h, cell)


def h_monotonicity_table(by_h: dict[float, list[dict]]) -> str:
    """Per model and ``h``: seeds whose per-layer loss never rises, on the training set / test set."""

    def cell(r, h):
        tm, m = (r or {}).get("train_monotonicity"), (r or {}).get("monotonicity")
        if not (tm and m):
            return "-"
        n = len(r["per_layer_loss"]["per_seed"])
        return f"{tm['monotone_seeds']}/{n} / {m['monotone_seeds']}/{n}"

    return _h_grid(by_h, cell)


def plot_h(by_h: dict[float, list[dict]], workdir: str) -> None:
    """``accuracy_vs_h.png`` (test accuracy against h per model) and ``per_layer_loss_h.png``
    (figure 3 left at every h, on the training set and on the test set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs = sorted(by_h)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, label in enumerate(LABELS):
        pts = [(h, r) for h in hs for r in by_h[h] if r["label"] == label and r["test_accuracy"]["n"]]
        if not pts:
            continue
        x = [h for h, _ in pts]
        mean = [100 * r["test_accuracy"]["mean"] for _, r in pts]
        std = [100 * r["test_accuracy"]["std"] for _, r in pts]
        color = "k" if label == "NAIS-Net" else line_color(i, len(LABELS))
        ax.errorbar(
            x, mean, yerr=std, color=color, marker="o", ms=4, capsize=3, lw=2 if color == "k" else 1, label=label
        )
    ax.set(xscale="log", xlabel="step h", ylabel="test accuracy (%)", title="Test accuracy against h (mean ± std)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "accuracy_vs_h.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(len(hs), 2, figsize=(12, 3.2 * len(hs)), squeeze=False, sharex=True)
    for row, h in zip(axes, sorted(by_h, reverse=True)):
        for ax, key, split in zip(row, ("per_layer_train_loss", "per_layer_loss"), ("training set", "test set")):
            per_layer_axes(ax, by_h[h], key)
            ax.set(title=f"h = {h:.4g}, {split}", ylabel="cross-entropy of x(i)")
    axes[0, 1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "per_layer_loss_h.png"), dpi=100)
    plt.close(fig)


def run_over_h(*, workdir: str, hs, **kwargs) -> dict[float, list[dict]]:
    """:func:`run` at every step size of ``hs``, each in :func:`h_dir`, then the comparison:
    ``results_h.md`` / ``results_h.json`` (test accuracy, rank and divergences against h; per-layer
    loss monotone on both splits) and the figures of :func:`plot_h`. A step whose sweeps finished
    earlier (another process, one per GPU) is read back, so a last call with every h only reports."""
    hs = [parse_h(h) for h in hs]
    for h in hs:  # every step's configs checked before any step trains (--hs=1,2 trained h = 1 first)
        checked_models(h=h, h_flag="--hs", **kwargs)
    by_h = {h: run(workdir=h_dir(workdir, h), h=h, h_flag="--hs", **kwargs) for h in hs}
    if kwargs.get("time_steps") or not distributed.is_primary():
        return by_h
    rows = [r for h in hs for r in by_h[h]]
    times = [row_training_seconds(r) for r in rows]
    header = {
        "dataset": kwargs["dataset"],
        "h": ", ".join(f"{h:.6g}" for h in sorted(hs, reverse=True)),
        "seeds per model and h": kwargs["seeds"],
        "trained on": trained_on(rows),
        "training time, all sweeps (their epochs, summed over every call)": (
            f"{sum(t for t, _ in times) / 60:.1f} min"
            + ("" if all(summed for _, summed in times) else " (older rows: the call that finished them)")
        ),
    }
    with open(os.path.join(workdir, "results_h.json"), "w") as f:
        json.dump({"header": header, "by_h": {f"{h:.6g}": by_h[h] for h in hs}}, f)
    md = ["# Section 5.1 against the step h", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += [
        "",
        "Test accuracy (%), mean ± std over the seeds that did not diverge; (#rank among the models at that h by that "
        "mean; diverged seeds).",
        "",
        h_table(by_h),
        "",
        "Seeds whose per-layer loss never rises (training set / test set):",
        "",
        h_monotonicity_table(by_h),
        "",
    ]
    with open(os.path.join(workdir, "results_h.md"), "w") as f:
        f.write("\n".join(md))
    plot_h(by_h, workdir)
    print("\n" + h_table(by_h))
    return by_h


# --------------------------------------------------------------------------- main


def checked_models(*, dataset, seeds, epochs, models=None, h=None, smoke=False, h_flag="--h", **_):
    """The labels of the models to run and ``make(model)``, their config; every config checked
    first, its errors naming the flag that set the value (``h_flag``: where ``h`` came from)."""
    labels = list(LABELS)
    if models:
        unknown = set(models) - set(LABELS.values())
        if unknown:
            raise ValueError(f"--models has unknown names {sorted(unknown)}; valid: {list(LABELS.values())}")
        labels = [lab for lab in labels if LABELS[lab] in models]
    elif smoke:
        labels = [lab for lab in labels if LABELS[lab] in SMOKE_MODELS]

    def make(model):
        return make_config(model, dataset=dataset, seeds=seeds, epochs=epochs, h=h, smoke=smoke)

    for label in labels:  # every config checked before anything is written (a bad --h, say)
        schema.validate(make(LABELS[label]), labels=flags_of_fields(h_flag))
    return labels, make


def run(
    *,
    workdir: str,
    dataset: str,
    seeds: int,
    epochs: int | None,
    models=None,
    h=None,
    smoke: bool = False,
    time_steps: int = 0,
    audit_data: str = "none",
    h_flag: str = "--h",
) -> list[dict]:
    from naisnet_jax.verify import AuditOptions

    from naisnet_jax import sweep

    labels, make = checked_models(
        dataset=dataset, seeds=seeds, epochs=epochs, models=models, h=h, smoke=smoke, h_flag=h_flag
    )
    os.makedirs(workdir, exist_ok=True)

    if time_steps:
        time_models(labels, make, time_steps, workdir)
        return []
    t0 = time.time()
    options = AuditOptions(data=audit_data)
    rows = [run_model(label, make(LABELS[label]), workdir, options) for label in labels]
    config = make(LABELS[labels[0]])
    wall = time.time() - t0
    paper = PAPER_MNIST if config.dataset == "mnist_pinned" else None
    header = {
        "dataset": config.dataset + (" (smoke: tiny sizes)" if smoke else ""),
        "seeds": f"{config.num_seeds} (config.seed + 0..{config.num_seeds - 1})",
        "epochs": config.num_epochs,
        "optimiser": f"SGD, momentum {config.momentum}, learning rate {config.learning_rate}, "
        f"batch {config.batch_size}",
        "h": f"{config.h:.6g} for every model (the paper does not state h; "
        "see src/naisnet_jax/configs/ablation_paper.py)",
        "inputs": "pixels in [0, 1]"
        if not config.standardize
        else "standardised with the training set's channel statistics",
        "eps": config.eps,
        "trained on": trained_on(rows),
        "training time per model (its epochs, summed over every call)": ", ".join(
            f"{r['label']} {training_time_text(r)}" for r in rows
        ),
        "paper": "MNIST test accuracy, mean of 10 runs" if paper else "the paper reports no Fashion-MNIST numbers",
    }
    if not distributed.is_primary():  # of several processes, the primary one writes the report
        return rows
    write_outputs(rows, workdir, header=header, paper=paper)
    plot(rows, workdir)
    print()
    print(short_table(rows, paper))
    print(
        f"\nwrote {workdir}/results.md, results.json and the figures; wall time {wall:.1f} s on "
        f"{sweep.device_description()}"
    )
    return rows


FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Flags are defined only when the script runs, so tests can import both experiments."""
    define_compilation_cache_flag()
    define_cluster_flags()
    flags.DEFINE_string("workdir", "runs/ablation", "Where every sweep and the results go.")
    flags.DEFINE_string("dataset", "mnist_pinned", "mnist_pinned or fashion_mnist_idx (any naisnet_jax dataset).")
    flags.DEFINE_integer("seeds", 10, "Seeds per model, trained side by side.")
    flags.DEFINE_integer("epochs", None, "Override the number of epochs (default: the config's 150).")
    flags.DEFINE_list("models", None, "Subset of models (default: naisnet_mnist and the nine ResNet variants).")
    flags.DEFINE_float("h", None, "Override the step size h of every model (default: the config's).")
    flags.DEFINE_list(
        "hs",
        None,
        "Run every model at each of these step sizes (numbers or fractions, e.g. 1,0.5,1/30), each "
        "in <workdir>/h_<h>, and compare them (results_h.md).",
    )
    flags.DEFINE_bool("smoke", False, "Tiny sizes (digits, 8 units, 3 layers, 2 epochs): seconds on a CPU.")
    flags.DEFINE_integer("time_steps", 0, "Only measure steps/s of each model's sweep over this many steps.")
    flags.DEFINE_string("audit_data", "none", "The verifier's inputs: none (parameters only), random, or a dataset.")


def _main(argv):
    del argv
    start_experiment(FLAGS)
    common = dict(
        dataset=FLAGS.dataset,
        seeds=FLAGS.seeds,
        epochs=FLAGS.epochs,
        models=FLAGS.models,
        smoke=FLAGS.smoke,
        time_steps=FLAGS.time_steps,
        audit_data=FLAGS.audit_data,
    )
    try:
        if FLAGS.hs:
            if FLAGS.h is not None:
                raise ValueError(f"--h={FLAGS.h} and --hs={FLAGS.hs} both given; pass one")
            run_over_h(workdir=FLAGS.workdir, hs=FLAGS.hs, **common)
        else:
            run(workdir=FLAGS.workdir, h=FLAGS.h, **common)
    except sweep_report.USER_ERRORS as e:
        exit_with_error(e)


if __name__ == "__main__":
    _define_flags()
    app.run(_main, flags_parser=sweep_report.parse_flags)
