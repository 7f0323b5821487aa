"""Seeds side by side: ``S`` independent runs of one model as one jitted program.

Every multi-run experiment trains through :func:`train_sweep`. The training state of the ``S``
seeds is stacked on a leading axis and every epoch is one jitted call,
``jax.vmap`` over seeds of ``lax.scan`` over the epoch's batches, followed by the evaluation on
the test split; the datasets live on the device once and are shared by every seed. In plain
Python, one epoch is::

    for i, seed in enumerate(seeds):                       # vmap
        perm_key, aug_key = split(fold_in(PRNGKey(seed + 1), epoch))
        for idx, key in zip(epoch_batches(perm_key, ...), step_keys(aug_key, ...)):  # scan
            state[i], _ = train_step(state[i], get_batch(train_data, idx, key=key))
        test[i] = evaluate(state[i], test_data)

Seed ``i`` of a sweep is the single run :func:`naisnet_jax.train.train_and_evaluate` with
``config.seed = seeds[i]``: the same initial parameters (``PRNGKey(seed)``), the same batch
order and the same augmentation keys, step by step (``tests/test_sweep.py`` checks the
parameters agree).

A seed whose training loss or parameters stop being finite during an epoch is *diverged*: the
epoch's result is discarded for that seed alone and its whole state (parameters, optimiser,
BatchNorm statistics) is frozen at the end of its last finite epoch, every later epoch; the
other seeds go on. Its records carry ``diverged_epoch``, its checkpoint is exported from the
frozen state and tables count it.

Several devices: the seed axis is split over the host's devices (``config.num_devices``, default
all; the most of them that divide the number of seeds evenly), the datasets replicated on each.
Seeds are independent, so the compiled epoch has no communication: each device trains its own
seeds, with the numbers of one device (``tests/test_sharding.py``).

Files under ``workdir``: ``metrics.jsonl`` (one record per epoch and seed),
``sweep_checkpoints/`` (the stacked state, for resume), and at the end one ordinary single-run
directory per seed, ``seed_<s>/`` with ``checkpoints/`` (``naisnet-verify`` audits it),
``metrics.jsonl`` and ``certificate.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import engine, metric_writers, models, train
from naisnet_jax.configs import schema
from naisnet_jax.projection import count_projected_blocks
from naisnet_jax.seeds import SweepSetup as SweepSetup
from naisnet_jax.seeds import check_seeds, default_seeds, prepare, seed_config, shard_seeds
from naisnet_jax.seeds import make_sweep_epoch as make_sweep_epoch  # the epoch program, for callers
from naisnet_jax.seeds import seed_mesh as seed_mesh
from naisnet_jax.seeds import step_keys as step_keys
from naisnet_jax.stability import max_radius_bound

SWEEP_CHECKPOINT_DIR = "sweep_checkpoints"
CERTIFICATE_FILE = "certificate.json"
# What a resumed sweep must share with the checkpoint it resumes: the declared resume fields and
# the seeds.
_RESUME_FIELDS = (*schema.RESUME_FIELDS, "seeds")


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class SeedResult:
    """One seed of a sweep after its last epoch (``certified`` etc. only once finished)."""

    seed: int
    epoch: int
    step: int
    train_loss: float | None
    train_accuracy: float | None
    test_loss: float
    test_accuracy: float
    generalisation_gap: float | None
    rho_max: float | None  # largest rho(I + hA) over NAIS blocks (None: no NAIS block)
    diverged_epoch: int | None  # first epoch whose result was not finite (None: never)
    checkpoint_dir: str | None = None  # the exported single-run checkpoint
    certified: bool | None = None
    certificate: Any = None  # the verifier's certificate of this seed
    per_step_loss: np.ndarray | None = None  # (K,) test cross-entropy of x(i), FC models
    per_step_train_loss: np.ndarray | None = None  # (K,) the same over the training set

    @property
    def diverged(self) -> bool:
        return self.diverged_epoch is not None


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """A sweep: the per-seed results, the epoch history and the stacked final state.

    ``state`` is the ``TrainState`` of every seed stacked on axis 0 (seed ``i`` is
    ``jax.tree.map(lambda x: x[i], state)``); ``mean``/``std`` normalise inputs, and
    ``train_data``/``test_data`` are the device-resident splits.
    """

    model: str
    dataset: str
    seeds: tuple[int, ...]
    epoch: int  # epochs done
    num_epochs: int
    runs: tuple[SeedResult, ...]
    history: tuple[dict, ...]  # metrics.jsonl records, one per epoch and seed
    seconds: float  # wall time of this call
    state: Any = None
    mean: Any = None
    std: Any = None
    train_data: Any = None
    test_data: Any = None

    @property
    def finished(self) -> bool:
        return self.epoch >= self.num_epochs

    @property
    def num_diverged(self) -> int:
        return sum(r.diverged for r in self.runs)

    @property
    def all_certified(self) -> bool | None:
        """Every seed certified (None before the audit has run)."""
        if any(r.certified is None for r in self.runs):
            return None
        return all(r.certified for r in self.runs)

    def stats(self, field: str) -> tuple[float, float, int]:
        """``(mean, std, n)`` of ``field`` over the seeds that did not diverge (population std;
        ``nan`` when none is left)."""
        values = [getattr(r, field) for r in self.runs if not r.diverged]
        values = np.asarray([v for v in values if v is not None], np.float64)
        if values.size == 0:
            return float("nan"), float("nan"), 0
        return float(values.mean()), float(values.std()), int(values.size)

    def seed_state(self, i: int):
        """Seed ``i``'s ``TrainState`` (index into ``seeds``)."""
        return jax.tree.map(lambda x: x[i], self.state)


