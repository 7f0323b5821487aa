"""The frame both wgmma engines of a conv block share: :mod:`naisnet_jax.kernels.wgmma_split`
(three bfloat16 products) and :mod:`naisnet_jax.kernels.wgmma_tf32` (TF32, the windows as views).

Each engine runs one program per pattern on Hopper's ``wgmma`` (Pallas, Mosaic GPU), its
``warpgroups`` warpgroups sharing the state's 64-row tiles (:data:`M`) in a contiguous run each,
the state or ``s_k`` in shared memory in :class:`naisnet_jax.kernels.common.Layout`'s rows. What
is the same in both lives here: the tiles, the TMA chunks and staging slots, which blocks and
warpgroup counts a kernel takes, the outputs and what the forward kernel saves, and the pieces
of a kernel body (the warpgroups as a team, a load into the WGMMA register layout, the mask of a
tile's pixels and the masked slope of the backward step). Each engine keeps its own kernels, its
shared memory and its choice of warpgroups.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from naisnet_jax.kernels.common import scaled_slope

Array = jax.Array

#: Rows per tile, the ``M`` of one ``wgmma``.
M = 64
#: Rows of a TMA box at most.
TMA_ROWS = 256
#: Most warpgroups a program gets (the fastest count that fits is taken: each engine's
#: ``choose_warpgroups``).
MAX_WARPGROUPS = 5
#: Shared memory a program may use on Hopper (227 KiB).
SMEM_BYTES = 232_448
#: Activations the kernels compute.
ACTIVATIONS = ("relu", "tanh")
#: The dtype the forward kernel saves ReLU's sign ``1[z_k > 0]`` in (:func:`saves_mask`): a byte.
SIGN_DTYPE = jnp.int8


# ------------------------------------------------------------------ tiles, chunks, warpgroups


def tma_chunks(start: int, stop: int, size: int = TMA_ROWS) -> list[tuple[int, int]]:
    """``(first row, rows)`` of the TMA boxes that cover rows ``start .. stop``, ``size`` rows each
    (the last one shorter)."""
    return [(s, min(size, stop - s)) for s in range(start, stop, size)]


def tiles_of(layout) -> int:
    """64-row tiles over the layout's tiled rows."""
    return layout.tiles * layout.tile_rows // M


def staging_slots(layout, warpgroups: int) -> int:
    """Staging slots per warpgroup: two (one tile's copy in flight while the next is staged), one
    if the warpgroup has a single tile."""
    return min(2, tiles_of(layout) // warpgroups)


def check_warpgroups(layout, warpgroups: int) -> None:
    """Raises ``ValueError`` unless ``warpgroups`` is a positive divisor of the layout's tiles."""
    tiles = tiles_of(layout)
    if warpgroups < 1 or tiles % warpgroups:
        raise ValueError(
            f"warpgroups={warpgroups!r} must be a positive divisor of the state's {tiles} tiles of {M} rows"
        )


def unsupported_shape(layout, x0: Array, kernel: Array, activation: str, channels: tuple[int, ...]) -> str | None:
    """Why a wgmma block kernel does not take this block, shared memory aside (``None``: it
    does): a float32 state of one of ``channels``, a 3x3 kernel, an activation in
    :data:`ACTIVATIONS`, tiles of a multiple of 64 rows."""
    C = x0.shape[-1]
    if x0.dtype != jnp.float32:
        return f"the wgmma kernels take float32 states, got {x0.dtype}"
    if kernel.shape[:2] != (3, 3):
        return f"the wgmma kernels take 3x3 kernels, got {kernel.shape[0]}x{kernel.shape[1]}"
    if C not in channels:
        listed = ", ".join(map(str, channels[:-1])) + f" or {channels[-1]}"
        return f"the wgmma kernels take {listed} channels, got {C}"
    if activation not in ACTIVATIONS:
        return f"the wgmma kernels take activation in {ACTIVATIONS}, got {activation!r}"
    if layout.tile_rows % M:
        return f"the layout's tile_rows={layout.tile_rows} must be a multiple of {M}"
    return None


# ------------------------------------------------------------------ outputs and saved values


def saves_mask(activation: str) -> bool:
    """Whether the forward kernel saves ``1[z_k > 0]`` in :data:`SIGN_DTYPE` in place of ``z_k``:
    ReLU's slope needs only the sign, so the saved pre-activations move a quarter of the bytes
    (exactly the same gradient: the backward kernel tests ``> 0`` on either)."""
    return activation == "relu"


def saved_dtype(activation: str):
    """The dtype the forward kernel saves a pre-activation in: ReLU's sign in :data:`SIGN_DTYPE`
    (:func:`saves_mask`), else ``z_k`` in float32."""
    return SIGN_DTYPE if saves_mask(activation) else jnp.float32


def forward_out_type(layout, N: int, C: int, steps: int, save: bool, activation: str):
    """The forward kernel's outputs: every state ``(K + 1, N, rows, C)`` and every saved
    pre-activation (:func:`saved_dtype`) if ``save``, else the last state."""
    states = jax.ShapeDtypeStruct(((steps + 1) if save else 1, N, layout.rows, C), jnp.float32)
    return (states, jax.ShapeDtypeStruct((steps, N, layout.rows, C), saved_dtype(activation))) if save else (states,)


def backward_out_type(layout, N: int, C: int, steps: int):
    """The backward kernel's outputs: ``g_0`` ``(N, rows, C)`` and ``s_0 .. s_{K-1}``."""
    return (
        jax.ShapeDtypeStruct((N, layout.rows, C), jnp.float32),
        jax.ShapeDtypeStruct((steps, N, layout.rows, C), jnp.float32),
    )


# ------------------------------------------------------------------ pieces of a kernel body


def warpgroup_team(nw):
    """``(wg, lead_only, everyone)`` for ``nw`` warpgroups: this warpgroup's index, a decorator that
    runs a function in warpgroup 0 only, and a barrier every warpgroup passes together."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if nw == 1:
        return 0, lambda f: f(), lambda sync: None
    wg = jax.lax.axis_index("wg")

    def everyone(sync):
        plgpu.barrier_arrive(sync)
        plgpu.barrier_wait(sync)

    return wg, pl.when(wg == 0), everyone


def load_registers(ref, *idx):
    """``ref[idx]`` from shared memory into registers in the WGMMA layout. Rows of 16 float32
    (64 B) load without bank conflicts; wider rows have no conflict-free pattern in Mosaic GPU,
    so they load without that guarantee."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    optimized = ref.shape[-1] * 4 <= 64
    kwargs = dict(layout=plgpu.Layout.WGMMA, optimized=optimized)
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:  # JAX 0.10
        return plgpu.load(ref, idx, **kwargs)
    return plgpu.load(ref.at[idx], **kwargs)  # JAX 0.11 deprecates a separate index


def pixel_mask(layout, q0, C):
    """``(M, C)`` mask (WGMMA layout) of the tile's rows that are pixels of the image."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return layout.is_pixel(q0 + plgpu.broadcasted_iota(jnp.int32, (M, C), 0, layout=plgpu.Layout.WGMMA))


def masked_slope(layout, q0, activation, h, z, g):
    """``h act'(z) g`` for a tile's rows from ``q0``, zero outside the image."""

    return jnp.where(pixel_mask(layout, q0, g.shape[-1]), scaled_slope(activation, h, z, g), jnp.zeros_like(g))
