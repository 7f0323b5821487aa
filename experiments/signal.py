"""Why the CIFAR-shaped nets learn or sit at chance: the first steps of training, block by block.

    python -m experiments.signal --workdir=runs/signal [--variants=a,b] [--dataset=mnist_pinned]
    python -m experiments.signal --workdir=runs/signal --report     # the table and figure only
    python -m experiments.signal --smoke --workdir=/tmp/signal      # tiny nets on digits, a CPU

Each variant (:data:`VARIANTS`: the paper's 3 x 18 blocks of 16/32/64 filters, ``h = 1``, in
the shipped form and in the other readings of the paper) is trained with SGD at the paper's
learning rate 0.1 (momentum 0.9, weight decay 2e-4, batch 128, standardised inputs, no
augmentation), the first ``--steps`` steps one at a time with, at every step and for every
block:

- the spread (std) of the block's output ``x_K``;
- the share of active ReLU units in the block's first and last step (a unit is active in step
  ``k`` when ``x_{k+1} - x_k > 0``, with ``x_0`` the block's start, ``0`` or its input ``u``;
  from ``x_0 = 0`` the first step's share is that of ``relu(drive) > 0``);
- the gradient norms of the drive kernel ``D`` and the state kernel, and the norm of ``D``;
- the step SGD actually takes on ``D`` relative to ``D`` (``||D' - D|| / ||D||``, momentum and
  weight decay included): under the drive's BatchNorm the loss does not see ``D``'s scale, so this
  relative step is how fast the block's features move; and the mean ``|scale|`` of the drive's
  BatchNorm (the size of the drive the state sees);
- what the projection (Algorithm 2) undoes of the SGD step on the state kernel:
  ``||P(c) - c|| / ||c - theta||`` for the momentum-free candidate ``c = theta - lr (g + wd theta)``;
- the loss, the accuracy and the logits' spread.

Then the run goes on to ``--epochs`` epochs (``--schedule=constant``: 0.1 throughout, as a user's
two-epoch try; ``paper``: the paper's drops at the same fractions of the run,
``conv_paper.scaled_boundaries``) and is tested: test accuracy with BatchNorm's running averages
(evaluation mode, as every reported accuracy), with the batches' own statistics, and evaluation
mode on 10,000 training images, which separates BatchNorm's train/eval mismatch from
generalisation, and with the running averages recomputed at the final weights
(:func:`_recomputed_statistics`), which tells whether that mismatch is the averages' lag.

Writes ``<workdir>/<variant>.json`` per variant (resumable: a variant with its file is not run
again) and, from all of them, ``results.json``, ``results.md`` and ``signal.png`` (per block at
step 0 and at the last measured step: spread, active share, drive gradient; and the loss).
Variants can run as separate processes, one a GPU, into one workdir; ``--report`` merges them.
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from experiments.sweep_report import script_version

# variant -> (label, model, model_kwargs). The shipped forms first, then the other readings.
VARIANTS = {
    "nais10": ("NAIS-Net10 (shipped: x(0) = 0, BN on every drive)", "naisnet_cifar10", {}),
    "nais1": ("NAIS-Net1 (shipped: x(0) = u, BN on every drive, its scale from 0)", "naisnet_cifar1", {}),
    "resnet": ("ResNet, one convolution a block", "resnet_cifar", {}),
    "nais10_transitions_lecun": (
        "NAIS-Net10, BN at stage changes only, LeCun drives (the former form)",
        "naisnet_cifar10",
        {"drive_norm": "transitions", "drive_init": "lecun"},
    ),
    "nais10_transitions": (
        "NAIS-Net10, BN at stage changes only, He drives",
        "naisnet_cifar10",
        {"drive_norm": "transitions", "drive_init": "he"},
    ),
    "nais10_none": (
        "NAIS-Net10, no BN on any drive, He drives",
        "naisnet_cifar10",
        {"drive_norm": "none", "drive_init": "he"},
    ),
    "nais10_input": ("NAIS-Net10, x(0) = u", "naisnet_cifar10", {"initial_state": "input"}),
    "nais1_zero": ("NAIS-Net1, x(0) = 0", "naisnet_cifar1", {"initial_state": "zero"}),
    "nais1_zero_transitions": (
        "NAIS-Net1, x(0) = 0, BN at stage changes only, He drives",
        "naisnet_cifar1",
        {"initial_state": "zero", "drive_norm": "transitions", "drive_init": "he"},
    ),
    "nais1_input_transitions": (
        "NAIS-Net1, x(0) = u, BN at stage changes only",
        "naisnet_cifar1",
        {"drive_norm": "transitions"},
    ),
    "nais1_scale_one": (
        "NAIS-Net1, x(0) = u, BN on every drive, its scale from 1",
        "naisnet_cifar1",
        {"zero_init_drive": False},
    ),
}
# --smoke: the same forms as miniatures (2 stages x 2 blocks of 4/8 filters) on digits
SMOKE_MODELS = {
    "naisnet_cifar10": ("naisnet_conv_tiny", {"stage_sizes": (2, 2), "steps": 3}),
    "naisnet_cifar1": ("naisnet_conv_tiny", {"stage_sizes": (2, 2), "steps": 1, "initial_state": "input"}),
    "resnet_cifar": ("resnet_conv_tiny", {"stage_sizes": (2, 2)}),
}
SCHEDULES = ("constant", "paper")


def make_config(
    model: str, kwargs: dict, *, dataset: str, epochs: int, schedule: str, seed: int = 0, warmup_steps: int = 0
):
    """The paper's CIFAR optimisation on ``dataset``: SGD 0.1, momentum 0.9, weight decay 2e-4,
    batch 128, ``h = 1``; ``schedule`` constant or the paper's drops scaled to ``epochs``;
    ``warmup_steps`` first steps at 0.01 (He et al.'s warm-up of ResNet-110)."""
    from naisnet_jax.configs import conv_paper, default

    config = default.get_config()
    config.model, config.dataset, config.seed = model, dataset, seed
    config.model_kwargs.update(kwargs)
    config.h, config.learning_rate, config.momentum, config.weight_decay = 1.0, 0.1, 0.9, 2e-4
    config.batch_size, config.eval_batch_size, config.num_epochs = 128, 1000, epochs
    config.lr_boundaries_epochs = conv_paper.scaled_boundaries(epochs) if schedule == "paper" else []
    config.lr_warmup_steps, config.lr_warmup_factor = warmup_steps, 0.1
    config.augment, config.standardize = False, True
    return config


def _block_names(params) -> list[str]:
    names = [k for k in params if k.startswith("stage")]
    return sorted(names, key=lambda s: tuple(int(p) for p in s.replace("stage", "").split("_block")))


def _diagnostic_step(state, config, blocks, steps_per_epoch):
    """``(state, x, y) -> (state, record)``: :func:`naisnet_jax.train.train_step` and the
    measurements of the module docstring, taken on the same batch before the step."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from naisnet_jax import models, train
    from naisnet_jax.projection import project_params

    schedule, wd = train.learning_rate_schedule(config, steps_per_epoch), config.weight_decay
    drive = "input" if "input" in state.params[blocks[0]] else "conv"  # ResNet blocks: "conv"

    def loss_fn(params, x, y):
        starts = []  # per NAIS block: its input u where it starts at x_0 = u, else None (x_0 = 0)

        def record(next_fun, args, kwargs, context):
            if isinstance(context.module, models.NaisConvBlock) and context.method_name == "__call__":
                starts.append(args[0] if context.module.initial_state == "input" else None)
            return next_fun(*args, **kwargs)

        variables = {"params": params, "batch_stats": state.batch_stats}
        with nn.intercept_methods(record):
            (logits, aux), _ = state.apply_fn(variables, x, train=True, return_aux=True, mutable=["batch_stats"])
        starts = starts or [None] * len(aux["trajectory"])  # ResNet blocks: one step from zero
        return jnp.mean(train.cross_entropy(logits, y)), (logits, aux["trajectory"], starts)

    def active(states, k, x0):  # share of units that moved up in step k
        before = (jnp.zeros_like(states[0]) if x0 is None else x0) if k == 0 else states[k - 1]
        return jnp.mean(states[k] - before > 0)

    @jax.jit
    def step(state, x, y):
        (loss, (logits, traj, starts)), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
        norm = lambda tree: jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(tree)))  # noqa: E731
        p = state.params
        rec = {
            "loss": loss,
            "accuracy": jnp.mean(jnp.argmax(logits, -1) == y),
            "logits_std": jnp.std(logits),
            "out_std": jnp.stack([jnp.std(t[-1]) for t in traj]),
            "active_first": jnp.stack([active(t, 0, x0) for t, x0 in zip(traj, starts)]),
            "active_last": jnp.stack([active(t, t.shape[0] - 1, x0) for t, x0 in zip(traj, starts)]),
            "g_drive": jnp.stack([norm(g[b][drive]["kernel"]) for b in blocks]),
            "w_drive": jnp.stack([norm(p[b][drive]["kernel"]) for b in blocks]),
        }
        if "state_kernel" in p[blocks[0]]:
            rec["g_state"] = jnp.stack([norm(g[b]["state_kernel"]) for b in blocks])
            lr = schedule(state.step)
            cand = jax.tree.map(lambda w, d: w - lr * (d + wd * w), p, g)
            proj = project_params(cand, eps=config.eps, eta=config.eta)
            rec["projection_undoes"] = jnp.stack(
                [
                    norm(proj[b]["state_kernel"] - cand[b]["state_kernel"])
                    / (norm(cand[b]["state_kernel"] - p[b]["state_kernel"]) + 1e-30)
                    for b in blocks
                ]
            )
        new, _ = train.train_step(state, (x, y))
        rec["step_drive"] = jnp.stack(
            [norm(new.params[b][drive]["kernel"] - p[b][drive]["kernel"]) / norm(p[b][drive]["kernel"]) for b in blocks]
        )
        if "drive_norm" in p[blocks[0]]:
            rec["drive_scale"] = jnp.stack(
                [jnp.mean(jnp.abs(p[b]["drive_norm"]["scale"])) if "drive_norm" in p[b] else jnp.nan for b in blocks]
            )
        return new, rec

    return step


def measure(
    variant: str,
    *,
    workdir: str,
    dataset: str,
    steps: int,
    epochs: int,
    schedule: str,
    smoke: bool,
    warmup_steps: int = 0,
    seed: int = 0,
) -> dict:
    """Trains one variant as the module docstring says; returns (and writes) its record."""
    import jax

    from naisnet_jax import data as data_lib
    from naisnet_jax import sweep, train

    label, model, kwargs = VARIANTS[variant]
    if smoke:
        model, tiny = SMOKE_MODELS[model]
        kwargs = {**tiny, **kwargs}
    config = make_config(
        model, kwargs, dataset=dataset, epochs=epochs, schedule=schedule, warmup_steps=warmup_steps, seed=seed
    )
    train.validate_config(config)
    start = time.time()
    ds = data_lib.load_dataset(dataset)
    mean, std = train.input_stats(config, ds.train_images)
    net = train.build_model(config, ds.num_classes)
    steps_per_epoch = len(ds.train_images) // config.batch_size
    state = train.create_train_state(config, net, ds.image_shape, steps_per_epoch)
    blocks = _block_names(state.params)
    step = _diagnostic_step(state, config, blocks, steps_per_epoch)
    train_data = data_lib.put_on_device(ds.train_images, ds.train_labels)
    test_data = data_lib.put_on_device(ds.test_images, ds.test_labels)
    key = jax.random.PRNGKey(config.seed)
    records = []
    order = data_lib.epoch_batches(jax.random.fold_in(key, 0), train_data.num_examples, config.batch_size)
    steps_asked, steps = steps, min(steps, order.shape[0])
    for i in range(steps):
        x, y = data_lib.get_batch(train_data, order[i], mean=mean, std=std)
        state, rec = step(state, x, y)
        records.append({"step": i, **jax.tree.map(lambda v: np.asarray(v).tolist(), rec)})
        if not math.isfinite(records[-1]["loss"]):
            break
    chunk = train.make_train_chunk(mean, std, train.augmentation(config))
    evaluate = train.make_evaluate(mean, std, config.eval_batch_size)
    history = []
    for epoch in range(epochs):
        order = np.asarray(
            data_lib.epoch_batches(jax.random.fold_in(key, epoch), train_data.num_examples, config.batch_size)
        )
        first = steps if epoch == 0 else 0  # epoch 0's first steps were the measured ones
        losses, accs = [], []
        for s in range(first, order.shape[0], config.steps_per_chunk):
            rows, count = train.chunk_rows(order, s, config.steps_per_chunk)  # one program
            state, m = chunk(state, train_data, rows, jax.random.fold_in(key, 10_000 * epoch + s), np.int32(count))
            losses.append(float(m["loss"]) * count)
            accs.append(float(m["accuracy"]) * count)
        done = order.shape[0] - first
        test = jax.tree.map(float, evaluate(state, test_data))
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": sum(losses) / done if done else None,
                "train_accuracy": sum(accs) / done if done else None,
                "test_loss": test["loss"],
                "test_accuracy": test["accuracy"],
            }
        )
        print(f"{variant} epoch {epoch + 1}: {history[-1]}", flush=True)
    some = min(10_000, len(ds.train_images))
    train_eval = jax.tree.map(
        float, evaluate(state, data_lib.put_on_device(ds.train_images[:some], ds.train_labels[:some]))
    )
    batch_stats_state = state.replace(apply_fn=_with_batch_statistics(state.apply_fn))
    test_batch_stats = jax.tree.map(float, evaluate(batch_stats_state, test_data))
    recomputed = state.replace(batch_stats=_recomputed_statistics(state, train_data, mean, std, key))
    test_recomputed = jax.tree.map(float, evaluate(recomputed, test_data))
    record = {
        "variant": variant,
        "label": label,
        "model": model,
        "model_kwargs": dict(kwargs),
        "dataset": dataset,
        "schedule": schedule,
        "lr_boundaries_epochs": list(config.lr_boundaries_epochs),
        "lr_warmup_steps": warmup_steps,
        "epochs": epochs,
        "blocks": blocks,
        "steps": records,
        "steps_asked": steps_asked,
        "history": history,
        "train_eval_accuracy": train_eval["accuracy"],
        "test_accuracy_batch_statistics": test_batch_stats["accuracy"],
        "test_accuracy_recomputed_statistics": test_recomputed["accuracy"],
        "seconds": time.time() - start,
        "seed": config.seed,
        "device": sweep.device_description(),
        "script": script_version(),
    }
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"{variant}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    return record


def _recomputed_statistics(state, data, mean, std, key, batches: int = 30, batch_size: int = 128):
    """BatchNorm's running averages recomputed at the final weights: ``batches`` training-mode
    passes over training batches with the weights fixed (the averages' momentum 0.9 leaves
    ``0.9^30``, 4%, of the old ones). Where evaluation then agrees with the batches' own
    statistics, the disagreement was the averages lagging behind weights that still moved."""
    import jax

    from naisnet_jax import data as data_lib

    @jax.jit
    def update(batch_stats, idx):
        x, _ = data_lib.get_batch(data, idx, mean=mean, std=std)
        variables = {"params": state.params, "batch_stats": batch_stats}
        _, new = state.apply_fn(variables, x, train=True, mutable=["batch_stats"])
        return new["batch_stats"]

    order = data_lib.epoch_batches(jax.random.fold_in(key, 99_999), data.num_examples, batch_size)
    batch_stats = state.batch_stats
    for i in range(min(batches, order.shape[0])):
        batch_stats = update(batch_stats, order[i])
    return batch_stats


def _with_batch_statistics(apply_fn):
    """``apply_fn`` whose evaluation normalises with each batch's own statistics (training mode),
    discarding the updated running averages."""

    def apply(variables, x, train=False, return_aux=False):
        out, _ = apply_fn(variables, x, train=True, return_aux=return_aux, mutable=["batch_stats"])
        return out

    return apply


def summary_row(rec: dict) -> dict:
    """The table's row of one variant's record."""
    first, last = rec["steps"][0], rec["steps"][-1]
    window = [s["loss"] for s in rec["steps"][-10:]]
    final = rec["history"][-1] if rec["history"] else {}
    return {
        "variant": rec["variant"],
        "label": rec["label"],
        "epochs": rec["epochs"],
        "logits_std_0": first["logits_std"],
        "out_std_0_min": min(first["out_std"]),
        "out_std_0_last": first["out_std"][-1],
        "active_0": float(np.mean(first["active_first"])),
        "g_drive_0_first_block": first["g_drive"][0],
        "g_drive_0_last_block": first["g_drive"][-1],
        "w_drive_first_block": [first["w_drive"][0], last["w_drive"][0]],
        "out_std_last_max": max(last["out_std"]),
        "out_std_last_last": last["out_std"][-1],
        "active_last_stage": float(np.mean(last["active_first"][-len(last["active_first"]) // 3 :])),
        "loss_last10": float(np.mean(window)),
        "steps_measured": len(rec["steps"]),
        "projection_undoes_max": max(max(s.get("projection_undoes", [0.0])) for s in rec["steps"]),
        # the median relative step on D over the measured steps, in the first and the last block
        "step_drive_first_block": _median_step(rec, 0),
        "step_drive_last_block": _median_step(rec, -1),
        "test_accuracy": final.get("test_accuracy"),
        "train_accuracy": final.get("train_accuracy"),
        "train_eval_accuracy": rec["train_eval_accuracy"],
        "test_accuracy_batch_statistics": rec["test_accuracy_batch_statistics"],
        "test_accuracy_recomputed_statistics": rec.get("test_accuracy_recomputed_statistics"),
        "trajectory": trajectory(rec),
    }


#: The steps at which the report's trajectory table samples each record (the last measured step too).
TRAJECTORY_STEPS = (0, 1, 2, 5, 10, 20, 50, 100, 200)


def trajectory(rec: dict) -> dict | None:
    """The first block's drive kernel through the measured steps: at each of
    :data:`TRAJECTORY_STEPS` (and the last measured step), its norm ``|D|``, its gradient's norm, the relative step SGD
    takes on it, the drive BatchNorm's mean ``|scale|``, the same relative step in the last block,
    and the mean training loss over the ten steps that end there. None for a record made before
    the relative step was measured. Under a warm-up of ``w`` steps it also samples steps ``w - 1`` and
    ``w + 9``: the warm-up's last ten steps and the first ten at the full rate."""
    steps = rec["steps"]
    if "step_drive" not in steps[0]:
        return None
    warmup = rec.get("lr_warmup_steps") or 0
    marks = set(TRAJECTORY_STEPS) | ({warmup - 1, warmup + 9} if warmup else set())
    at = sorted({i for i in marks if i < len(steps)} | {len(steps) - 1})
    return {
        "step": at,
        "w_drive_first_block": [steps[i]["w_drive"][0] for i in at],
        "g_drive_first_block": [steps[i]["g_drive"][0] for i in at],
        "step_drive_first_block": [steps[i]["step_drive"][0] for i in at],
        "step_drive_last_block": [steps[i]["step_drive"][-1] for i in at],
        # a ResNet block has no drive BatchNorm whose scale is recorded
        "drive_scale_first_block": [steps[i]["drive_scale"][0] if "drive_scale" in steps[i] else None for i in at],
        "loss_10": [float(np.mean([s["loss"] for s in steps[max(0, i - 9) : i + 1]])) for i in at],
        "accuracy_10": [float(np.mean([s["accuracy"] for s in steps[max(0, i - 9) : i + 1]])) for i in at],
    }


def _median_step(rec: dict, block: int) -> float | None:
    """The median over the measured steps of ``||D' - D|| / ||D||`` in ``block`` (None for a
    record made before it was measured)."""
    steps = [s["step_drive"][block] for s in rec["steps"] if "step_drive" in s]
    return float(np.median(steps)) if steps else None


def report(workdir: str) -> list[dict]:
    """``results.json``, ``results.md`` and ``signal.png`` from every ``<variant>.json``."""
    records = []
    for variant in VARIANTS:
        path = os.path.join(workdir, f"{variant}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    if not records:
        raise ValueError(f"no variant results in {workdir!r}; run the experiment first.")
    rows = [summary_row(r) for r in records]
    header = {k: sorted({str(r[k]) for r in records}) for k in ("dataset", "schedule", "epochs", "device", "script")}
    # a record without "seed" predates the field; the command then had no way to choose one: seed 0
    header["seeds"] = sorted({str(r.get("seed", 0)) for r in records})
    header["lr_warmup_steps"] = sorted({str(r.get("lr_warmup_steps", 0)) for r in records})
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}"  # noqa: E731
    md = ["# The first steps of the CIFAR-shaped nets, block by block", ""]
    md += [f"- {k}: {', '.join(v)}" for k, v in header.items()]
    md += [
        "",
        "Step 0 is the initialisation (training mode, first batch); 'last' is the last measured step. "
        "`|g_D|` is the drive kernel's gradient norm in the first and last block; `|D|` the first "
        "block's drive kernel norm at step 0 and at the last measured step. Accuracies in %: test "
        "with running averages (as reported everywhere), train (running mean over the epoch), "
        "evaluation mode on 10k training images, test with each batch's own statistics, test with the "
        "running averages recomputed at the final weights.",
        "",
        "| variant | epochs | logits std @0 | min block std @0 | \\|g_D\\| @0 first / last block "
        "| \\|D\\| first block @0 -> last | max block std @last | last-stage active @last | loss (last 10) "
        "| test | train | eval on train | test, batch stats | test, averages recomputed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['label']} | {r['epochs']} | {r['logits_std_0']:.3g} | {r['out_std_0_min']:.3g} | "
            f"{r['g_drive_0_first_block']:.3g} / {r['g_drive_0_last_block']:.3g} | "
            f"{r['w_drive_first_block'][0]:.3g} -> {r['w_drive_first_block'][1]:.3g} | {r['out_std_last_max']:.3g} | "
            f"{100 * r['active_last_stage']:.0f}% | {r['loss_last10']:.3f} | {pct(r['test_accuracy'])} | "
            f"{pct(r['train_accuracy'])} | {pct(r['train_eval_accuracy'])} | "
            f"{pct(r['test_accuracy_batch_statistics'])} | {pct(r['test_accuracy_recomputed_statistics'])} |"
        )
    md += trajectory_table(rows)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    plot(records, os.path.join(workdir, "signal.png"))
    print("\n".join(md))
    return rows


def trajectory_table(rows: list[dict]) -> list[str]:
    """The trajectory section of ``results.md`` (empty when no row has one)."""
    rows = [r for r in rows if r["trajectory"]]
    if not rows:
        return []
    md = [
        "",
        "## The first block's drive kernel, step by step",
        "",
        "At each step: `|D|`, the first block's drive kernel norm before the step; `|g_D|`, the norm of "
        "the loss's gradient on it; the relative step "
        "`||D' - D|| / ||D||` SGD takes on it (momentum and weight decay included; with momentum 0.9 a "
        "step of weight decay alone is lr x wd / (1 - 0.9) = 2e-4 at lr 0.1); the drive BatchNorm's "
        "mean |scale|; the same relative step in the last block; the mean training loss and batch "
        "accuracy over the ten steps that end there.",
        "",
        "| variant | step | \\|D\\| first block | \\|g_D\\| first block | relative step, first block "
        "| BN \\|scale\\|, first block | relative step, last block | loss (10 steps) | batch acc. (10 steps, %) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["trajectory"]
        for j, step in enumerate(t["step"]):
            md.append(
                f"| {r['variant'] if j == 0 else ''} | {step} | {t['w_drive_first_block'][j]:.3g} | "
                f"{t['g_drive_first_block'][j]:.3g} | "
                f"{t['step_drive_first_block'][j]:.3g} | {_g(t['drive_scale_first_block'][j])} | "
                f"{t['step_drive_last_block'][j]:.3g} | {t['loss_10'][j]:.3f} | "
                f"{_pct(t.get('accuracy_10'), j)} |"
            )
    return md


def _pct(values: list | None, j: int) -> str:
    """``values[j]`` as a percentage ("-" for a trajectory stored before the accuracy was)."""
    return "-" if values is None else f"{100 * values[j]:.1f}"


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(21, 8.5))
    colours = plt.get_cmap("tab20")
    for i, rec in enumerate(records):
        first, last = rec["steps"][0], rec["steps"][-1]
        blocks = np.arange(len(first["out_std"]))
        (line,) = axes[0, 0].semilogy(blocks, first["out_std"], label=rec["variant"], color=colours(i % 20))
        axes[0, 1].semilogy(blocks, last["out_std"], color=line.get_color())
        axes[0, 2].semilogy(blocks, first["g_drive"], color=line.get_color())
        axes[1, 0].plot(blocks, last["active_first"], color=line.get_color())
        axes[1, 1].semilogy(blocks, last["w_drive"], color=line.get_color())
        axes[1, 2].plot([s["loss"] for s in rec["steps"]], color=line.get_color(), lw=0.8)
        axes[0, 3].semilogy([s["w_drive"][0] for s in rec["steps"]], color=line.get_color(), lw=0.8)
        if "step_drive" in first:  # records made before the relative step was measured lack it
            axes[1, 3].semilogy([s["step_drive"][0] for s in rec["steps"]], color=line.get_color(), lw=0.8)
    titles = [  # in the order of axes.flat: (title, x label, y label)
        ("block output std at step 0", "block", "std"),
        ("block output std at the last measured step", "block", "std"),
        ("drive kernel gradient norm at step 0", "block", "|g_D|"),
        ("first block's drive kernel norm, step by step", "step", "|D|"),
        ("share of active ReLU units (first step) at the last measured step", "block", "share"),
        ("drive kernel norm at the last measured step", "block", "|D|"),
        ("training loss, step by step", "step", "loss"),
        ("relative SGD step on the first block's drive kernel", "step", "|D' - D| / |D|"),
    ]
    for ax, (title, xlabel, ylabel) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    axes[1, 2].axhline(math.log(10), color="k", ls=":", lw=0.8)
    axes[1, 2].set_ylim(0, 5)  # ln 10 in the middle; a diverging run leaves the panel
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def settings_of(record: dict) -> dict:
    """What a record was measured with, as :func:`measure`'s arguments name it. A record made
    before the seed was stored had no way to choose one (seed 0); one made before the steps asked
    for were stored does not say them (the steps measured can be fewer: an epoch's, or up to a
    loss that was not finite)."""
    settings = {
        "dataset": record["dataset"],
        "schedule": record["schedule"],
        "epochs": record["epochs"],
        "warmup_steps": record.get("lr_warmup_steps", 0),
        "seed": record.get("seed", 0),
    }
    if "steps_asked" in record:
        settings["steps"] = record["steps_asked"]
    return settings


def check_record(path: str, wanted: dict) -> None:
    """A record already in the workdir stands for this call only if it was measured with the same
    settings; else ``ValueError`` naming both, since merging it would mix two experiments."""
    with open(path) as f:
        have = settings_of(json.load(f))
    differ = {k: (have[k], v) for k, v in wanted.items() if k in have and have[k] != v}
    if differ:
        said = ", ".join(f"{k} {a!r} there, {b!r} asked" for k, (a, b) in differ.items())
        raise ValueError(f"{path} was measured with other settings ({said}); use another --workdir")


def _main(argv):
    from absl import flags, logging

    from experiments.sweep_report import USER_ERRORS, check_workdir, enable_compilation_cache, exit_with_error

    del argv
    F = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    check_workdir(F.workdir)
    unknown = sorted(set(F.variants or ()) - set(VARIANTS))
    if unknown:
        exit_with_error(ValueError(f"--variants {unknown} unknown; choose from {list(VARIANTS)}."))
    if not F.report:
        dataset = "digits" if F.smoke else F.dataset
        wanted = dict(
            dataset=dataset,
            schedule=F.schedule,
            epochs=F.epochs,
            steps=F.steps,
            warmup_steps=F.warmup_steps,
            seed=F.seed,
        )
        variants = F.variants or list(VARIANTS)
        done = [v for v in variants if os.path.exists(os.path.join(F.workdir, f"{v}.json"))]
        for variant in done:  # before anything is written
            try:
                check_record(os.path.join(F.workdir, f"{variant}.json"), wanted)
            except ValueError as e:  # nothing measured
                exit_with_error(e)
        enable_compilation_cache(F.compilation_cache, F.workdir)
        try:
            for variant in (v for v in variants if v not in done):
                measure(variant, workdir=F.workdir, smoke=F.smoke, **wanted)
        except USER_ERRORS as e:  # an unknown dataset, a missing data folder
            exit_with_error(e)
    try:
        report(F.workdir)
    except ValueError as e:  # --report on a workdir without records
        exit_with_error(e)


def _define_flags() -> None:
    from absl import flags

    from experiments.sweep_report import define_compilation_cache_flag

    define_compilation_cache_flag()
    flags.DEFINE_string("workdir", "runs/signal", "Where the per-variant records and the report go.")
    flags.DEFINE_list("variants", None, f"Subset of {list(VARIANTS)} (default: all).")
    flags.DEFINE_string("dataset", "mnist_pinned", "Dataset (its training set and test set).")
    flags.DEFINE_integer("steps", 100, "Steps measured one at a time.", lower_bound=1)
    flags.DEFINE_integer("epochs", 2, "Epochs in all (the measured steps are the first of them).", lower_bound=1)
    flags.DEFINE_enum("schedule", "constant", SCHEDULES, "Learning rate: 0.1 throughout, or the paper's drops.")
    flags.DEFINE_integer("warmup_steps", 0, "First steps at learning rate 0.01 (He et al.'s warm-up).", lower_bound=0)
    flags.DEFINE_integer(
        "seed", 0, "The runs' seed: initial parameters and batch order (a new --workdir a seed).", lower_bound=0
    )
    flags.DEFINE_bool("smoke", False, "Tiny nets on digits: seconds on a CPU.")
    flags.DEFINE_bool("report", False, "Only merge the records in --workdir into the table and figure.")


if __name__ == "__main__":
    from absl import app

    from experiments.sweep_report import parse_flags

    _define_flags()
    app.run(_main, flags_parser=parse_flags)
