"""Section 5.2's comparison on MNIST and Fashion-MNIST: NAIS-Net1, NAIS-Net10 and the ResNet.

    python -m experiments.conv --workdir=runs/conv
    python -m experiments.conv --time_steps=50 --workdir=runs/conv   # steps/s and projected time
    python -m experiments.conv --smoke --workdir=/tmp/conv_smoke      # seconds, on a CPU

3 stages x 18 blocks of 16/32/64 filters, every block's drive normalised (the form the package
ships), against the one-convolution ResNet and He et al.'s two-convolution ResNet-110. The headline
NAIS-Nets start every block at ``x(0) = 0``, the paper's equation 1 ("used throughout the paper"):
NAIS-Net1 is ``naisnet_cifar1`` with ``initial_state="zero"`` (its one step never applies the state
kernel: a plain 54-layer network, which the model warns about), NAIS-Net10 ``naisnet_cifar10`` as
shipped. The ablation rows are the other start for both, ``x(0) = u`` (``naisnet_cifar1``'s default),
and NAIS-Net10 with BatchNorm only where the stage changes or nowhere (drives at He scale, the start
that keeps their spread); ``experiments/RESULTS.md`` says why. ``experiments/signal.py`` shows what
each form does in its first steps. Each model is one sweep of
``--seeds`` seeds (``naisnet_jax.sweep``) with the config ``src/naisnet_jax/configs/conv_paper.py``:
the paper's CIFAR schedule compressed to ``--epochs`` epochs (see the config for why).
Writes to ``--workdir``: ``results.json`` / ``results.md`` (test accuracy, train accuracy and
generalisation gap, mean +- std over seeds, per dataset), ``accuracy_<dataset>.png`` (train and
test accuracy over epochs, figure 4 right) and ``gap.png``; each sweep lives in
``<workdir>/<dataset>/<variant>`` and resumes; a finished one is read back from its
``summary.json``. ``--report_only`` writes the tables from the finished sweeps alone (sweeps run on
several machines, gathered in one workdir) and names the ones not yet run.
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
    script_version,
    start_experiment,
    stat_row,
    sweep_times,
    trained_on,
    training_time_text,
    write_summary,
)

# variant -> (paper label, model, model_kwargs): the baselines, the headline NAIS-Nets, the ablations
VARIANTS = {
    "resnet": ("ResNet", "resnet_cifar", {}),
    "resnet2": ("ResNet-110, two convolutions a block", "resnet_cifar", {"convs": 2}),
    "naisnet1": ("NAIS-Net1", "naisnet_cifar1", {"initial_state": "zero"}),
    "naisnet10": ("NAIS-Net10", "naisnet_cifar10", {}),
    "naisnet1_input": ("NAIS-Net1, x(0) = u", "naisnet_cifar1", {}),
    "naisnet10_input": ("NAIS-Net10, x(0) = u", "naisnet_cifar10", {"initial_state": "input"}),
    "naisnet10_transitions": (
        "NAIS-Net10, BN at stage changes only",
        "naisnet_cifar10",
        {"drive_norm": "transitions", "drive_init": "he"},
    ),
    "naisnet10_none": ("NAIS-Net10, no BN on drives", "naisnet_cifar10", {"drive_norm": "none", "drive_init": "he"}),
}
# Speed options of every NAIS variant (same maths: tests/test_perf.py, tests/test_conv_kernels.py):
# on a CUDA GPU the 16- and 32-channel blocks run as fused Pallas kernels, the others the stacked VJP,
# every block's loop unrolled by 10 (NAIS-Net10's step on an H100: 1.6 x the plain step,
# BENCHMARKS.md); on a CPU or TPU the stacked VJP. --nofast trains with the plain step.
NAIS_FAST = {"block_vjp": "fused", "scan_unroll": 10}
# --smoke: the same variants, miniature (digits, 2 stages x 1 block of 4/8 filters)
SMOKE_MODELS = {
    "resnet_cifar": ("resnet_conv_tiny", {}),
    "naisnet_cifar1": ("naisnet_conv_tiny", {"steps": 1, "initial_state": "input"}),
    "naisnet_cifar10": ("naisnet_conv_tiny", {"steps": 2}),
}
# CIFAR test accuracy (%) in the paper (5 runs), for reference only: these runs are on (Fashion-)MNIST.
PAPER_CIFAR10 = {"ResNet": "91.72 ± 0.38", "NAIS-Net1": "91.24 ± 0.10", "NAIS-Net10": "91.25 ± 0.46"}
#: The NAIS-Nets of the headline rows (every claim against both ResNets); the other NAIS variants
#: are ablations (claims against the one-convolution ResNet).
HEADLINE = ("naisnet1", "naisnet10")
BASELINES = ("resnet", "resnet2")
#: Bootstrap resamples of the seeds behind the ratios' intervals.
BOOTSTRAP = 10_000
#: The config fields this command's flags set, named by the flag in its errors.
FLAG_OF_FIELD = {
    "num_epochs": "--epochs",
    "num_seeds": "--seeds",
    "seeds_at_once": "--seeds_at_once",
    "limit_train": "--limit_train",
}


def make_config(
    variant: str,
    *,
    dataset: str,
    seeds: int,
    epochs: int | None,
    smoke: bool,
    limit_train: int | None = None,
    fast: bool = True,
    seeds_at_once: int | None = None,
):
    import ml_collections

    from naisnet_jax.configs import conv_paper

    _, model, kwargs = VARIANTS[variant]
    if fast and model.startswith("naisnet"):
        kwargs = {**kwargs, **NAIS_FAST}
    config = conv_paper.get_config()
    config.dataset = dataset
    config.model = model
    config.model_kwargs = ml_collections.ConfigDict(dict(kwargs))
    config.num_seeds = seeds
    config.seeds_at_once = seeds_at_once
    config.progress = sys.stderr.isatty()
    if limit_train is not None:  # the first limit_train training images (the test set stays whole)
        config.limit_train = limit_train
    if smoke:
        tiny, tiny_kwargs = SMOKE_MODELS[model]
        config.model = tiny
        config.model_kwargs = ml_collections.ConfigDict({**tiny_kwargs, **kwargs})  # the variant's own win
        config.dataset = "digits"
        config.limit_train, config.limit_test = 256, 100
        config.batch_size = config.eval_batch_size = 64
        epochs = 2 if epochs is None else epochs
    if epochs is not None:
        config.num_epochs = epochs
        config.lr_boundaries_epochs = conv_paper.scaled_boundaries(epochs)
    return config


def summary_path(variant: str, config, workdir: str) -> str:
    """Where ``variant``'s sweep on ``config.dataset`` writes its row when it finishes."""
    return os.path.join(workdir, config.dataset, variant, "summary.json")


