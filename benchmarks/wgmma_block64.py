"""Benchmark (prototype, lost in the step in sessions 23 and 24): 64-channel blocks on ``wgmma``.

NAIS-Net10's 64-channel stage (8x8x64) runs on XLA and cuDNN: ~6.5 ms of an H100 step, 180
forward convolutions of ~8.5 us and their gradients (``BENCHMARKS.md``). The Triton kernels lose
there (nine 128 x 64 windows do not fit a program's registers), and ``naisnet_jax.hopper_block``
does not fit: its split taps alone take 2 x 74 KB of shared memory, and with the state
double-buffered a program would need 256 KB of the 227 KB an SM has.

These kernels keep one state buffer instead. Every warpgroup computes its tiles' new values into
registers (reading the old state's windows), the warpgroups meet, write the new tiles over the
old ones, and meet again; warpgroup 0's copy of a state out of the buffer must be done before
the next writes. At 8x8x64 with 64-row tiles (2 tiles): the state 150 x 256 B = 38 KB, the
split taps 147 KB, one staging slot of 16 KB per warpgroup, 219 KB with two warpgroups. The
products are ``hopper_block``'s (windows split in bfloat16, three ``wgmma`` per tap; here 64
columns each).

On a GPU the script checks the kernels against the Triton kernels run in Pallas' interpreter at
the highest precision (same buffers) and times a block's forward and its gradient (these kernels,
the weight gradient as XLA's stacked convolution, the drive's a sum) against XLA's stacked VJP
(what NAIS-Net10 runs at 64 channels now). ``--smoke`` (any machine) lowers the kernels for CUDA.

    python benchmarks/wgmma_block64.py --out=$OUT/wgmma_block64
    python benchmarks/wgmma_block64.py --out=/tmp/wb64 --smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

TILE_ROWS = 64  # the layout's tiles: at 8x8, 2 of them cover the 100 padded rows


def forward_kernel(
    layout,
    offsets,
    steps,
    h,
    activation,
    nw,
    x0_ref,
    d_ref,
    taps_hi,
    taps_lo,
    xs_ref,
    zs_ref,
    state,
    zstage,
    w_hi_ref,
    w_lo_ref,
    bar,
    bar0,
    sync,
):
    """Pattern ``n``'s K steps over one state buffer (``state[0]``), tiles shared by ``nw``
    warpgroups; every state and pre-activation out by TMA."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.fused_block import _act
    from naisnet_jax.hopper_block import M, _chunks, _conv_tile, _inside, _load, _team, tiles_of

    n = jax.lax.axis_index("n")
    wg, lead_only, everyone = _team(nw)
    S, C = layout.slack, state.shape[-1]
    per = tiles_of(layout) // nw
    slots = zstage.shape[1]
    centre = offsets.index(0)
    region = _chunks(0, layout.rows)
    first = [(wg * per + j) * M for j in range(per)]

    @lead_only
    def _():  # the taps, and the drive through the buffer into registers
        plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)
        plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
        for s0, size in region:
            plgpu.copy_gmem_to_smem(d_ref.at[n, pl.ds(s0, size)], state.at[0, pl.ds(s0, size)], bar)

    plgpu.barrier_wait(bar)
    drive = [_load(state, 0, pl.ds(S + q0, M), slice(None)) for q0 in first]
    plgpu.commit_smem()
    everyone(sync)  # every warpgroup holds its drive before x_0 overwrites it

    @lead_only
    def _():
        for s0, size in region:
            plgpu.copy_gmem_to_smem(x0_ref.at[n, pl.ds(s0, size)], state.at[0, pl.ds(s0, size)], bar0)

    plgpu.barrier_wait(bar0)

    @lead_only
    def _():  # xs[0] = x_0
        for s0, size in region:
            plgpu.copy_smem_to_gmem(state.at[0, pl.ds(s0, size)], xs_ref.at[0, n, pl.ds(s0, size)])

    def step(k, carry):
        new = []
        for j, q0 in enumerate(first):
            rows = pl.ds(S + q0, M)
            acc, x = _conv_tile(state, 0, S + q0, offsets, w_hi_ref, w_lo_ref, centre)
            z = acc + drive[j]
            keep, zero = _inside(layout, q0, C), jnp.zeros_like(z)
            new.append(jnp.where(keep, x + h * _act(activation, z), zero))
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # the slot's last copy has read it
            zstage[wg, j % slots] = jnp.where(keep, z, zero)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(zstage.at[wg, j % slots], zs_ref.at[k, n, rows])

        @lead_only
        def _():  # x_k's copy out of the buffer is done before x_{k+1} overwrites it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        everyone(sync)  # every window of x_k is read
        for j, q0 in enumerate(first):
            state[0, pl.ds(S + q0, M), :] = new[j]
        plgpu.commit_smem()
        everyone(sync)  # x_{k+1} complete

        @lead_only
        def _():
            for s0, size in region:
                plgpu.copy_smem_to_gmem(state.at[0, pl.ds(s0, size)], xs_ref.at[k + 1, n, pl.ds(s0, size)])

        return carry

    jax.lax.fori_loop(0, steps, step, 0)
    plgpu.wait_smem_to_gmem(0)


