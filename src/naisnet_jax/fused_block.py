"""A tied convolutional NAIS block's K steps in one GPU kernel each way (Pallas, Triton).

XLA runs a block ``X_{k+1} = X_k + h act(conv(X_k, C) + drive)`` as K small
convolutions and K elementwise fusions forward, and about three times as many
kernels backward: at the CIFAR shapes (16 to 64 channels) each is a few
microseconds of work, and a 54-block NAIS-Net10 step is bound by the latency of
some 3,000 launches, not by arithmetic (``BENCHMARKS.md``). Here one kernel runs a
block's K forward steps and one its K backward steps; one program per pattern
keeps the pattern's state in the L2 cache between steps, and every 3x3
convolution is nine ``(M, C) @ (C, C)`` products on the tensor cores.

Measured on an H100 (``BENCHMARKS.md``): a tile loads nine overlapping windows and
moves each into the tensor cores' layout (Pallas' Triton backend gives a program no
shared memory to hold a tile and its halo once), and the kernels beat XLA at 16 and 32
channels (at 32 with smaller tiles, :data:`TILINGS`, and a wider weight-gradient program,
:data:`WGRAD_TILINGS`), not at 64; the automatic choice uses them up to
:data:`AUTO_MAX_CHANNELS`.

Layout. A pattern's ``(H, W, C)`` state is zero padded to ``(H + 2p, W + 2q, C)``
(``p, q`` the kernel's half sizes) and flattened to rows of ``C``: tap ``(a, b)`` of
the convolution at row ``r`` then reads row ``r + a (W + 2q) + b``, a contiguous
window, so a tap over ``M`` rows is one tile load. The padded rows are framed by
``S = p (W + 2q) + q`` slack rows on each side so that every window stays in the
buffer; rows outside the image are computed like the others and written as zero,
which keeps the zero padding for the next step. A step writes a new buffer, and a
barrier separates the steps (the next step reads rows that other threads wrote).

Backward (the same stacked form as :mod:`naisnet_jax.block_vjp`): the kernel
carries ``g_k`` back, ``s_k = h act'(z_k) g_{k+1}``, ``g_k = g_{k+1} +
conv^T(s_k)`` (the transposed convolution: the kernel's taps mirrored, their
channel matrices transposed), and writes every ``s_k``. A third kernel sums the
weight gradient, tap ``t``'s ``sum_k sum_p x_k(p + offset_t)^T s_k(p)``, one
program (one warp) per step and pattern over tiles of rows: cuDNN's weight-gradient
convolution over the stacked, zero-padded states cost more than the two block
kernels together at 16 channels (``BENCHMARKS.md``). The drive's gradient is the sum of the
``s_k``, which that kernel adds up as it reads them (:data:`WGRAD_SUMS_STEPS`; without it, the
kernel runs per step on a second stream beside the backward chain,
:func:`naisnet_jax.block_vjp.on_side_stream`, and XLA sums the ``s_k``).

On Hopper GPUs the forward and backward kernels have a second implementation,
:mod:`naisnet_jax.hopper_block` (Pallas' Mosaic GPU backend: the pattern held in shared
memory, the products on ``wgmma`` in split bfloat16, several warpgroups a program), with the
same buffers, so this module's weight-gradient kernel takes its outputs; ``engine=`` chooses.

:func:`unroll_tied_conv` is the entry point; it runs the kernels on a CUDA GPU
(float32, channels a power of two from 16 to 128, odd kernel sizes; automatically
up to :data:`AUTO_MAX_CHANNELS`) and otherwise falls back to :func:`naisnet_jax.block_vjp.unroll_tied`, whose values
it reproduces (``tests/test_fused_block.py`` runs the kernels in Pallas'
interpret mode on the CPU, in float64, against the plain loop).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from naisnet_jax import hopper_block, hopper_tf32
from naisnet_jax.block_vjp import _sum_to_shape, check_tied, conv_op, on_side_stream, unroll_tied
from naisnet_jax.checks import check_int
from naisnet_jax.kernels.common import act, scaled_slope

Array = jax.Array

#: Rows of the flattened state a program computes per tile (the ``M`` of each product).
TILE_ROWS = 256
#: Warps per program.
NUM_WARPS = 8
#: The block kernels' tiling by channels, ``C -> (tile rows, warps)``, where it differs from
#: ``(TILE_ROWS, NUM_WARPS)``. On an H100 (batch 128, K = 10): at 16x16x32 the forward kernel
#: takes 0.215 ms with 128-row tiles against 0.538 with 256 (its nine 32-channel windows fill the
#: registers), the backward kernel 0.204 against 0.529.
TILINGS = {32: (128, 8)}
#: Widest state the automatic choice (``interpret=None``) sends to the GPU kernels. On an
#: H100 the kernels beat XLA's stacked VJP for 16 channels (forward and backward of a 32x32x16
#: block: 1.41x with the weight-gradient kernel) and 32 (NAIS-Net10's training step 40.1
#: against 41.3 ms with its 32-channel stage on them) and lose for 64, where cuDNN's
#: convolutions are efficient; wider blocks keep the stacked VJP.
AUTO_MAX_CHANNELS = 32


def default_tiling(channels: int) -> tuple[int, int]:
    """The block kernels' ``(tile rows, warps)`` for a state of ``channels`` channels."""
    return TILINGS.get(channels, (TILE_ROWS, NUM_WARPS))


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