# --------------------------------------------------------------------------- checkpoints


def _sweep_tree(state, diverged_epoch) -> dict:
    return dict(engine.checkpoint_tree(state), diverged_epoch=jnp.asarray(diverged_epoch, jnp.int32))


def _normalised(value):
    return json.loads(json.dumps(value))


def _resume_view(config, seeds) -> dict:
    view = {name: config[name] for name in schema.RESUME_FIELDS}
    return _normalised({**view, "model_kwargs": train.model_kwargs(config), "seeds": list(seeds)})


def _check_same_sweep(meta: dict, config, seeds, directory) -> None:
    """Resuming another sweep would mix runs or fail as a shape mismatch; say what differs."""
    ours = _resume_view(config, seeds)
    stored = (meta.get("extra") or {}).get("sweep", {})
    # a field an older version did not store held its declared default then
    theirs = {**_normalised(schema.complete(stored)), **stored} if stored else {}

    def same(k):  # speed options may differ: same parameters, same maths
        if k == "model_kwargs":
            return models.without_speed_options(theirs.get(k)) == models.without_speed_options(ours[k])
        return theirs.get(k) == ours[k]

    differ = [f"{k}: checkpoint {theirs.get(k)!r}, now {ours[k]!r}" for k in _RESUME_FIELDS if not same(k)]
    if differ:
        raise ValueError(
            f"{directory} holds a sweep that differs from this one ({'; '.join(differ)}): "
            f"use another workdir, or the checkpoint's settings, to resume."
        )


# --------------------------------------------------------------------------- the verifier


def audit_seed(checkpoint_dir: str, options=None):
    """The verifier's :class:`~naisnet_jax.verify.Certificate` of one exported seed (its
    checkpoint, as a user would audit it; the one place the sweep calls the verifier)."""
    from naisnet_jax.verify import AuditOptions, audit

    return audit(checkpoint_dir, options if options is not None else AuditOptions())


def certificate_certified(certificate) -> bool:
    return bool(certificate.certified)


# --------------------------------------------------------------------------- the sweep


def _has_step_logits(model, state, input_shape) -> bool:
    one = jax.tree.map(lambda x: x[0], train.state_variables(state))
    out = jax.eval_shape(
        lambda v: model.apply(v, jnp.zeros((1, *input_shape), jnp.float32), train=False, return_aux=True), one
    )
    return "step_logits" in out[1]


def _seed_records(history, seed):
    return [{k: v for k, v in r.items() if k != "seed"} for r in history if r["seed"] == seed]


