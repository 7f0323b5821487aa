"""The TF32 wgmma engine of a conv block: its forward and backward kernels on Hopper's ``wgmma``
in TF32, the windows as views.

The same computation and buffers as :mod:`naisnet_jax.kernels.wgmma_split`, in the frame both
engines share (:mod:`naisnet_jax.kernels.wgmma_common`: one program per pattern, its warpgroups
sharing the 64-row tiles, the state or ``s_k`` double-buffered in shared memory, the drive or the
gradient in registers for all K steps). It differs in two ways:

- **The state in planes.** Shared memory holds a state as ``C / 4`` planes of 4 channels,
  ``(C / 4, rows, 4)`` float32: rows of 16 bytes. In ``wgmma``'s unswizzled K-major layout a core
  matrix is 8 rows of 16 bytes, so a tap's window at any row offset *is* an operand: a
  shared-memory descriptor that starts at the window's first row, 128 bytes between core
  matrices along M (8 rows), a plane's bytes along K (4 channels). No window is loaded into
  registers or split; a tile's products are one ``m64nCk8`` per tap and 8 channels.
- **TF32 products**, the precision of XLA's convolutions at JAX's default matmul precision
  (and of the Triton kernels of :mod:`naisnet_jax.kernels.triton_conv`): about 11 significant bits, where
  the split engine's three bfloat16 products keep about 16. :func:`naisnet_jax.kernels.unroll_tied_conv`
  takes these kernels unless the default precision asks for more (``"highest"``, ``"float32"``).

Global memory keeps :class:`naisnet_jax.kernels.common.Layout`'s row-major buffers (``rows`` a multiple of 8, so
that every TMA chunk moves whole 128-byte groups). The inputs move in by TMA a plane at a time,
as ``(rows, 4)`` boxes of the ``(rows, C)`` buffer, once a kernel. The saved states and ``s_k``
go out a tile at a time through a row-major staging slot per warpgroup: boxes of 16-byte rows
move at a fraction of the bandwidth. A tile's state goes from planes to registers and back
through :func:`load_tile` and :func:`store_tile` (the WGMMA register layout, 8-byte accesses).

At 64 channels (ReLU, at a precision that allows TF32) the float32 taps take 147 KB, so the state has
one buffer (:func:`buffers_of`). A step computes every tile's products, the warpgroups meet, and
then the step writes. The drive comes in a tile at a time through the staging slot, the taps
one copy a tap (:func:`tap_copies`). For XLA's weight gradient the saved states and ``s_k``
leave as images (``interior=True``: :func:`interior_runs`, a copy a run of pixels).

Pallas' interpreter cannot run ``wgmma``: the values are checked on a GPU
(``benchmarks/hopper_checks.py``), the tests lower the kernels for CUDA on the CPU, and their
speed against the split-bfloat16 and Triton engines is in BENCHMARKS.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from naisnet_jax.kernels.common import act
from naisnet_jax.kernels.tf32_planes import (
    PLANE,
    load_tile,
    products,
    store_tile,
    swizzle_of,
    taps_transforms,
    tile_of,
)
from naisnet_jax.kernels.wgmma_common import (
    MAX_WARPGROUPS,
    SIGN_DTYPE,
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


def saved_bytes(activation: str) -> int:
    """Bytes of a saved pre-activation (:func:`naisnet_jax.kernels.wgmma_common.saved_dtype`)."""
    return jnp.dtype(saved_dtype(activation)).itemsize


#: Channels the kernels take. At 64 the float32 taps take 147 KB of shared memory, so the state
#: is single-buffered there (:func:`buffers_of`).
CHANNELS = (16, 32, 64)


def buffers_of(C: int) -> int:
    """State buffers in shared memory: two (a step reads one while it writes the other), one at
    64 channels (a step's products first, then, after the warpgroups meet, its writes)."""
    return 1 if C > 32 else 2


def smem_bytes(layout, C: int, warpgroups: int, activation: str = "relu") -> int:
    """Shared memory of a program: the planes' buffers (:func:`buffers_of`), the ``z_k`` staging
    slots, one float32 row-major slot per warpgroup, the float32 taps, and 1 KiB for barriers and
    alignment."""
    staging = warpgroups * staging_slots(layout, warpgroups) * M * C * saved_bytes(activation)
    return buffers_of(C) * layout.rows * C * 4 + staging + warpgroups * M * C * 4 + 9 * C * C * 4 + 1024


def choose_warpgroups(layout, C: int, activation: str = "relu") -> int | None:
    """The most warpgroups (up to ``wgmma_common.MAX_WARPGROUPS``) that divide the tiles and fit
    in shared memory, or ``None`` if not even one fits."""
    fits = [nw for nw in range(1, MAX_WARPGROUPS + 1) if tiles_of(layout) % nw == 0]
    fits = [nw for nw in fits if smem_bytes(layout, C, nw, activation) <= SMEM_BYTES]
    return max(fits) if fits else None


def unsupported(layout, x0, kernel, activation: str) -> str | None:
    """``None`` if these kernels take the block (``layout`` with rows a multiple of 8), else why not
    (``wgmma_common.unsupported_shape`` with :data:`CHANNELS`, and this module's shared memory)."""
    C = x0.shape[-1]
    why = unsupported_shape(layout, x0, kernel, activation, CHANNELS)
    if why is None and choose_warpgroups(layout, C, activation) is None:
        need = smem_bytes(layout, C, 1, activation)
        shape = "x".join(str(d) for d in x0.shape[1:])
        return f"a {shape} state needs {need} bytes of shared memory, more than {SMEM_BYTES}"
    return why


def _out_rows(layout) -> list[tuple[int, int]]:
    """The TMA chunks that send a state's tiled rows out of the planes: whole groups of 8 rows
    (a plane's 128 bytes), from the group holding the first tiled row to the one holding the last."""
    start = layout.slack // 8 * 8
    stop = min(layout.rows, -(-(layout.slack + tiles_of(layout) * M) // 8) * 8)
    return tma_chunks(start, stop)


def interior_runs(layout, q0: int) -> list[tuple[int, int, int, int]]:
    """The image's pixels among a tile's rows (the tile from row ``q0`` of the padded image): a
    ``(tile row, image row, first column, length)`` for each run of them, in order."""
    runs = []
    for i in range(layout.height):
        start = (i + layout.pad_h) * layout.padded_width + layout.pad_w
        lo, hi = max(start, q0), min(start + layout.width, q0 + M)
        if lo < hi:
            runs.append((lo - q0, i, lo - start, hi - lo))
    return runs


def _send_tile(layout, stage, dst, j, per, wg, nw, interior):
    """Sends the staging slot ``stage`` ``(M, C)``, this warpgroup's tile ``j``, to ``dst``: the
    buffer ``(rows, C)`` of a pattern, or with ``interior`` its image's pixels ``(H W, C)`` (the
    tile's runs of pixels, one copy each, committed as one group). Flat images keep a vmapped
    kernel's outputs within TMA's five dimensions."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not interior:
        q0 = (wg * per + j) * M
        plgpu.copy_smem_to_gmem(stage, dst.at[pl.ds(layout.slack + q0, M)])
        return
    for w in range(nw):  # a tile's runs are static: one branch a warpgroup

        def send(w=w):
            runs = interior_runs(layout, (w * per + j) * M)
            for r, (a, i, c0, length) in enumerate(runs):
                plgpu.copy_smem_to_gmem(
                    stage.at[pl.ds(a, length)],
                    dst.at[pl.ds(i * layout.width + c0, length)],
                    commit_group=r == len(runs) - 1,
                )

        if nw == 1:
            send()
        else:
            pl.when(wg == w)(send)


def tap_copies(C: int) -> int:
    """TMA copies that bring the taps in: one, or one a tap where a row spans more than one
    swizzle group (64 channels): the swizzled ``(9, C, C)`` then tiles into five dimensions, six
    under ``vmap``, more than TMA takes."""
    return 1 if 4 * C <= swizzle_of(C) else 9


def _taps_in(src, taps, bar):
    """The taps ``(9, C, C)`` from global into shared memory, as :func:`tap_copies` says."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if tap_copies(taps.shape[-1]) == 1:
        plgpu.copy_gmem_to_smem(src, taps, bar)
        return
    for t in range(taps.shape[0]):
        plgpu.copy_gmem_to_smem(src.at[t], taps.at[t], bar)


def _planes_in(src, planes, bar, chunks):
    """``src`` ``(rows, C)`` in global memory into ``planes`` ``(C / 4, rows, 4)`` by TMA."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for g in range(planes.shape[0]):
        for s0, size in chunks:
            plgpu.copy_gmem_to_smem(
                src.at[pl.ds(s0, size), pl.ds(PLANE * g, PLANE)], planes.at[g, pl.ds(s0, size)], bar
            )


def _planes_out(planes, dst, chunks):
    """``planes`` ``(C / 4, rows, 4)`` into ``dst`` ``(rows, C)`` in global memory by TMA."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for g in range(planes.shape[0]):
        for s0, size in chunks:
            plgpu.copy_smem_to_gmem(planes.at[g, pl.ds(s0, size)], dst.at[pl.ds(s0, size), pl.ds(PLANE * g, PLANE)])


def _forward_kernel(layout, offsets, steps, h, activation, save, nw, interior, x0_ref, d_ref, taps_g, xs_ref, *rest):
    """``wgmma_split._forward_kernel`` with the state in planes and the windows as views. Saved
    states go out tile by tile through a row-major staging slot (a box of 16-byte rows, one a
    plane, would move at a fraction of the bandwidth), with ``interior`` as images; without
    ``save`` the last state goes out by planes."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    xk_ref, rest = (rest[0], rest[1:]) if interior else (None, rest)  # images: x_K apart from x_0 .. x_{K-1}
    zs_ref, scratch = (rest[0], rest[1:]) if save else (None, rest)
    state, zstage, xstage, taps, bar, *dbar, sync = scratch
    single = state.shape[0] == 1  # one buffer: a step's products first, then (after a meeting) its writes
    mask = saves_mask(activation)
    n = jax.lax.axis_index("n")
    wg, lead_only, everyone = warpgroup_team(nw)
    S, C = layout.slack, state.shape[1] * PLANE
    per = tiles_of(layout) // nw
    slots = zstage.shape[1]
    region = tma_chunks(0, layout.rows)

    def tiles():
        return [(wg * per + j) * M for j in range(per)]  # this warpgroup's tiles' first rows

    @lead_only
    def _():  # x_0 into buffer 0, the drive into buffer 1 (free until step 0 writes it)
        _taps_in(taps_g, taps, bar)  # TMA swizzles them on the way in
        _planes_in(x0_ref.at[n], state.at[0], bar, region)
        if not single:
            _planes_in(d_ref.at[n], state.at[1], bar, region)

    drive = []
    if single:  # the drive's tiles through the row-major slot, one at a time
        first = tiles()
        for q0 in first:
            plgpu.copy_gmem_to_smem(d_ref.at[n, pl.ds(S + q0, M)], xstage.at[wg], dbar[0].at[wg])
            plgpu.barrier_wait(dbar[0].at[wg])
            drive.append(load_registers(xstage, wg, slice(None), slice(None)))
            plgpu.commit_smem()  # every thread has read the slot before it is refilled
    plgpu.barrier_wait(bar)
    if not single:
        first = tiles()
        drive = [load_tile(tile_of(state, 1, S + q0)) for q0 in first]

    def send_x(value, k, j, pending):  # this warpgroup's tile j of x_k out through the staging slot
        plgpu.wait_smem_to_gmem(pending, wait_read_only=True)  # the slot's last copy has read it
        xstage[wg] = value
        plgpu.commit_smem()
        if not interior or isinstance(k, int):
            _send_tile(layout, xstage.at[wg], xs_ref.at[k, n], j, per, wg, nw, interior)
            return
        pl.when(k < steps)(lambda: _send_tile(layout, xstage.at[wg], xs_ref.at[k, n], j, per, wg, nw, True))
        pl.when(k == steps)(lambda: _send_tile(layout, xstage.at[wg], xk_ref.at[n], j, per, wg, nw, True))

    if save:  # xs[0] = x_0
        for j, q0 in enumerate(first):
            send_x(load_tile(tile_of(state, 0, S + q0)), 0, j, 0)

    plgpu.commit_smem()
    everyone(sync)  # every warpgroup holds its drive before step 0 overwrites buffer 1

    def step(k, carry):
        src, dst = (0, 0) if single else (k % 2, 1 - k % 2)
        if single:  # every window of x_k read before any tile of x_{k+1} is written
            zs = [products(layout, offsets, state, src, q0, taps) + drive[j] for j, q0 in enumerate(first)]
            everyone(sync)
        for j, q0 in enumerate(first):
            rows = pl.ds(S + q0, M)
            z = zs[j] if single else products(layout, offsets, state, src, q0, taps) + drive[j]
            x = load_tile(tile_of(state, src, S + q0))
            keep, zero = pixel_mask(layout, q0, C), jnp.zeros_like(z)
            new = jnp.where(keep, x + h * act(activation, z), zero)
            store_tile(new, tile_of(state, dst, S + q0))
            if save:
                # copies in flight, newest first: z of the tile before (if any), then older ones
                send_x(new, k + 1, j, 1)
                # in flight: x of this tile, z of the one before; the slot's last user is older
                plgpu.wait_smem_to_gmem(slots, wait_read_only=True)
                saved = jnp.where(keep, jnp.where(z > 0, jnp.ones_like(z), zero) if mask else z, zero)
                zstage[wg, j % slots] = saved.astype(zstage.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(zstage.at[wg, j % slots], zs_ref.at[k, n, rows])
        plgpu.commit_smem()  # this warpgroup's tiles of x_{k+1} are in buffer dst
        everyone(sync)  # x_{k+1} complete; nobody reads buffer src any more
        if not save:

            @pl.when(k == steps - 1)
            def _():
                lead_only(lambda: _planes_out(state.at[dst], xs_ref.at[0, n], _out_rows(layout)))

        return carry

    jax.lax.fori_loop(0, steps, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _backward_kernel(
    layout, offsets, steps, h, activation, nw, interior, gk_ref, zs_ref, taps_g, g0_ref, ss_ref, *rest
):
    """``wgmma_split._backward_kernel`` with ``s_k`` in planes and the windows as views; each
    ``s_k`` goes out tile by tile through a row-major staging slot (with ``interior`` as images),
    ``g_0`` by planes."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    sbuf, zbuf, sstage, taps, bar, zbar, sync = rest
    single = sbuf.shape[0] == 1  # one buffer: a step's products first, then (after a meeting) its writes
    n = jax.lax.axis_index("n")
    wg, lead_only, everyone = warpgroup_team(nw)
    S, C = layout.slack, sbuf.shape[1] * PLANE
    per = tiles_of(layout) // nw
    slots = zbuf.shape[1]
    first = [(wg * per + j) * M for j in range(per)]  # this warpgroup's tiles' first rows
    region = tma_chunks(0, layout.rows)

    def fetch_z(k, j):  # z_k's tile j (of this warpgroup) into its slot j % slots
        plgpu.copy_gmem_to_smem(
            zs_ref.at[k, n, pl.ds(S + first[j], M)], zbuf.at[wg, j % slots], zbar.at[slots * wg + j % slots]
        )

    def slope_tile(j, g):  # h act'(z) g for the tile whose z is in its slot, masked
        plgpu.barrier_wait(zbar.at[slots * wg + j % slots])
        z = load_registers(zbuf, wg, j % slots, slice(None), slice(None)).astype(g.dtype)  # ReLU: saved 1[z > 0]
        return masked_slope(layout, first[j], activation, h, z, g)

    def put_s(j, s, buf, k):  # s_k's tile j into planes buf (windows) and out (row-major)
        store_tile(s, tile_of(sbuf, buf, S + first[j]))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging slot's last copy has read it
        sstage[wg] = s
        plgpu.commit_smem()  # also: every thread is done with z's slot j % slots before it is refilled
        _send_tile(layout, sstage.at[wg], ss_ref.at[k, n], j, per, wg, nw, interior)

    into = 0 if single else 1

    @lead_only
    def _():
        _taps_in(taps_g, taps, bar)
        _planes_in(gk_ref.at[n], sbuf.at[into], bar, region)  # g_K through buffer 1 into registers

    plgpu.barrier_wait(bar)
    g = [load_tile(tile_of(sbuf, into, S + q0)) for q0 in first]
    if single:
        everyone(sync)  # every g_K read before s_{K-1} overwrites it
    fetch_z(steps - 1, 0)
    for j in range(per):  # s_{K-1} into buffer 0
        if j + 1 < per:
            fetch_z(steps - 1, j + 1)
        put_s(j, slope_tile(j, g[j]), 0, steps - 1)
    everyone(sync)  # s_{K-1} complete, and every g_K read out of buffer 1

    def step(i, g, last=False):  # k = K-1-i: g_k from s_k (buffer i % 2), then s_{k-1} (the other)
        k = steps - 1 - i
        src, dst = (0, 0) if single else (i % 2, 1 - i % 2)
        if not last:
            fetch_z(k - 1, 0)
        g = list(g)
        if single:  # every window of s_k read before any tile of s_{k-1} is written
            accs = [products(layout, offsets, sbuf, src, q0, taps) for q0 in first]
            everyone(sync)
        for j in range(per):
            if not last and j + 1 < per:
                fetch_z(k - 1, j + 1)
            acc = accs[j] if single else products(layout, offsets, sbuf, src, first[j], taps)
            g[j] = jnp.where(pixel_mask(layout, first[j], C), g[j] + acc, jnp.zeros_like(acc))
            if not last:
                put_s(j, slope_tile(j, g[j]), dst, k - 1)
        if not last:
            everyone(sync)  # s_{k-1} complete; nobody reads buffer src any more
        return tuple(g)

    g = jax.lax.fori_loop(0, steps - 1, step, tuple(g))
    g = step(steps - 1, g, last=True)  # k = 0: g_0 only
    # the buffer the last step did not read: every warpgroup was done reading it at the previous
    # step's meeting
    free = 0 if single else 1 - (steps - 1) % 2  # one buffer: its last reads were before the last meeting
    for j, q0 in enumerate(first):
        store_tile(g[j], tile_of(sbuf, free, S + q0))
    plgpu.commit_smem()
    everyone(sync)
    lead_only(lambda: _planes_out(sbuf.at[free], g0_ref.at[n], _out_rows(layout)))
    plgpu.wait_smem_to_gmem(0)


def _mosaic_call(body, layout, taps, out_type, barriers, nw, N, staging=jnp.float32):
    """``body`` as a Mosaic GPU kernel, one program of ``nw`` warpgroups per pattern, with the
    scratch both kernels use: the state buffers in planes ``(buffers_of(C), C / 4, rows, 4)``, two ``(M, C)``
    staging slots of dtype ``staging`` per warpgroup (``z_k`` out or in), one float32 slot per
    warpgroup (states out, row-major), the taps ``(9, N, K)`` float32 swizzled,
    then ``barriers`` and a barrier for the warpgroups to meet at. Returns ``f(*buffers)``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    C = taps.shape[-1]
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((buffers_of(C), C // PLANE, layout.rows, PLANE), jnp.float32),
            plgpu.SMEM((nw, staging_slots(layout, nw), M, C), staging),
            plgpu.SMEM((nw, M, C), jnp.float32),  # each warpgroup's row-major slot for states out
            plgpu.SMEM((9, C, C), jnp.float32, transforms=taps_transforms(C)),
            *barriers,
            plgpu.Barrier(num_arrivals=nw),
        ],
        grid=(N,),  # one program a pattern
        grid_names=("n",),
        **(dict(num_threads=nw, thread_name="wg") if nw > 1 else {}),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    return lambda *buffers: call(*buffers, taps.astype(jnp.float32))


def _check_program(layout, warpgroups: int, C: int, activation: str) -> None:
    check_warpgroups(layout, warpgroups)
    if smem_bytes(layout, C, warpgroups, activation) > SMEM_BYTES:
        raise ValueError(
            f"warpgroups={warpgroups!r}: a program needs {smem_bytes(layout, C, warpgroups, activation)} bytes of "
            f"shared memory, more than {SMEM_BYTES} (choose_warpgroups gives the most that fit)"
        )
    if layout.rows % 8:
        raise ValueError(
            f"the TF32 kernels need a layout whose rows are a multiple of 8 (Layout.of(..., align=8)), "
            f"got rows={layout.rows}"
        )


def _check_interior(C: int, interior: bool) -> None:
    if interior and C * 4 % 128:  # each run of pixels leaves the staging slot from its own row
        raise ValueError(
            f"interior=True sends runs of pixels from any row of a tile, which TMA needs 128-byte aligned: "
            f"rows of {C} float32 channels ({C * 4} bytes) are not; use interior=False"
        )


def fused_forward(layout, x0b, db, taps, *, steps, h, activation, save, warpgroups, interior=False):
    """As :func:`naisnet_jax.kernels.wgmma_split.fused_forward`, in TF32 (``layout.rows`` a multiple of 8).
    ``interior`` (with ``save``; at least 32 channels): the states as images, not buffers, and
    ``x_K`` apart: ``(x_0 .. x_{K-1} (K, N, H, W, C), x_K (N, H, W, C), zs)`` (XLA's weight
    gradient takes the first as it is: no copy out of the buffers)."""
    _check_program(layout, warpgroups, x0b.shape[-1], activation)
    _check_interior(x0b.shape[-1], interior and save)
    call = _forward_call(layout, steps, float(h), activation, bool(save), warpgroups, bool(interior and save))
    return call(x0b, db, taps)


def fused_backward(layout, gb, zs, taps, *, steps, h, activation, warpgroups, interior=False):
    """As :func:`naisnet_jax.kernels.wgmma_split.fused_backward`, in TF32 (for ReLU, ``zs`` the saved
    signs, or ``z_k`` itself, reduced to its sign first). ``interior``: the ``s_k`` as images
    ``(K, N, H, W, C)``, as :func:`fused_forward`'s."""
    if saves_mask(activation) and zs.dtype != SIGN_DTYPE:  # z_k given: ReLU needs only its sign
        zs = (zs > 0).astype(SIGN_DTYPE)
    _check_program(layout, warpgroups, gb.shape[-1], activation)
    _check_interior(gb.shape[-1], interior)
    return _backward_call(layout, steps, float(h), activation, warpgroups, bool(interior))(gb, zs, taps)


@functools.cache
def _forward_call(layout, steps, h, activation, save, warpgroups, interior):
    return jax.jit(
        functools.partial(
            _forward,
            layout,
            steps=steps,
            h=h,
            activation=activation,
            save=save,
            warpgroups=warpgroups,
            interior=interior,
        )
    )


@functools.cache
def _backward_call(layout, steps, h, activation, warpgroups, interior):
    return jax.jit(
        functools.partial(
            _backward, layout, steps=steps, h=h, activation=activation, warpgroups=warpgroups, interior=interior
        )
    )


def _pixels(layout, out: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """``(..., N, rows, C)`` -> the images' pixels, ``(..., N, H W, C)``."""
    return jax.ShapeDtypeStruct(out.shape[:-2] + (layout.height * layout.width, out.shape[-1]), out.dtype)


def _as_images(layout, pixels):
    """``(..., H W, C)`` -> ``(..., H, W, C)``."""
    return pixels.reshape(pixels.shape[:-2] + (layout.height, layout.width, pixels.shape[-1]))


def _forward(layout, x0b, db, taps, *, steps, h, activation, save, warpgroups, interior=False):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    N, _, C = x0b.shape
    out_type, saved = forward_out_type(layout, N, C, steps, save, activation), saved_dtype(activation)
    if interior:  # x_0 .. x_{K-1} and x_K as images (the first for XLA's weight gradient as they are)
        head = _pixels(layout, out_type[0].update(shape=(steps,) + out_type[0].shape[1:]))
        out_type = (head, head.update(shape=head.shape[1:]), *out_type[1:])
    single = buffers_of(C) == 1  # the drive then comes in tile by tile, on a barrier per warpgroup
    loads = tap_copies(C) + (1 if single else 2) * (C // PLANE) * len(tma_chunks(0, layout.rows))
    barriers = [plgpu.Barrier(num_arrivals=loads)]
    if single:
        barriers.append(plgpu.Barrier(num_arrivals=1, num_barriers=warpgroups))
    body = functools.partial(
        _forward_kernel, layout, layout.offsets(3, 3), steps, h, activation, save, warpgroups, interior
    )
    body.__name__ = "hopper_tf32_forward_kernel"  # the kernel's name in a profile
    # tap t as (N, K) = (C_out, C_in): TF32's B is K-major
    transposed = jnp.swapaxes(taps, 1, 2)
    out = _mosaic_call(body, layout, transposed, out_type, barriers, warpgroups, N, saved)(x0b, db)
    return (_as_images(layout, out[0]), _as_images(layout, out[1]), out[2]) if interior else out


def _backward(layout, gb, zs, taps, *, steps, h, activation, warpgroups, interior=False):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    N, _, C = gb.shape
    mirrored = [-off for off in layout.offsets(3, 3)]
    out_type = backward_out_type(layout, N, C, steps)
    if interior:
        out_type = (out_type[0], _pixels(layout, out_type[1]))
    barriers = [
        plgpu.Barrier(num_arrivals=tap_copies(C) + (C // PLANE) * len(tma_chunks(0, layout.rows))),
        plgpu.Barrier(num_arrivals=1, num_barriers=staging_slots(layout, warpgroups) * warpgroups),
    ]
    body = functools.partial(_backward_kernel, layout, mirrored, steps, h, activation, warpgroups, interior)
    body.__name__ = "hopper_tf32_backward_kernel"
    # the transposed convolution's tap t is W_t^T, (K, N) = (C_out, C_in); stored (N, K): W_t itself
    g0, ss = _mosaic_call(body, layout, taps, out_type, barriers, warpgroups, N, staging=zs.dtype)(gb, zs)
    return g0, (_as_images(layout, ss) if interior else ss)
