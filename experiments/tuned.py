"""Section 5.1 with every model's learning rate chosen on a validation split, the same way for all.

    python -m experiments.tuned --workdir=runs/tuned                 # choose, train, report; resumes
    CUDA_VISIBLE_DEVICES=$i python -m experiments.tuned --workdir=runs/tuned --report=false &  # one a GPU
    python -m experiments.tuned --smoke --workdir=/tmp/tuned         # seconds, on a CPU

The paper states SGD with momentum 0.9 and learning rate 0.1 for all ten nets; at ``h = 1`` that
rate saturates the shared-weight tanh nets within a few steps (RESULTS.md), so a comparison at
0.1 alone ranks how each net survives one rate. Here each model gets the rate it does best with,
chosen without the test set:

1. **Choice.** The training set is split: its first 50,000 images train, its last 10,000 (the
   MNIST file's own validation rows) score (``config.validation``); the test set is not loaded.
   Every rate of the grid (:data:`GRID`, half-decades from 0.3 to 0.0003) trains
   ``--choice_seeds`` seeds for ``--choice_epochs`` epochs. A rate's score is the mean over seeds
   of the validation accuracy averaged over the last :data:`SCORE_EPOCHS` epochs, a diverged seed
   scoring 0. The best score wins; where the winner is an end of the grid, the grid grows by a
   half-decade that way (:func:`neighbour`) until the winner is inside it.
2. **Final.** At the chosen rate, ``--seeds`` seeds x 150 epochs on all 60,000 training images,
   tested once on the test set, exactly as ``experiments/ablation.py`` trains (its config, ``h``
   from ``--h``, default 1): every seed of a stable model audited, its per-layer loss on both
   splits, seed 0's single-neuron trajectories for the NAIS-Nets, and the share of saturated tanh
   units (:func:`saturated_share`).

The models (:data:`VARIANTS`) are the ten of ``ablation.py``, NAIS-Net and ResNet-SH-Stable each
with Algorithm 1's bound ``delta = 1 - 2 eps`` and with the supplement's ``delta = 2 (1 - eps)``
("proven sufficient for our MNIST experiments"). Each model's work lives in ``<workdir>/<key>``
(``lr_<rate>/`` per rate tried, ``final/``, ``choice.json``, ``summary.json``) behind a lock, so
several processes (one a GPU) share a workdir: each takes the models no other holds. A last call
(``--report``, the default) writes ``results.json`` / ``results.md``, ``lr_choice.png``,
``per_layer_loss.png``, ``neuron_trajectory.png`` and ``test_accuracy.png``, with the rows of the
literal protocol (learning rate 0.1, ``--literal``) beside the tuned ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import numpy as np
from absl import app, flags

from experiments import ablation, sweep_report
from experiments.sweep_report import (
    define_cluster_flags,
    define_compilation_cache_flag,
    exit_with_error,
    pm,
    read_summary,
    script_version,
    start_experiment,
    trained_on,
    write_summary,
)
from naisnet_jax import distributed
from naisnet_jax.configs import schema

#: The learning rates every model tries first: half-decades from 0.3 down to 0.0003.
GRID = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0003)
#: The grid never grows past these.
LR_LIMITS = (1e-5, 1.0)
#: Validation epochs averaged into a rate's score (the last ones of the choice run).
SCORE_EPOCHS = 5
#: MNIST's training set minus these images trains the choice runs; these score them.
VALIDATION = 10_000
#: A tanh unit is saturated when its pre-activation exceeds this in size (``tanh' < 0.071``).
SATURATION = 2.0
#: The flags that set the choice's and the final sweeps' config fields, as their errors name them.
CHOICE_FLAGS = {"num_epochs": "--choice_epochs", "num_seeds": "--choice_seeds", "h": "--h"}
FINAL_FLAGS = {"num_epochs": "--epochs", "num_seeds": "--seeds", "h": "--h"}
LITERAL = os.path.join(os.path.dirname(__file__), "results", "ablation_h", "results_h.json")


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str  # directory and row name
    label: str  # the paper's name of the model
    model: str  # naisnet_jax.models name
    relaxed: bool = False  # Algorithm 1 with delta = 2 (1 - eps)

    @property
    def row_label(self) -> str:
        return f"{self.label}, δ = 2(1 − ε)" if self.relaxed else self.label

    @property
    def bound(self) -> str | None:
        if not ablation.switches(self.label)["Stable"]:
            return None
        return "2(1 − ε)" if self.relaxed else "1 − 2ε"


VARIANTS = tuple(Variant(model, label, model) for label, model in ablation.LABELS.items()) + (
    Variant("naisnet_mnist_relaxed", "NAIS-Net", "naisnet_mnist", relaxed=True),
    Variant("resnet_sh_stable_relaxed", "ResNet-SH-Stable", "resnet_sh_stable", relaxed=True),
)
SMOKE_KEYS = ("naisnet_mnist", "naisnet_mnist_relaxed", "resnet_sh_bn")


def neighbour(lr: float, *, up: bool) -> float:
    """The next half-decade rate (``1`` or ``3`` times a power of ten) above or below ``lr``:
    0.3 -> 1 going up, 0.1 -> 0.03 going down."""
    e = math.floor(math.log10(lr) + 1e-9)
    mantissa = round(lr / 10**e)
    if mantissa not in (1, 3) or not math.isclose(lr, mantissa * 10**e, rel_tol=1e-9):
        raise ValueError(f"lr={lr!r} is not a half-decade rate (1 or 3 times a power of ten)")
    if up:
        return float(f"3e{e}") if mantissa == 1 else float(f"1e{e + 1}")
    return float(f"1e{e}") if mantissa == 3 else float(f"3e{e - 1}")


def lr_name(lr: float) -> str:
    return f"{lr:g}"


# --------------------------------------------------------------------------- configs


def final_config(variant: Variant, *, lr: float, seeds: int, epochs: int | None, h: float, smoke: bool):
    config = ablation.make_config(variant.model, dataset="mnist_pinned", seeds=seeds, epochs=epochs, h=h, smoke=smoke)
    config.learning_rate = float(lr)
    config.relaxed = variant.relaxed
    return config


def choice_config(variant: Variant, *, lr: float, seeds: int, epochs: int, h: float, smoke: bool):
    """:func:`final_config` trained on the training set's first images and scored on its last
    :data:`VALIDATION` (64 of the digits in a smoke run); the test set is not loaded."""
    config = final_config(variant, lr=lr, seeds=seeds, epochs=epochs, h=h, smoke=smoke)
    config.validation = 64 if smoke else VALIDATION
    return config


# --------------------------------------------------------------------------- the choice


def score(history: list[dict], seeds, *, epochs: int) -> dict:
    """A rate's choice run: per seed, its validation accuracy averaged over the last
    :data:`SCORE_EPOCHS` epochs (0 for a seed that diverged); the score is their mean."""
    last = max(r["epoch"] for r in history)
    window = range(max(1, last - SCORE_EPOCHS + 1), last + 1)
    diverged = {r["seed"] for r in history if r["diverged_epoch"] is not None}
    per_seed = [
        0.0
        if s in diverged
        else float(np.mean([r["test_accuracy"] for r in history if r["seed"] == s and r["epoch"] in window]))
        for s in seeds
    ]
    final = [next(r["test_accuracy"] for r in history if r["seed"] == s and r["epoch"] == last) for s in seeds]
    return {
        "score": float(np.mean(per_seed)),
        "per_seed": per_seed,
        "final_accuracy": final,
        "diverged": len(diverged & set(seeds)),
        "epochs": last,
        "complete": last >= epochs,
    }


def choose(scores: dict[float, dict]) -> float:
    """The rate of the best score (ties: the larger rate)."""
    return max(scores, key=lambda lr: (scores[lr]["score"], lr))


def run_choice(variant: Variant, workdir: str, *, seeds: int, epochs: int, h: float, smoke: bool) -> dict:
    """Every rate of the (growing) grid for ``variant``; returns ``choice.json``'s content."""
    from naisnet_jax import sweep

    grid = list(GRID[1:4] if smoke else GRID)
    scores: dict[float, dict] = {}
    seconds = 0.0
    while True:
        for lr in grid:
            if lr in scores:
                continue
            config = choice_config(variant, lr=lr, seeds=seeds, epochs=epochs, h=h, smoke=smoke)
            path = os.path.join(workdir, f"lr_{lr_name(lr)}", "choice.json")
            row = read_summary(path, config)
            if row is None:
                t0 = time.time()
                result = sweep.train_sweep(
                    config, os.path.dirname(path), audit=False, per_step_loss=False, verbose=False, labels=CHOICE_FLAGS
                )
                row = {
                    "learning_rate": lr,
                    **score(list(result.history), result.seeds, epochs=config.num_epochs),
                    "seeds": list(result.seeds),
                    "seconds": time.time() - t0,
                    "device": sweep.device_description(),
                    "script": script_version(),
                }
                write_summary(path, config, row)
                print(
                    f"   {variant.key} lr {lr_name(lr)}: validation {100 * row['score']:.2f}% "
                    f"({row['diverged']} diverged) in {row['seconds']:.0f}s",
                    flush=True,
                )
            scores[lr] = row
            seconds += row["seconds"]
        best = choose(scores)
        lo, hi = min(grid), max(grid)
        if best == hi and hi < LR_LIMITS[1]:
            grid.append(min(neighbour(hi, up=True), LR_LIMITS[1]))
        elif best == lo and lo > LR_LIMITS[0]:
            grid.append(max(neighbour(lo, up=False), LR_LIMITS[0]))
        else:
            break
    return {
        "chosen": best,
        "at_edge": best in (min(grid), max(grid)),
        "grid": sorted(grid, reverse=True),
        "rows": [scores[lr] for lr in sorted(scores, reverse=True)],
        "seeds": seeds,
        "epochs": epochs,
        "validation": config.validation,
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- the final run


@functools.lru_cache(maxsize=4)
def _saturation_counts(apply_fn, threshold: float):
    """``(variables, x) -> (saturated, total)`` tanh units of one batch, jitted once per model
    (every seed of a sweep shares its ``apply_fn``)."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax.probe import AUDIT_COLLECTION, BlockProbe

    @jax.jit
    def counts(variables, x):
        _, sown = apply_fn(variables, x, train=False, mutable=[AUDIT_COLLECTION])
        probes = jax.tree.leaves(sown, is_leaf=lambda v: isinstance(v, BlockProbe))
        saturated = total = 0
        for p in probes:
            if p.activation != "tanh":
                continue
            xs = jnp.concatenate([p.x0[None].astype(p.states.dtype), p.states])
            act = jnp.diff(xs, axis=0) / p.h
            saturated += jnp.sum(jnp.abs(act) > math.tanh(threshold))
            total += act.size
        return saturated, total

    return counts


def saturated_share(state, data, mean, std, *, batch_size: int = 2000, threshold: float = SATURATION) -> float:
    """The share of tanh units whose pre-activation exceeds ``threshold`` in size, over every
    layer (unroll step) of every block and every example of ``data``.

    A layer is ``x_{k+1} = x_k + h tanh(pre_k)``, so ``tanh(pre_k) = (x_{k+1} - x_k) / h`` from
    the states each block reports to the verifier (:class:`naisnet_jax.probe.BlockProbe`: ``x0``
    and ``x_1 .. x_K``); ``|pre| > t`` is ``|tanh(pre)| > tanh(t)``. Models of every kind and
    fast path report the same states, so no model is recognised by name."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax import data as data_lib
    from naisnet_jax import train

    counts = _saturation_counts(state.apply_fn, threshold)
    variables = train.state_variables(state)

    n = data.images.shape[0]
    saturated = total = 0
    for start in range(0, n, batch_size):
        x, _ = data_lib.get_batch(data, jnp.arange(start, min(n, start + batch_size)), mean=mean, std=std)
        s, t = jax.device_get(counts(variables, x))
        saturated, total = saturated + int(s), total + int(t)
    if total == 0:
        raise ValueError("the model reports no tanh layer; the saturated share is undefined")
    return saturated / total


def confidence_interval(values, level: float = 0.95) -> dict:
    """Student's t interval of the mean of ``values`` (sample std); ``None`` bounds below 2 values."""
    from scipy import stats

    v = np.asarray(values, np.float64)
    if v.size < 2:
        return {"low": None, "high": None, "level": level, "n": int(v.size)}
    half = stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return {"low": float(v.mean() - half), "high": float(v.mean() + half), "level": level, "n": int(v.size)}


def run_final(variant: Variant, workdir: str, *, lr: float, seeds: int, epochs, h: float, smoke: bool) -> dict:
    from naisnet_jax.verify import AuditOptions

    from naisnet_jax import sweep

    config = final_config(variant, lr=lr, seeds=seeds, epochs=epochs, h=h, smoke=smoke)
    path = os.path.join(workdir, "summary.json")
    row = read_summary(path, config)
    if row is not None:
        return row
    t0 = time.time()
    result = sweep.train_sweep(
        config,
        os.path.join(workdir, "final"),
        audit_options=AuditOptions(data="none"),
        audit_baselines=False,
        labels=FINAL_FLAGS,
    )
    row = ablation.summarise(variant.label, result, config, time.time() - t0)
    row.update(
        key=variant.key,
        label=variant.row_label,
        bound=variant.bound,
        learning_rate=lr,
        test_accuracy_ci95=confidence_interval(
            [r.test_accuracy for r in result.runs if not r.diverged],
        ),
    )
    shares = [
        saturated_share(result.seed_state(i), result.test_data, result.mean, result.std)
        for i, r in enumerate(result.runs)
        if not r.diverged
    ]
    row["saturated"] = {
        "threshold": SATURATION,
        "split": "test",
        "mean": float(np.mean(shares)) if shares else None,
        "per_seed": shares,
    }
    if variant.label in ablation.TRAJECTORY_MODELS:
        row["neuron_trajectory"] = ablation.neuron_trajectories(result)
    write_summary(path, config, row)
    return row


def run_variant(variant: Variant, workdir: str, **kw) -> dict | None:
    """Choice then final run of ``variant`` in ``workdir/<key>``; ``None`` when another process
    holds it."""
    import filelock

    directory = os.path.join(workdir, variant.key)
    os.makedirs(directory, exist_ok=True)
    lock = filelock.FileLock(os.path.join(directory, ".variant.lock"))
    held = False
    if distributed.is_primary():  # of a multi-process run, the primary holds it for all
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            held = True
    if distributed.agree(int(held)):
        print(f"== {variant.key}: another process holds it", flush=True)
        return None
    try:
        print(f"== {variant.key}: choosing the learning rate", flush=True)
        h, smoke = kw["h"], kw["smoke"]
        choice = run_choice(variant, directory, seeds=kw["choice_seeds"], epochs=kw["choice_epochs"], h=h, smoke=smoke)
        if distributed.is_primary():
            with open(os.path.join(directory, "choice.json"), "w") as f:
                json.dump(choice, f, indent=1)
        print(f"== {variant.key}: chose {lr_name(choice['chosen'])}; {kw['seeds']} seeds on the test set", flush=True)
        row = run_final(
            variant, directory, lr=choice["chosen"], seeds=kw["seeds"], epochs=kw["epochs"], h=h, smoke=smoke
        )
        row["choice"] = choice
        return row
    finally:
        if lock.is_locked:
            lock.release()


# --------------------------------------------------------------------------- the report


def rank_among_ten(rows: list[dict]) -> dict[str, int]:
    """Each row's rank by mean test accuracy among the paper's ten models, a relaxed-bound row
    taking the place of its ``1 - 2 eps`` namesake."""
    strict = [r for r in rows if r.get("bound") != "2(1 − ε)"]
    out = {}
    for r in rows:
        ten = [s for s in strict if s["model"] != r["model"]] + [r]
        out[r["label"]] = ablation.ranks(ten)[r["label"]]
    return out


def literal_rows(path: str) -> dict[str, dict]:
    """The literal protocol's rows (learning rate 0.1, h = 1) by paper label, from the stored
    ``results_h.json`` of ``experiments/ablation.py --hs``; none for ``path=''``. A path that is
    not such a file is refused in one line (a mistyped path dropped the column without a word)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            by_h = json.load(f)["by_h"]
        return {r["label"]: r for r in by_h.get("1", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise ValueError(
            f"--literal={path!r} is not a results_h.json of `experiments.ablation --hs` ({why}); "
            "give that file, or --literal='' for no literal rows."
        ) from None


def ci_text(ci: dict) -> str:
    if ci.get("low") is None:
        return "-"
    return f"[{100 * ci['low']:.2f}, {100 * ci['high']:.2f}]"


def table(rows: list[dict], literal: dict[str, dict]) -> str:
    rank = rank_among_ten(rows)
    lit_rank = ablation.ranks(list(literal.values())) if literal else {}
    head = (
        "| model | bound δ | chosen lr | validation (%) | test acc (%) | 95% CI | rank of ten | train acc (%) | "
        "gap (pp) | diverged | certified | saturated tanh units | per-layer loss monotone (train / test) | "
        "lr 0.1: test acc (%), rank |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        n = len(r["seeds"])
        chosen = next(c for c in r["choice"]["rows"] if c["learning_rate"] == r["learning_rate"])
        cert = f"{r['certified_seeds']}/{n}" if r["has_nais_block"] else "n/a"
        sat = r["saturated"]["mean"]
        mono = "-"
        if r.get("monotonicity") and r.get("train_monotonicity"):
            k = len(r["per_layer_loss"]["per_seed"])
            mono = f"{r['train_monotonicity']['monotone_seeds']}/{k} / {r['monotonicity']['monotone_seeds']}/{k}"
        lit = literal.get(r["label"]) if r.get("bound") != "2(1 − ε)" else None
        lit_text = f"{pm(lit['test_accuracy'])} (#{lit_rank[lit['label']]})" if lit else "-"
        edge = " (edge)" if r["choice"]["at_edge"] else ""
        lines.append(
            f"| {r['label']} | {r.get('bound') or ''} | {lr_name(r['learning_rate'])}{edge} | "
            f"{100 * chosen['score']:.2f} | {pm(r['test_accuracy'])} | {ci_text(r['test_accuracy_ci95'])} | "
            f"#{rank[r['label']]} | {pm(r['train_accuracy'])} | {pm(r['generalisation_gap'])} | "
            f"{r['diverged']}/{n} | {cert} | {'-' if sat is None else f'{100 * sat:.1f}%'} | {mono} | {lit_text} |"
        )
    return "\n".join(lines)


def choice_table(rows: list[dict]) -> str:
    """Validation score (%) of every rate tried, per model; the chosen one in bold."""
    rates = sorted({c["learning_rate"] for r in rows for c in r["choice"]["rows"]}, reverse=True)
    head = "| model | " + " | ".join(lr_name(lr) for lr in rates) + " |"
    lines = [head, "|" + "---|" * (len(rates) + 1)]
    for r in rows:
        by = {c["learning_rate"]: c for c in r["choice"]["rows"]}
        cells = []
        for lr in rates:
            c = by.get(lr)
            if c is None:
                cells.append("")
                continue
            text = f"{100 * c['score']:.2f}" + (f" ({c['diverged']} div.)" if c["diverged"] else "")
            cells.append(f"**{text}**" if lr == r["learning_rate"] else text)
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_choice(rows: list[dict], workdir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, r in enumerate(rows):
        c = sorted(r["choice"]["rows"], key=lambda c: c["learning_rate"])
        lr = [x["learning_rate"] for x in c]
        acc = [100 * x["score"] for x in c]
        style = "--" if r.get("bound") == "2(1 − ε)" else "-"
        color = "k" if r["model"] == "naisnet_mnist" else ablation.line_color(i, len(rows))
        ax.plot(lr, acc, style, color=color, marker="o", ms=3, lw=1.2, label=r["label"])
        ax.plot([r["learning_rate"]], [100 * max(x["score"] for x in c)], "*", color=color, ms=10)
    ax.set(
        xscale="log",
        xlabel="learning rate",
        ylabel="validation accuracy (%)",
        title="Choice runs: validation accuracy against the learning rate (star: chosen)",
    )
    ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "lr_choice.png"), dpi=120)
    plt.close(fig)


def report(
    rows: list[dict], workdir: str, *, literal: dict[str, dict], literal_path: str, h: float, settings: dict
) -> str:
    wall = sum(r["seconds"] + r["choice"]["seconds"] for r in rows)
    header = {
        "dataset": "mnist_pinned" + (" (smoke: digits, tiny sizes)" if settings["smoke"] else ""),
        "h": f"{h:.6g} for every model",
        "choice": f"{settings['choice_seeds']} seeds x {settings['choice_epochs']} epochs per rate, trained on the "
        f"first images of the training set and scored on its last {rows[0]['choice']['validation']} "
        f"(mean validation accuracy over the last {SCORE_EPOCHS} epochs, a diverged seed scoring 0)",
        "final": f"{len(rows[0]['seeds'])} seeds (config.seed + 0..{len(rows[0]['seeds']) - 1}) x "
        f"{rows[0]['epochs']} epochs on the whole training set at the chosen rate, tested once",
        "optimiser": "SGD, momentum 0.9, batch 128, no decay (src/naisnet_jax/configs/ablation_paper.py)",
        "saturated": f"share of tanh units with |pre-activation| > {SATURATION:g} over every layer and test image, "
        "mean over seeds",
        "literal rows": os.path.relpath(literal_path) if literal else "none",
        "trained on": trained_on(rows),
        "training wall time (choice + final, all models)": f"{wall / 60:.1f} min",
    }
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    md = ["# Section 5.1 with tuned learning rates", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += [
        "",
        "Test accuracy: mean ± std over the seeds that did not diverge (population std); 95% CI: Student's t "
        "interval of the mean. Rank among the paper's ten models, a δ = 2(1 − ε) row in place of its "
        "1 − 2ε namesake. Per-layer loss: seeds whose loss of x(i) through the classifier never rises.",
        "",
        table(rows, literal),
        "",
        "Validation accuracy (%) of every learning rate tried (chosen in bold):",
        "",
        choice_table(rows),
        "",
        "Monotonicity of the per-layer loss:",
        "",
        ablation.monotonicity_text(rows, "test"),
        ablation.monotonicity_text(rows, "train"),
        "",
    ]
    text = "\n".join(md)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(text)
    ablation.plot(rows, workdir)
    plot_choice(rows, workdir)
    return text


# --------------------------------------------------------------------------- main


def run(
    *,
    workdir: str,
    keys=None,
    seeds: int = 10,
    epochs: int | None = None,
    choice_seeds: int = 3,
    choice_epochs: int = 30,
    h: float = 1.0,
    smoke: bool = False,
    do_report: bool = True,
    literal: str = LITERAL,
) -> list[dict]:
    from naisnet_jax import sweep

    variants = list(VARIANTS)
    if keys:
        unknown = set(keys) - {v.key for v in VARIANTS}
        if unknown:
            raise ValueError(f"--models has unknown names {sorted(unknown)}; valid: {[v.key for v in VARIANTS]}")
        variants = [v for v in variants if v.key in keys]
    elif smoke:
        variants = [v for v in variants if v.key in SMOKE_KEYS]
    if smoke:
        choice_epochs = min(choice_epochs, 2)
    for v in variants:  # every model's configs checked before anything is written (a bad --h, say)
        schema.validate(
            choice_config(v, lr=GRID[0], seeds=choice_seeds, epochs=choice_epochs, h=h, smoke=smoke),
            labels=CHOICE_FLAGS,
        )
        schema.validate(
            final_config(v, lr=GRID[0], seeds=seeds, epochs=epochs, h=h, smoke=smoke),
            labels=FINAL_FLAGS,
        )
    literal_by = literal_rows(literal) if not smoke else {}  # read before anything is trained
    os.makedirs(workdir, exist_ok=True)
    settings = dict(
        seeds=seeds, epochs=epochs, choice_seeds=choice_seeds, choice_epochs=choice_epochs, h=h, smoke=smoke
    )
    t0 = time.time()
    rows = {}
    for v in variants:
        row = run_variant(v, workdir, **settings)
        if row is not None:
            rows[v.key] = row
    if not do_report:
        print(
            f"done with the models this process could take in {time.time() - t0:.0f} s on {sweep.device_description()}"
        )
        return list(rows.values())
    missing = [v.key for v in variants if v.key not in rows]
    for key in missing:  # finished by another process?
        v = next(x for x in variants if x.key == key)
        row = run_variant(v, workdir, **settings)
        if row is None:
            raise RuntimeError(f"{key} is still held by another process; report once every process has ended")
        rows[key] = row
    ordered = [rows[v.key] for v in variants]
    if not distributed.is_primary():  # of several processes, the primary one writes the report
        return ordered
    report(ordered, workdir, literal=literal_by, literal_path=literal, h=h, settings=settings)
    rank = rank_among_ten(ordered)
    print(f"\n{'model':<34} {'lr':>7} {'test acc (%)':>16} {'95% CI':>16} {'rank':>5} {'sat.':>6} {'lr 0.1':>16}")
    for r in ordered:
        lit = literal_by.get(r["label"]) if r.get("bound") != "2(1 − ε)" else None
        print(
            f"{r['label']:<34} {lr_name(r['learning_rate']):>7} {pm(r['test_accuracy']):>16} "
            f"{ci_text(r['test_accuracy_ci95']):>16} {'#' + str(rank[r['label']]):>5} "
            f"{100 * (r['saturated']['mean'] or 0):5.1f}% {pm(lit['test_accuracy']) if lit else '-':>16}"
        )
    print(f"\nwrote {workdir}/results.md, results.json and the figures in {time.time() - t0:.0f} s")
    return ordered


FLAGS = flags.FLAGS


def _define_flags() -> None:
    define_compilation_cache_flag()
    define_cluster_flags()
    flags.DEFINE_string("workdir", "runs/tuned", "Where every sweep and the results go.")
    flags.DEFINE_list("models", None, "Subset of the models by key (default: all twelve).")
    flags.DEFINE_integer("seeds", 10, "Seeds of each final run.")
    flags.DEFINE_integer("epochs", None, "Epochs of each final run (default: the config's 150).")
    flags.DEFINE_integer("choice_seeds", 3, "Seeds of each choice run.")
    flags.DEFINE_integer("choice_epochs", 30, "Epochs of each choice run.")
    flags.DEFINE_float("h", 1.0, "The step h of every model.")
    flags.DEFINE_bool("smoke", False, "Tiny sizes (digits, 8 units, 3 layers, 2 epochs, 3 rates): a CPU test.")
    flags.DEFINE_bool("report", True, "Write the tables and figures (false: train what this process can take).")
    flags.DEFINE_string("literal", LITERAL, "results_h.json of the literal protocol (learning rate 0.1), or ''.")


def _main(argv):
    del argv
    start_experiment(FLAGS)
    try:
        run(
            workdir=FLAGS.workdir,
            keys=FLAGS.models,
            seeds=FLAGS.seeds,
            epochs=FLAGS.epochs,
            choice_seeds=FLAGS.choice_seeds,
            choice_epochs=FLAGS.choice_epochs,
            h=FLAGS.h,
            smoke=FLAGS.smoke,
            do_report=FLAGS.report,
            literal=FLAGS.literal,
        )
    except sweep_report.USER_ERRORS as e:
        exit_with_error(e)


if __name__ == "__main__":
    _define_flags()
    app.run(_main, flags_parser=sweep_report.parse_flags)
