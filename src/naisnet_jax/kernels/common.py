"""What every kernel engine computes the same way inside its kernels: the activation and its
scaled slope. Imported by the engines, importing none of them."""

from __future__ import annotations

import jax.numpy as jnp


def act(activation: str, z):
    """``act(z)`` in a kernel (ReLU as a maximum)."""
    return jnp.maximum(z, 0) if activation == "relu" else jnp.tanh(z)


def scaled_slope(activation: str, h: float, z, g):
    """``h act'(z) g``, ReLU's slope at 0 taken as 0 (as ``jax.nn.relu``)."""
    if activation == "relu":
        return jnp.where(z > 0, h * g, jnp.zeros_like(g))
    t = jnp.tanh(z)
    return h * g * (1 - t) * (1 + t)