def finished_row(variant: str, config, workdir: str) -> dict | None:
    """The row of ``variant``'s sweep under ``workdir`` if it finished with this config, else None."""
    return read_summary(summary_path(variant, config, workdir), config)


def run_variant(variant: str, config, workdir: str, audit_options) -> dict:
    from naisnet_jax import seeds, sweep

    label = VARIANTS[variant][0]
    summary = summary_path(variant, config, workdir)
    run_dir = os.path.dirname(summary)
    row = finished_row(variant, config, workdir)
    if row is not None:
        print(f"== {label} on {config.dataset}: finished earlier, read from {summary}", flush=True)
        return row
    print(
        f"== {label} ({config.model} {dict(config.model_kwargs)}) on {config.dataset}: "
        f"{config.num_seeds} seeds x {config.num_epochs} epochs",
        flush=True,
    )
    t0 = time.time()
    result = sweep.train_sweep(
        config, run_dir, audit_options=audit_options, audit_baselines=False, per_step_loss=False, labels=FLAG_OF_FIELD
    )
    row = {
        "variant": variant,
        "label": label,
        "model": config.model,
        "model_kwargs": dict(config.model_kwargs),
        "dataset": config.dataset,
        "seeds": list(result.seeds),
        "epochs": result.epoch,
    }
    for field in ("test_accuracy", "train_accuracy", "generalisation_gap", "test_loss"):
        row[field] = stat_row(result, field)
    row["diverged"] = result.num_diverged
    row["chance_accuracy"] = chance_accuracy(result.test_data.labels)  # the split the sweep evaluated on
    row["has_nais_block"] = any(r.rho_max is not None for r in result.runs)
    row["certified_seeds"] = sum(bool(r.certified) for r in result.runs)
    row["rho_bound_max"] = max((r.rho_max for r in result.runs if r.rho_max is not None), default=None)
    row["test_accuracy_curve"] = curve(result.history, "test_accuracy")
    row["train_accuracy_curve"] = curve(result.history, "train_accuracy")
    row.update(sweep_times(result, time.time() - t0))
    row["device"] = sweep.device_description()
    row["devices"] = seeds.seed_mesh(config, config.num_seeds).devices.size  # those the seeds were split over
    row["seeds_at_once"] = config.seeds_at_once  # how many of a device's seeds ran side by side (None: all)
    row["script"] = script_version()
    write_summary(summary, config, row)
    return row


