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
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from naisnet_jax import checkpoint as ckpt
from naisnet_jax import data as data_lib
from naisnet_jax import metric_writers, models, train
from naisnet_jax.checks import check_int
from naisnet_jax.projection import count_projected_blocks
from naisnet_jax.stability import max_radius_bound

SWEEP_CHECKPOINT_DIR = "sweep_checkpoints"
CERTIFICATE_FILE = "certificate.json"
# What a resumed sweep must share with the checkpoint it resumes.
_RESUME_FIELDS = ("model", "model_kwargs", "seeds", "dataset", "limit_train", "limit_test", "batch_size", "standardize")


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


# --------------------------------------------------------------------------- keys and seeds


def default_seeds(config) -> tuple[int, ...]:
    """``config.seed + range(config.num_seeds)``."""
    num = check_int("config.num_seeds", config.get("num_seeds", 1))
    return tuple(int(config.seed) + i for i in range(num))


def check_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    """Seeds of a sweep: a non-empty sequence of distinct integers in [0, 2**32 - 2] (the data
    stream of seed ``s`` uses ``s + 1``)."""
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds=() must be a non-empty sequence of integers.")
    for i, s in enumerate(seeds):
        check_int(f"seeds[{i}]", s, 0, 2**32 - 2)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds={seeds!r} repeats a seed; every seed of a sweep must differ.")
    return tuple(int(s) for s in seeds)


def step_keys(aug_key: jax.Array, num_steps: int, steps_per_chunk: int) -> jax.Array:
    """The per-step augmentation keys of ``train.train_and_evaluate``, ``(num_steps, 2)``.

    That loop runs an epoch in chunks of ``steps_per_chunk`` steps and gives chunk ``c`` the
    keys ``split(fold_in(aug_key, c), chunk_length)``; in plain Python::

        [k for c, start in enumerate(range(0, num_steps, steps_per_chunk))
           for k in split(fold_in(aug_key, c), min(steps_per_chunk, num_steps - start))]
    """
    parts = [
        jax.random.split(jax.random.fold_in(aug_key, c), min(steps_per_chunk, num_steps - start))
        for c, start in enumerate(range(0, num_steps, steps_per_chunk))
    ]
    return jnp.concatenate(parts, axis=0)


# --------------------------------------------------------------------------- the epoch program


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_sweep_epoch(
    mean,
    std,
    *,
    augment: bool | str,
    batch_size: int,
    steps_per_chunk: int,
    eval_batch_size: int,
    num_steps: int | None = None,
    evaluate: bool = True,
    mesh: Mesh | None = None,
) -> Callable:
    """The jitted epoch of every seed:
    ``(state, diverged_epoch, base_keys, train_data, test_data, epoch) ->
    (state, diverged_epoch, train_metrics, test_metrics)``, state donated.

    ``state`` and ``diverged_epoch`` (int32, 0 = finite so far) have a leading seed axis,
    ``base_keys`` is ``(S, 2)``: ``PRNGKey(seed + 1)`` per seed. ``num_steps`` cuts the epoch
    short (timing); ``evaluate=False`` leaves out the test pass (``test_metrics`` is ``{}``).
    With a ``mesh`` of several devices each device runs the seeds of its share of the seed
    axis (:func:`per_device_seeds`): no communication.
    """
    eval_fn = train.make_evaluate(mean, std, eval_batch_size) if evaluate else None

    def one_seed(state, diverged_epoch, base_key, train_data, test_data, epoch):
        n = train_data.images.shape[0]
        perm_key, aug_key = jax.random.split(jax.random.fold_in(base_key, epoch))
        idx = data_lib.epoch_batches(perm_key, n, batch_size)
        if num_steps is not None:
            idx = idx[:num_steps]
        keys = step_keys(aug_key, idx.shape[0], steps_per_chunk) if augment else None

        def body(state, inputs):
            i, k = inputs
            batch = data_lib.get_batch(train_data, i, mean=mean, std=std, key=k, augment=augment)
            return train.train_step(state, batch)

        new, metrics = jax.lax.scan(body, state, (idx, keys))
        train_metrics = jax.tree.map(jnp.mean, metrics)
        finite = jnp.isfinite(train_metrics["loss"]) & _all_finite((new.params, new.batch_stats))
        keep = finite & (diverged_epoch == 0)
        state = jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, state)
        diverged_epoch = jnp.where((diverged_epoch == 0) & ~finite, epoch, diverged_epoch)
        test_metrics = eval_fn(state, test_data) if evaluate else {}
        return state, diverged_epoch, train_metrics, test_metrics

    sweep_epoch = per_device_seeds(jax.vmap(one_seed, in_axes=(0, 0, 0, None, None, None)), mesh, 3, 3)
    return jax.jit(sweep_epoch, donate_argnums=(0, 1))