def train_sweep(
    config,
    workdir: str,
    *,
    seeds: Sequence[int] | None = None,
    stop_after_epochs: int | None = None,
    audit_options: Any = None,
    audit: bool = True,
    audit_baselines: bool = True,
    per_step_loss: bool = True,
    verbose: bool = True,
) -> SweepResult:
    """Train ``config``'s model once per seed, side by side, in ``workdir``; resumes.

    ``seeds`` defaults to ``config.seed + range(config.num_seeds)``. ``stop_after_epochs`` ends
    this call early (as an interruption would). Once ``config.num_epochs`` epochs are done,
    every seed is exported as a single-run checkpoint under ``workdir/seed_<s>/checkpoints``,
    audited by the verifier (``audit=False`` skips it, ``audit_baselines=False`` skips it for
    models without a NAIS block; ``audit_options`` is passed on) and, for
    FC models, its per-layer loss on the test set and on the training set is measured
    (``per_step_loss=False`` skips it).
    Resuming a workdir that holds a sweep of another model, seeds or data raises ``ValueError``.
    """
    t_start = time.time()
    train.validate_config(config)
    seeds = check_seeds(default_seeds(config) if seeds is None else seeds)
    os.makedirs(workdir, exist_ok=True)
    with engine.workdir_lock(workdir):
        mngr = ckpt.manager(os.path.join(workdir, SWEEP_CHECKPOINT_DIR), max_to_keep=config.keep_checkpoints)
        metrics_path = os.path.join(workdir, train.METRICS_FILE)
        if mngr.latest_step() is not None:  # refuse before loading data or compiling
            _check_same_sweep(ckpt.read_metadata(mngr), config, seeds, mngr.directory)

        s = prepare(config, seeds)
        n_seeds = len(seeds)
        state, diverged_epoch = s.state, shard_seeds(jnp.zeros((n_seeds,), jnp.int32), s.mesh)
        metadata = ckpt.CheckpointMetadata.from_config(
            config, s.ds, s.mean, s.std, model_kwargs=train.model_kwargs(config)
        ).replace(extra={"sweep": _resume_view(config, seeds)})
        start_epoch = 1
        if mngr.latest_step() is not None:
            tree, epoch = engine.restore_latest(mngr, _sweep_tree(state, diverged_epoch))
            state = engine.restore_into(state, tree)
            state = state.replace(step=jnp.asarray(state.step, s.state.step.dtype))  # saved as int32
            state, diverged_epoch = shard_seeds((state, tree["diverged_epoch"]), s.mesh)
            start_epoch = epoch + 1
            metric_writers.write_jsonl(
                metrics_path, [r for r in engine.read_metrics(metrics_path) if r["epoch"] < start_epoch]
            )
            if verbose:
                print(f"Resuming the sweep in {mngr.directory} at epoch {start_epoch}.", flush=True)
        elif os.path.exists(metrics_path):
            os.remove(metrics_path)

        epoch_fn = s.programs.epoch
        schedule = train.learning_rate_schedule(config, s.steps_per_epoch)
        has_nais = count_projected_blocks(state.params) > 0  # found by name: the seed axis does not matter
        history = engine.read_metrics(metrics_path) if start_epoch > 1 else []
        end_epoch = (
            config.num_epochs
            if stop_after_epochs is None
            else min(config.num_epochs, start_epoch + stop_after_epochs - 1)
        )
        progress = engine.progress(end_epoch - start_epoch + 1, bool(config.progress) and verbose, unit="epoch")
        for epoch in range(start_epoch, end_epoch + 1):
            t0 = time.time()
            state, diverged_epoch, train_m, test_m = epoch_fn(
                state, diverged_epoch, s.base_keys, s.train_data, s.test_data, jnp.asarray(epoch, jnp.int32)
            )
            fetched = jax.device_get((train_m, test_m, diverged_epoch, state.step, state.params if has_nais else None))
            train_m, test_m, div, steps, host_params = fetched
            seconds = time.time() - t0
            records = []
            for i, seed in enumerate(seeds):
                rho = float("nan")
                if has_nais:
                    rho = max_radius_bound(jax.tree.map(lambda x: x[i], host_params), eps=config.eps, h=config.h)
                train_loss = float(train_m["loss"][i]) if int(div[i]) == 0 else None
                train_acc = float(train_m["accuracy"][i]) if int(div[i]) == 0 else None
                record = {
                    "epoch": epoch,
                    "seed": seed,
                    "step": int(steps[i]),
                    "learning_rate": float(schedule(max(int(steps[i]) - 1, 0))),
                    "train_loss": train_loss,
                    "train_accuracy": train_acc,
                    "test_loss": engine.finite_or_none(float(test_m["loss"][i])),
                    "test_accuracy": float(test_m["accuracy"][i]),
                    "rho_max": engine.finite_or_none(rho),
                    "epoch_seconds": seconds,
                    "diverged_epoch": int(div[i]) or None,
                }
                record["generalisation_gap"] = None if train_acc is None else train_acc - record["test_accuracy"]
                records.append(record)
            history = history + records
            metric_writers.write_jsonl(metrics_path, history)  # before the checkpoint, as train does
            if epoch % config.checkpoint_every_epochs == 0 or epoch == config.num_epochs:
                ckpt.save(mngr, epoch, _sweep_tree(state, diverged_epoch), metadata.replace(epoch=epoch))
            progress.update(1)
            if verbose:
                acc = np.asarray([r["test_accuracy"] for r in records])
                ok = np.asarray(div) == 0
                summary = f"test acc {acc[ok].mean():.4f} +- {acc[ok].std():.4f}" if ok.any() else "every seed diverged"
                progress.write(
                    f"[{config.model}] epoch {epoch}: {summary} over {int(ok.sum())}/{n_seeds} seeds | {seconds:.2f}s"
                )
        progress.close()

        done_epoch = max((r["epoch"] for r in history), default=0)
        last = {r["seed"]: r for r in history if r["epoch"] == done_epoch}
        runs = []
        finished = done_epoch >= config.num_epochs
        if finished:
            losses = train_losses = None
            if per_step_loss and _has_step_logits(s.model, state, s.ds.image_shape):
                losses = np.asarray(s.programs.per_step_loss(state, s.test_data))
                train_losses = np.asarray(s.programs.per_step_loss(state, s.train_data))
            host_tree = jax.device_get(engine.checkpoint_tree(state))
        for i, seed in enumerate(seeds):
            r = last.get(seed)
            if r is None:  # nothing trained yet
                runs.append(SeedResult(seed, 0, 0, None, None, float("nan"), float("nan"), None, None, None))
                continue
            run = SeedResult(
                seed=seed,
                epoch=r["epoch"],
                step=r["step"],
                train_loss=r["train_loss"],
                train_accuracy=r["train_accuracy"],
                test_loss=r["test_loss"] if r["test_loss"] is not None else float("nan"),
                test_accuracy=r["test_accuracy"],
                generalisation_gap=r["generalisation_gap"],
                rho_max=r["rho_max"],
                diverged_epoch=r["diverged_epoch"],
            )
            if finished:
                directory = _export_seed(
                    config, workdir, seed, jax.tree.map(lambda x: x[i], host_tree), metadata, r, history
                )
                cert = certified = None
                if audit and (has_nais or audit_baselines):
                    cert = audit_seed(directory, audit_options)
                    certified = certificate_certified(cert)
                    from naisnet_jax.verify.report import write_json  # the verifier is imported on use

                    write_json(cert, os.path.join(workdir, f"seed_{seed}", CERTIFICATE_FILE))
                run = dataclasses.replace(
                    run,
                    checkpoint_dir=directory,
                    certified=certified,
                    certificate=cert,
                    per_step_loss=None if losses is None else losses[i],
                    per_step_train_loss=None if train_losses is None else train_losses[i],
                )
            runs.append(run)
        mngr.close()
        return SweepResult(
            model=config.model,
            dataset=config.dataset,
            seeds=seeds,
            epoch=done_epoch,
            num_epochs=config.num_epochs,
            runs=tuple(runs),
            history=tuple(history),
            seconds=time.time() - t_start,
            state=state,
            mean=s.mean,
            std=s.std,
            train_data=s.train_data,
            test_data=s.test_data,
        )


def _export_seed(config, workdir, seed, tree, metadata, record, history) -> str:
    """Seed ``seed`` as an ordinary single-run directory: checkpoint and metrics."""
    run_dir = os.path.join(workdir, f"seed_{seed}")
    directory = os.path.join(run_dir, train.CHECKPOINT_DIR)
    mngr = ckpt.manager(directory, max_to_keep=1)
    try:
        step = int(tree["step"])
        if mngr.latest_step() != step:
            one = seed_config(config, seed)
            meta = metadata.replace(
                config=one.to_dict(), epoch=record["epoch"], extra={"diverged_epoch": record["diverged_epoch"]}
            )
            ckpt.save(mngr, step, tree, meta)
    finally:
        mngr.close()
    metric_writers.write_jsonl(os.path.join(run_dir, train.METRICS_FILE), _seed_records(history, seed))
    return directory


def device_description() -> str:
    """``"<platform>: <device kind>"`` of the first device, e.g. ``gpu: NVIDIA H200``."""
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', str(d))}"


def mean_std(values) -> tuple[float, float]:
    values = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    return (float(values.mean()), float(values.std())) if values.size else (float("nan"), float("nan"))
