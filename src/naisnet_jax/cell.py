"""Pure single steps of NAIS blocks. No Flax, no loops.

A fully connected NAIS block advances its state ``x`` (shape ``(batch, n)``) by

    x_{k+1} = x_k + h * act(x_k @ A.T + drive),      drive = u @ B.T + b,

and a convolutional one (``x`` of shape ``(batch, H, W, C)``) by

    X_{k+1} = X_k + h * act(conv(X_k, C) + drive),   drive = conv(U, D) + E.

The drive holds the block input's contribution and is computed once per block
by the caller, not once per step. A step is one iteration; the loop belongs to
the caller (see :mod:`naisnet_jax.unroll`), e.g. for a tied block::

    step = functools.partial(fc_step, drive=drive, A=A, h=h)
    x_K = unroll(step, x0, steps=K)

With untied weights (per-step ``A(k)``, ``drive(k)``), the same step is used
with the step's own parameters; ``unroll(..., xs=(As, drives))`` feeds them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax.checks import check_choice, check_int, check_number

Array = jax.Array

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
}


def check_activation(activation: str, name: str = "activation") -> str:
    """``activation`` names an entry of :data:`ACTIVATIONS`."""
    return check_choice(name, activation, sorted(ACTIVATIONS))


def check_step_size(h: float, name: str = "h") -> float:
    """``h`` must lie in (0, 1]: the stability proofs need ``h <= 1``. A traced ``h`` passes."""
    if isinstance(h, jax.core.Tracer):  # a traced h cannot be checked here
        return h
    return check_number(
        name, h, 0.0, 1.0, lo_open=True, why=": h must be positive and at most 1 (the stability proofs need h <= 1)"
    )


def activation_slope(activation: str, z: Array) -> Array:
    """Elementwise derivative ``act'(z)`` (ReLU's slope at 0 is taken as 0)."""
    check_activation(activation)
    if activation == "tanh":
        return 1.0 - jnp.tanh(z) ** 2
    return (z > 0).astype(z.dtype)


def conv_same(x: Array, kernel: Array, *, stride: int = 1, precision=None) -> Array:
    """Cross-correlation of NHWC ``x`` with an HWIO ``kernel``, SAME zero padding."""
    check_int("stride", stride)
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        window_strides=(stride, stride),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=precision,
    )


def fc_step(
    x: Array,
    drive: Array,
    A: Array,
    *,
    h: float = 1.0,
    activation: str = "tanh",
    precision=None,
) -> Array:
    """One fully connected NAIS step ``x + h * act(x @ A.T + drive)``.

    Args:
      x: state, shape ``(batch, n)``.
      drive: precomputed input term ``u @ B.T + b``, broadcastable to ``x``.
      A: state matrix, shape ``(n, n)``.
      h: step size in (0, 1].
      activation: ``"tanh"`` or ``"relu"``.
    """
    check_step_size(h)
    act = ACTIVATIONS[check_activation(activation)]
    x, drive, A = jnp.asarray(x), jnp.asarray(drive), jnp.asarray(A)
    check_dense_state(x.shape, A.shape)
    check_drive(x.shape, drive.shape)
    return x + h * act(jnp.matmul(x, A.T, precision=precision) + drive)


def conv_step(
    x: Array,
    drive: Array,
    kernel: Array,
    *,
    h: float = 1.0,
    activation: str = "tanh",
    precision=None,
) -> Array:
    """One convolutional NAIS step ``X + h * act(conv(X, C) + drive)``.

    Args:
      x: state, shape ``(batch, H, W, C)``.
      drive: precomputed input term ``conv(U, D) + E``, broadcastable to ``x``.
      kernel: state kernel ``C``, HWIO ``(k, k, C, C)`` with odd ``k``;
        stride 1 and SAME zero padding keep the state's shape.
      h: step size in (0, 1].
      activation: ``"tanh"`` or ``"relu"``.
    """
    check_step_size(h)
    act = ACTIVATIONS[check_activation(activation)]
    x, drive, kernel = jnp.asarray(x), jnp.asarray(drive), jnp.asarray(kernel)
    check_conv_state(x.shape, kernel.shape)
    check_drive(x.shape, drive.shape)
    return x + h * act(conv_same(x, kernel, precision=precision) + drive)


def check_dense_state(x_shape: tuple[int, ...], A_shape: tuple[int, ...]) -> None:
    """A dense step's state ``x`` (``(..., n)``) and square state matrix ``A`` (``(n, n)``) fit."""
    if len(A_shape) != 2 or A_shape[0] != A_shape[1]:
        raise ValueError(f"state matrix A must be square (n, n); got shape {tuple(A_shape)}.")
    if len(x_shape) < 1:
        raise ValueError(f"state x of shape {tuple(x_shape)} has no feature axis; expected (..., {A_shape[0]}).")
    if x_shape[-1] != A_shape[0]:
        raise ValueError(f"state x has {x_shape[-1]} features but A has shape {tuple(A_shape)}.")


def check_conv_state(x_shape: tuple[int, ...], kernel_shape: tuple[int, ...]) -> None:
    """A conv step's state ``x`` is NHWC and has the state kernel's ``C`` channels."""
    check_kernel_shape(kernel_shape)
    if len(kernel_shape) != 4:  # per-step kernels: a step takes one of them
        check_kernel_shape(kernel_shape, leading_axes=False)
    if len(x_shape) != 4:
        raise ValueError(f"state x must be NHWC (batch, H, W, C); got shape {tuple(x_shape)}.")
    if x_shape[-1] != kernel_shape[-1]:
        raise ValueError(
            f"state x of shape {tuple(x_shape)} has {x_shape[-1]} channels but the state kernel has shape "
            f"{tuple(kernel_shape)}."
        )


def check_drive(x_shape: tuple[int, ...], drive_shape: tuple[int, ...]) -> None:
    """The drive broadcasts to the state's shape (a step keeps the state's shape)."""
    try:
        shape = np.broadcast_shapes(tuple(x_shape), tuple(drive_shape))
    except ValueError:
        shape = None
    if shape != tuple(x_shape):
        raise ValueError(
            f"drive of shape {tuple(drive_shape)} does not broadcast to the state x of shape {tuple(x_shape)} "
            f"(a step keeps the state's shape)."
        )


def check_kernel_shape(shape: tuple[int, ...], *, square_channels: bool = True, leading_axes: bool = True) -> None:
    """A conv kernel is HWIO ``(k, k, C_in, C_out)`` with an odd ``k = 2p+1`` (every channel has a
    centre tap); a state kernel also has ``C_in == C_out`` (``square_channels``).
    ``leading_axes`` allows ``(..., k, k, C, C)`` (untied per-step kernels)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 4 or (not leading_axes and len(shape) != 4):
        axes = (
            "(..., k, k, C_in, C_out) HWIO with optional leading axes" if leading_axes else "(k, k, C_in, C_out) HWIO"
        )
        raise ValueError(f"kernel of shape {shape} is not {axes}.")
    kh, kw, cin, cout = shape[-4:]
    if kh != kw or kh % 2 == 0:
        raise ValueError(
            f"kernel of shape {shape} has a {kh}x{kw} filter ({'even' if kh == kw else 'not square'}); "
            f"expected an odd square filter k x k (k = 2p+1, so that every channel has a centre tap)."
        )
    if square_channels and cin != cout:
        raise ValueError(
            f"state kernel of shape {shape} has C_in={cin}, C_out={cout}; expected square channels "
            f"(C_in == C_out: the state maps C channels to C channels)."
        )