def per_device_seeds(fn: Callable, mesh: Mesh | None, seeded: int, shared: int) -> Callable:
    """``fn`` (vmapped over seeds: ``seeded`` arguments with a seed axis, then ``shared``
    ones without) run by every device of ``mesh`` on its own seeds (``jax.shard_map``).

    Left to the SPMD partitioner, the evaluation (a convolution of the shared test images
    with every seed's kernels) gathered every seed's kernels on every device."""
    if mesh is None or mesh.devices.size == 1:
        return fn
    axis = PartitionSpec(train.DATA_AXIS)
    in_specs = (axis,) * seeded + (PartitionSpec(),) * shared
    return train._shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=axis)


def stack_states(states: Sequence[train.TrainState]) -> train.TrainState:
    """Single-run states -> one state with a leading seed axis (the first state's
    ``apply_fn`` and ``tx``: each single run builds equal but distinct ones)."""
    leaves = [jax.tree.leaves(st) for st in states]
    treedef = jax.tree.structure(states[0])

    def stack(xs):  # strongly typed (a Python 0 step is weakly typed): a restored state then matches
        return jnp.stack([jnp.asarray(x, dtype=jnp.asarray(x).dtype) for x in xs])

    return jax.tree.unflatten(treedef, [stack(xs) for xs in zip(*leaves)])


def seed_mesh(config, num_seeds: int) -> Mesh:
    """A 1-D mesh for the seed axis: the most of this host's devices (at most
    ``config.num_devices``, default all) that divide ``num_seeds`` evenly."""
    devices = jax.local_devices()
    limit = config.get("num_devices")
    if limit is not None:
        check_int("config.num_devices", limit, 1, len(devices))
        devices = devices[:limit]
    count = max(k for k in range(1, len(devices) + 1) if num_seeds % k == 0)
    return Mesh(np.asarray(devices[:count]), (train.DATA_AXIS,))


