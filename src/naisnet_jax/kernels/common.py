"""What the kernel engines share: the activation rules inside a kernel, the padded-rows layout
of a conv block's state, Pallas' Triton call, the argument checks of a tied block, and the probes
of the machine (a GPU backend, a CUDA device, a Hopper card) that the policy reads.

The probes are module functions called through this module (``common.gpu_backend()``), so a test
on a CPU can stand in for a GPU by replacing them. Imported by every engine, importing none.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from naisnet_jax.cell import check_activation, check_step_size
from naisnet_jax.checks import check_int
from naisnet_jax.kernels.tuning import TILE_ROWS
from naisnet_jax.unroll import check_scan_unroll

Array = jax.Array


def act(activation: str, z):
    """``act(z)`` in a kernel (ReLU as a maximum)."""
    return jnp.maximum(z, 0) if activation == "relu" else jnp.tanh(z)


def scaled_slope(activation: str, h: float, z, g):
    """``h act'(z) g``, ReLU's slope at 0 taken as 0 (as ``jax.nn.relu``)."""
    if activation == "relu":
        return jnp.where(z > 0, h * g, jnp.zeros_like(g))
    t = jnp.tanh(z)
    return h * g * (1 - t) * (1 + t)


# ------------------------------------------------------------------------- the machine


def gpu_backend() -> bool:
    """JAX's default backend is a GPU (the side stream of weight gradients needs one)."""
    return jax.default_backend() == "gpu"


def default_device():
    """The device JAX computes on by default: the one ``jax.default_device`` names, if set (a
    device, or a platform's name: that backend's first device), else the default backend's first."""
    default = jax.config.jax_default_device
    return jax.devices(default)[0] if default is None or isinstance(default, str) else default


def hopper_available() -> bool:
    """JAX's default device is a Hopper GPU (compute capability 9.x)."""
    device = default_device()
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def gpu_kernels_available(x0: Array) -> bool:
    """The GPU kernels run here: a float32 state and a CUDA GPU as JAX's default device (the one
    ``jax.default_device`` names, if set: a model run on the CPU of a GPU machine falls back)."""
    if x0.dtype != jnp.float32:
        return False
    device = default_device()
    return device.platform == "gpu" and "cuda" in getattr(device.client, "platform_version", "").lower()


# ------------------------------------------------------------------- Pallas' Triton call


