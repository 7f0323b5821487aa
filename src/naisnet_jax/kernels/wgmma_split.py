"""The split-bfloat16 wgmma engine of a conv block: its forward and backward kernels on Hopper's
``wgmma`` (Pallas, Mosaic GPU), in three bfloat16 products (about 16 significant bits). The
blocks take them where JAX's matmul precision asks for more than TF32; at the default precision
they take the faster TF32 kernels of :mod:`naisnet_jax.kernels.wgmma_tf32`; the frame both
engines share (tiles, chunks, warpgroups, what the forward kernel saves) is
:mod:`naisnet_jax.kernels.wgmma_common`.

The same computation, buffers and layout as :mod:`naisnet_jax.kernels.triton_conv`'s kernels
(its weight-gradient kernel takes these kernels' outputs unchanged), written for Pallas'
Mosaic GPU backend, where a program holds a pattern's whole state in shared memory:

- one program per pattern, of ``warpgroups`` warpgroups that share the state's 64-row tiles (a
  contiguous run each); the state (forward) or ``s_k`` (backward) double-buffered in shared
  memory in :class:`naisnet_jax.kernels.common.Layout`'s buffer layout (2 x 1,350 rows x 64 B at 32x32x16);
- per tile, each tap's window loaded from shared memory into registers at its row offset (any
  offset: ``wgmma`` takes a shared-memory operand only swizzled and 8-row tiled, which a window
  at an arbitrary row is not, and a register operand only in 16 or 8 bits), split into
  ``hi + lo`` in bfloat16 (:func:`split_bf16`) and multiplied with the taps, split the same way
  and held in swizzled shared memory, by three ``wgmma``: ``hi w_hi + lo w_hi + hi w_lo``. The
  products carry about 16 significant bits, more than TF32's 11 (``tests/test_wgmma_split.py``);
- forward: the drive held in registers for all K steps, ``x_0`` and the drive in by TMA, each
  new state out by TMA after its step (its tiled rows: the slack around them only feeds windows)
  and each pre-activation ``z_k`` through a staging buffer per warpgroup (two slots; one where a
  warpgroup has a single tile); for ReLU only ``1[z_k > 0]``, in int8
  (:func:`~naisnet_jax.kernels.wgmma_common.saves_mask`);
- backward: the gradient ``g`` in registers for all K steps, the transposed convolution over
  ``s_k``'s windows (taps mirrored and transposed), each ``z_{k-1}`` tile in by TMA one tile
  ahead, each ``s_k`` out by TMA.

The warpgroups meet at a barrier after every step (the next step reads rows the others wrote);
warpgroup 0 moves the whole buffers in and out.

Pallas' interpreter cannot run ``wgmma``, so the values are checked on a GPU
(``benchmarks/hopper_checks.py``) and the tests lower the kernels for CUDA on the CPU; their
speed against the Triton kernels is in BENCHMARKS.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from naisnet_jax.kernels.common import act
from naisnet_jax.kernels.wgmma_common import (
    MAX_WARPGROUPS,
    SMEM_BYTES,
    M,
    backward_out_type,
    check_warpgroups,
    forward_out_type,
    load_registers,
    masked_slope,
    pixel_mask,
    saved_dtype,
    saves_mask,
    staging_slots,
    tiles_of,
    tma_chunks,
    unsupported_shape,
    warpgroup_team,
)

Array = jax.Array


def _out_rows(layout, C: int) -> list[tuple[int, int]]:
    """The TMA chunks that send a state out: its tiled rows only, from the last 128-byte boundary
    at or before the first (a box starts aligned in shared memory). The slack rows around them,
    which only feed windows, are not written: the kernels that read these outputs mask them
    (the Triton engine's weight-gradient kernel) or take the image (``Layout.interior``)."""
    per = max(1, 128 // (4 * C))  # rows in 128 bytes
    return tma_chunks(layout.slack // per * per, layout.slack + tiles_of(layout) * M)


def smem_bytes(layout, C: int, warpgroups: int) -> int:
    """Shared memory of a program: the double buffer, the staging slots, the split taps, and 1 KiB
    for barriers and alignment."""
    staging = warpgroups * staging_slots(layout, warpgroups) * M * C * 4
    return 2 * layout.rows * C * 4 + staging + 2 * 9 * C * C * 2 + 1024


def choose_warpgroups(layout, C: int) -> int | None:
    """The most warpgroups (up to :data:`MAX_WARPGROUPS`) that divide the tiles and fit in shared
    memory, or ``None`` if not even one fits."""
    fits = [nw for nw in range(1, MAX_WARPGROUPS + 1) if tiles_of(layout) % nw == 0]
    fits = [nw for nw in fits if smem_bytes(layout, C, nw) <= SMEM_BYTES]
    return max(fits) if fits else None


def unsupported(layout, x0: Array, kernel: Array, activation: str) -> str | None:
    """``None`` if these kernels take the block, else why not (in words)."""
    C = x0.shape[-1]
    why = unsupported_shape(layout, x0, kernel, activation, CHANNELS)
    if why is None and choose_warpgroups(layout, C) is None:
        need = smem_bytes(layout, C, 1)
        return f"a {x0.shape[1]}x{x0.shape[2]}x{C} state needs {need} bytes of shared memory, more than {SMEM_BYTES}"
    return why


#: Channels these kernels take.
CHANNELS = (16, 32)


def split_bf16(x: Array) -> tuple[Array, Array]:
    """``(hi, lo)`` in bfloat16 with ``hi + lo`` carrying ``x`` to about 16 significant bits:
    ``hi`` is ``x`` with its low 16 bits cleared, ``lo = x - hi`` (exact in float32) rounded.
    Written with bit masks, not as ``bf16(x)`` and ``x - f32(hi)``: XLA on a GPU drops a
    float32 -> bfloat16 -> float32 round trip (it allows excess precision), which would make
    ``lo`` zero."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def _conv_tile(buf, src, start, offsets, w_hi_ref, w_lo_ref, centre=None):
    """``(sum_t window_t @ w_t, window_centre)`` for the tile at row ``start`` of ``buf[src]``, each
    product as three bfloat16 ``wgmma`` (``hi w_hi + lo w_hi + hi w_lo``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = buf.shape[-1]

    def products(acc_ref):
        kept = None
        for i, off in enumerate(offsets):
            window = load_registers(buf, src, pl.ds(start + off, M), slice(None))
            kept = window if i == centre else kept
            hi, lo = split_bf16(window)
            plgpu.wgmma(acc_ref, hi, w_hi_ref.at[i])
            plgpu.wgmma(acc_ref, lo, w_hi_ref.at[i])
            plgpu.wgmma(acc_ref, hi, w_lo_ref.at[i])
        plgpu.wgmma_wait(0)
        return acc_ref[...], kept

    return pl.run_scoped(products, plgpu.ACC((M, C), jnp.float32))


def _forward_kernel(
    layout,
    offsets,
    steps,
    h,
    activation,
    save,
    nw,
    x0_ref,
    d_ref,
    taps_hi,
    taps_lo,
    xs_ref,
    *rest,
):
    """Pattern ``n``'s K steps, its tiles shared by ``nw`` warpgroups; they meet after every step,
    then warpgroup 0 sends the new state out (every state if ``save``, else the last)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    zs_ref, (state, zstage, w_hi_ref, w_lo_ref, bar, sync) = (rest[0], rest[1:]) if save else (None, rest)
    mask = saves_mask(activation)
    n = jax.lax.axis_index("n")
    wg, lead_only, everyone = warpgroup_team(nw)
    S, C = layout.slack, state.shape[-1]
    per = tiles_of(layout) // nw
    slots = zstage.shape[1]
    centre = offsets.index(0)
    region, out = tma_chunks(0, layout.rows), _out_rows(layout, C)

    @lead_only
    def _():  # x_0 into buffer 0, the drive into buffer 1 (free until step 0 writes it)
        plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)  # TMA swizzles them on the way in
        plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
        for s0, size in region:
            plgpu.copy_gmem_to_smem(x0_ref.at[n, pl.ds(s0, size)], state.at[0, pl.ds(s0, size)], bar)
            plgpu.copy_gmem_to_smem(d_ref.at[n, pl.ds(s0, size)], state.at[1, pl.ds(s0, size)], bar)

    plgpu.barrier_wait(bar)
    first = [(wg * per + j) * M for j in range(per)]  # this warpgroup's tiles' first rows
    drive = [load_registers(state, 1, pl.ds(S + q0, M), slice(None)) for q0 in first]
    if save:

        @lead_only
        def _():  # xs[0] = x_0
            for s0, size in out:
                plgpu.copy_smem_to_gmem(state.at[0, pl.ds(s0, size)], xs_ref.at[0, n, pl.ds(s0, size)])

    plgpu.commit_smem()
    everyone(sync)  # every warpgroup holds its drive before step 0 overwrites buffer 1

    def step(k, carry):
        src, dst = k % 2, 1 - k % 2
        for j, q0 in enumerate(first):
            rows = pl.ds(S + q0, M)
            acc, x = _conv_tile(state, src, S + q0, offsets, w_hi_ref, w_lo_ref, centre)
            z = acc + drive[j]
            keep, zero = pixel_mask(layout, q0, C), jnp.zeros_like(z)
            state[dst, rows, :] = jnp.where(keep, x + h * act(activation, z), zero)
            if save:
                # the slot's last copy has read it (one slot: the last copy of all)
                plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                saved = jnp.where(keep, jnp.where(z > 0, jnp.ones_like(z), zero) if mask else z, zero)
                zstage[wg, j % slots] = saved.astype(zstage.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(zstage.at[wg, j % slots], zs_ref.at[k, n, rows])
        plgpu.commit_smem()  # this warpgroup's tiles of x_{k+1} are in buffer dst

        @lead_only
        def _():  # x_k's copy out of buffer src is done before step k + 1 overwrites it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        everyone(sync)  # x_{k+1} complete; nobody reads buffer src any more

        def send():
            for s0, size in out:
                slot = k + 1 if save else 0
                plgpu.copy_smem_to_gmem(state.at[dst, pl.ds(s0, size)], xs_ref.at[slot, n, pl.ds(s0, size)])

        @lead_only
        def _():  # every state out if saved, else the last
            if save:
                send()
            else:
                pl.when(k == steps - 1)(send)

        return carry

    jax.lax.fori_loop(0, steps, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _backward_kernel(
    layout,
    offsets,
    steps,
    h,
    activation,
    nw,
    gk_ref,
    zs_ref,
    taps_hi,
    taps_lo,
    g0_ref,
    ss_ref,
    sbuf,
    zbuf,
    w_hi_ref,
    w_lo_ref,
    bar,
    zbar,
    sync,
):
    """Pattern ``n``'s gradient from ``x_K`` back to ``x_0``, as the Triton engine's backward kernel:
    ``s_k = h act'(z_k) g_{k+1}``, ``g_k = g_{k+1} + conv^T(s_k)`` (``offsets``: the mirrored taps;
    the taps transposed). ``g`` stays in registers, ``s_k`` double-buffered in shared memory (read
    as windows while ``s_{k-1}`` is written), each ``z_{k-1}`` tile in by TMA one tile ahead through
    two slots per warpgroup. The tiles are shared as in the forward kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = jax.lax.axis_index("n")
    wg, lead_only, everyone = warpgroup_team(nw)
    S, C = layout.slack, sbuf.shape[-1]
    per = tiles_of(layout) // nw
    slots = zbuf.shape[1]
    first = [(wg * per + j) * M for j in range(per)]  # this warpgroup's tiles' first rows
    region, out = tma_chunks(0, layout.rows), _out_rows(layout, C)

    def fetch_z(k, j):  # z_k's tile j (of this warpgroup) into its slot j % slots
        plgpu.copy_gmem_to_smem(
            zs_ref.at[k, n, pl.ds(S + first[j], M)], zbuf.at[wg, j % slots], zbar.at[slots * wg + j % slots]
        )

    def slope_tile(j, g):  # h act'(z) g for the tile whose z is in its slot, masked
        plgpu.barrier_wait(zbar.at[slots * wg + j % slots])
        z = load_registers(zbuf, wg, j % slots, slice(None), slice(None)).astype(g.dtype)  # ReLU: saved 1[z > 0]
        return masked_slope(layout, first[j], activation, h, z, g)

    def send(buf, dst):  # warpgroup 0: a buffer's tiled rows out
        @lead_only
        def _():
            for s0, size in out:
                plgpu.copy_smem_to_gmem(sbuf.at[buf, pl.ds(s0, size)], dst.at[pl.ds(s0, size)])

    @lead_only
    def _():
        plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)
        plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
        for s0, size in region:  # g_K through buffer 1 into registers
            plgpu.copy_gmem_to_smem(gk_ref.at[n, pl.ds(s0, size)], sbuf.at[1, pl.ds(s0, size)], bar)

    plgpu.barrier_wait(bar)
    g = [load_registers(sbuf, 1, pl.ds(S + q0, M), slice(None)) for q0 in first]
    fetch_z(steps - 1, 0)
    for j in range(per):  # s_{K-1} into buffer 0
        if j + 1 < per:
            fetch_z(steps - 1, j + 1)
        sbuf[0, pl.ds(S + first[j], M), :] = slope_tile(j, g[j])
        plgpu.commit_smem()  # every thread is done with slot j % slots before it is refilled
    everyone(sync)  # s_{K-1} complete, and every g_K read out of buffer 1
    send(0, ss_ref.at[steps - 1, n])

    def step(i, g, last=False):  # k = K-1-i: g_k from s_k (buffer i % 2), then s_{k-1} (the other)
        k = steps - 1 - i
        src, dst = i % 2, 1 - i % 2
        if not last:
            fetch_z(k - 1, 0)
        g = list(g)
        for j in range(per):
            if not last and j + 1 < per:
                fetch_z(k - 1, j + 1)
            acc, _ = _conv_tile(sbuf, src, S + first[j], offsets, w_hi_ref, w_lo_ref)
            g[j] = jnp.where(pixel_mask(layout, first[j], C), g[j] + acc, jnp.zeros_like(acc))
            if not last:
                sbuf[dst, pl.ds(S + first[j], M), :] = slope_tile(j, g[j])
                plgpu.commit_smem()
        if not last:

            @lead_only
            def _():  # s_{k+1}'s copy out of buffer src is done before the next step overwrites it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            everyone(sync)  # s_{k-1} complete; nobody reads buffer src any more
            send(dst, ss_ref.at[k - 1, n])
        return tuple(g)

    g = jax.lax.fori_loop(0, steps - 1, step, tuple(g))
    g = step(steps - 1, g, last=True)  # k = 0: g_0 only
    # the buffer the last step did not read: every warpgroup was done reading it at the previous
    # step's meeting, and its copy out was awaited then
    free = 1 - (steps - 1) % 2
    for j, q0 in enumerate(first):
        sbuf[free, pl.ds(S + q0, M), :] = g[j]
    plgpu.commit_smem()
    everyone(sync)
    send(free, g0_ref.at[n])
    plgpu.wait_smem_to_gmem(0)


def _swizzled(C: int):
    """Shared-memory transforms of a ``(C, C)`` bfloat16 tap for ``wgmma``: rows of ``2 C`` bytes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = min(128, 2 * C)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _mosaic_call(body, layout, taps, out_type, barriers, nw, buffers=2, staging=jnp.float32):
    """``body`` as a Mosaic GPU kernel, one program of ``nw`` warpgroups per pattern, with the
    scratch both kernels use: the state buffers (``(buffers, rows, C)``: double-buffered, or one
    where the new tiles wait in registers), two ``(M, C)`` staging slots of dtype ``staging``
    per warpgroup, the split taps ``(9, C, C)`` in swizzled shared memory, then ``barriers`` and a
    barrier for the warpgroups to meet at. Returns ``f(*buffers)``; the split taps are passed
    after the buffers."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = taps.shape[-1]
    swizzled = _swizzled(C)
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((buffers, layout.rows, C), jnp.float32),
            plgpu.SMEM((nw, staging_slots(layout, nw), M, C), staging),
            plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((9, C, C), jnp.bfloat16, transforms=swizzled),
            *barriers,
            plgpu.Barrier(num_arrivals=nw),
        ],
        grid=(out_type[0].shape[-3],),  # the patterns: every output is (..., N, rows, C)
        grid_names=("n",),
        **(dict(num_threads=nw, thread_name="wg") if nw > 1 else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    return lambda *buffers: call(*buffers, *split_bf16(taps.astype(jnp.float32)))


def fused_forward(layout, x0b, db, taps, *, steps, h, activation, save, warpgroups):
    """The forward kernel on buffers (``x_0``'s, the drive's; taps ``(9, C, C)``): ``(xs, zs)``,
    every state and pre-activation, if ``save``, else ``(x_K,)`` with ``x_K`` of shape
    ``(1, N, rows, C)``."""
    check_warpgroups(layout, warpgroups)
    return _forward_call(layout, steps, float(h), activation, bool(save), warpgroups)(x0b, db, taps)


def fused_backward(layout, gb, zs, taps, *, steps, h, activation, warpgroups):
    """The backward kernel on buffers (``g``'s at ``x_K``, the saved ``zs``; the forward taps
    ``(9, C, C)``): ``(g_0, s_0 .. s_{K-1})``."""
    check_warpgroups(layout, warpgroups)
    return _backward_call(layout, steps, float(h), activation, warpgroups)(gb, zs, taps)


# One jitted function per configuration: a model calls it for each of its blocks, and JAX lowers a
# jitted function once per shape, so the Mosaic kernel is built once, not once per block (NAIS-Net10:
# 4 kernels instead of 72).
@functools.cache
def _forward_call(layout, steps, h, activation, save, warpgroups):
    return jax.jit(
        functools.partial(_forward, layout, steps=steps, h=h, activation=activation, save=save, warpgroups=warpgroups)
    )


@functools.cache
def _backward_call(layout, steps, h, activation, warpgroups):
    return jax.jit(functools.partial(_backward, layout, steps=steps, h=h, activation=activation, warpgroups=warpgroups))


def _forward(layout, x0b, db, taps, *, steps, h, activation, save, warpgroups):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    N, _, C = x0b.shape
    out_type, saved = forward_out_type(layout, N, C, steps, save, activation), saved_dtype(activation)
    loads = 2 + 2 * len(tma_chunks(0, layout.rows))
    body = functools.partial(_forward_kernel, layout, layout.offsets(3, 3), steps, h, activation, save, warpgroups)
    body.__name__ = "hopper_forward_kernel"  # the kernel's name in a profile
    call = _mosaic_call(body, layout, taps, out_type, [plgpu.Barrier(num_arrivals=loads)], warpgroups, staging=saved)
    return call(x0b, db)


def _backward(layout, gb, zs, taps, *, steps, h, activation, warpgroups):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    N, _, C = gb.shape
    mirrored = [-off for off in layout.offsets(3, 3)]
    out_type = backward_out_type(layout, N, C, steps)
    barriers = [
        plgpu.Barrier(num_arrivals=2 + len(tma_chunks(0, layout.rows))),
        plgpu.Barrier(num_arrivals=1, num_barriers=staging_slots(layout, warpgroups) * warpgroups),
    ]
    body = functools.partial(_backward_kernel, layout, mirrored, steps, h, activation, warpgroups)
    body.__name__ = "hopper_backward_kernel"
    transposed = jnp.swapaxes(taps, 1, 2)  # tap t's C_out x C_in, as the transposed convolution takes it
    return _mosaic_call(body, layout, transposed, out_type, barriers, warpgroups, staging=zs.dtype)(gb, zs)
