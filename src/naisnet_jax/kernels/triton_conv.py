"""The Triton engine of a conv block: its K steps in one GPU kernel each way, and the kernel's
weight gradient in a third (Pallas' Triton backend; any CUDA GPU).

XLA runs a block ``X_{k+1} = X_k + h act(conv(X_k, C) + drive)`` as K small convolutions and K
elementwise fusions forward, and about three times as many kernels backward: at the CIFAR shapes
(16 to 64 channels) each is a few microseconds of work, and a 54-block NAIS-Net10 step is bound
by the latency of some 3,000 launches, not by arithmetic. Here one kernel runs a block's K
forward steps and one its K backward steps; one program per pattern keeps the pattern's state
in the L2 cache between steps, and every 3x3 convolution is nine ``(M, C) @ (C, C)`` products
on the tensor cores. A tile loads nine overlapping windows and moves each into the tensor
cores' layout (Pallas' Triton backend gives a program no shared memory to hold a tile and its
halo once).

The state lives in the padded-rows layout of :class:`naisnet_jax.kernels.common.Layout`: tap
``(a, b)`` at row ``r`` reads row ``r + a (W + 2q) + b``, a contiguous window, so a tap over
``M`` rows is one tile load; rows outside the image are computed like the others and written
as zero, which keeps the zero padding for the next step. A step writes a new buffer, and a
barrier separates the steps (the next step reads rows that other threads wrote).

Backward (the stacked form of :mod:`naisnet_jax.kernels.stacked`): the kernel carries ``g_k``
back, ``s_k = h act'(z_k) g_{k+1}``, ``g_k = g_{k+1} + conv^T(s_k)`` (the transposed convolution:
the kernel's taps mirrored, their channel matrices transposed), and writes every ``s_k``. The
weight-gradient kernel sums tap ``t``'s ``sum_k sum_p x_k(p + offset_t)^T s_k(p)``, one program
a run of a pattern's rows over every step, and the drive's gradient ``sum_k s_k`` as it reads
them (cuDNN's weight-gradient convolution over the stacked, zero-padded states costs more than
the two block kernels together at 16 channels). Its tiling: :mod:`naisnet_jax.kernels.tuning`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from naisnet_jax.kernels.common import Layout, act, index, pallas_triton, scaled_slope
from naisnet_jax.kernels.tuning import WGRAD_CHUNKS, WGRAD_STAGES, wgrad_tiling

Array = jax.Array


def _inside(layout: Layout, tile_start) -> Array:
    """``(M, 1)`` mask of the tile's rows that are pixels of the image (not padding)."""
    return layout.is_pixel(tile_start + lax.broadcasted_iota(jnp.int32, (layout.tile_rows, 1), 0))


def _over_tiles(layout, config, body) -> None:
    """``body(t, None)`` for every tile ``t`` of a step: unrolled or as a loop."""
    if config.unroll_tiles:
        for t in range(layout.tiles):
            body(t, None)
    else:
        lax.fori_loop(0, layout.tiles, body, None)


def _barrier(interpret: bool) -> None:
    if not interpret:  # the interpreter runs a program's statements in order
        from jax.experimental.pallas import triton as plgpu

        plgpu.debug_barrier()


def _windows(ref, lead, start, rows, offsets) -> list:
    """``ref[*lead, start + offset_t : + rows]`` for every tap ``t``, all loads issued first.

    Issued together, the loads cost one round trip to memory, not one per tap (each
    product waits for its operand's move into the layout of the tensor cores). One
    indexer per load: Triton's lowering takes no ``ref.at[...][...]``."""
    from jax.experimental import pallas as pl

    return [ref[(*lead, pl.ds(start + off, rows))] for off in offsets]


def _conv(windows, taps):
    """``sum_t windows[t] @ taps[t]``: one tile of the convolution."""
    acc = None
    for window, tap in zip(windows, taps):
        part = jnp.dot(window, tap, preferred_element_type=window.dtype)
        acc = part if acc is None else acc + part
    return acc


def _taps_of(w_ref, count, hoisted):
    """The kernel's taps: loaded once here (``hoisted``) or a function loading them per tile."""
    if hoisted:
        taps = [w_ref[t] for t in range(count)]
        return lambda: taps
    return lambda: [w_ref[t] for t in range(count)]