def _inside(layout: Layout, tile_start) -> Array:
    """``(M, 1)`` mask of the tile's rows that are pixels of the image (not padding)."""
    return layout.is_pixel(tile_start + lax.broadcasted_iota(jnp.int32, (layout.tile_rows, 1), 0))


def _index(v) -> Array:
    """An index in JAX's default integer type (int64 with x64 on: the interpreter's slices
    need every index of one type, and loops count in it)."""
    return jnp.asarray(v, jax.dtypes.canonicalize_dtype(jnp.int64))


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

    n = _index(pl.program_id(0))
    M, S = layout.tile_rows, layout.slack
    centre = offsets.index(0)
    taps_now = _taps_of(w_ref, len(offsets), config.hoist_taps)

    def slot(k):
        return k if save else k % 2

    def copy(t, carry):
        t = _index(t)
        rows = pl.ds(S + t * M, M)
        xs_ref[0, n, rows] = x0_ref[n, rows]
        return carry

    _over_tiles(layout, config, copy)
    _barrier(config.interpret)

    def step(k, carry):
        k = _index(k)
        src = slot(k)

        def tile(t, carry):
            q0 = _index(t) * M
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

    n = _index(pl.program_id(0))
    M, S = layout.tile_rows, layout.slack
    mirrored = [-off for off in offsets]
    taps_now = _taps_of(wt_ref, len(offsets), config.hoist_taps)

    def first(t, carry):  # g_K and s_{K-1}
        q0 = _index(t) * M
        rows = pl.ds(S + q0, M)
        g = gk_ref[n, rows]
        g_ref[n, rows] = g
        s = scaled_slope(activation, h, zs_ref[steps - 1, n, rows], g)
        s_ref[steps - 1, n, rows] = jnp.where(_inside(layout, q0), s, jnp.zeros_like(s))
        return carry

    _over_tiles(layout, config, first)
    _barrier(config.interpret)

    def step(i, carry):  # k = K-1 .. 0: g_k = g_{k+1} + conv^T(s_k), then s_{k-1}
        k = steps - 1 - _index(i)
        prev = jnp.maximum(k - 1, 0)

        def tile(t, carry):
            q0 = _index(t) * M
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
    and need no masks. Masking every window cost a quarter of the kernel's time at 32x32x16 on an
    H200 (measured with a profiler, BENCHMARKS.md)."""
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
            q = S + (first + _index(i)) * rows
            masks = [_rows_in(q + off, rows, S, end) for off in taps] if masked else None
            return tile(q, acc, None if masks is None else masks.__getitem__)

        return run

    a, b = _edge_split(layout, offsets, rows, first, count)
    acc = lax.fori_loop(_index(0), _index(a), body(True), acc)
    acc = lax.fori_loop(_index(a), _index(b), body(False), acc)
    return lax.fori_loop(_index(b), _index(count), body(True), acc)


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


def _weight_grad_kernel(layout, offsets, batch, rows, chunks, xs_ref, s_ref, dw_ref):
    """Program ``p = (k N + n) chunks + c`` sums step ``k``'s, pattern ``n``'s share of the
    weight gradient over the ``c``-th of ``chunks`` equal runs of the state's tiles of ``rows``
    rows: ``dW_t^T += s_k^T @ x_k(window t)``, tap by tap (:func:`_sum_tiles`).

    Narrow programs (one warp at 16 channels, two at 32, :data:`WGRAD_TILINGS`): the products
    have a ``(C, C)`` output and a long reduction over rows, which a wider program would give
    every warp whole (each warp holding both operands). The windows of the state's first and last
    few tiles reach into the slack rows, which nothing writes; those windows are masked to zero
    (``s`` is zero there, but ``0 x NaN`` is not), the others are not (:func:`_edge_split`).
    """
    from jax.experimental import pallas as pl

    p = _index(pl.program_id(0))
    k, n, c = p // (batch * chunks), p // chunks % batch, p % chunks

    def tile(q, acc, inside):
        return _tap_products(acc, s_ref[k, n, pl.ds(q, rows)], xs_ref, k, n, q, offsets, inside)

    _sum_tiles(layout, offsets, rows, c, chunks, p, dw_ref, tile)


def _weight_grad_sum_kernel(layout, offsets, steps, rows, chunks, xs_ref, s_ref, dw_ref, sum_ref):
    """Program ``p = n chunks + c`` sums pattern ``n``'s share of the weight gradient over the
    ``c``-th of ``chunks`` equal runs of its rows, every step in turn for each tile of ``rows``
    rows, and writes the tile's ``sum_k s_k`` (the drive's gradient) on the way: the ``s_k`` it
    loads for the products anyway, so no second pass over them. Otherwise as
    :func:`_weight_grad_kernel` (the slack rows of ``sum_ref`` are not written)."""
    from jax.experimental import pallas as pl

    p = _index(pl.program_id(0))
    n, c = p // chunks, p % chunks

    def tile(q, acc, inside):
        def step(k, carry):
            acc, total = carry
            k = _index(k)
            s = s_ref[k, n, pl.ds(q, rows)]
            return _tap_products(acc, s, xs_ref, k, n, q, offsets, inside), total + s

        acc, total = lax.fori_loop(0, steps, step, (acc, jnp.zeros((rows, sum_ref.shape[-1]), sum_ref.dtype)))
        sum_ref[n, pl.ds(q, rows)] = total
        return acc

    _sum_tiles(layout, offsets, rows, c, chunks, p, dw_ref, tile)


class Config(NamedTuple):
    """How the kernels run: in Pallas' interpreter or on the GPU, and their tiling."""

    interpret: bool = False
    tile_rows: int = TILE_ROWS
    num_warps: int = NUM_WARPS
    unroll_tiles: bool = True  # a step's tiles as straight-line code (independent loads overlap)
    hoist_taps: bool = True  # load the kernel's taps once per program, not once per tile
    # > 0: the forward and backward kernels on Hopper's wgmma (naisnet_jax.hopper_block), with this
    # many warpgroups a pattern; 0: the Triton kernels
    warpgroups: int = 0
    # with warpgroups > 0: the TF32 wgmma kernels (naisnet_jax.hopper_tf32), whose layout's rows are
    # a multiple of 8; else the bfloat16 x 3 ones (naisnet_jax.hopper_block)
    tf32: bool = False
    # the kernel's gradient from XLA's convolution gradient (cuDNN) on the saved states, not from
    # the Triton weight-gradient kernel (which is slow at 64 channels)
    xla_wgrad: bool = False

    def layout(self, H: int, W: int, kh: int, kw: int) -> Layout:
        """The buffers' layout of an ``H x W`` state for a ``kh x kw`` kernel under this config."""
        return Layout.of(H, W, kh, kw, self.tile_rows, align=8 if self.tf32 else 1)

    def hopper(self):
        """The module of this config's wgmma kernels."""
        return hopper_tf32 if self.tf32 else hopper_block