def shard_seeds(tree, mesh: Mesh):
    """Every array of ``tree`` split along its leading (seed) axis over ``mesh``."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(train.DATA_AXIS)))


def _seed_config(config, seed: int):
    c = config.copy_and_resolve_references()
    c.seed = int(seed)
    c.num_seeds = 1
    return c


@dataclasses.dataclass(frozen=True)
class _Programs:
    """The model, optimiser and jitted programs of one configuration (shared by sweeps of it)."""

    model: Any
    tx: Any
    epoch: Callable
    per_step_loss: Callable


_PROGRAMS: dict[str, _Programs] = {}
_PROGRAMS_KEPT = 2


def _programs(config, ds, steps_per_epoch: int, mean, std, mesh: Mesh | None = None) -> _Programs:
    """One set of programs per configuration and process, so that a resumed or repeated sweep
    of the same configuration reuses the compiled epoch (jit caches on the function object and
    on the state's static fields, ``apply_fn`` and ``tx``). The key is the whole config but the
    seeds and the bookkeeping, plus the data's shape and statistics."""
    d = config.to_dict()
    for k in ("seed", "num_seeds", "num_epochs", "progress", "checkpoint_every_epochs", "keep_checkpoints"):
        d.pop(k, None)
    key = json.dumps(
        [
            d,
            ds.num_classes,
            list(ds.train_images.shape),
            list(ds.test_images.shape),
            steps_per_epoch,
            np.asarray(mean).tolist(),
            np.asarray(std).tolist(),
            None if mesh is None else [str(d) for d in mesh.devices.flat],
        ],
        sort_keys=True,
        default=str,
    )
    if key not in _PROGRAMS:
        while len(_PROGRAMS) >= _PROGRAMS_KEPT:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[key] = _Programs(
            model=train.build_model(config, ds.num_classes),
            tx=train.make_optimizer(config, steps_per_epoch),
            epoch=make_sweep_epoch(
                mean,
                std,
                augment=train.augmentation(config),
                batch_size=config.batch_size,
                steps_per_chunk=config.steps_per_chunk,
                eval_batch_size=config.eval_batch_size,
                mesh=mesh,
            ),
            per_step_loss=jax.jit(
                per_device_seeds(
                    jax.vmap(train.make_per_step_loss(mean, std, config.eval_batch_size), in_axes=(0, None)),
                    mesh,
                    1,
                    1,
                )
            ),
        )
    return _PROGRAMS[key]


@dataclasses.dataclass
class _Setup:
    ds: data_lib.Dataset
    model: Any
    steps_per_epoch: int
    state: train.TrainState  # stacked
    programs: _Programs
    mean: np.ndarray
    std: np.ndarray
    train_data: data_lib.DeviceData
    test_data: data_lib.DeviceData
    base_keys: jax.Array
    mesh: Mesh  # the seed axis's devices


def _setup(config, seeds: tuple[int, ...]) -> _Setup:
    train.validate_config(config)
    ds = data_lib.load_dataset(
        config.dataset,
        data_dir=config.get("data_dir"),
        limit_train=config.get("limit_train"),
        limit_test=config.get("limit_test"),
    )
    n_train = ds.train_images.shape[0]
    if config.batch_size > n_train:
        raise ValueError(f"config.batch_size={config.batch_size} exceeds the {n_train} training examples.")
    steps_per_epoch = n_train // config.batch_size
    mean, std = train.input_stats(config, ds.train_images)
    mesh = seed_mesh(config, len(seeds))
    programs = _programs(config, ds, steps_per_epoch, mean, std, mesh)
    model = programs.model
    # Each seed initialised exactly as its single run (same eager ops), then stacked.
    states = [
        train.create_train_state(_seed_config(config, s), model, ds.train_images.shape[1:], steps_per_epoch)
        for s in seeds
    ]
    if count_projected_blocks(states[0].params) == 0 and config.model.startswith("naisnet"):
        raise ValueError(f"{config.model} has no NAIS block parameters to project; check naisnet_jax.models.")
    state = stack_states(states).replace(tx=programs.tx)  # the cached programs' static fields
    return _Setup(
        ds=ds,
        model=model,
        steps_per_epoch=steps_per_epoch,
        state=shard_seeds(state, mesh),
        programs=programs,
        mean=mean,
        std=std,
        train_data=train.replicate(data_lib.put_on_device(ds.train_images, ds.train_labels), mesh),
        test_data=train.replicate(data_lib.put_on_device(ds.test_images, ds.test_labels), mesh),
        base_keys=shard_seeds(jnp.stack([jax.random.PRNGKey(s + 1) for s in seeds]), mesh),
        mesh=mesh,
    )


# --------------------------------------------------------------------------- checkpoints


def _sweep_tree(state, diverged_epoch) -> dict:
    return dict(train._checkpoint_tree(state), diverged_epoch=jnp.asarray(diverged_epoch, jnp.int32))


def _normalised(value):
    return json.loads(json.dumps(value))


def _resume_view(config, seeds) -> dict:
    return _normalised(
        {
            "model": config.model,
            "model_kwargs": train.model_kwargs(config),
            "seeds": list(seeds),
            "dataset": config.dataset,
            "limit_train": config.get("limit_train"),
            "limit_test": config.get("limit_test"),
            "batch_size": config.batch_size,
            "standardize": config.get("standardize", True),
        }
    )


def _check_same_sweep(meta: dict, config, seeds, directory) -> None:
    """Resuming another sweep would mix runs or fail as a shape mismatch; say what differs."""
    ours = _resume_view(config, seeds)
    theirs = (meta.get("extra") or {}).get("sweep", {})

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


def _progress(total: int, enabled: bool):
    if not (enabled and sys.stderr.isatty()):
        return train._NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="epoch", dynamic_ncols=True, leave=False)