# --------------------------------------------------------------------------- outputs


def table(rows) -> str:
    head = (
        "| dataset | model | test acc (%) | train acc (%) | gap (pp) | diverged | certified | "
        "paper, CIFAR-10 test (%) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        n = len(r["seeds"])
        cert = f"{r['certified_seeds']}/{n}" if r["has_nais_block"] else "n/a (no NAIS block)"
        paper = PAPER_CIFAR10.get(r["label"].split(",")[0], "")
        lines.append(
            f"| {r['dataset']} | {r['label']} | {pm(r['test_accuracy'])} | {pm(r['train_accuracy'])} | "
            f"{pm(r['generalisation_gap'])} | {r['diverged']}/{n} | {cert} | {paper} |"
        )
    return "\n".join(lines)


def _finite(*stats: dict) -> list[np.ndarray]:
    """Each statistic's per-seed values over the seeds where all of them are finite (a diverged
    seed has no training statistics, so its test accuracy is left out with them)."""
    per_seed = [s["per_seed"] for s in stats]
    keep = [all(v is not None and np.isfinite(v) for v in vs) for vs in zip(*per_seed)]
    return [np.asarray([v for v, k in zip(vs, keep) if k], np.float64) for vs in per_seed]


def chance_accuracy(test_labels) -> float:
    """The test accuracy of always answering the test set's most frequent class: what a net
    that learned nothing scores (11.35% on MNIST, whose test set holds 1,135 ones; 10% on the
    balanced Fashion-MNIST and CIFAR-10)."""
    labels = np.asarray(test_labels)
    return float(np.bincount(labels).max() / labels.shape[0])


# a seed whose test accuracy does not beat ``chance_accuracy`` by this much learned nothing
CHANCE_MARGIN = 0.01


def _no_claim(row: dict) -> str | None:
    """Why ``row`` makes none of the paper's claims, or None: it diverged on some seeds or stayed
    at chance on some (a net answering one class everywhere has no spread or gap to compare)."""
    n = len(row["test_accuracy"]["per_seed"])
    diverged = row.get("diverged", 0)
    at_chance = 0
    if row.get("chance_accuracy") is not None:
        acc, _ = _finite(row["test_accuracy"], row["generalisation_gap"])
        at_chance = int(np.sum(acc <= row["chance_accuracy"] + CHANCE_MARGIN))
    if diverged and at_chance:
        return f"diverged on {diverged} of {n} seeds, at chance on {at_chance}"
    if diverged:
        return f"diverged on {diverged} of {n} seeds"
    if at_chance:
        return f"at chance on {at_chance} of {n} seeds"
    return None


def bootstrap_ratios(acc_a, gap_a, acc_b, gap_b, *, resamples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """Percentile 95% intervals of the gap ratio (mean gap of ``a`` / of ``b``) and the spread
    ratio (std of ``a``'s test accuracy / ``b``'s), each model's seeds resampled with replacement,
    ``resamples`` times. A resample where a ratio is undefined (a mean gap <= 0, a zero std) is
    left out of that ratio and counted; with a handful of seeds the intervals are wide."""
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(acc_a), (resamples, len(acc_a)))
    ib = rng.integers(0, len(acc_b), (resamples, len(acc_b)))
    ga, gb = gap_a[ia].mean(1), gap_b[ib].mean(1)
    sa, sb = acc_a[ia].std(1), acc_b[ib].std(1)
    out = {"resamples": resamples}
    for name, num, den, ok in (("gap_ratio", ga, gb, (ga > 0) & (gb > 0)), ("spread_ratio", sa, sb, sb > 0)):
        r = num[ok] / den[ok]
        out[name] = [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))] if r.size else None
        out[f"{name}_undefined"] = int((~ok).sum())
    return out