def _forward_kernel(layout, offsets, steps, h, activation, save, config, x0_ref, d_ref, w_ref, xs_ref, *zs):
    """Program ``n`` runs pattern ``n``'s K steps. ``save``: keep every state in ``xs_ref``
    and every pre-activation in ``zs``; else ``xs_ref`` holds two buffers used in turn."""
    from jax.experimental import pallas as pl

    n = index(pl.program_id(0))
    M, S = layout.tile_rows, layout.slack
    centre = offsets.index(0)
    taps_now = _taps_of(w_ref, len(offsets), config.hoist_taps)

    def slot(k):
        return k if save else k % 2

    def copy(t, carry):
        t = index(t)
        rows = pl.ds(S + t * M, M)
        xs_ref[0, n, rows] = x0_ref[n, rows]
        return carry

    _over_tiles(layout, config, copy)
    _barrier(config.interpret)

    def step(k, carry):
        k = index(k)
        src = slot(k)

        def tile(t, carry):
            q0 = index(t) * M
            rows = pl.ds(S + q0, M)
            windows = _windows(xs_ref, (src, n), S + q0, M, offsets)
            taps, d = taps_now(), d_ref[n, rows]
            x = windows[centre]
            z = _conv(windows, taps) + d
            a = act(activation, z)
            inside = _inside(layout, q0)
            zero = jnp.zeros_like(x)
            xs_ref[slot(k + 1), n, rows] = jnp.where(inside, x + h * a, zero)
            if save:
                zs[0][k, n, rows] = jnp.where(inside, z, zero)
            return carry

        _over_tiles(layout, config, tile)
        _barrier(config.interpret)
        return carry

    lax.fori_loop(0, steps, step, 0)


def _backward_kernel(layout, offsets, steps, h, activation, config, gk_ref, zs_ref, wt_ref, g_ref, s_ref):
    """Program ``n`` carries pattern ``n``'s gradient from ``x_K`` back to ``x_0``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    n = index(pl.program_id(0))
    M, S = layout.tile_rows, layout.slack
    mirrored = [-off for off in offsets]
    taps_now = _taps_of(wt_ref, len(offsets), config.hoist_taps)

    def first(t, carry):  # g_K and s_{K-1}
        q0 = index(t) * M
        rows = pl.ds(S + q0, M)
        g = gk_ref[n, rows]
        g_ref[n, rows] = g
        s = scaled_slope(activation, h, zs_ref[steps - 1, n, rows], g)
        s_ref[steps - 1, n, rows] = jnp.where(_inside(layout, q0), s, jnp.zeros_like(s))
        return carry

    _over_tiles(layout, config, first)
    _barrier(config.interpret)

    def step(i, carry):  # k = K-1 .. 0: g_k = g_{k+1} + conv^T(s_k), then s_{k-1}
        k = steps - 1 - index(i)
        prev = jnp.maximum(k - 1, 0)

        def tile(t, carry):
            q0 = index(t) * M
            rows = pl.ds(S + q0, M)
            windows = _windows(s_ref, (k, n), S + q0, M, mirrored)
            taps, g, z = taps_now(), g_ref[n, rows], zs_ref[prev, n, rows]
            inside = _inside(layout, q0)
            g = g + _conv(windows, taps)
            g = jnp.where(inside, g, jnp.zeros_like(g))
            g_ref[n, rows] = g
            s = scaled_slope(activation, h, z, g)
            s = jnp.where(inside, s, jnp.zeros_like(s))
            plgpu.store(s_ref.at[prev, n, rows], s, mask=jnp.broadcast_to(k > 0, s.shape))
            return carry

        _over_tiles(layout, config, tile)
        _barrier(config.interpret)
        return carry

    lax.fori_loop(0, steps, step, 0)


def _rows_in(first, rows, start, end) -> Array:
    """``(rows, 1)``: which of the rows ``first ..`` lie in the tiled rows ``[start, end)``
    (outside them is slack, which nothing writes)."""
    r = first + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return (r >= start) & (r < end)


def _tap_products(acc, s, xs_ref, k, n, q, offsets, inside=None) -> tuple:
    """``acc_t + s^T @ x_k(window t)`` for every tap ``t`` (its row offset ``offsets[t]``): one
    tile of step ``k``, pattern ``n``, the windows masked to zero outside the tiled rows where
    ``inside(t)`` says so (``s`` is zero there, but ``0 x NaN`` is not); ``inside=None``: the
    tile's windows lie inside them."""
    from jax.experimental import pallas as pl

    sT, rows = s.T, s.shape[0]
    out = []
    for t, (acc_t, off) in enumerate(zip(acc, offsets)):
        x = xs_ref[k, n, pl.ds(q + off, rows)]
        if inside is not None:
            x = jnp.where(inside(t), x, jnp.zeros_like(x))
        out.append(acc_t + jnp.dot(sT, x, preferred_element_type=x.dtype))
    return tuple(out)