GPU = Config()  # the GPU kernels at the default tiling
_INTERPRET = contextvars.ContextVar("naisnet_fused_interpret", default=False)


@contextlib.contextmanager
def interpreted():
    """Inside this context, blocks that would fall back run the kernels in the interpreter.

    For tests on a CPU: a model with ``block_vjp="fused"`` then really goes through
    the kernels (read when the model is traced)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def _pallas(kernel, out_shape, programs: int, config, num_warps=None, num_stages=1):
    """``pallas_call`` of ``kernel`` over ``programs`` programs, as ``config`` says (any config with
    ``interpret`` and ``num_warps``, this module's or :mod:`naisnet_jax.fused_dense`'s);
    ``num_stages``: Triton's software pipelining of the kernel's loops."""
    from jax.experimental import pallas as pl

    params = {}
    if not config.interpret:
        from jax.experimental.pallas import triton as plgpu

        warps = num_warps or config.num_warps
        params["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(programs,), interpret=config.interpret, **params)


def _taps(kernel: Array) -> Array:
    """HWIO ``(kh, kw, C, C)`` -> ``(kh * kw, C, C)``, tap ``(a, b)`` at ``a * kw + b``."""
    kh, kw, ci, co = kernel.shape
    return kernel.reshape(kh * kw, ci, co)


def fused_forward(x0, drive, kernel, *, steps, h, activation, save=True, config=GPU):
    """The block's states as buffers (``layout.interior`` gives the images).

    ``save=True`` returns ``(layout, xs, zs)``: every state ``x_0 .. x_K``, shape
    ``(K + 1, N, rows, C)`` (with :data:`Config` ``xla_wgrad`` as images, the pair ``x_0 ..
    x_{K-1}`` ``(K, N, H, W, C)`` and ``x_K`` ``(N, H, W, C)``: the TF32 wgmma kernels write
    them so), and every pre-activation ``z_0 .. z_{K-1}``, shape ``(K, N, rows, C)``.
    ``save=False`` returns ``(layout, x_K)`` only.
    """
    N, H, W, C = x0.shape
    kh, kw = kernel.shape[:2]
    layout = config.layout(H, W, kh, kw)
    x0b = layout.to_buffer(x0)
    db = layout.to_buffer(jnp.broadcast_to(drive, x0.shape).astype(x0.dtype))
    if config.warpgroups and not config.interpret:
        out = config.hopper().fused_forward(
            layout,
            x0b,
            db,
            _taps(kernel.astype(x0.dtype)),
            steps=steps,
            h=h,
            activation=activation,
            save=save,
            warpgroups=config.warpgroups,
            **(dict(interior=config.xla_wgrad) if config.tf32 else {}),
        )
        if save and config.xla_wgrad:  # hopper_block writes buffers only
            out = ((out[0], out[1]), out[2]) if config.tf32 else (_states_apart(layout, out[0], steps), out[1])
        return (layout, *out) if save else (layout, out[0][0])
    body = functools.partial(_forward_kernel, layout, layout.offsets(kh, kw), steps, h, activation, save, config)
    states = jax.ShapeDtypeStruct(((steps + 1) if save else 2, N, layout.rows, C), x0.dtype)
    out_shape = (states, jax.ShapeDtypeStruct((steps, N, layout.rows, C), x0.dtype)) if save else (states,)
    out = _pallas(body, out_shape, N, config)(x0b, db, _taps(kernel.astype(x0.dtype)))
    if save and config.xla_wgrad:
        out = (_states_apart(layout, out[0], steps), out[1])
    return (layout, *out) if save else (layout, out[0][steps % 2])


def _states_apart(layout, xs, steps):
    """Buffers ``x_0 .. x_K`` as :func:`fused_forward` gives them with ``xla_wgrad``: images, the
    first ``K`` apart from ``x_K``."""
    images = layout.interior(xs)
    return images[:steps], images[steps]


def fused_backward(layout, g, zs, kernel, *, steps, h, activation, config=GPU):
    """``(g_0, s_0 .. s_{K-1})`` as buffers from the gradient ``g`` at ``x_K`` (with :data:`Config`
    ``xla_wgrad`` the ``s_k`` as images, as :func:`fused_forward`'s states)."""
    N, C = g.shape[0], g.shape[-1]
    kh, kw = kernel.shape[:2]
    if config.warpgroups and not config.interpret:
        g0, ss = config.hopper().fused_backward(
            layout,
            layout.to_buffer(g),
            zs,
            _taps(kernel.astype(g.dtype)),
            steps=steps,
            h=h,
            activation=activation,
            warpgroups=config.warpgroups,
            **(dict(interior=config.xla_wgrad) if config.tf32 else {}),
        )
        return (g0, layout.interior(ss)) if config.xla_wgrad and not config.tf32 else (g0, ss)
    transposed = jnp.swapaxes(_taps(kernel.astype(g.dtype)), 1, 2)  # tap t's C_out x C_in
    body = functools.partial(_backward_kernel, layout, layout.offsets(kh, kw), steps, h, activation, config)
    out_shape = (
        jax.ShapeDtypeStruct((N, layout.rows, C), g.dtype),
        jax.ShapeDtypeStruct((steps, N, layout.rows, C), g.dtype),
    )
    g0, ss = _pallas(body, out_shape, N, config)(layout.to_buffer(g), zs, transposed)
    return (g0, layout.interior(ss)) if config.xla_wgrad else (g0, ss)


#: Rows per tile of the weight-gradient kernel (on an H100, 32 rows: a 32x32x16 block forward +
#: backward 0.98 ms, 64 rows 1.03, 128 rows 1.08).
WGRAD_ROWS = 32
#: Warps per weight-gradient program.
WGRAD_WARPS = 1
#: Its tiling by channels, ``C -> (rows, warps)``, where it differs. At 16x16x32 (H100, K = 10,
#: batch 128) one warp takes 384 us, two 227 to 230 us (64 or 32 rows), four 258 to 322; at 8x8x64
#: four warps take 435 us (cuDNN ~90: 64 channels stay on XLA). 128 channels (only when forced)
#: take 64's tiling, not measured.
WGRAD_TILINGS = {32: (64, 2), 64: (32, 4), 128: (32, 4)}
#: Programs a pattern's step is split between (at most; a divisor of its runs of rows), by channels,
#: and Triton's pipelining stages of the kernel's loop over rows. On an H200 (batch 128, 9 steps;
#: a tiling sweep): at 32x32x16 four programs and two stages take 0.201 ms against
#: 0.207 for one and one (best 0.196: four and one); at 16x16x32 one program and two stages 0.195
#: against 0.209. NAIS-Net10's step with these: 27.72 against 28.20 ms (``BENCHMARKS.md``).
WGRAD_CHUNKS = {16: 4, 32: 1}
WGRAD_STAGES = 2
#: The fused path's backward pass takes the drive's gradient ``sum_k s_k`` from the weight-gradient
#: kernel (:func:`fused_weight_grad` with ``sum_steps=True``: one program a run of rows over every
#: step, on the main stream) instead of a separate sum over the saved ``s_k`` (XLA, a second read
#: of all of them) beside the per-step kernel on the second stream. On an H200 (batch 128, 9 steps)
#: the kernel with the sum takes 0.197 ms against 0.222 for the two at 32x32x16 and 0.154 against
#: 0.199 at 16x16x32; NAIS-Net10's step 26.96 against 27.91 ms, then 26.37 against 27.21 with the
#: 32-channel tiling below (``BENCHMARKS.md``).
WGRAD_SUMS_STEPS = True
#: Programs a pattern is split between in that mode (at most; a divisor of its runs of rows), by
#: channels: the fastest of a tiling sweep on an H200.
WGRAD_SUM_CHUNKS = {16: 8, 32: 4}
#: The summing kernel's ``(rows, warps)`` by channels where it differs from :data:`WGRAD_TILINGS`:
#: at 16x16x32 on an H200, 32 rows and two warps take 0.154 ms (four programs a pattern) against
#: 0.205 for 64 rows and two warps (two programs).
WGRAD_SUM_TILINGS: dict[int, tuple[int, int]] = {32: (32, 2)}


def _wgrad_rows(layout, C: int, sum_steps: bool = False) -> tuple[int, int]:
    """``(rows, warps)`` of a weight-gradient program for ``C`` channels on ``layout`` (of the
    kernel that also sums the steps' ``s_k``, ``sum_steps``)."""
    rows, warps = WGRAD_TILINGS.get(C, (WGRAD_ROWS, WGRAD_WARPS))
    if sum_steps:
        rows, warps = WGRAD_SUM_TILINGS.get(C, (rows, warps))
    return min(rows, layout.tile_rows), warps


def _wgrad_runs(layout, C: int, sum_steps: bool = False) -> int:
    """Runs of rows a weight-gradient program sums over a whole state (``chunks`` divide them)."""
    return layout.tiles * layout.tile_rows // _wgrad_rows(layout, C, sum_steps)[0]


def _chunks_of(count: int, most: int = 10) -> int:
    """The largest divisor of ``count`` up to ``most``."""
    return max(d for d in range(1, min(count, most) + 1) if count % d == 0)


def fused_weight_grad(layout, xs, ss, kernel_shape, config=GPU, chunks=None, sum_steps=False):
    """``dW`` (HWIO) from the saved states ``xs`` and the backward kernel's ``ss`` (buffers),
    each pattern's step summed by ``chunks`` programs (a divisor of its runs of rows; default
    the largest up to :data:`WGRAD_CHUNKS` for ``C``).

    ``sum_steps=True`` returns ``(dW, sum_k s_k)``, the sum a buffer ``(N, rows, C)`` (its slack
    rows undefined; ``layout.interior`` gives the image): each program then takes a run of a
    pattern's rows over every step (``chunks`` default: up to :data:`WGRAD_SUM_CHUNKS`)."""
    steps, N, _, C = ss.shape
    kh, kw = kernel_shape[:2]
    rows, warps = _wgrad_rows(layout, C, sum_steps)
    most = (WGRAD_SUM_CHUNKS if sum_steps else WGRAD_CHUNKS).get(C, 1)
    runs = _wgrad_runs(layout, C, sum_steps)
    chunks = _chunks_of(runs, most) if chunks is None else chunks
    if runs % chunks:
        raise ValueError(f"chunks={chunks} must divide the {runs} runs of rows of a state's weight gradient.")
    offsets = layout.offsets(kh, kw)
    programs = (1 if sum_steps else steps) * N * chunks
    parts_shape = jax.ShapeDtypeStruct((programs, kh * kw, C, C), ss.dtype)
    if sum_steps:
        body = functools.partial(_weight_grad_sum_kernel, layout, offsets, steps, rows, chunks)
        out_shape = (parts_shape, jax.ShapeDtypeStruct(ss.shape[1:], ss.dtype))
    else:
        body = functools.partial(_weight_grad_kernel, layout, offsets, N, rows, chunks)
        out_shape = parts_shape
    out = _pallas(body, out_shape, programs, config, num_warps=warps, num_stages=WGRAD_STAGES)(xs, ss)
    dW = _kernel_of_parts(out[0] if sum_steps else out, kernel_shape)
    return (dW, out[1]) if sum_steps else dW


def _kernel_of_parts(parts: Array, kernel_shape: tuple) -> Array:
    """``dW`` (HWIO ``kernel_shape``) from the weight-gradient programs' partial sums ``parts``,
    ``(programs, taps, C_out, C_in)``: each tap's transpose, summed over the programs."""
    return jnp.swapaxes(jnp.sum(parts, axis=0), 1, 2).reshape(kernel_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(x0, drive, kernel, steps, h, activation, config):
    layout, x = fused_forward(x0, drive, kernel, steps=steps, h=h, activation=activation, save=False, config=config)
    return layout.interior(x)


def _fused_fwd(x0, drive, kernel, steps, h, activation, config):
    layout, xs, zs = fused_forward(x0, drive, kernel, steps=steps, h=h, activation=activation, config=config)
    if config.xla_wgrad:  # the states as images, x_K apart
        xs, x = xs
    else:
        x = layout.interior(xs[steps])
    return x, (xs, zs, drive, kernel)


def _fused_bwd(steps, h, activation, config, res, g):
    """``dx0`` from the backward kernel, ``dW`` from the weight-gradient kernel, ``d drive`` a sum."""
    xs, zs, drive, kernel = res
    N, H, W, C = g.shape
    layout = config.layout(H, W, kernel.shape[0], kernel.shape[1])
    g0, ss = fused_backward(layout, g, zs, kernel, steps=steps, h=h, activation=activation, config=config)
    weight_grad = functools.partial(fused_weight_grad, layout, kernel_shape=kernel.shape, config=config)
    if config.xla_wgrad:  # dW = sum_k x_k * s_k as one convolution gradient over the stacked steps

        def xla_weight_grad(xs, ss):  # x_0 .. x_{K-1} and the s_k as images
            stacked = xs.reshape((-1, H, W, C))
            _, pull = jax.vjp(lambda w: conv_op(stacked, w), kernel)
            return pull(ss.reshape(stacked.shape).astype(stacked.dtype))[0]

        side = WIDE_WGRAD_SIDE and not config.interpret
        dW = on_side_stream(xla_weight_grad, None if side else False)(xs, ss)
        s_sum = jnp.sum(ss, axis=0)
    elif WGRAD_SUMS_STEPS:  # the drive's gradient from the same kernel, which the chain then waits for
        dW, s_sum = weight_grad(xs, ss, sum_steps=True)
        s_sum = layout.interior(s_sum)
    else:
        dW = on_side_stream(weight_grad, False if config.interpret else None)(xs, ss)
        s_sum = jnp.sum(layout.interior(ss), axis=0)
    d_drive = _sum_to_shape(s_sum, drive.shape).astype(drive.dtype)
    return layout.interior(g0), d_drive, dW.astype(kernel.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def kernel_supported(x0: Array, kernel: Array) -> str | None:
    """``None`` if the fused kernels take this block, else why not (in words)."""
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


def gpu_kernels_available(x0: Array) -> bool:
    """The GPU kernels run here: a float32 state and a CUDA GPU as JAX's default device (the one
    ``jax.default_device`` names, if set: a model run on the CPU of a GPU machine falls back)."""
    if x0.dtype != jnp.float32:
        return False
    device = hopper_block.default_device()
    return device.platform == "gpu" and "cuda" in getattr(device.client, "platform_version", "").lower()


def kernel_mode(name: str, interpret: bool | None, why: str | None, runs_here: bool) -> bool | None:
    """How the entry point ``name`` runs a block: ``True`` in Pallas' interpreter, ``False`` as
    GPU kernels, ``None`` not at all (fall back to the stacked VJP). ``interpret=None`` chooses:
    the interpreter inside :func:`interpreted`, the GPU kernels where the block fits them
    (``why is None``) and ``runs_here``; a forced choice on a block they do not take is refused,
    naming ``why``."""
    if interpret is None:
        if why is None and _INTERPRET.get():
            return True
        return False if why is None and runs_here else None
    if why is not None:
        raise ValueError(f"{name}: the fused kernels do not take this block: {why}.")
    return bool(interpret)


#: The wgmma engine's kernels where JAX's default matmul precision allows TF32 (its default on a
#: GPU, as for XLA's convolutions): ``True`` takes :mod:`naisnet_jax.hopper_tf32` (TF32, the
#: windows as views), ``False`` :mod:`naisnet_jax.hopper_block` (three bfloat16 products, about 16
#: significant bits). Where the precision asks for more than TF32, always the latter. Read when a
#: block is traced.
WGMMA_TF32 = True
#: ``jax.default_matmul_precision`` values that allow TF32 products (``None``: JAX's default).
TF32_PRECISIONS = (None, "default", "fastest", "bfloat16", "tensorfloat32", "high", "TF32_TF32_F32")


#: 64-channel tied blocks (ReLU, 3x3) on a Hopper GPU at a precision that allows TF32 run
#: :mod:`naisnet_jax.hopper_tf32`'s kernels (the state single-buffered, 64-row tiles) with the
#: kernel's gradient from XLA's convolution gradient on the saved states (:data:`Config`
#: ``xla_wgrad``); ``False``: the stacked VJP (on an H100 the 8x8x64 block
#: of NAIS-Net10 takes 0.095 / 0.114 ms forward / backward against the Triton kernels' 1.00 /
#: 0.98, and the training step 23.18 against 24.51 ms). Read when a block is traced.
WGMMA_WIDE = True
#: Those blocks' kernel gradients (XLA's, on the saved states) on the second stream
#: (:func:`naisnet_jax.block_vjp.on_side_stream`), not the main one.
WIDE_WGRAD_SIDE = False
#: Channels of the blocks :data:`WGMMA_WIDE` takes, and their tile rows.
WIDE_CHANNELS, WIDE_TILE_ROWS = 64, 64


def _wide_config(x0, kernel, activation, engine, interpret, warpgroups) -> Config | None:
    """The config of a 64-channel block on the TF32 wgmma kernels (:data:`WGMMA_WIDE`), or ``None``
    where it does not apply: another width, the Triton engine, the interpreter, a precision above
    TF32, a block the kernels refuse, or (unless forced by ``interpret=False, engine="wgmma"``)
    no Hopper GPU here."""
    if not WGMMA_WIDE or x0.shape[-1] != WIDE_CHANNELS or engine == "triton" or interpret:
        return None
    forced = interpret is False and engine == "wgmma"
    if not (forced or (interpret is None and gpu_kernels_available(x0) and hopper_block.hopper_available())):
        return None
    config = Config(tile_rows=WIDE_TILE_ROWS, tf32=True, xla_wgrad=True)
    layout = config.layout(x0.shape[1], x0.shape[2], kernel.shape[0], kernel.shape[1])
    if not wgmma_tf32() or hopper_tf32.unsupported(layout, x0, kernel, activation) is not None:
        return None
    nw = warpgroups or hopper_tf32.choose_warpgroups(layout, x0.shape[-1], activation)
    return config._replace(warpgroups=nw)


def wgmma_tf32() -> bool:
    """Whether a block traced now takes the TF32 wgmma kernels: :data:`WGMMA_TF32` and a default
    matmul precision in :data:`TF32_PRECISIONS`."""
    precision = jax.config.jax_default_matmul_precision
    return WGMMA_TF32 and (precision if precision is None else str(precision)) in TF32_PRECISIONS


def _wgmma_warpgroups(engine, warpgroups, x0, kernel, activation, tile_rows, tf32=False) -> int:
    """Warpgroups a program of the wgmma kernels gets for this block, or 0 for the Triton kernels:
    ``engine=None`` takes wgmma where the block fits it on a Hopper GPU; ``"wgmma"`` refuses a
    block it does not take, naming why. ``tf32``: the kernels of :mod:`naisnet_jax.hopper_tf32`."""
    if engine == "triton":
        return 0
    config = Config(tile_rows=tile_rows, tf32=tf32)
    layout = config.layout(x0.shape[1], x0.shape[2], kernel.shape[0], kernel.shape[1])
    if tf32:
        why = hopper_tf32.unsupported(layout, x0, kernel, activation)
        choose = functools.partial(hopper_tf32.choose_warpgroups, activation=activation)
    else:
        why = hopper_block.unsupported(layout, x0, kernel, activation)
        choose = hopper_block.choose_warpgroups
    if engine == "wgmma":
        if why is not None:
            raise ValueError(f"unroll_tied_conv: engine='wgmma' does not take this block: {why}.")
        return warpgroups or choose(layout, x0.shape[-1])
    if why is None and hopper_block.hopper_available():
        return choose(layout, x0.shape[-1])
    return 0


def unroll_tied_conv(
    x0: Array,
    drive: Array,
    kernel: Array,
    *,
    steps: int,
    h: float = 1.0,
    activation: str = "relu",
    scan_unroll: int | bool = 1,
    interpret: bool | None = None,
    tile_rows: int | None = None,
    num_warps: int | None = None,
    unroll_tiles: bool = True,
    hoist_taps: bool | None = None,
    engine: str | None = None,
    warpgroups: int | None = None,
) -> Array:
    """``x_K`` of a tied conv NAIS block; the fused Pallas kernels where they run.

    Plain-Python meaning (values and gradients equal those of this loop)::

        x = x0
        for k in range(steps):
            x = x + h * act(conv_same(x, kernel) + drive)
        return x

    ``interpret=None`` runs the GPU kernels when the block fits them
    (:func:`kernel_supported`), :func:`gpu_kernels_available` and the state has at most
    :data:`AUTO_MAX_CHANNELS` channels (where they are the faster path), else the stacked
    pure-JAX VJP (:func:`naisnet_jax.block_vjp.unroll_tied`, with ``scan_unroll``)
    or, inside :func:`interpreted`, the kernels in Pallas' interpreter.
    ``interpret=True`` runs the interpreter (any backend and float dtype: the
    tests' path), ``False`` forces the GPU kernels. ``tile_rows`` (a power of two,
    at least 16; default by channels, :data:`TILINGS`, else :data:`TILE_ROWS`), ``num_warps``
    (likewise, else :data:`NUM_WARPS`), ``unroll_tiles`` and ``hoist_taps`` (default: for
    at most 32 channels) tune the Triton kernels. Their products run at the
    default precision (TF32 on an NVIDIA GPU, as XLA's convolutions).

    ``engine`` picks the GPU kernels' implementation: ``"triton"``, or ``"wgmma"`` for the
    forward and backward kernels on Hopper's ``wgmma`` (Hopper GPUs; 3x3 kernels, 16 or 32
    channels, ReLU or tanh; 64 channels with ReLU at a precision that allows TF32, see
    :data:`WGMMA_WIDE`): at JAX's default matmul precision those of
    :mod:`naisnet_jax.hopper_tf32` (TF32 products, as XLA's convolutions), where the precision
    asks for more (``jax.default_matmul_precision("float32")``) or :data:`WGMMA_TF32` is off those
    of :mod:`naisnet_jax.hopper_block` (products split in bfloat16 halves, about 16 significant
    bits); ``warpgroups`` a program (default: the most that fit, :func:`wgmma_tf32`'s module's
    ``choose_warpgroups``).
    ``None`` takes ``"wgmma"`` where the block fits it on a Hopper GPU, else ``"triton"``. Both
    apply where the GPU kernels run (``interpret=False``, or chosen as above); a block that falls
    back runs the stacked VJP whatever ``engine`` says.
    """
    x0, drive, kernel, h = check_tied("unroll_tied_conv", x0, drive, kernel, steps, h, activation, scan_unroll)
    default_rows, default_warps = default_tiling(x0.shape[-1])
    tile_rows = default_rows if tile_rows is None else tile_rows
    num_warps = default_warps if num_warps is None else num_warps
    check_int("tile_rows", tile_rows, 16)
    check_int("num_warps", num_warps)
    if tile_rows & (tile_rows - 1):
        raise ValueError(f"tile_rows={tile_rows!r} must be a power of two (a tile is one (tile_rows, C) block).")
    why = kernel_supported(x0, kernel)
    hoist = x0.shape[-1] <= 32 if hoist_taps is None else bool(hoist_taps)  # 9 C x C taps in registers
    runs_here = gpu_kernels_available(x0) and x0.shape[-1] <= AUTO_MAX_CHANNELS
    if engine not in (None, "triton", "wgmma"):
        raise ValueError(f"engine={engine!r} must be None, 'triton' or 'wgmma'.")
    if warpgroups is not None:
        if engine != "wgmma":
            raise ValueError(f"warpgroups={warpgroups!r} tunes the wgmma kernels: pass engine='wgmma' with it.")
        check_int("warpgroups", warpgroups)
    wide = None if why is not None else _wide_config(x0, kernel, activation, engine, interpret, warpgroups)
    if wide is not None:
        return _fused(x0, drive, kernel, steps, h, activation, wide)
    mode = kernel_mode("unroll_tied_conv", interpret, why, runs_here)
    if mode is None:
        return unroll_tied(conv_op, x0, drive, kernel, steps=steps, h=h, activation=activation, scan_unroll=scan_unroll)
    if mode and engine == "wgmma":
        raise ValueError(
            "unroll_tied_conv: engine='wgmma' needs a Hopper GPU: "
            "Pallas' interpreter (interpret=True) cannot run wgmma."
        )
    tf32 = wgmma_tf32()
    nw = 0 if mode else _wgmma_warpgroups(engine, warpgroups, x0, kernel, activation, tile_rows, tf32)
    config = Config(mode, tile_rows, num_warps, bool(unroll_tiles), hoist, nw, tf32=tf32 and nw > 0)
    return _fused(x0, drive, kernel, steps, h, activation, config)
