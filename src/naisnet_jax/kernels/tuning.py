"""The GPU kernels' tuning tables, in one place.

Each value is the fastest of a sweep on an H100 or H200 at the paper's shapes (batch 128,
K = 9 or 10; BENCHMARKS.md gives the sweeps and their timings). A table keyed by channels
overrides the default for that width. :class:`naisnet_jax.kernels.KernelPolicy` overrides the
block kernels' tiling per call (``tile_rows``, ``num_warps``, ``block_rows``, ``warpgroups``),
for tuning on another card.
"""

from __future__ import annotations

# ----------------------------------------------------------------- Triton conv block kernels

#: Rows of the flattened state a program computes per tile (the ``M`` of each product).
TILE_ROWS = 256
#: Warps per program.
NUM_WARPS = 8
#: ``C -> (tile rows, warps)`` where it differs from ``(TILE_ROWS, NUM_WARPS)``: at 32 channels
#: the nine windows of a 256-row tile fill the registers.
TILINGS = {32: (128, 8)}
#: Widest state the automatic choice sends to the Triton or split-bfloat16 kernels: at 64
#: channels cuDNN's convolutions in the stacked VJP are faster than them (a 64-channel block
#: takes the TF32 wgmma kernels instead, where they run: :data:`WIDE_CHANNELS`).
AUTO_MAX_CHANNELS = 32


def default_tiling(channels: int) -> tuple[int, int]:
    """The conv block kernels' ``(tile rows, warps)`` for a state of ``channels`` channels."""
    return TILINGS.get(channels, (TILE_ROWS, NUM_WARPS))


# ------------------------------------------------------- Triton conv weight-gradient kernel

#: Rows per tile of the weight-gradient kernel, and warps per program. Narrow programs: its
#: products have a ``(C, C)`` output and a long reduction over rows.
WGRAD_ROWS = 32
WGRAD_WARPS = 1
#: ``C -> (rows, warps)`` where it differs (128 channels, taken only when forced, use 64's).
WGRAD_TILINGS = {32: (32, 2), 64: (32, 4), 128: (32, 4)}
#: Programs a pattern's rows are split between (at most; a divisor of its runs of rows), by
#: channels.
WGRAD_CHUNKS = {16: 8, 32: 4}
#: Triton's software-pipelining stages of the kernel's loop over rows.
WGRAD_STAGES = 2


def wgrad_tiling(channels: int) -> tuple[int, int]:
    """The weight-gradient kernel's ``(rows, warps)`` for ``channels`` channels."""
    return WGRAD_TILINGS.get(channels, (WGRAD_ROWS, WGRAD_WARPS))


# -------------------------------------------------------------- TF32 wgmma, 64 channels

#: Channels of the blocks that take the TF32 wgmma kernels with a single-buffered state and
#: XLA's kernel gradient, and their tile rows.
WIDE_CHANNELS, WIDE_TILE_ROWS = 64, 64

# ------------------------------------------------------------------- Triton dense kernels

#: Batch rows per program (the ``M`` of each product; Triton's products need at least 16).
DENSE_ROWS = 16
#: Warps per program.
DENSE_WARPS = 4
#: Programs the dense weight-gradient kernel aims for (each sums a group of steps), and their warps.
DENSE_WGRAD_PROGRAMS = 128
DENSE_WGRAD_WARPS = 8
