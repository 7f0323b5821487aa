"""What the per-kind audits share: the block record, grouping, gains."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax.probe import BlockProbe


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
