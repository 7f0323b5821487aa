"""The programs of a sweep (:mod:`naisnet_jax.sweep`): the seeds and their data keys, the epoch
of every seed as one jitted program (``jax.vmap`` over seeds of ``lax.scan`` over batches, split
over the host's devices by seed; ``config.seeds_at_once`` runs a device's seeds a few at a time),
the cache of compiled programs, and the stacked initial state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from naisnet_jax import data as data_lib
from naisnet_jax import engine, parallel, train
from naisnet_jax.checks import check_int
from naisnet_jax.projection import count_projected_blocks

# --------------------------------------------------------------------------- keys and seeds


def default_seeds(config) -> tuple[int, ...]:
    """``config.seed + range(config.num_seeds)`` (``config`` validated first)."""
    config = train.validate_config(config)
    return tuple(int(config.seed) + i for i in range(config.num_seeds))


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
    eval_batch_size: int,
    num_steps: int | None = None,
    evaluate: bool = True,
    mesh: Mesh | None = None,
    seeds_at_once: int | None = None,
) -> Callable:
    """The jitted epoch of every seed:
    ``(state, diverged_epoch, base_keys, train_data, test_data, epoch) ->
    (state, diverged_epoch, train_metrics, test_metrics)``, state donated.

    ``state`` and ``diverged_epoch`` (int32, 0 = finite so far) have a leading seed axis,
    ``base_keys`` is ``(S, 2)``: ``PRNGKey(seed + 1)`` per seed. ``num_steps`` cuts the epoch
    short (timing); ``evaluate=False`` leaves out the test pass (``test_metrics`` is ``{}``).
    With a ``mesh`` of several devices each device runs the seeds of its share of the seed
    axis (:func:`per_device_seeds`): no communication. ``seeds_at_once`` (``config.seeds_at_once``)
    runs a device's seeds that many side by side at a time (:func:`map_seeds`).
    """
    eval_fn = train.make_evaluate(mean, std, eval_batch_size) if evaluate else None

    def one_seed(state, diverged_epoch, base_key, train_data, test_data, epoch):
        n = train_data.images.shape[0]
        perm_key, aug_key = jax.random.split(jax.random.fold_in(base_key, epoch))
        idx = data_lib.epoch_batches(perm_key, n, batch_size)
        if num_steps is not None:
            idx = idx[:num_steps]
        keys = train.step_keys(aug_key, 0, idx.shape[0]) if augment else None

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

    sweep_epoch = per_device_seeds(map_seeds(one_seed, 3, seeds_at_once), mesh, 3, 3)
    return jax.jit(sweep_epoch, donate_argnums=(0, 1))


def map_seeds(fn: Callable, seeded: int, seeds_at_once: int | None = None) -> Callable:
    """``fn`` over a seed axis: its first ``seeded`` arguments carry the axis, the others are
    shared. ``seeds_at_once=None`` runs every seed side by side (``jax.vmap``); ``k`` runs them
    in groups of ``k`` side by side, the groups one after another in a ``lax.scan``, and the
    seeds left over as one more group (a single seed without ``vmap``, as ``k = 1`` runs every
    seed). The same computation either way; which is faster depends on the model and the card
    (``benchmarks/seeds_at_once.py`` measures it: section 5.2's NAIS-Net10 on one H200 trains
    1.16 times faster one seed at a time than four side by side)."""
    if seeds_at_once is not None:
        check_int("seeds_at_once", seeds_at_once)

    @functools.wraps(fn)  # the program keeps fn's name
    def mapped(*args):
        own, shared = args[:seeded], args[seeded:]
        seeds = jax.tree.leaves(own)[0].shape[0]
        k = seeds if seeds_at_once is None else min(seeds_at_once, seeds)
        if k == seeds:
            return jax.vmap(fn, in_axes=(0,) * seeded + (None,) * len(shared))(*args)

        def group(a):  # seeds (g, ...) -> their outputs (g, ...)
            if jax.tree.leaves(a)[0].shape[0] == 1:
                return jax.tree.map(lambda y: y[None], fn(*jax.tree.map(lambda x: x[0], a), *shared))
            return jax.vmap(lambda *b: fn(*b, *shared))(*a)

        whole = seeds - seeds % k
        groups = jax.tree.map(lambda x: x[:whole].reshape(whole // k, k, *x.shape[1:]), own)
        _, out = jax.lax.scan(lambda carry, a: (carry, group(a)), None, groups)
        out = jax.tree.map(lambda y: y.reshape(whole, *y.shape[2:]), out)
        if whole == seeds:
            return out
        rest = group(jax.tree.map(lambda x: x[whole:], own))
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, rest)

    return mapped


def per_device_seeds(fn: Callable, mesh: Mesh | None, seeded: int, shared: int) -> Callable:
    """``fn`` (vmapped over seeds: ``seeded`` arguments with a seed axis, then ``shared``
    ones without) run by every device of ``mesh`` on its own seeds (``jax.shard_map``).

    Left to the SPMD partitioner, the evaluation (a convolution of the shared test images
    with every seed's kernels) gathered every seed's kernels on every device."""
    if mesh is None or mesh.devices.size == 1:
        return fn
    axis = PartitionSpec(train.DATA_AXIS)
    in_specs = (axis,) * seeded + (PartitionSpec(),) * shared
    return parallel.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=axis)


def stack_states(states: Sequence[train.TrainState]) -> train.TrainState:
    """Single-run states -> one state with a leading seed axis (the first state's
    ``apply_fn`` and ``tx``: each single run builds equal but distinct ones)."""
    leaves = [jax.tree.leaves(st) for st in states]
    treedef = jax.tree.structure(states[0])

    def stack(xs):  # strongly typed (a Python 0 step is weakly typed): a restored state then matches
        return jnp.stack([jnp.asarray(x, dtype=jnp.asarray(x).dtype) for x in xs])

    return jax.tree.unflatten(treedef, [stack(xs) for xs in zip(*leaves)])


def seed_mesh(config, num_seeds: int) -> Mesh:
    """A 1-D mesh for the seed axis: the most devices (at most ``config.num_devices``, default
    all) that divide ``num_seeds`` evenly. Over several processes, every process gives the same
    number of its own devices (so each trains its share of the seeds), which needs ``num_seeds``
    to be a multiple of the number of processes."""
    processes = jax.process_count()
    devices = jax.devices()
    limit = config.num_devices
    if limit is not None:
        check_int("config.num_devices", limit, 1, len(devices))
    else:
        limit = len(devices)
    if num_seeds % processes:
        raise ValueError(
            f"{num_seeds} seeds cannot be split evenly over {processes} processes: give a multiple of {processes}."
        )
    count = max(k for k in range(processes, limit + 1, processes) if num_seeds % k == 0) if limit >= processes else 0
    if count == 0:
        raise ValueError(f"config.num_devices={limit} gives fewer devices than the {processes} processes.")
    per_process = count // processes
    by_process = [[d for d in devices if d.process_index == p] for p in range(processes)]
    chosen = [d for own in by_process for d in own[:per_process]]
    return Mesh(np.asarray(chosen), (train.DATA_AXIS,))


def shard_seeds(tree, mesh: Mesh):
    """Every array of ``tree`` split along its leading (seed) axis over ``mesh``."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(train.DATA_AXIS)))


def seed_config(config, seed: int):
    """``config`` as the single run of ``seed`` (``config.seed = seed``, one seed)."""
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


class ProgramCache:
    """The programs of the last ``kept`` configurations a sweep ran, so that a resumed or repeated
    sweep of the same configuration reuses the compiled epoch (jit caches on the function object
    and on the state's static fields, ``apply_fn`` and ``tx``). Its owner decides how long it
    lives: :func:`prepare` makes one per call unless it is given one, and a caller that runs
    sweeps of the same configuration one after another passes the same cache to each."""

    def __init__(self, kept: int = 2):
        self.kept = check_int("kept", kept)
        self._entries: dict[str, _Programs] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, config, ds, steps_per_epoch: int, mean, std, mesh: Mesh | None = None) -> _Programs:
        """The programs of ``config`` on ``ds``, built on the first request. The key is the whole
        config but the seeds and the bookkeeping, plus the data's shape and statistics."""
        key = _programs_key(config, ds, steps_per_epoch, mean, std, mesh)
        if key not in self._entries:
            while len(self._entries) >= self.kept:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = _build_programs(config, ds, steps_per_epoch, mean, std, mesh)
        return self._entries[key]