def gap_at_training_accuracy(row: dict, train_accuracy: float) -> dict | None:
    """``row``'s generalisation gap (mean over seeds) at the point of its run where its mean
    training accuracy first reached ``train_accuracy``, interpolated linearly between epochs; None
    if it never did. Compares gaps at a matched fit instead of at the end of equal schedules."""
    train = as_array(row["train_accuracy_curve"]["mean"])
    test = as_array(row["test_accuracy_curve"]["mean"])
    epochs = np.asarray(row["train_accuracy_curve"]["epochs"], np.float64)
    reached = np.flatnonzero(train >= train_accuracy)
    if reached.size == 0:
        return None
    i = int(reached[0])
    j = max(i - 1, 0)
    t = 0.0 if i == 0 else (train_accuracy - train[j]) / (train[i] - train[j])
    gap = (1 - t) * (train[j] - test[j]) + t * (train[i] - test[i])
    return {"epoch": float(epochs[j] + t * (epochs[i] - epochs[j])), "gap": float(gap)}


def claims(rows) -> list[dict]:
    """The paper's three claims, per dataset, for each headline NAIS-Net against each ResNet row
    (and each ablation row against the one-convolution ResNet): the difference of mean test
    accuracy with its standard error (Welch), the generalisation gap's ratio (the paper: about a
    third smaller, a ratio near 0.67) and the ratio of the test accuracy's spread over seeds (the
    paper: lower variance, a ratio below 1), both with bootstrap intervals over seeds, and the
    ResNet's gap at the NAIS-Net's final training accuracy (:func:`gap_at_training_accuracy`;
    the paper's smaller gap comes with a lower fit of the training set too). A net that diverged
    or stayed at chance on some seeds makes none of them: its entry says why (``no_claim``)."""
    ablations = [v for v in VARIANTS if v.startswith("naisnet") and v not in HEADLINE]
    pairs = [(n, b) for n in HEADLINE for b in BASELINES] + [(v, BASELINES[0]) for v in ablations]
    out = []
    for dataset in sorted({r["dataset"] for r in rows}):
        sub = {r["variant"]: r for r in rows if r["dataset"] == dataset}
        for nais, base in pairs:
            if nais not in sub or base not in sub:
                continue
            entry = {"dataset": dataset, "nais": sub[nais]["label"], "resnet": sub[base]["label"]}
            reason = _no_claim(sub[nais])
            if reason is not None:
                out.append(entry | {"no_claim": reason})
                continue
            a, ga = _finite(sub[nais]["test_accuracy"], sub[nais]["generalisation_gap"])
            b, gb = _finite(sub[base]["test_accuracy"], sub[base]["generalisation_gap"])
            if min(len(a), len(b)) < 2:
                continue
            matched = gap_at_training_accuracy(sub[base], sub[nais]["train_accuracy"]["mean"])
            out.append(
                entry
                | {
                    "accuracy_difference": float(a.mean() - b.mean()),
                    "difference_se": float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))),
                    # a ratio of gaps says how much smaller NAIS-Net's gap is only if both are positive
                    "gap_ratio": float(ga.mean() / gb.mean()) if min(ga.mean(), gb.mean()) > 0 else None,
                    "spread_ratio": float(a.std() / b.std()) if b.std() > 0 else None,
                    "bootstrap": bootstrap_ratios(a, ga, b, gb),
                    "resnet_gap_at_matched_fit": matched,
                    "gap_ratio_at_matched_fit": (
                        float(ga.mean() / matched["gap"])
                        if matched is not None and min(ga.mean(), matched["gap"]) > 0
                        else None
                    ),
                }
            )
    return out


def _interval(values: list[float] | None) -> str:
    return "" if values is None else f" [{values[0]:.2f}, {values[1]:.2f}]"