def backward_kernel(
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
    """``g_0`` and every ``s_k`` from ``g_K``, as ``hopper_block``'s backward kernel, over one
    ``s`` buffer (``sbuf[0]``): the new ``s_{k-1}`` tiles wait in registers until every window of
    ``s_k`` is read."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import M, _chunks, _conv_tile, _inside, _load, _slope_tile, _team, tiles_of

    n = jax.lax.axis_index("n")
    wg, lead_only, everyone = _team(nw)
    S, C = layout.slack, sbuf.shape[-1]
    per = tiles_of(layout) // nw
    slots = zbuf.shape[1]
    first = [(wg * per + j) * M for j in range(per)]
    region = _chunks(0, layout.rows)

    def fetch_z(k, j):
        plgpu.copy_gmem_to_smem(
            zs_ref.at[k, n, pl.ds(S + first[j], M)], zbuf.at[wg, j % slots], zbar.at[slots * wg + j % slots]
        )

    def slope_tile(j, g):
        plgpu.barrier_wait(zbar.at[slots * wg + j % slots])
        z = _load(zbuf, wg, j % slots, slice(None), slice(None))
        out = _slope_tile(layout, first[j], activation, h, z, g)
        plgpu.commit_smem()  # every thread has read the slot before it is refilled
        return out

    def send(out):
        @lead_only
        def _():
            for s0, size in region:
                plgpu.copy_smem_to_gmem(sbuf.at[0, pl.ds(s0, size)], out.at[pl.ds(s0, size)])

    def overwrite(tiles_now):  # the buffer's tiles, once every window of the old ones is read
        @lead_only
        def _():  # and the old contents' copy out is done
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        everyone(sync)
        for j, q0 in enumerate(first):
            sbuf[0, pl.ds(S + q0, M), :] = tiles_now[j]
        plgpu.commit_smem()
        everyone(sync)

    @lead_only
    def _():
        plgpu.copy_gmem_to_smem(taps_hi, w_hi_ref, bar)
        plgpu.copy_gmem_to_smem(taps_lo, w_lo_ref, bar)
        for s0, size in region:  # g_K through the buffer into registers
            plgpu.copy_gmem_to_smem(gk_ref.at[n, pl.ds(s0, size)], sbuf.at[0, pl.ds(s0, size)], bar)

    plgpu.barrier_wait(bar)
    g = [_load(sbuf, 0, pl.ds(S + q0, M), slice(None)) for q0 in first]
    fetch_z(steps - 1, 0)
    s_last = []
    for j in range(per):
        if j + 1 < per:
            fetch_z(steps - 1, j + 1)
        s_last.append(slope_tile(j, g[j]))
    overwrite(s_last)  # s_{K-1} over g_K
    send(ss_ref.at[steps - 1, n])

    def step(i, g, last=False):  # k = K-1-i: g_k from s_k (in the buffer), then s_{k-1} over it
        k = steps - 1 - i
        if not last:
            fetch_z(k - 1, 0)
        g, new = list(g), []
        for j in range(per):
            if not last and j + 1 < per:
                fetch_z(k - 1, j + 1)
            acc, _ = _conv_tile(sbuf, 0, S + first[j], offsets, w_hi_ref, w_lo_ref)
            g[j] = jnp.where(_inside(layout, first[j], C), g[j] + acc, jnp.zeros_like(acc))
            if not last:
                new.append(slope_tile(j, g[j]))
        if not last:
            overwrite(new)
            send(ss_ref.at[k - 1, n])
        return tuple(g)

    g = jax.lax.fori_loop(0, steps - 1, step, tuple(g))
    g = step(steps - 1, g, last=True)
    overwrite(g)  # g_0 over s_0
    send(g0_ref.at[n])
    plgpu.wait_smem_to_gmem(0)


@functools.cache
def forward(layout, steps, h, activation, nw):
    """``(x0b, db, taps) -> (xs, zs)`` on buffers, jitted (one kernel per shape)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import _chunks, _mosaic_call

    def run(x0b, db, taps):
        N, _, C = x0b.shape
        out_type = (
            jax.ShapeDtypeStruct((steps + 1, N, layout.rows, C), jnp.float32),
            jax.ShapeDtypeStruct((steps, N, layout.rows, C), jnp.float32),
        )
        chunks = len(_chunks(0, layout.rows))
        barriers = [plgpu.Barrier(num_arrivals=2 + chunks), plgpu.Barrier(num_arrivals=chunks)]
        body = functools.partial(forward_kernel, layout, layout.offsets(3, 3), steps, h, activation, nw)
        return _mosaic_call(body, layout, taps, out_type, barriers, nw, buffers=1)(x0b, db)

    return jax.jit(run)


@functools.cache
def backward(layout, steps, h, activation, nw):
    """``(gb, zs, taps) -> (g0, ss)`` on buffers, jitted."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from naisnet_jax.hopper_block import _chunks, _mosaic_call, _slots

    def run(gb, zs, taps):
        N, _, C = gb.shape
        out_type = (
            jax.ShapeDtypeStruct((N, layout.rows, C), jnp.float32),
            jax.ShapeDtypeStruct((steps, N, layout.rows, C), jnp.float32),
        )
        barriers = [
            plgpu.Barrier(num_arrivals=2 + len(_chunks(0, layout.rows))),
            plgpu.Barrier(num_arrivals=1, num_barriers=_slots(layout, nw) * nw),
        ]
        mirrored = [-off for off in layout.offsets(3, 3)]
        body = functools.partial(backward_kernel, layout, mirrored, steps, h, activation, nw)
        return _mosaic_call(body, layout, jnp.swapaxes(taps, 1, 2), out_type, barriers, nw, buffers=1)(gb, zs)

    return jax.jit(run)


def block(steps, h=1.0, activation="relu", nw=2):
    """``x_K`` of a tied conv block on these kernels, differentiable: the weight gradient as XLA's
    convolution over the stacked states, the drive's the sum of the ``s_k`` (``fused_block``'s
    stacked form)."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax.block_vjp import _weight_grad, conv_op
    from naisnet_jax.fused_block import Layout, _sum_to_shape

    def layout_of(x):
        return Layout.of(x.shape[1], x.shape[2], 3, 3, TILE_ROWS)

    def taps(kernel):
        return kernel.reshape(9, kernel.shape[-2], kernel.shape[-1]).astype(jnp.float32)

    @jax.custom_vjp
    def run(x0, drive, kernel):
        return fwd(x0, drive, kernel)[0]

    def fwd(x0, drive, kernel):
        layout = layout_of(x0)
        db = layout.to_buffer(jnp.broadcast_to(drive, x0.shape))
        xs, zs = forward(layout, steps, h, activation, nw)(layout.to_buffer(x0), db, taps(kernel))
        return layout.interior(xs[steps]), (xs, zs, drive, kernel)

    def bwd(res, g):
        xs, zs, drive, kernel = res
        layout = layout_of(g)
        g0, ss = backward(layout, steps, h, activation, nw)(layout.to_buffer(g), zs, taps(kernel))
        N, H, W, C = g.shape
        x = layout.interior(xs[:steps]).reshape((-1, H, W, C))
        s = layout.interior(ss)
        dW = _weight_grad(conv_op)(x, s.reshape((-1, H, W, C)), kernel)
        return layout.interior(g0), _sum_to_shape(jnp.sum(s, axis=0), drive.shape), dW

    run.defvjp(fwd, bwd)
    return run