def _edge_split(layout, offsets, rows, first, count) -> tuple:
    """``(a, b)``: of a program's ``count`` tiles of ``rows`` rows, from tile ``first`` of the
    state on, those before ``a`` and from ``b`` on have windows reaching into the slack rows (the
    first and last few tiles of the state); those in ``[a, b)`` lie wholly inside the tiled rows
    and need no masks (masking every window costs a quarter of the kernel's time: BENCHMARKS.md)."""
    total = layout.tiles * layout.tile_rows // rows
    lo = -(-max(0, -min(offsets)) // rows)  # tiles whose windows start below the tiled rows
    hi = total - -(-max(0, max(offsets)) // rows)  # from here on, windows end past them
    a = jnp.clip(lo - first, 0, count)
    return a, jnp.clip(hi - first, a, count)


def _sum_over_tiles(layout, offsets, rows, first, count, acc, tile, taps=None) -> tuple:
    """``acc = tile(q, acc, inside)`` over ``count`` tiles of ``rows`` rows from tile ``first`` of
    the state (``q`` a tile's first row).

    Only the state's first and last few tiles have windows that reach into the slack rows, which
    nothing writes; for them ``inside(t)`` says which rows of tap ``t``'s window lie in the tiled
    rows (masks made once a tile), for the rest it is ``None`` (no masks: :func:`_edge_split`,
    which finds those tiles from all the kernel's ``offsets``). ``taps``: the row offsets of the
    taps the masks are for (default ``offsets``; they may be traced values)."""
    S = layout.slack
    end = S + layout.tiles * layout.tile_rows
    taps = offsets if taps is None else taps

    def body(masked):
        def run(i, acc):
            q = S + (first + index(i)) * rows
            masks = [_rows_in(q + off, rows, S, end) for off in taps] if masked else None
            return tile(q, acc, None if masks is None else masks.__getitem__)

        return run

    a, b = _edge_split(layout, offsets, rows, first, count)
    acc = lax.fori_loop(index(0), index(a), body(True), acc)
    acc = lax.fori_loop(index(a), index(b), body(False), acc)
    return lax.fori_loop(index(b), index(count), body(True), acc)


def _sum_tiles(layout, offsets, rows, c, chunks, p, dw_ref, tile, taps=None) -> None:
    """The skeleton of both weight-gradient kernels: from zero accumulators for every tap, run
    ``tile`` over the ``c``-th of ``chunks`` equal runs of the state's tiles of ``rows`` rows
    (:func:`_sum_over_tiles`), then write the sums to ``dw_ref[p]``. ``taps``: the row offsets of
    the taps this program sums, if not all ``offsets``."""
    count = layout.tiles * layout.tile_rows // rows // chunks  # tiles a program sums
    taps = offsets if taps is None else taps
    acc = tuple(jnp.zeros((dw_ref.shape[-1],) * 2, dw_ref.dtype) for _ in taps)
    acc = _sum_over_tiles(layout, offsets, rows, c * count, count, acc, tile, taps)
    for t, acc_t in enumerate(acc):
        dw_ref[p, t] = acc_t


def _weight_grad_sum_kernel(layout, offsets, steps, rows, chunks, xs_ref, s_ref, dw_ref, sum_ref):
    """Program ``p = n chunks + c`` sums pattern ``n``'s share of the weight gradient over the
    ``c``-th of ``chunks`` equal runs of its rows, every step in turn for each tile of ``rows``
    rows (``dW_t^T += s_k^T @ x_k(window t)``, tap by tap: :func:`_sum_tiles`), and writes the
    tile's ``sum_k s_k`` (the drive's gradient) on the way: the ``s_k`` it loads for the
    products anyway, so no second pass over them (the slack rows of ``sum_ref`` are not written).

    Narrow programs (:func:`naisnet_jax.kernels.tuning.wgrad_tiling`): the products have a
    ``(C, C)`` output and a long reduction over rows, which a wider program would give every
    warp whole. The windows of the state's first and last few tiles reach into the slack rows,
    which nothing writes; those windows are masked to zero (``s`` is zero there, but ``0 x NaN``
    is not), the others are not (:func:`_edge_split`)."""
    from jax.experimental import pallas as pl

    p = index(pl.program_id(0))
    n, c = p // chunks, p % chunks

    def tile(q, acc, inside):
        def step(k, carry):
            acc, total = carry
            k = index(k)
            s = s_ref[k, n, pl.ds(q, rows)]
            return _tap_products(acc, s, xs_ref, k, n, q, offsets, inside), total + s

        acc, total = lax.fori_loop(0, steps, step, (acc, jnp.zeros((rows, sum_ref.shape[-1]), sum_ref.dtype)))
        sum_ref[n, pl.ds(q, rows)] = total
        return acc

    _sum_tiles(layout, offsets, rows, c, chunks, p, dw_ref, tile)


def forward(layout, offsets, x0b, db, taps, *, steps, h, activation, save, config):
    """The Triton forward kernel on buffers: ``save`` gives ``(xs, zs)``, every state ``x_0 ..
    x_K`` ``(K + 1, N, rows, C)`` and every pre-activation ``(K, N, rows, C)``; else ``(xs,)``,
    two buffers used in turn (``x_K`` in ``xs[K % 2]``)."""
    N, C = x0b.shape[0], x0b.shape[-1]
    body = functools.partial(_forward_kernel, layout, offsets, steps, h, activation, save, config)
    states = jax.ShapeDtypeStruct(((steps + 1) if save else 2, N, layout.rows, C), x0b.dtype)
    out_shape = (states, jax.ShapeDtypeStruct((steps, N, layout.rows, C), x0b.dtype)) if save else (states,)
    return pallas_triton(body, out_shape, N, config)(x0b, db, taps)


def backward(layout, offsets, g, zs, taps, *, steps, h, activation, config):
    """The Triton backward kernel from the gradient ``g`` at ``x_K`` (an image): ``(g_0, s_0 ..
    s_{K-1})`` as buffers."""
    N, C = g.shape[0], g.shape[-1]
    transposed = jnp.swapaxes(taps, 1, 2)  # tap t's C_out x C_in
    body = functools.partial(_backward_kernel, layout, offsets, steps, h, activation, config)
    out_shape = (
        jax.ShapeDtypeStruct((N, layout.rows, C), g.dtype),
        jax.ShapeDtypeStruct((steps, N, layout.rows, C), g.dtype),
    )
    return pallas_triton(body, out_shape, N, config)(layout.to_buffer(g), zs, transposed)


def _wgrad_rows(layout, C: int) -> tuple[int, int]:
    """``(rows, warps)`` of a weight-gradient program for ``C`` channels on ``layout``."""
    rows, warps = wgrad_tiling(C)
    return min(rows, layout.tile_rows), warps


def _wgrad_runs(layout, C: int) -> int:
    """Runs of rows a weight-gradient program sums over a whole state (``chunks`` divide them)."""
    return layout.tiles * layout.tile_rows // _wgrad_rows(layout, C)[0]


def _chunks_of(count: int, most: int = 10) -> int:
    """The largest divisor of ``count`` up to ``most``."""
    return max(d for d in range(1, min(count, most) + 1) if count % d == 0)


def weight_grad(layout, xs, ss, kernel_shape, config, chunks=None):
    """``(dW, sum_k s_k)`` from the saved states ``xs`` and the backward kernel's ``ss`` (buffers):
    ``dW`` HWIO, the sum a buffer ``(N, rows, C)`` (its slack rows undefined; ``layout.interior``
    gives the image). Each program takes a run of a pattern's rows over every step, a pattern
    split between ``chunks`` programs (a divisor of its runs of rows; default the largest up to
    :data:`naisnet_jax.kernels.tuning.WGRAD_CHUNKS` for ``C``)."""
    steps, N, _, C = ss.shape
    kh, kw = kernel_shape[:2]
    rows, warps = _wgrad_rows(layout, C)
    runs = _wgrad_runs(layout, C)
    chunks = _chunks_of(runs, WGRAD_CHUNKS.get(C, 1)) if chunks is None else chunks
    if runs % chunks:
        raise ValueError(f"chunks={chunks} must divide the {runs} runs of rows of a state's weight gradient.")
    programs = N * chunks
    body = functools.partial(_weight_grad_sum_kernel, layout, layout.offsets(kh, kw), steps, rows, chunks)
    out_shape = (
        jax.ShapeDtypeStruct((programs, kh * kw, C, C), ss.dtype),
        jax.ShapeDtypeStruct(ss.shape[1:], ss.dtype),
    )
    parts, s_sum = pallas_triton(body, out_shape, programs, config, num_warps=warps, num_stages=WGRAD_STAGES)(xs, ss)
    return _kernel_of_parts(parts, kernel_shape), s_sum


def _kernel_of_parts(parts: Array, kernel_shape: tuple) -> Array:
    """``dW`` (HWIO ``kernel_shape``) from the weight-gradient programs' partial sums ``parts``,
    ``(programs, taps, C_out, C_in)``: each tap's transpose, summed over the programs."""
    return jnp.swapaxes(jnp.sum(parts, axis=0), 1, 2).reshape(kernel_shape)