def _has_step_logits(model, state, input_shape) -> bool:
    one = jax.tree.map(lambda x: x[0], train._variables(state))
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
    seeds = check_seeds(default_seeds(config) if seeds is None else seeds)
    train.validate_config(config)
    os.makedirs(workdir, exist_ok=True)
    mngr = ckpt.manager(os.path.join(workdir, SWEEP_CHECKPOINT_DIR), max_to_keep=config.keep_checkpoints)
    metrics_path = os.path.join(workdir, train.METRICS_FILE)
    if mngr.latest_step() is not None:  # refuse before loading data or compiling
        _check_same_sweep(ckpt.read_metadata(mngr), config, seeds, mngr.directory)

    s = _setup(config, seeds)
    n_seeds = len(seeds)
    state, diverged_epoch = s.state, shard_seeds(jnp.zeros((n_seeds,), jnp.int32), s.mesh)
    metadata = ckpt.CheckpointMetadata.from_config(config, s.ds, s.mean, s.std).replace(
        extra={"sweep": _resume_view(config, seeds)}
    )
    start_epoch = 1
    if mngr.latest_step() is not None:
        target = _sweep_tree(state, diverged_epoch)
        tree, meta = ckpt.restore(mngr, target=target)
        # as fresh arrays of the fresh state's dtypes (the step counter is int64 with x64), so the
        # compiled epoch is reused
        tree = jax.tree.map(lambda x, like: jnp.asarray(np.asarray(x), like.dtype), tree, target)
        state = train._restore_into(state, tree)
        state = state.replace(step=jnp.asarray(state.step, s.state.step.dtype))  # saved as int32
        state, diverged_epoch = shard_seeds((state, tree["diverged_epoch"]), s.mesh)
        start_epoch = int(meta["epoch"]) + 1
        metric_writers.write_jsonl(
            metrics_path, [r for r in train._read_metrics(metrics_path) if r["epoch"] < start_epoch]
        )
        if verbose:
            print(f"Resuming the sweep in {mngr.directory} at epoch {start_epoch}.", flush=True)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)

    epoch_fn = s.programs.epoch
    schedule = train.learning_rate_schedule(config, s.steps_per_epoch)
    has_nais = count_projected_blocks(state.params) > 0  # found by name: the seed axis does not matter
    history = train._read_metrics(metrics_path) if start_epoch > 1 else []
    end_epoch = (
        config.num_epochs if stop_after_epochs is None else min(config.num_epochs, start_epoch + stop_after_epochs - 1)
    )
    progress = _progress(end_epoch - start_epoch + 1, bool(config.progress) and verbose)
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
                "test_loss": train._finite_or_none(float(test_m["loss"][i])),
                "test_accuracy": float(test_m["accuracy"][i]),
                "rho_max": train._finite_or_none(rho),
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
        host_tree = jax.device_get(train._checkpoint_tree(state))
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
            seed_config = _seed_config(config, seed)
            meta = metadata.replace(
                config=seed_config.to_dict(), epoch=record["epoch"], extra={"diverged_epoch": record["diverged_epoch"]}
            )
            ckpt.save(mngr, step, tree, meta)
    finally:
        mngr.close()
    metric_writers.write_jsonl(os.path.join(run_dir, train.METRICS_FILE), _seed_records(history, seed))
    return directory