def claims_table(rows) -> str:
    head = (
        "| dataset | NAIS-Net | against | test acc difference (pp, ± s.e.) | gap ratio [95% bootstrap] "
        "(paper: ~0.67) | spread ratio over seeds [95% bootstrap] (paper: < 1) | the ResNet's gap at NAIS-Net's "
        "training accuracy (pp, epoch) | gap ratio at that fit |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in claims(rows):
        if "no_claim" in c:
            lines.append(f"| {c['dataset']} | {c['nais']} | {c['resnet']} | n/a: {c['no_claim']} | | | | |")
            continue
        boot = c["bootstrap"]
        gap = "n/a (a gap <= 0)" if c["gap_ratio"] is None else f"{c['gap_ratio']:.2f}{_interval(boot['gap_ratio'])}"
        spread = "-" if c["spread_ratio"] is None else f"{c['spread_ratio']:.2f}{_interval(boot['spread_ratio'])}"
        m = c["resnet_gap_at_matched_fit"]
        matched = "never reached" if m is None else f"{100 * m['gap']:.2f} (epoch {m['epoch']:.1f})"
        ratio = "n/a" if c["gap_ratio_at_matched_fit"] is None else f"{c['gap_ratio_at_matched_fit']:.2f}"
        lines.append(
            f"| {c['dataset']} | {c['nais']} | {c['resnet']} | {100 * c['accuracy_difference']:+.2f} ± "
            f"{100 * c['difference_se']:.2f} | {gap} | {spread} | {matched} | {ratio} |"
        )
    return "\n".join(lines)


def gap_label(label: str, rows) -> str:
    """The gap figure's name for model ``label``: the label, and under it, per dataset, why its
    bar means little (seeds that diverged or stayed at chance), naming the dataset when the rows
    hold several."""
    several = len({r["dataset"] for r in rows}) > 1
    notes = []
    for r in (r for r in rows if r["label"] == label):
        reason = _no_claim(r)
        if reason is not None:
            notes.append(f"{r['dataset']}: {reason}" if several else reason)
    return "\n".join([label, *notes])


def plot(rows, workdir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for dataset in sorted({r["dataset"] for r in rows}):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for i, r in enumerate(r for r in rows if r["dataset"] == dataset):
            for kind, style in (("train", ":"), ("test", "-")):
                c = r[f"{kind}_accuracy_curve"]
                ep = np.asarray(c["epochs"])
                mean, std = as_array(c["mean"]), as_array(c["std"])
                ax.plot(ep, mean, style, color=f"C{i}", marker="o", ms=3, label=f"{r['label']} ({kind})")
                ax.fill_between(ep, mean - std, mean + std, color=f"C{i}", alpha=0.12, lw=0)
        ax.set(
            xlabel="epoch",
            ylabel="accuracy",
            title=f"{dataset}: train (dotted) and test (solid) accuracy, mean ± std over seeds",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, f"accuracy_{dataset}.png"), dpi=120)
        plt.close(fig)

    datasets = sorted({r["dataset"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    # one horizontal bar per model and dataset: the long model names stay readable
    fig, ax = plt.subplots(figsize=(8.5, 1.2 + 0.45 * len(labels) * max(len(datasets), 1) ** 0.5))
    width = 0.8 / max(len(datasets), 1)
    for j, dataset in enumerate(datasets):
        sub = {r["label"]: r for r in rows if r["dataset"] == dataset}
        y = np.arange(len(labels)) + j * width
        gaps = [100 * sub[lab]["generalisation_gap"]["mean"] if lab in sub else np.nan for lab in labels]
        errs = [100 * sub[lab]["generalisation_gap"]["std"] if lab in sub else np.nan for lab in labels]
        ax.barh(y, gaps, width, xerr=errs, label=dataset, capsize=3)
    ticks = [gap_label(lab, rows) for lab in labels]
    ax.set_yticks(np.arange(len(labels)) + width * (len(datasets) - 1) / 2, ticks, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="train - test accuracy (pp)", title="Generalisation gap (mean ± std, seeds that did not diverge)")
    ax.axvline(0, color="k", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "gap.png"), dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def run(
    *,
    workdir: str,
    datasets,
    seeds: int = 4,
    epochs: int | None = None,
    variants=None,
    smoke: bool = False,
    time_steps: int = 0,
    full_audit: bool = False,
    limit_train: int | None = None,
    fast: bool = True,
    seeds_at_once: int | None = None,
    report_only: bool = False,
) -> list[dict]:
    from naisnet_jax.verify import AuditOptions

    from naisnet_jax import distributed, sweep, train
    from naisnet_jax.configs import schema

    variants = list(variants or VARIANTS)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"--variants has unknown names {sorted(unknown)}; valid: {list(VARIANTS)}")
    os.makedirs(workdir, exist_ok=True)
    if smoke:
        datasets = ["digits"]
    configs = [
        (
            v,
            make_config(
                v,
                dataset=d,
                seeds=seeds,
                epochs=epochs,
                smoke=smoke,
                limit_train=limit_train,
                fast=fast,
                seeds_at_once=seeds_at_once,
            ),
        )
        for d in datasets
        for v in variants
    ]
    for _, config in configs:  # every config checked before anything runs or is said (a bad --epochs, say)
        schema.validate(config, labels=FLAG_OF_FIELD)

    if time_steps:
        rows = []
        for v, config in configs[: len(variants)]:  # one dataset: the shapes are the same for both
            t = sweep_report.time_steps(config, steps=time_steps)
            t["variant"] = v
            rows.append(t)
            print(
                f"{VARIANTS[v][0]:<22} {t['steps_per_second']:7.2f} steps/s ({t['seeds']} seeds)  "
                f"{t['images_per_second']:9.0f} seed-images/s  eval {t['eval_seconds']:.2f}s  "
                f"compile {t['compile_seconds']:.0f}s  projected {t['projected_seconds'] / 60:.2f} min per dataset",
                flush=True,
            )
        total = len(datasets) * sum(t["projected_seconds"] for t in rows)
        if not distributed.is_primary():
            return rows
        with open(os.path.join(workdir, "timing.json"), "w") as f:
            json.dump({"rows": rows, "datasets": list(datasets), "projected_total_seconds": total}, f, indent=1)
        print(
            f"\nprojected training, {len(datasets)} datasets: {total / 60:.1f} min ({configs[0][1].num_epochs} "
            f"epochs, without compilation) on {sweep.device_description()}"
        )
        return rows

    options = AuditOptions(data="none", estimate_conv_radius=full_audit)
    t0 = time.time()
    missing = []
    if report_only:  # the tables of the sweeps that have finished; nothing is trained
        rows = []
        for v, c in configs:
            row = finished_row(v, c, workdir)
            if row is None:
                missing.append(f"{c.dataset}/{v}")
            else:
                rows.append(row)
        if not rows:
            raise ValueError(f"--report_only: no finished sweep under {workdir!r} for {missing}")
        if missing:
            print(f"not finished, left out of the report: {', '.join(missing)}", flush=True)
    else:
        rows = [run_variant(v, config, workdir, options) for v, config in configs]
    wall = time.time() - t0
    if not distributed.is_primary():  # of several processes, the primary one writes the report
        return rows
    config = configs[0][1]
    header = {
        "datasets": ", ".join(datasets) + (" (smoke: tiny models on digits)" if smoke else ""),
        "training images": "all" if config.limit_train is None else f"the first {config.limit_train}",
        "seeds": f"{config.num_seeds} per model (config.seed + 0..{config.num_seeds - 1})",
        "schedule": (
            f"{config.num_epochs} epochs, SGD momentum {config.momentum}, batch {config.batch_size}, "
            f"learning rate {config.learning_rate} divided by 10 at epochs {list(config.lr_boundaries_epochs)} "
            f"(the paper's 450-epoch CIFAR schedule with its drops at the same fractions of the run; "
            f"see src/naisnet_jax/configs/conv_paper.py), weight decay {config.weight_decay}, "
            + {False: "no augmentation", True: "4-pixel pad-and-crop and flip", "crop": "4-pixel pad-and-crop"}[
                train.augmentation(config)
            ]
        ),
        "audit": "parameter-level (Algorithm 2's condition and Gershgorin bounds)"
        + (" plus Arnoldi radii of every conv block" if full_audit else ""),
        "trained on": trained_on(rows),
        "training time of each sweep (its epochs, summed over every call)": ", ".join(
            f"{r['dataset']}/{r['label']} {training_time_text(r)}"
            + (f" on {r['devices']} device(s)" if "devices" in r else "")
            + (f", {r['seeds_at_once']} seed(s) at a time" if r.get("seeds_at_once") else "")
            for r in rows
        ),
        "paper": "CIFAR-10 numbers shown for reference only (5 runs, 450 epochs); these runs are on (Fashion-)MNIST",
    }
    if missing:
        header["not yet run"] = ", ".join(missing)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows, "claims": claims(rows)}, f, indent=1)
    md = ["# Section 5.2 on MNIST and Fashion-MNIST: NAIS-Net1, NAIS-Net10 and the one-convolution ResNet", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += [
        "",
        "Mean ± std over the seeds that did not diverge (population std). Train accuracy is the running "
        "mean over the last epoch's batches; gap = train - test.",
        "",
        table(rows),
        "",
        "The paper's claims (section 5.2): equal accuracy, a generalisation gap about a third smaller, "
        "lower variance over runs. Gap ratio = NAIS-Net's mean gap / the ResNet's; spread ratio = the std "
        "of NAIS-Net's test accuracy over seeds / the ResNet's; intervals: percentile bootstrap over seeds "
        f"({BOOTSTRAP} resamples). The ResNet's gap at NAIS-Net's training accuracy: its mean gap at the "
        "point of its run where its mean training accuracy first reached NAIS-Net's final one (linear "
        "between epochs). A net that diverged, or stayed at chance "
        f"(within {100 * CHANCE_MARGIN:.0f} point of always answering the test set's commonest class), on "
        "some seed makes no claim.",
        "",
        claims_table(rows),
        "",
    ]
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write("\n".join(md))
    plot(rows, workdir)
    print()
    w = max(len(r["label"]) for r in rows)
    print(f"{'dataset':<18} {'model':<{w}} {'test acc (%)':>16} {'gap (pp)':>14} {'div':>4} {'cert':>5}")
    for r in rows:
        n = len(r["seeds"])
        cert = f"{r['certified_seeds']}/{n}" if r["has_nais_block"] else "n/a"
        print(
            f"{r['dataset']:<18} {r['label']:<{w}} {pm(r['test_accuracy']):>16} {pm(r['generalisation_gap']):>14} "
            f"{r['diverged']:>4} {cert:>5}"
        )
    print("\n" + claims_table(rows))
    where = (
        "from the finished sweeps' records (each row's device and times are in results.md)"
        if report_only
        else f"wall time {wall:.1f} s on {sweep.device_description()}"
    )
    print(f"\nwrote {workdir}/results.md, results.json and the figures; {where}")
    return rows


FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Flags are defined only when the script runs, so tests can import both experiments."""
    define_compilation_cache_flag()
    define_cluster_flags()
    flags.DEFINE_string("workdir", "runs/conv", "Where every sweep and the results go.")
    flags.DEFINE_list("datasets", ["mnist_pinned", "fashion_mnist_idx"], "Datasets, each a full comparison.")
    flags.DEFINE_integer("seeds", 4, "Seeds per model, split over the host's GPUs (side by side on each).")
    flags.DEFINE_integer("epochs", None, "Override the number of epochs (the schedule's drops scale with it).")
    flags.DEFINE_list("variants", None, f"Subset of {list(VARIANTS)}.")
    flags.DEFINE_bool("smoke", False, "Tiny models on digits, 2 epochs: seconds on a CPU.")
    flags.DEFINE_integer("time_steps", 0, "Only measure steps/s of each model's sweep over this many steps.")
    flags.DEFINE_integer("limit_train", None, "Train on the first N training images only (the test set stays whole).")
    flags.DEFINE_bool("full_audit", False, "Also compute Arnoldi spectral radii of every conv block (slow).")
    flags.DEFINE_bool("fast", True, f"NAIS nets with the speed options {NAIS_FAST} (same maths); --nofast: plain step.")
    flags.DEFINE_integer(
        "seeds_at_once",
        None,
        "Each GPU trains its seeds this many side by side at a time, the groups in turn (default: all at once); "
        "the same computation (benchmarks/seeds_at_once.py says which is faster).",
    )
    flags.DEFINE_bool(
        "report_only", False, "Write the tables from the sweeps that have finished (say which have not); train nothing."
    )


def _main(argv):
    del argv
    start_experiment(FLAGS)
    try:
        run(
            workdir=FLAGS.workdir,
            datasets=FLAGS.datasets,
            seeds=FLAGS.seeds,
            epochs=FLAGS.epochs,
            variants=FLAGS.variants,
            smoke=FLAGS.smoke,
            time_steps=FLAGS.time_steps,
            full_audit=FLAGS.full_audit,
            limit_train=FLAGS.limit_train,
            fast=FLAGS.fast,
            seeds_at_once=FLAGS.seeds_at_once,
            report_only=FLAGS.report_only,
        )
    except sweep_report.USER_ERRORS as e:
        exit_with_error(e)


if __name__ == "__main__":
    _define_flags()
    app.run(_main, flags_parser=sweep_report.parse_flags)
