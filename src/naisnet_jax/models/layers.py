"""What the NAIS blocks and the ResNet baselines share: the initial state, the compute dtype,
the initialisers of the state and drive weights, and BatchNorm (its constants and the axis its
statistics are averaged over).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from naisnet_jax.parametrize import zero_delta
from naisnet_jax.projection import project_conv, project_fc

Array = jax.Array
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5
PARAM_DTYPE = jnp.float32  # as Flax's own layers, also when x64 is enabled


def initial_state_x0(u: Array, state_shape: tuple, dtype, initial_state: str, block: str) -> Array:
    """``x_0`` of a block: zeros of ``state_shape``, or ``u`` itself for ``"input"``.

    ``"input"`` needs ``u.shape == state_shape`` (same width, and for a conv block stride 1);
    otherwise ``ValueError`` naming both shapes.
    """
    if initial_state == "zero":
        return jnp.zeros(state_shape, dtype)
    if tuple(u.shape) != tuple(state_shape):
        raise ValueError(
            f"{block} with initial_state='input' starts at x_0 = u, but its input u has shape "
            f"{tuple(u.shape)} and its state {tuple(state_shape)}; use initial_state='zero' or "
            f"an input of the state's shape (equal width, stride 1)."
        )
    return u.astype(dtype)


def compute_dtype(dtype):
    """The dtype a block computes in: ``dtype`` as a numpy dtype, or ``None`` (the inputs' dtype)."""
    return None if dtype is None else jnp.dtype(dtype)


# ----------------------------------------------------------- initialisation


def fc_init(eps: float) -> Callable:
    """``R`` with N(0, 1/n) entries, then Algorithm 1: feasible from the start."""

    def init(key, shape, dtype=PARAM_DTYPE):
        R = jax.random.normal(key, shape, dtype) / math.sqrt(shape[-1])
        return project_fc(R, eps=eps)

    return init


def drive_init(name: str) -> Callable:
    """Initialiser of a conv block's drive kernel ``D`` (HWIO): variance ``s / fan_in``, ``s = 1``
    for ``"lecun"`` (Flax's default) and ``s = 2`` for ``"he"``.

    Started at ``x_0 = 0``, a block's first state is ``x_1 = h act(D u + E)``, and at
    initialisation its state kernel is ``-I`` plus off-centre taps of small total weight, so the
    later steps barely move it (for ReLU and ``h = 1``, ``x_2 = x_1 + relu(C x_1 + d)`` adds
    ``relu`` of the small off-centre term only): the block's output is about ``relu(D u)``. Its
    pre-activation has second moment ``s E[u^2]`` and ReLU keeps half of it. Where the drive is
    not normalised, ``"he"`` therefore passes the second moment from block to block and
    ``"lecun"`` halves it at every block (``0.5^54`` over the CIFAR nets). Where the drive is
    normalised (the default, :class:`DriveNorm`) the scale of ``D`` cancels in the forward pass
    but sets the step SGD takes on it: BatchNorm makes the loss invariant to that scale, so the
    gradient shrinks as ``1 / |D|`` and the relative step as ``1 / |D|^2``: ``"he"`` halves
    the effective learning rate of every drive. In two epochs at 0.1 on MNIST
    (``experiments/signal.py``, one seed) NAIS-Net10 did about as well either way (test accuracy
    with batch statistics 93.2% with ``"he"``, 94.3% with ``"lecun"``), so the default stays
    Flax's.
    """
    scale = {"he": 2.0, "lecun": 1.0}[name]
    return nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")


def conv_init(eps: float, eta: float) -> Callable:
    """State kernel with N(0, 1/(k^2 C)) taps, then Algorithm 2 with ``delta = 0``."""

    def init(key, shape, dtype=PARAM_DTYPE):
        k, _, c, _ = shape[-4:]
        kernel = jax.random.normal(key, shape, dtype) / math.sqrt(k * k * c)
        return project_conv(kernel, zero_delta(shape, dtype), eps=eps, eta=eta)[0]

    return init


def batch_norm(
    train: bool, name: str, dtype=None, *, zero_scale: bool = False, axis_name: str | None = None
) -> nn.BatchNorm:
    """The models' BatchNorm: batch statistics when ``train`` (across the mapped axis
    ``axis_name`` too, a model's ``batch_axis``), scale 0 or 1."""
    return nn.BatchNorm(
        use_running_average=not train,
        axis_name=axis_name if train else None,
        momentum=BN_MOMENTUM,
        epsilon=BN_EPSILON,
        name=name,
        dtype=compute_dtype(dtype),
        scale_init=nn.initializers.zeros if zero_scale else nn.initializers.ones,
    )
