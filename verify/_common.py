"""What the per-kind audits share: the block record, grouping, gains."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax.probe import BlockProbe

from ._numerics import x64_scope


@dataclasses.dataclass
class Block:
    """One block found by its probe: the float32 pass (operators as the model runs them) and,
    with inputs, the float64 pass (inputs, drives, states)."""

    index: int  # discovery order
    name: str
    p32: BlockProbe
    p64: BlockProbe | None
    key: Any  # PRNG key of this block

    @property
    def kind(self) -> str:
        return self.p32.kind


def group(blocks: Iterable[Block], signature: Callable[[Block], Hashable]) -> list[list[Block]]:
    """Blocks with equal ``signature`` (shapes, static settings), in discovery order."""
    groups: dict[Hashable, list[Block]] = {}
    for b in blocks:
        groups.setdefault(signature(b), []).append(b)
    return list(groups.values())


def map_groups(fn: Callable[[list[Block]], Any], groups: Sequence[list[Block]], *, workers: int | None = None) -> list:
    """``[fn(g) for g in groups]``, with groups side by side in threads.

    Groups of different shapes compile different XLA programs; a cold audit spends most of
    its time compiling them, and XLA compiles (and the device runs) programs of several
    threads at once. ``workers`` defaults to one per group, at most ``os.cpu_count() // 2``
    (so 1, in order, on a two-core machine). Each thread enters the audit's float64 scope
    itself: JAX's x64 switch and matmul precision are thread-local. The result does not
    depend on ``workers``: groups share no state and each keeps its own PRNG keys."""
    groups = list(groups)
    if workers is None:
        workers = min(len(groups), max(1, (os.cpu_count() or 1) // 2))
    if workers <= 1 or len(groups) <= 1:
        return [fn(g) for g in groups]

    def scoped(g):
        with x64_scope():
            return fn(g)

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="audit-group") as pool:
        return list(pool.map(scoped, groups))


def side_by_side(*calls: Callable[[], Any]) -> list:
    """``[call() for call in calls]``, side by side in threads as :func:`map_groups` runs groups
    (one after the other on a machine of two cores). For phases of an audit that share no state:
    their programs compile at once."""
    return map_groups(lambda call: call(), calls)


def all_finite(*arrays) -> bool:
    """Every entry of every array given (``None`` skipped) is finite."""
    return all(a is None or bool(np.all(np.isfinite(np.asarray(a)))) for a in arrays)


def stack(arrays) -> jax.Array:
    return jnp.stack([jnp.asarray(a, jnp.float64) for a in arrays])


def gain(h: float, b_norm: float, rho: float | None) -> float | None:
    """The paper's input-output gain ``h ||B|| / (1 - rho)`` (inf when ``rho >= 1``)."""
    if rho is None or b_norm is None:
        return None
    return float(h * b_norm / (1 - rho)) if rho < 1 else float("inf")


def perturbation(u_shape: tuple, seed: int) -> np.ndarray:
    """The random input perturbation direction (standard normal, one per input pattern)."""
    return np.random.default_rng(seed + 1).standard_normal(u_shape)