def pallas_triton(kernel, out_shape, programs: int, config, num_warps=None, num_stages=1):
    """``pallas_call`` of ``kernel`` over ``programs`` programs, as ``config`` says (any config with
    ``interpret`` and ``num_warps``, a conv or a dense engine's);
    ``num_stages``: Triton's software pipelining of the kernel's loops."""
    from jax.experimental import pallas as pl

    params = {}
    if not config.interpret:
        from jax.experimental.pallas import triton as plgpu

        warps = num_warps or config.num_warps
        params["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(programs,), interpret=config.interpret, **params)


def taps_of(kernel: Array) -> Array:
    """HWIO ``(kh, kw, C, C)`` -> ``(kh * kw, C, C)``, tap ``(a, b)`` at ``a * kw + b``."""
    kh, kw, ci, co = kernel.shape
    return kernel.reshape(kh * kw, ci, co)


def kernel_mode(
    name: str, interpret: bool | None, why: str | None, runs_here: bool, *, strict: bool = True
) -> bool | None:
    """How the entry point ``name`` runs a block: ``True`` in Pallas' interpreter, ``False`` as
    GPU kernels, ``None`` not at all (fall back to the stacked VJP). ``interpret=None`` chooses
    the GPU kernels where the block fits them (``why is None``) and ``runs_here``. A forced
    choice (``True`` or ``False``) on a block they do not take is refused, naming ``why``; with
    ``strict=False`` that block falls back instead (a policy's ``strict``)."""
    if why is not None:
        if interpret is None or not strict:
            return None
        raise ValueError(f"{name}: the fused kernels do not take this block: {why}.")
    if interpret is None:
        return False if runs_here else None
    return bool(interpret)


# ------------------------------------------------------------ a conv block's state as rows


class Layout(NamedTuple):
    """Where a pattern's padded state lives in its buffer of ``rows`` x ``C``."""

    height: int
    width: int
    pad_h: int
    pad_w: int
    slack: int  # rows before the padded image (and at least as many after it)
    tiles: int  # tiles of ``tile_rows`` covering the padded image
    tile_rows: int
    rows: int

    @property
    def padded_width(self) -> int:
        return self.width + 2 * self.pad_w

    @property
    def padded_rows(self) -> int:
        return (self.height + 2 * self.pad_h) * self.padded_width

    @classmethod
    def of(cls, height: int, width: int, kh: int, kw: int, tile_rows: int = TILE_ROWS, align: int = 1) -> Layout:
        """The layout of a ``height x width`` state for a ``kh x kw`` kernel; ``rows`` rounded up
        to a multiple of ``align`` (the extra rows are slack after the image)."""
        pad_h, pad_w = kh // 2, kw // 2
        padded_width = width + 2 * pad_w
        slack = pad_h * padded_width + pad_w
        tiles = -(-(height + 2 * pad_h) * padded_width // tile_rows)
        rows = -(-(tiles * tile_rows + 2 * slack) // align) * align
        return cls(height, width, pad_h, pad_w, slack, tiles, tile_rows, rows)

    def is_pixel(self, q: Array) -> Array:
        """Whether each row ``q`` of the padded image (counted from its first row) is a pixel of
        the image, not padding."""
        i, j = q // self.padded_width, q % self.padded_width
        return (i >= self.pad_h) & (i < self.pad_h + self.height) & (j >= self.pad_w) & (j < self.pad_w + self.width)

    def offsets(self, kh: int, kw: int) -> list[int]:
        """Row offset of every tap, in the kernel's ``(a, b)`` order."""
        return [(a - self.pad_h) * self.padded_width + (b - self.pad_w) for a in range(kh) for b in range(kw)]

    def to_buffer(self, x: Array) -> Array:
        """``(..., H, W, C)`` -> ``(..., rows, C)``: zero padded, flattened, framed by slack."""
        lead = x.shape[:-3]
        pad = [(0, 0)] * len(lead) + [(self.pad_h, self.pad_h), (self.pad_w, self.pad_w), (0, 0)]
        flat = jnp.pad(x, pad).reshape(lead + (self.padded_rows, x.shape[-1]))
        after = self.rows - self.slack - self.padded_rows
        return jnp.pad(flat, [(0, 0)] * len(lead) + [(self.slack, after), (0, 0)])

    def padded(self, buf: Array) -> Array:
        """``(..., rows, C)`` -> the zero-padded image ``(..., H + 2p, W + 2q, C)``."""
        img = lax.slice_in_dim(buf, self.slack, self.slack + self.padded_rows, axis=-2)
        return img.reshape(buf.shape[:-2] + (self.height + 2 * self.pad_h, self.padded_width, buf.shape[-1]))

    def interior(self, buf: Array) -> Array:
        """``(..., rows, C)`` -> the image ``(..., H, W, C)``."""
        img = self.padded(buf)
        return img[..., self.pad_h : self.pad_h + self.height, self.pad_w : self.pad_w + self.width, :]


def index(v) -> Array:
    """An index in JAX's default integer type (int64 with x64 on: the interpreter's slices
    need every index of one type, and loops count in it)."""
    return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.int64))


# --------------------------------------------------------------------------- arguments


def sum_to_shape(a: Array, shape: tuple[int, ...]) -> Array:
    """Sum the broadcast axes of ``a`` away so that it has ``shape``."""
    lead = a.ndim - len(shape)
    a = jnp.sum(a, axis=tuple(range(lead))) if lead else a
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return jnp.sum(a, axis=axes, keepdims=True) if axes else a


def check_tied(name, x0, drive, W, steps, h, activation, scan_unroll):
    """The common arguments of a tied block's unroll ``name``, checked: returns ``(x0, drive,
    W, h)`` with the arrays in one dtype and ``h`` a Python float (it must be static)."""
    check_int("steps", steps)
    check_step_size(h)
    check_activation(activation)
    check_scan_unroll(scan_unroll)
    if isinstance(h, jax.core.Tracer):
        raise ValueError(f"{name} needs a static step size h (a Python float), not a traced value.")
    dtype = jnp.result_type(x0, drive, W)
    return x0.astype(dtype), drive.astype(dtype), W.astype(dtype), float(h)
