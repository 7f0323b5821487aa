"""Devices: the 1-D data mesh of training, replicating and sharding arrays on it, and
``shard_map`` as the trainers use it.

Data parallelism: a 1-D ``Mesh`` over the devices (axis ``"data"``); parameters,
optimiser state and the device-resident dataset are replicated, and every batch is
sharded along its leading axis inside the jitted step, so each device gathers,
augments and differentiates its own rows; XLA all-reduces the gradients and
BatchNorm's batch statistics (the numbers are those of one device, up to the order
of the sums). One device is the same code with a mesh of one. The dataset is
replicated, not sharded: the sets that fit on one device (MNIST, CIFAR: at most
150 MB as uint8) then need no communication to shuffle over the whole set each
epoch, and a sharded set would have to exchange rows for every batch.
Several processes (:mod:`naisnet_jax.distributed`): every process runs the same
program; ``jax.devices()`` then lists every process's devices and each process puts
its (identical) copy of the data on its own devices.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from naisnet_jax.checks import check_int, check_number

DATA_AXIS = "data"


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh (axis ``"data"``) over the first ``num_devices`` devices (all if None)."""
    devices = jax.devices()
    if num_devices is not None:
        check_int("num_devices", num_devices)
        check_number("num_devices", num_devices, 1, len(devices), why=" (the devices present)")
        devices = devices[:num_devices]
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def batch_norm_axis(mesh: Mesh | None, sync_batch_norm: bool = True) -> str | None:
    """The ``batch_axis`` of a model the data-parallel step runs over ``mesh``: ``"data"`` where
    the batch is split over several devices and BatchNorm takes the whole batch's statistics
    (``sync_batch_norm``), else ``None`` (one device, or each device's own rows)."""
    return DATA_AXIS if mesh is not None and mesh.devices.size > 1 and sync_batch_norm else None


def replicate(tree, mesh: Mesh):
    """Every array of ``tree`` on every device of ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(  # several hosts: each holds the same values
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), tree
    )


def shard_batch(tree, mesh: Mesh | None):
    """Inside ``jit``: split every array of ``tree`` along its leading (batch) axis over ``mesh``."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, PartitionSpec(DATA_AXIS)))


def check_batch_divides(config, mesh: Mesh) -> None:
    n = mesh.devices.size
    for field in ("batch_size", "eval_batch_size"):
        if config[field] % n:
            raise ValueError(
                f"config.{field}={config[field]} is not a multiple of the {n} devices the batch is "
                f"split over; change it or set config.num_devices."
            )


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` without its per-device variance check (``check_vma``; ``check_rep``
    in older JAX, under ``jax.experimental``): the model's loops start from constants (``x_0 =
    0``) and carry per-device values, which the check would have every model mark by hand.
    What it guards is kept by construction here: every output is averaged over the axis."""
    fn = getattr(jax, "shard_map", None)
    if fn is not None:
        return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - JAX < 0.6

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)  # pragma: no cover
