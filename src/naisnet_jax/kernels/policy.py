"""Which engine runs a tied block: the typed policy a caller passes, and the choice made from it.

A :class:`KernelPolicy` is a frozen value: what the caller asks for (an engine, the interpreter,
a tiling to try on another card). :func:`conv_plan` turns it, the block's shapes and the machine
into a :class:`ConvPlan` (which kernels, which tiling), or ``None`` where the block runs the
stacked VJP. Nothing here is a module switch: the same policy and machine give the same plan.

The automatic choice for a conv block, where the GPU kernels run (a CUDA GPU, float32) and JAX's
default matmul precision allows TF32 products (:data:`TF32_PRECISIONS`: its default, the
precision of XLA's own convolutions there):

- 16 and 32 channels: on a Hopper GPU the TF32 wgmma kernels, on other cards the Triton kernels;
- 64 channels, ReLU, 3x3, on a Hopper GPU: the TF32 wgmma kernels with XLA's convolution
  gradient for the kernel's gradient;
- anything else: the stacked VJP (cuDNN's convolutions are faster there).

Where the precision asks for more than TF32 (``jax.default_matmul_precision("float32")`` or
``"highest"``), the 16- and 32-channel blocks take the Triton kernels on every card: Pallas
lowers their products at that precision (IEEE float32), so the fast path's gradients agree with
autodiff's to float32 accuracy; the 64-channel blocks take the stacked VJP, whose convolutions
XLA computes at that precision. Forced with ``engine="wgmma"``, a block there takes the
split-bfloat16 wgmma kernels (about 16 significant bits: faster, not float32-exact).

Each choice is the faster one measured on an H100 and an H200 (BENCHMARKS.md); none changes
the maths beyond the products' precision.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from naisnet_jax.checks import check_bool, check_int
from naisnet_jax.kernels import common, tuning, wgmma_split, wgmma_tf32
from naisnet_jax.kernels.common import Layout

Array = jax.Array

ENGINES = (None, "triton", "wgmma")
#: ``jax.default_matmul_precision`` values that allow TF32 products (``None``: JAX's default).
TF32_PRECISIONS = (None, "default", "fastest", "bfloat16", "tensorfloat32", "high", "TF32_TF32_F32")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """How the fused paths run a tied block (``block_vjp="fused"``); the default chooses by block
    and machine (the module's docstring).

    - ``engine``: ``None`` (by card), ``"triton"`` (any CUDA GPU) or ``"wgmma"`` (Hopper; a block
      it does not take is refused, naming why). Conv blocks only: a dense block has one engine.
    - ``interpret``: ``None`` runs the GPU kernels where they run and are the faster path, else
      the stacked VJP; ``True`` runs Pallas' interpreter on any backend and float dtype (the
      tests' path); ``False`` forces the GPU kernels.
    - ``strict``: a block that the kernels ``interpret`` forces do not take is refused, naming
      why (``True``), or runs the stacked VJP (``False``: a model whose blocks the kernels take
      in part, e.g. a model's ``kernel_interpret`` option).
    - ``tile_rows``, ``num_warps``, ``unroll_tiles``, ``hoist_taps``: the Triton conv kernels'
      tiling (default: :mod:`naisnet_jax.kernels.tuning`; ``hoist_taps``: for at most 32
      channels); ``warpgroups``: a wgmma program's (with ``engine="wgmma"``; default: the most
      that fit); ``block_rows``, ``num_warps``: the Triton dense kernels'. For tuning on
      another card; the defaults are the fastest measured.
    """

    engine: str | None = None
    interpret: bool | None = None
    strict: bool = True
    tile_rows: int | None = None
    num_warps: int | None = None
    unroll_tiles: bool = True
    hoist_taps: bool | None = None
    warpgroups: int | None = None
    block_rows: int | None = None

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} must be None, 'triton' or 'wgmma'.")
        if self.interpret not in (None, True, False):
            raise ValueError(f"interpret={self.interpret!r} must be None, True or False.")
        check_bool("strict", self.strict)
        for name in ("tile_rows", "block_rows"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, 16)
                if value & (value - 1):
                    raise ValueError(f"{name}={value!r} must be a power of two (a tile is one ({name}, C) block).")
        if self.num_warps is not None:
            check_int("num_warps", self.num_warps)
        if self.warpgroups is not None:
            if self.engine != "wgmma":
                raise ValueError(
                    f"warpgroups={self.warpgroups!r} tunes the wgmma kernels: pass engine='wgmma' with it."
                )
            check_int("warpgroups", self.warpgroups)


DEFAULT = KernelPolicy()


def check_policy(policy) -> KernelPolicy:
    """``policy`` itself if it is a :class:`KernelPolicy`, else a ``TypeError`` that says so."""
    if not isinstance(policy, KernelPolicy):
        raise TypeError(f"policy must be a naisnet_jax.kernels.KernelPolicy, got {type(policy).__name__}.")
    return policy


class ConvPlan(NamedTuple):
    """How a conv block's kernels run: in Pallas' interpreter or on the GPU, on which engine, with
    which tiling."""

    interpret: bool = False
    tile_rows: int = tuning.TILE_ROWS
    num_warps: int = tuning.NUM_WARPS
    unroll_tiles: bool = True  # a step's tiles as straight-line code (independent loads overlap)
    hoist_taps: bool = True  # load the kernel's taps once per program, not once per tile
    # > 0: the forward and backward kernels on Hopper's wgmma, with this many warpgroups a
    # pattern; 0: the Triton kernels
    warpgroups: int = 0
    # with warpgroups > 0: the TF32 wgmma kernels, whose layout's rows are a multiple of 8; else
    # the split-bfloat16 ones
    tf32: bool = False
    # the kernel's gradient from XLA's convolution gradient (cuDNN) on the saved states, not
    # from the Triton weight-gradient kernel (slow at 64 channels)
    xla_wgrad: bool = False

    def layout(self, H: int, W: int, kh: int, kw: int) -> Layout:
        """The buffers' layout of an ``H x W`` state for a ``kh x kw`` kernel under this plan."""
        return Layout.of(H, W, kh, kw, self.tile_rows, align=8 if self.tf32 else 1)

    def wgmma(self):
        """The module of this plan's wgmma kernels."""
        return wgmma_tf32 if self.tf32 else wgmma_split


def tf32_allowed() -> bool:
    """Whether JAX's default matmul precision, as a block is traced now, allows TF32 products."""
    precision = jax.config.jax_default_matmul_precision
    return (precision if precision is None else str(precision)) in TF32_PRECISIONS


def conv_supported(x0: Array, kernel: Array) -> str | None:
    """``None`` if the fused conv kernels take this block, else why not (in words)."""
    if x0.ndim != 4 or kernel.ndim != 4:
        return f"expected a state (batch, H, W, C) and an HWIO kernel, got shapes {x0.shape} and {kernel.shape}"
    kh, kw, ci, co = kernel.shape
    C = x0.shape[-1]
    if ci != C or co != C:
        return f"the kernel {kernel.shape} must map the state's {C} channels to {C}"
    if kh % 2 == 0 or kw % 2 == 0:
        return f"the kernel's size must be odd, got {kh}x{kw}"
    if C < 16 or C > 128 or C & (C - 1):
        return f"the channels must be a power of two from 16 to 128, got {C}"
    return None


def _wide_plan(x0, kernel, activation, policy: KernelPolicy) -> ConvPlan | None:
    """The plan of a 64-channel block on the TF32 wgmma kernels, or ``None`` where it does not
    apply: another width, the Triton engine, the interpreter, a precision above TF32, a block the
    kernels refuse, or (unless forced by ``interpret=False, engine="wgmma"``) no Hopper GPU here."""
    engine, interpret = policy.engine, policy.interpret
    if x0.shape[-1] != tuning.WIDE_CHANNELS or engine == "triton" or interpret:
        return None
    forced = interpret is False and engine == "wgmma"
    if not (forced or (interpret is None and common.gpu_kernels_available(x0) and common.hopper_available())):
        return None
    plan = ConvPlan(tile_rows=tuning.WIDE_TILE_ROWS, tf32=True, xla_wgrad=True)
    layout = plan.layout(x0.shape[1], x0.shape[2], kernel.shape[0], kernel.shape[1])
    if not tf32_allowed() or wgmma_tf32.unsupported(layout, x0, kernel, activation) is not None:
        return None
    nw = policy.warpgroups or wgmma_tf32.choose_warpgroups(layout, x0.shape[-1], activation)
    return plan._replace(warpgroups=nw)


def _wgmma_warpgroups(policy: KernelPolicy, x0, kernel, activation, tile_rows, tf32) -> int:
    """Warpgroups a program of the wgmma kernels gets for this block, or 0 for the Triton kernels:
    ``engine=None`` takes wgmma where the block fits it on a Hopper GPU and the precision allows
    TF32 (above it, the Triton kernels, exact at that precision); ``"wgmma"`` refuses a block it
    does not take, naming why. ``tf32``: the TF32 kernels, else the split ones."""
    if policy.engine == "triton" or (policy.engine is None and not tf32):
        return 0
    layout = ConvPlan(tile_rows=tile_rows, tf32=tf32).layout(x0.shape[1], x0.shape[2], kernel.shape[0], kernel.shape[1])
    engine = wgmma_tf32 if tf32 else wgmma_split
    why = engine.unsupported(layout, x0, kernel, activation)
    if policy.engine == "wgmma":
        if why is not None:
            raise ValueError(f"unroll_tied_conv: engine='wgmma' does not take this block: {why}.")
        return policy.warpgroups or _choose(engine, layout, x0.shape[-1], activation)
    if why is None and common.hopper_available():
        return _choose(engine, layout, x0.shape[-1], activation)
    return 0


def _choose(engine, layout, C: int, activation: str) -> int:
    if engine is wgmma_tf32:
        return wgmma_tf32.choose_warpgroups(layout, C, activation=activation)
    return wgmma_split.choose_warpgroups(layout, C)


def conv_plan(x0: Array, kernel: Array, activation: str, policy: KernelPolicy = DEFAULT) -> ConvPlan | None:
    """The plan of a tied conv block under ``policy`` on this machine, or ``None``: the stacked VJP.

    Refuses, naming why, what the policy forces on a block that cannot take it (the GPU kernels
    on a block they do not take, the wgmma engine on a block it does not take or in the
    interpreter)."""
    why = conv_supported(x0, kernel)
    if why is None:
        wide = _wide_plan(x0, kernel, activation, policy)
        if wide is not None:
            return wide
    default_rows, default_warps = tuning.default_tiling(x0.shape[-1])
    tile_rows = policy.tile_rows or default_rows
    num_warps = policy.num_warps or default_warps
    tf32 = tf32_allowed()
    runs_here = common.gpu_kernels_available(x0) and x0.shape[-1] <= tuning.AUTO_MAX_CHANNELS
    mode = common.kernel_mode("unroll_tied_conv", policy.interpret, why, runs_here, strict=policy.strict)
    if mode is None:
        return None
    if mode and policy.engine == "wgmma":
        raise ValueError(
            "unroll_tied_conv: engine='wgmma' needs a Hopper GPU: "
            "Pallas' interpreter (interpret=True) cannot run wgmma."
        )
    nw = 0 if mode else _wgmma_warpgroups(policy, x0, kernel, activation, tile_rows, tf32)
    hoist = x0.shape[-1] <= 32 if policy.hoist_taps is None else bool(policy.hoist_taps)  # 9 C x C taps in registers
    return ConvPlan(mode, tile_rows, num_warps, bool(policy.unroll_tiles), hoist, nw, tf32=tf32 and nw > 0)
