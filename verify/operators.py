"""Linear operators of NAIS blocks as functions on flat vectors, and their dense matrices.

Every operator here is a `jax.tree_util.Partial`: a pytree whose leaves are the arrays it holds
(kernel, matrix, slopes, step size) and whose function is a fixed module-level object. That lets
`jax.jit` reuse one compiled Arnoldi cycle for every operator of the same shapes instead of
recompiling for each new closure.

Flattening convention: one image `X` of shape `(H, W, C)` is the vector `X.reshape(-1)`, i.e.
row-major, so entry `(y, x, c)` sits at index `(y * W + x) * C + c`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import Partial

from naisnet_jax.cell import check_kernel_shape
from naisnet_jax.checks import check_choice, check_int

from ._numerics import jit

Array = jax.Array
_HIGHEST = lax.Precision.HIGHEST
_PADDINGS = ("SAME", "CIRCULAR")


def _image_hw(image_shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in image_shape)
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"image_shape must be (H, W) or (H, W, C) with positive sizes; got {shape}")
    return shape[0], shape[1]


@functools.cache
def _conv_flat_fn(height: int, width: int, padding: str) -> Callable[[Array, Array], Array]:
    """One fixed function object per (H, W, padding), so jit caches hit across kernels."""

    def apply(kernel: Array, v: Array) -> Array:
        dtype = jnp.result_type(kernel.dtype, v.dtype)
        kernel = kernel.astype(dtype)
        x = v.astype(dtype).reshape(1, height, width, kernel.shape[2])
        if padding == "CIRCULAR":
            p = (kernel.shape[0] - 1) // 2
            x = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)), mode="wrap")
            lax_padding = "VALID"
        else:
            lax_padding = "SAME"
        y = lax.conv_general_dilated(
            x,
            kernel,
            window_strides=(1, 1),
            padding=lax_padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=_HIGHEST,
        )
        return y.reshape(-1)

    return apply


def conv_operator(kernel, image_shape, *, padding: str = "SAME") -> Callable[[Array], Array]:
    """The linear map `vec(X) -> vec(conv(X, kernel))` for one image.

    `kernel` is HWIO `(k, k, C_in, C_out)` with odd `k`; `image_shape` is `(H, W)` or
    `(H, W, C_in)`.
    The map sends a vector of length `H*W*C_in` to one of length `H*W*C_out` (row-major flatten
    of `(H, W, C)`). The conv is a stride-1 cross-correlation (`lax.conv_general_dilated`) with
    SAME zero padding, or with periodic padding when `padding="CIRCULAR"` (the torus, whose
    spectrum `fft_conv_spectrum` gives exactly).
    """
    kernel = jnp.asarray(kernel)
    check_kernel_shape(kernel.shape, square_channels=False, leading_axes=False)
    height, width = _image_hw(image_shape)
    if len(tuple(image_shape)) == 3 and int(image_shape[2]) != kernel.shape[2]:
        raise ValueError(
            f"image_shape {tuple(image_shape)} has {image_shape[2]} channels but the kernel of "
            f"shape {tuple(kernel.shape)} expects C_in={kernel.shape[2]}"
        )
    padding = padding.upper()
    check_choice("padding", padding, _PADDINGS)
    return Partial(_conv_flat_fn(height, width, padding), kernel)


def conv_matrix(kernel, image_shape, *, padding: str = "SAME") -> Array:
    """Dense matrix `M` of `conv_operator`: `vec(conv(X, kernel)) = M @ vec(X)`.

    Row `(y * W + x) * C_out + o` is output pixel `(y, x)` channel `o`; column
    `(y' * W + x') * C_in + i` is input pixel `(y', x')` channel `i`. Built with `jax.jacfwd`, so
    its size is `(H*W*C_out, H*W*C_in)`: meant for small images only.
    """
    op = conv_operator(kernel, image_shape, padding=padding)
    height, width = _image_hw(image_shape)
    n_in = height * width * op.args[0].shape[2]
    return jax.jacfwd(op)(jnp.zeros((n_in,), op.args[0].dtype))


def _dense_mv(matrix: Array, v: Array) -> Array:
    dtype = jnp.result_type(matrix.dtype, v.dtype)
    return jnp.matmul(matrix.astype(dtype), v.astype(dtype), precision=_HIGHEST)


def dense_operator(matrix) -> Callable[[Array], Array]:
    """The map `v -> matrix @ v` (column-vector convention; a dense block's `x @ A.T` is `A x`)."""
    matrix = jnp.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(f"a dense operator needs a 2-D matrix; got shape {tuple(matrix.shape)}")
    return Partial(_dense_mv, matrix)


def as_operator(a) -> Callable[[Array], Array]:
    """A 2-D array becomes `dense_operator(a)`; a callable is wrapped as a pytree `Partial`."""
    if isinstance(a, Partial):
        return a
    if callable(a):
        return Partial(a)
    if isinstance(a, (np.ndarray, jax.Array)):
        return dense_operator(a)
    raise TypeError(f"expected a 2-D matrix or a linear function v -> A v; got {type(a).__name__}")


def _jacobian_mv(op, slopes: Array, h: Array, v: Array) -> Array:
    av = op(v)
    return v + h * slopes * av


def jacobian_operator(a, slopes, h) -> Callable[[Array], Array]:
    """The block Jacobian `J = I + h diag(s) A` as the map `v -> v + h * s * (A v)`.

    `a` is a dense state matrix `A` (n x n) or a linear function `v -> A v` (e.g. `conv_operator`);
    `slopes` holds `s = act'(pre-activation)` for one pattern, any shape with `n` entries, flattened
    row-major (an `(H, W, C)` slope image lines up with `conv_operator`'s ordering).
    """
    op = as_operator(a)
    slopes = jnp.ravel(jnp.asarray(slopes))
    if isinstance(a, (np.ndarray, jax.Array)):
        n = a.shape[0]
        if a.shape != (n, n) or slopes.shape != (n,):
            raise ValueError(
                f"A must be square with one slope per row; got A {tuple(a.shape)}, slopes with {slopes.size} entries"
            )
    return Partial(_jacobian_mv, op, slopes, jnp.asarray(h))


@jit
def _apply_rows(op, rows: Array) -> Array:
    return jax.vmap(op)(rows)


def operator_matrix(op, n: int, *, dtype=None, chunk: int = 256) -> Array:
    """Dense `n x n` matrix of a linear function `v -> A v`, column `j` being `op(e_j)`.

    The identity is fed through `jax.vmap(op)` in chunks of `chunk` basis vectors, so memory stays
    at `chunk * n` per call besides the result. `dtype` defaults to JAX's default float (float64
    under x64).
    """
    op = as_operator(op)
    n = check_int("n", int(n))
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.zeros((), float).dtype
    chunk = max(1, min(int(chunk), n))
    blocks = []
    for start in range(0, n, chunk):
        idx = jnp.arange(start, start + chunk)
        rows = (idx[:, None] == jnp.arange(n)[None, :]).astype(dtype)  # rows past n are all zero
        blocks.append(_apply_rows(op, rows)[: min(chunk, n - start)])
    columns = jnp.concatenate(blocks, axis=0)  # row j holds op(e_j)
    if columns.shape != (n, n):
        raise ValueError(f"op must map length-{n} vectors to length-{n} vectors; got {columns.shape[1]}")
    return columns.T
