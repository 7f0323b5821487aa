"""The TF32 wgmma engine's state in planes: a conv state in shared memory as ``C / 4`` planes of 4
float32 channels (rows of 16 bytes), whose windows at any row offset are ``wgmma`` operands as
they lie, and the moves of a tile between planes and registers.

In ``wgmma``'s unswizzled K-major layout a core matrix is 8 rows of 16 bytes, so a tap's window
is a shared-memory descriptor that starts at the window's first row, 128 bytes between core
matrices along M (8 rows) and a plane's bytes along K (4 channels); a tile's products are one
``m64nCk8`` per tap and 8 channels (:func:`wgmma_sum`). The descriptors and the register moves
are written in Mosaic GPU's own IR (``plgpu.inline_mgpu``); :mod:`naisnet_jax.kernels.wgmma_tf32`
builds its kernels from them.
"""

from __future__ import annotations

import functools
import importlib

import jax.numpy as jnp

from naisnet_jax.kernels.wgmma_common import M

#: Channels of a plane: 16 bytes of float32, one core matrix's row.
PLANE = 4


def _mgpu():
    """Mosaic GPU's modules (imported when a kernel is built: they need jaxlib's GPU parts)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, nvvm, vector
    from jax.experimental.mosaic import gpu as mgpu

    mods = {m: importlib.import_module(f"jax.experimental.mosaic.gpu.{m}") for m in ("mma_utils", "utils", "wgmma")}
    fa = importlib.import_module("jax.experimental.mosaic.gpu.fragmented_array")
    return ir, arith, nvvm, vector, mgpu, mods["mma_utils"], mods["utils"], mods["wgmma"], fa


def swizzle_of(C: int) -> int:
    """Swizzle of the taps' rows in shared memory: ``C`` float32."""
    return min(128, 4 * C)


