"""Seeds side by side: ``S`` independent runs of one model as one jitted program.

Every multi-run experiment trains through :func:`train_sweep`. The training state of the ``S``
seeds is stacked on a leading axis and every epoch is one jitted call,
``jax.vmap`` over seeds of ``lax.scan`` over the epoch's batches, followed by the evaluation on
the test split; the datasets live on the device once and are shared by every seed. In plain
Python, one epoch is::

    for i, seed in enumerate(seeds):                       # vmap
        perm_key, aug_key = split(fold_in(PRNGKey(seed + 1), epoch))
        for step, idx in enumerate(epoch_batches(perm_key, ...)):  # scan
            key = fold_in(aug_key, step)                     # train.step_keys
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
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import distributed, engine, metric_writers, train
from naisnet_jax.projection import count_projected_blocks
from naisnet_jax.seeds import ProgramCache, check_seeds, default_seeds, prepare, seed_config, shard_seeds
from naisnet_jax.seeds import SweepSetup as SweepSetup
from naisnet_jax.seeds import make_sweep_epoch as make_sweep_epoch  # the epoch program, for callers
from naisnet_jax.seeds import seed_mesh as seed_mesh
from naisnet_jax.stability import max_radius_bound

SWEEP_CHECKPOINT_DIR = ckpt.SWEEP_CHECKPOINT_DIR
CERTIFICATE_FILE = "certificate.json"


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


# --------------------------------------------------------------------------- the verifier


def audit_seed(checkpoint_dir: str, options=None):
    """The verifier's :class:`~naisnet_jax.verify.Certificate` of one exported seed (its
    checkpoint, as a user would audit it; the one place the sweep calls the verifier)."""
    from naisnet_jax.verify import AuditOptions, audit

    return audit(checkpoint_dir, options if options is not None else AuditOptions())


def certificate_certified(certificate) -> bool:
    return bool(certificate.certified)


# --------------------------------------------------------------------------- the sweep


@dataclasses.dataclass
class SeedEpochs:
    """The epoch of every seed as one jitted call (:func:`naisnet_jax.seeds.make_sweep_epoch`),
    on the state ``(stacked train state, diverged_epoch)``; a seed that diverges is frozen, the
    others go on. An :class:`naisnet_jax.engine.EpochProgram`."""

    config: Any
    setup: SweepSetup
    seeds: tuple[int, ...]
    has_nais: bool  # found by name: the seed axis does not matter
    unit: str = "epoch"

    @property
    def steps_per_epoch(self) -> int:
        return self.setup.steps_per_epoch

    def progress_units(self, epochs: int) -> int:
        return epochs

    def saved_tree(self, state) -> dict:
        return _sweep_tree(*state)

    def summary(self, epoch: int, records: list[dict]) -> str:
        ok = [r for r in records if r["diverged_epoch"] is None]
        acc = np.asarray([r["test_accuracy"] for r in ok])
        summary = f"test acc {acc.mean():.4f} +- {acc.std():.4f}" if ok else "every seed diverged"
        seconds = records[0]["epoch_seconds"]
        return f"[{self.config.model}] epoch {epoch}: {summary} over {len(ok)}/{len(records)} seeds | {seconds:.2f}s"

    def train_epoch(self, state, epoch: int, progress) -> tuple[tuple, list[dict]]:
        config, s = self.config, self.setup
        schedule = train.learning_rate_schedule(config, s.steps_per_epoch)
        t0 = time.time()
        state, diverged_epoch, train_m, test_m = s.programs.epoch(
            *state, s.base_keys, s.train_data, s.test_data, jnp.asarray(epoch, jnp.int32)
        )
        params = state.params if self.has_nais else None
        train_m, test_m, div, steps, host_params = distributed.gather(
            (train_m, test_m, diverged_epoch, state.step, params)
        )
        seconds = time.time() - t0
        records = []
        for i, seed in enumerate(self.seeds):
            rho = float("nan")
            if self.has_nais:
                rho = max_radius_bound(jax.tree.map(lambda x: x[i], host_params), eps=config.eps, h=config.h)
            record = engine.epoch_record(
                epoch=epoch,
                step=int(steps[i]),
                learning_rate=float(schedule(max(int(steps[i]) - 1, 0))),
                train=jax.tree.map(lambda x: x[i], train_m) if int(div[i]) == 0 else None,
                test=jax.tree.map(lambda x: x[i], test_m),
                rho_max=rho,
                seconds=seconds,
            )
            records.append({"epoch": epoch, "seed": seed, **record, "diverged_epoch": int(div[i]) or None})
        progress.update(1)
        return (state, diverged_epoch), records


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
    programs: ProgramCache | None = None,
    labels: Mapping[str, str] | None = None,
) -> SweepResult:
    """Train ``config``'s model once per seed, side by side, in ``workdir``; resumes.

    ``seeds`` defaults to ``config.seed + range(config.num_seeds)``. ``stop_after_epochs`` ends
    this call early (as an interruption would). Once ``config.num_epochs`` epochs are done,
    every seed is exported as a single-run checkpoint under ``workdir/seed_<s>/checkpoints``,
    audited by the verifier (``audit=False`` skips it, ``audit_baselines=False`` skips it for
    models without a NAIS block; ``audit_options`` is passed on) and, for FC models, its per-layer
    loss on the test and training sets is measured (``per_step_loss=False`` skips it).
    ``programs``: the compiled programs to take from and keep in (the same
    :class:`naisnet_jax.seeds.ProgramCache` for sweeps of one configuration, one after another;
    by default this call's own). ``labels``: the flags that set config fields, for what it says
    (``{"num_epochs": "--epochs"}``). Resuming another sweep's workdir raises ``ValueError``.
    """
    t_start = time.time()
    train.validate_config(config, labels)
    seeds = check_seeds(default_seeds(config) if seeds is None else seeds)
    os.makedirs(workdir, exist_ok=True)
    view = engine.resume_view(config, train.model_kwargs(config), seeds)
    with engine.RunDirectory(
        workdir, view, checkpoints=SWEEP_CHECKPOINT_DIR, keep=config.keep_checkpoints, config=config, labels=labels
    ) as run:
        run.refuse_another_run()  # refuse another sweep's checkpoints before loading data or compiling
        s = prepare(config, seeds, programs=programs)
        metadata = ckpt.CheckpointMetadata.from_config(
            config, s.ds, s.mean, s.std, model_kwargs=train.model_kwargs(config)
        )
        state, diverged_epoch, start_epoch = _start(run, s, config, verbose)

        end_epoch = engine.last_epoch(config, start_epoch, stop_after_epochs)
        program = SeedEpochs(config=config, setup=s, seeds=seeds, has_nais=count_projected_blocks(state.params) > 0)
        progress = engine.progress(
            end_epoch - start_epoch + 1, bool(config.progress), unit="epoch", quiet=not (verbose and run.primary)
        )
        state, diverged_epoch = engine.run_epochs(
            run,
            program,
            (state, diverged_epoch),
            start_epoch=start_epoch,
            end_epoch=end_epoch,
            config=config,
            metadata=metadata,
            progress=progress,
        )
        history = list(run.records)

        done_epoch = max((r["epoch"] for r in history), default=0)
        audit = audit and (program.has_nais or audit_baselines)
        say = run.say if verbose else None
        runs = _seed_results(
            config, workdir, seeds, s, state, history, metadata, audit, audit_options, per_step_loss, say
        )
        return SweepResult(
            model=config.model,
            dataset=config.dataset,
            seeds=seeds,
            epoch=done_epoch,
            num_epochs=config.num_epochs,
            runs=runs,
            history=tuple(history),
            seconds=time.time() - t_start,
            state=state,
            mean=s.mean,
            std=s.std,
            train_data=s.train_data,
            test_data=s.test_data,
        )


def _start(run: engine.RunDirectory, s: SweepSetup, config, verbose: bool):
    """``(state, diverged_epoch, start_epoch)``: the setup's fresh state, or the run's newest
    checkpoint restored into it and split over the seed mesh."""
    state, diverged_epoch = s.state, shard_seeds(jnp.zeros((len(s.base_keys),), jnp.int32), s.mesh)
    resumed = run.resume(_sweep_tree(state, diverged_epoch))
    if resumed is None:
        return state, diverged_epoch, 1
    tree, epoch = resumed
    state = engine.restore_into(state, tree)
    state = state.replace(step=jnp.asarray(state.step, s.state.step.dtype))  # saved as int32
    state, diverged_epoch = shard_seeds((state, tree["diverged_epoch"]), s.mesh)
    if verbose and not run.complete(epoch + 1, config.num_epochs):
        run.say(f"Resuming the sweep in {run.checkpoint_dir} at epoch {epoch + 1}.")
    return state, diverged_epoch, epoch + 1


def _seed_results(
    config,
    workdir,
    seeds,
    s: SweepSetup,
    state,
    history,
    metadata,
    audit: bool,
    audit_options,
    per_step_loss: bool,
    say: Callable[[str], None] | None = None,
) -> tuple[SeedResult, ...]:
    """Each seed's :class:`SeedResult` from its last record; once the sweep has finished, each
    seed is also exported as a single-run directory, audited (``audit``) and, for a model with
    per-step logits, measured layer by layer (``per_step_loss``); ``say`` gets a line per seed."""
    done_epoch = max((r["epoch"] for r in history), default=0)
    last = {r["seed"]: r for r in history if r["epoch"] == done_epoch}
    runs = []
    finished = done_epoch >= config.num_epochs
    if finished:
        losses = train_losses = None
        if per_step_loss and _has_step_logits(s.model, state, s.ds.image_shape):
            losses = distributed.gather(s.programs.per_step_loss(state, s.test_data))
            train_losses = distributed.gather(s.programs.per_step_loss(state, s.train_data))
        host_tree = distributed.gather(engine.checkpoint_tree(state))
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
            t0 = time.time()
            directory = _export_seed(
                config, workdir, seed, jax.tree.map(lambda x: x[i], host_tree), metadata, r, history
            )
            cert = certified = None
            if audit:
                cert = audit_seed(directory, audit_options)
                certified = certificate_certified(cert)
                from naisnet_jax.verify.report import write_json  # the verifier is imported on use

                if distributed.is_primary():
                    write_json(cert, os.path.join(workdir, f"seed_{seed}", CERTIFICATE_FILE))
            if say is not None:
                verdict = "" if cert is None else (": certified" if certified else ": not certified")
                done = "exported and audited" if cert is not None else "exported"
                say(f"[{config.model}] seed {seed} {done} in {time.time() - t0:.1f}s{verdict} ({directory})")
            run = dataclasses.replace(
                run,
                checkpoint_dir=directory,
                certified=certified,
                certificate=cert,
                per_step_loss=None if losses is None else losses[i],
                per_step_train_loss=None if train_losses is None else train_losses[i],
            )
        runs.append(run)
    return tuple(runs)


def _export_seed(config, workdir, seed, tree, metadata, record, history) -> str:
    """Seed ``seed`` as an ordinary single-run directory: checkpoint and metrics."""
    run_dir = os.path.join(workdir, f"seed_{seed}")
    directory = os.path.join(run_dir, train.CHECKPOINT_DIR)
    mngr = ckpt.manager(directory, max_to_keep=1)
    try:
        step = int(tree["step"])
        if mngr.latest_step() != step:
            one = seed_config(config, seed)
            extra = {"diverged_epoch": record["diverged_epoch"], "seeds": [seed]}  # resumable as a single run
            meta = metadata.replace(config=one.to_dict(), epoch=record["epoch"], extra=extra)
            ckpt.save(mngr, step, tree, meta)
    finally:
        mngr.close()
    if distributed.is_primary():  # every process saved the checkpoint (Orbax's protocol); one writes the log
        metric_writers.write_jsonl(os.path.join(run_dir, train.METRICS_FILE), _seed_records(history, seed))
    return directory


def device_description() -> str:
    """``"<platform>: <device kind>"`` of the first device, e.g. ``gpu: NVIDIA H200``."""
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', str(d))}"


def mean_std(values) -> tuple[float, float]:
    values = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    return (float(values.mean()), float(values.std())) if values.size else (float("nan"), float("nan"))