def patch_models() -> None:
    """Makes the NAIS nets run their 64-channel tied conv blocks (float32, 3x3) on these kernels
    when JAX's default device is a Hopper GPU (``train_step.py``'s ``c64="wgmma"``); every other
    block as before."""
    import jax.numpy as jnp

    from naisnet_jax.hopper_block import hopper_available

    _common.patch_c64_blocks(block, lambda x0: x0.dtype == jnp.float32 and hopper_available())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warpgroups", default="1,2")
    parser.add_argument("--smoke", action="store_true", help="lower the kernels for CUDA only (any machine)")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: inputs, timing, errors
    import jax
    import jax.numpy as jnp

    import naisnet_jax.block_vjp
    from naisnet_jax import fused_block as fb
    from naisnet_jax.block_vjp import conv_op, unroll_tied

    os.makedirs(args.out, exist_ok=True)
    if not args.smoke and not _common.hopper_here(args.out, "wgmma_block64"):
        return
    K, shape, rows = args.steps, (8, 8, 64), []
    teams = [int(v) for v in args.warpgroups.split(",")]
    if args.smoke:
        naisnet_jax.block_vjp._gpu_backend = lambda: True
        x = jax.ShapeDtypeStruct((args.batch, *shape), jnp.float32)
        w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32)
        for nw in teams:
            f, g = bench._functions(block(K, nw=nw))
            for name, fn, a in (("forward", f, (x, x, w)), ("gradient", g, (x, x, w, x))):
                try:
                    text = fn.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
                    print(f"8x8x64 {name}, {nw} warpgroups: lowered for CUDA, {len(text)} characters")
                except Exception as e:
                    print(f"8x8x64 {name}, {nw} warpgroups: does not lower: {type(e).__name__}: {str(e)[:200]}")
        return
    x0, drive, kernel, cot = bench._inputs(args.batch, shape)
    layout = fb.Layout.of(8, 8, 3, 3, TILE_ROWS)
    interpreted = fb.Config(interpret=True, tile_rows=TILE_ROWS)
    with jax.default_matmul_precision("highest"):  # the reference: Triton's kernels, interpreted
        ref_xs, ref_zs = jax.jit(
            lambda a, b, c: fb.fused_forward(a, b, c, steps=K, h=1.0, activation="relu", config=interpreted)[1:]
        )(x0, drive, kernel)
        ref_g0, ref_ss = jax.jit(
            lambda g, z, c: fb.fused_backward(layout, g, z, c, steps=K, h=1.0, activation="relu", config=interpreted)
        )(cot, ref_zs, kernel)
    xla = bench._functions(functools.partial(unroll_tied, conv_op, steps=K, h=1.0, activation="relu", scan_unroll=10))
    variants = {"xla_stacked_unroll10": xla}
    variants.update({f"wgmma_bf16x3 {nw}wg single buffer": bench._functions(block(K, nw=nw)) for nw in teams})
    taps = kernel.reshape(9, 64, 64)
    for name, (f, g) in variants.items():
        row = dict(shape="8x8x64", name=name)
        try:
            if name.startswith("wgmma"):
                nw = int(name.split()[1][:-2])
                xs, zs = forward(layout, K, 1.0, "relu", nw)(layout.to_buffer(x0), layout.to_buffer(drive), taps)
                row["err_xK"] = bench._rel(layout.interior(xs[-1]), layout.interior(ref_xs[-1]))
                row["err_zs"] = bench._rel(layout.interior(zs), layout.interior(ref_zs))
                g0, ss = backward(layout, K, 1.0, "relu", nw)(layout.to_buffer(cot), ref_zs, taps)
                row["err_g0"] = bench._rel(layout.interior(g0), layout.interior(ref_g0))
                row["err_ss"] = bench._rel(layout.interior(ss), layout.interior(ref_ss))
            row["forward_ms"] = 1e3 * bench._time(f, (x0, drive, kernel), args.iters, args.repeats)
            row["gradient_ms"] = 1e3 * bench._time(g, (x0, drive, kernel, cot), args.iters, args.repeats)
        except Exception as e:  # a kernel the compiler refuses is a row, not the end
            _common.error_row(row, e)
        rows.append(row)
        print(row, flush=True)
    columns = [
        ("shape", "state", "s"),
        ("name", "path", "s"),
        ("forward_ms", "forward ms", ".3f"),
        ("gradient_ms", "forward + gradient ms", ".3f"),
        ("err_xK", "x_K rel err", ".1e"),
        ("err_zs", "z rel err", ".1e"),
        ("err_g0", "g_0 rel err", ".1e"),
        ("err_ss", "s rel err", ".1e"),
    ]
    header = f"A 64-channel block, batch {args.batch}, K = {K}, ReLU, on {{device}}"
    _common.report(args.out, "wgmma_block64", header, rows, columns)


if __name__ == "__main__":
    main()