def taps_transforms(C: int):
    """Shared-memory transforms of the ``(9, C, C)`` float32 taps, each ``(N, K)`` (TF32's B is
    K-major): tiles of 8 rows x one swizzle width."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = swizzle_of(C)
    return (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))


def window_fields(reach: int, offset: int, plane_bytes: int, first_channel: int = 0) -> dict:
    """The shared-memory descriptor fields of a tap's window, in bytes from the span's first row
    (``reach`` rows before the tile): ``start`` (the window's first row, at channel
    ``first_channel``, a multiple of 4: where a ``wgmma_m64`` call's group of channels starts), ``lbo`` (between core
    matrices along K: one plane, 4 channels), ``sbo`` (along M: 8 rows of 16 bytes), ``k_step``
    (from one ``m64nNk8`` to the next: 8 channels, two planes). In the unswizzled K-major layout
    element ``(m, k)`` of the window is at ``start + (m // 8) sbo + (m % 8) 16 + (k // 4) lbo +
    (k % 4) 4`` for the instruction's ``k < 8`` (PTX's canonical layout; ``tests/test_wgmma_tf32.py``
    checks it against the planes)."""
    row = 4 * PLANE
    start = (reach + offset) * row + first_channel // PLANE * plane_bytes
    return dict(start=start, lbo=plane_bytes, sbo=8 * row, k_step=2 * plane_bytes)


def wgmma_sum(C: int, element_type, issue):
    """In an mgpu function: the ``(M, C)`` float32 sum that ``issue(regs, types)`` accumulates
    by ``wgmma_m64`` calls on ``regs``, a zeroed accumulator's registers, updated in place
    (``regs[0:1] = wgmma_m64(regs[0:1], ..., **types)``); awaited, and back from the
    accumulator's register tiling to the WGMMA layout. ``types`` names the operands'
    ``element_type`` as this JAX's ``wgmma_m64`` takes it (one in jax 0.10, one an operand
    later)."""
    import inspect

    _, _, nvvm, _, mgpu, _, _, wgmma, _ = _mgpu()
    if "element_type" in inspect.signature(wgmma.wgmma_m64).parameters:
        types = {"element_type": element_type}
    else:
        types = {"a_element_type": element_type, "b_element_type": element_type}
    acc = wgmma.WGMMAAccumulator.zero(M, C)
    regs = acc._value.registers.copy()
    issue(regs, types)
    nvvm.wgmma_commit_group_sync_aligned()
    nvvm.wgmma_wait_group_sync_aligned(0)
    value = mgpu.FragmentedArray(_registers=regs, _layout=acc._value.layout, _is_signed=None)
    return wgmma.WGMMAAccumulator(_value=value, _original_layout=acc._original_layout, _sync=False).value


def tile_products(offsets, C: int, reach: int, plane_bytes: int):
    """The mgpu function ``(ctx, span, taps) -> z`` of one tile: ``z = sum_t window_t @ B_t`` in
    TF32, ``span`` the planes' rows from ``reach`` before the tile to ``reach`` after it
    (``(C / 4, M + 2 reach, 4)``), tap ``t``'s window the ``M`` rows from ``reach + offsets[t]``;
    ``taps`` ``(9, N, K)`` swizzled (``B_t`` transposed). A tap's K runs in groups of one swizzle
    width (32 channels at most): one ``wgmma_m64`` call a group, its 8 planes on for the next."""
    ir, _, _, _, _, mma_utils, utils, wgmma, _ = _mgpu()
    from jax._src.lib.mlir.dialects import llvm

    swizzle = swizzle_of(C)
    k_group = swizzle // 4  # channels of one wgmma_m64 call

    def products(ctx, span, taps):
        del ctx
        i8, i64 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(64)
        base = utils.memref_ptr(span)
        return wgmma_sum(C, ir.FloatTF32Type.get(), functools.partial(issue, base, taps, i8, i64))

    def issue(base, taps, i8, i64, regs, types):
        for t, off in enumerate(offsets):
            # A, the window: K-major, unswizzled; core matrices 8 rows x 16 B, 128 B apart along M,
            # a plane apart along K
            for g in range(C // k_group):
                fields = window_fields(reach, off, plane_bytes, g * k_group)
                a_desc = mma_utils.encode_descriptor(
                    utils.getelementptr(base, [fields["start"]], i8),
                    leading_byte_offset=fields["lbo"],
                    stride_byte_offset=fields["sbo"],
                    swizzle=None,
                )
                # tap t as a (K tiles, N tiles, K tile, N tile) view of its (N, K) rows
                b = utils.memref_transpose(utils.memref_slice(taps, t), (1, 0, 3, 2))
                (b_desc, b_k_stride), (_, b_group_stride), b_fastest = mma_utils.create_descriptor(
                    b, swizzle=swizzle, group_size=(k_group, C), logical_k_major=True
                )
                assert b_fastest == mma_utils.Dim.K, b_fastest
                b_g = b_desc
                if g:
                    step = llvm.ConstantOp(i64, ir.IntegerAttr.get(i64, mma_utils.encode_addr(g * b_group_stride)))
                    b_g = llvm.add(b_desc, step, overflow_flags=llvm.IntegerOverflowFlags.none)
                regs[0:1] = wgmma.wgmma_m64(
                    regs[0:1],
                    a_desc,
                    b_g,
                    swizzle=swizzle,
                    n=C,
                    **types,
                    a_transpose=False,
                    a_k_stride=fields["k_step"],  # an instruction's 8 channels: two planes
                    b_transpose=False,
                    b_k_stride=b_k_stride[1][-1],
                )

    return products


def plane_index(arith, ir, r, c):
    """``(plane, row, lane)`` of element ``(r, c)`` of a tile in planes."""
    index = ir.IndexType.get()
    four = arith.constant(index, PLANE)
    return [arith.divui(c, four), r, arith.remui(c, four)]


def load_tile_fn(C: int):
    """mgpu ``(ctx, tile) -> (M, C)`` in the WGMMA layout, ``tile`` a ``(C / 4, M, 4)`` view."""
    ir, arith, _, vector, mgpu, _, _, _, fa = _mgpu()

    def load(ctx, tile):
        del ctx
        layout = fa.WGMMA_LAYOUT
        vec = ir.VectorType.get((2,), ir.F32Type.get())
        regs = []
        for r, c in layout.thread_idxs((M, C)):
            regs.append(vector.load(vec, tile, plane_index(arith, ir, r, c)))
        import numpy as np

        return mgpu.FragmentedArray(
            _registers=np.array(regs, dtype=object).reshape(layout.registers_shape((M, C))),
            _layout=layout,
            _is_signed=None,
        )

    return load


def store_tile_fn(C: int):
    """mgpu ``(ctx, value, tile) -> None``: an ``(M, C)`` WGMMA-layout value into the
    ``(C / 4, M, 4)`` view ``tile``."""
    ir, arith, _, vector, _, _, _, _, fa = _mgpu()

    def store(ctx, value, tile):
        del ctx
        for reg, (r, c) in zip(value.registers.flat, fa.WGMMA_LAYOUT.thread_idxs((M, C))):
            vector.store(reg, tile, plane_index(arith, ir, r, c))

    return store


def load_tile(planes):
    """The ``(M, C)`` tile of a ``(C / 4, M, 4)`` planes view, in registers (WGMMA layout)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = planes.shape[0] * PLANE
    return plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((M, C), jnp.float32, layout=plgpu.Layout.WGMMA),
    )(load_tile_fn(C))(planes)


def store_tile(value, planes):
    """``value`` ``(M, C)`` (WGMMA layout) into a ``(C / 4, M, 4)`` planes view."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = planes.shape[0] * PLANE
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(store_tile_fn(C))(value, planes)


def products(layout, offsets, planes, buf, q0, taps):
    """The tile at ``q0`` (first tiled row, counted from the slack): ``sum_t window_t @ B_t``
    over ``planes[buf]``'s windows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C, rows = planes.shape[1] * PLANE, planes.shape[2]
    S = layout.slack  # every window lies within the slack around the tile
    products = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(taps_transforms(C))),
        return_type=plgpu.ShapeDtypeStruct((M, C), jnp.float32, layout=plgpu.Layout.WGMMA),
    )(tile_products(offsets, C, S, rows * 4 * PLANE))
    return products(planes.at[buf, :, pl.ds(q0, M + 2 * S)], taps)


def tile_of(planes, buf, row):
    from jax.experimental import pallas as pl

    return planes.at[buf, :, pl.ds(row, M)]