# --------------------------------------------------------------------------- timing


_KERNEL_OPS = re.compile(r"=\s*\S+\s+(fusion|custom-call|dot|convolution|sort|scatter|gather|copy|while)\(")


def count_kernels(hlo_text: str) -> dict[str, int]:
    """Launch-level instructions of an optimised HLO module, by opcode, outside fused
    computations (on a GPU each fusion or custom call is roughly one kernel)."""
    counts: dict[str, int] = {}
    fused = False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            fused = "fused" in line.split("(")[0] or line.startswith("%fused")
            continue
        m = _KERNEL_OPS.search(line)
        if m and not fused:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def time_steps(config, *, seeds: Sequence[int] | None = None, steps: int = 100, repeats: int = 3) -> dict:
    """Measure the sweep's training steps per second on this device.

    Compiles the epoch program cut to ``steps`` steps (no evaluation), runs it once to warm
    up, then times ``repeats`` calls; also times one test evaluation. ``projected_seconds`` is
    the training of ``config.num_epochs`` epochs at that rate plus one evaluation per epoch.
    """
    seeds = check_seeds(default_seeds(config) if seeds is None else seeds)
    s = _setup(config, seeds)
    steps = min(steps, s.steps_per_epoch)
    common = dict(
        augment=train.augmentation(config),
        batch_size=config.batch_size,
        steps_per_chunk=config.steps_per_chunk,
        eval_batch_size=config.eval_batch_size,
    )
    fn = make_sweep_epoch(s.mean, s.std, num_steps=steps, evaluate=False, mesh=s.mesh, **common)
    state, div = s.state, shard_seeds(jnp.zeros((len(seeds),), jnp.int32), s.mesh)
    args = (s.base_keys, s.train_data, s.test_data)
    t0 = time.time()
    compiled = fn.lower(state, div, *args, jnp.asarray(1, jnp.int32)).compile()
    compile_seconds = time.time() - t0
    kernels = count_kernels(compiled.as_text())
    state, div, m, _ = compiled(state, div, *args, jnp.asarray(1, jnp.int32))
    jax.block_until_ready(m)
    times = []
    for r in range(repeats):
        t0 = time.time()
        state, div, m, _ = compiled(state, div, *args, jnp.asarray(2 + r, jnp.int32))
        jax.block_until_ready(m)
        times.append(time.time() - t0)
    evaluate = jax.jit(jax.vmap(train.make_evaluate(s.mean, s.std, config.eval_batch_size), in_axes=(0, None)))
    jax.block_until_ready(evaluate(state, s.test_data))
    t0 = time.time()
    jax.block_until_ready(evaluate(state, s.test_data))
    eval_seconds = time.time() - t0
    best = min(times)
    sps = steps / best
    return {
        "model": config.model,
        "seeds": len(seeds),
        "batch_size": config.batch_size,
        "steps_timed": steps,
        "repeats": repeats,
        "steps_per_second": sps,
        "step_ms": 1e3 * best / steps,
        "seed_steps_per_second": sps * len(seeds),
        "images_per_second": sps * len(seeds) * config.batch_size,
        "eval_seconds": eval_seconds,
        "compile_seconds": compile_seconds,
        "steps_per_epoch": s.steps_per_epoch,
        "epochs": config.num_epochs,
        "projected_seconds": config.num_epochs * (s.steps_per_epoch / sps + eval_seconds),
        "kernels": kernels,
        "device": str(jax.devices()[0]),
    }


def device_description() -> str:
    """``"<platform>: <device kind>"`` of the first device, e.g. ``gpu: NVIDIA H200``."""
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', str(d))}"


def mean_std(values) -> tuple[float, float]:
    values = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    return (float(values.mean()), float(values.std())) if values.size else (float("nan"), float("nan"))