def _programs_key(config, ds, steps_per_epoch: int, mean, std, mesh: Mesh | None) -> str:
    d = config.to_dict()
    for k in ("seed", "num_seeds", "num_epochs", "progress", "checkpoint_every_epochs", "keep_checkpoints"):
        d.pop(k, None)
    return json.dumps(
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


def _build_programs(config, ds, steps_per_epoch: int, mean, std, mesh: Mesh | None) -> _Programs:
    return _Programs(
        model=train.build_model(config, ds.num_classes),
        tx=train.make_optimizer(config, steps_per_epoch),
        epoch=make_sweep_epoch(
            mean,
            std,
            augment=train.augmentation(config),
            batch_size=config.batch_size,
            eval_batch_size=config.eval_batch_size,
            mesh=mesh,
            seeds_at_once=config.seeds_at_once,
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


@dataclasses.dataclass
class SweepSetup:
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


def prepare(config, seeds: tuple[int, ...], *, programs: ProgramCache | None = None) -> SweepSetup:
    """Everything a sweep of ``config`` over ``seeds`` runs on: the checked data on the device,
    the compiled programs (from ``programs``, else built for this call), every seed's initial
    state stacked and split over the seed mesh, the seeds' data keys."""
    train.validate_config(config)
    ds, steps_per_epoch = engine.load_training_data(config)
    mean, std = train.input_stats(config, ds.train_images)
    mesh = seed_mesh(config, len(seeds))
    programs = (ProgramCache() if programs is None else programs).get(config, ds, steps_per_epoch, mean, std, mesh)
    model = programs.model
    # Each seed initialised exactly as its single run (same eager ops), then stacked.
    states = [
        train.create_train_state(seed_config(config, s), model, ds.train_images.shape[1:], steps_per_epoch)
        for s in seeds
    ]
    if count_projected_blocks(states[0].params) == 0 and config.model.startswith("naisnet"):
        raise ValueError(f"{config.model} has no NAIS block parameters to project; check naisnet_jax.models.")
    state = stack_states(states).replace(tx=programs.tx)  # the cached programs' static fields
    return SweepSetup(
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
