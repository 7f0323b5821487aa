"""Benchmark (GPU; prototype, lost): 64-channel blocks as one Triton kernel a step.

Session 26 on an H200 (``benchmarks/results/s26/a``): forward + gradient 0.54 to 0.76 ms a block
against 0.48 for the stacked VJP; only the forward pass won (0.197 against 0.253 ms at 128 rows on
8 warps). That forward pass with the stacked VJP's backward pass made NAIS-Net10's step slower,
27.44 against 26.42 ms (variant ``c64_forward``, removed; it is at commit a1bc7d7).

At 8x8x64, NAIS-Net10's blocks run the stacked VJP. Each step forward is one cuDNN
convolution (~8.3 us on an H200) and one elementwise fusion (~3 us). Each step backward is a
cuDNN input gradient (~12.1 us) and its fusions. XLA launches each convolution from the host
between command buffers. In session 25's profile the main stream waited ~5 us before every forward
convolution and ~10 us before every input gradient: 2.7 ms of a ~26.4 ms step
(``benchmarks/results/s25/``). Whole-block kernels (one program a pattern) lost to cuDNN
there: the Triton one 2 to 4 x in session 21, the wgmma prototype in session 23.

Here each step is one Pallas (Triton) kernel. Pallas kernels sit in XLA's command buffers, so
there are no host waits. Each program takes one tile of ``TILE_ROWS`` rows of one pattern, not
one pattern, so a step has ``batch x tiles`` programs (512 at batch 128):

- forward, step k: ``z = conv(x_k, C) + drive``, ``x_{k+1} = x_k + h act(z)``, both written
  (the residual ``z_k`` in float32);
- backward, step k: ``s_k = h act'(z_k) g_{k+1}``, computed for every window row from the
  windows of ``z_k`` and ``g_{k+1}`` (no program needs another's output), then
  ``g_k = g_{k+1} + conv^T(s_k)``; the tile's ``s_k`` is written too;
- the weight gradient stays cuDNN's convolution over the stacked steps, and the drive's gradient
  is XLA's sum of the ``s_k``, as in the stacked VJP.

The script checks a block's value and gradients against the stacked VJP at the highest precision,
and times a block alone (forward, forward + gradient) both ways. ``train_step.py``'s variant
``nais10_fused_unroll10_c64_steps`` runs the whole step with it (:func:`patch_models`).
``--smoke`` runs the kernels in Pallas' interpreter on a CPU, in float64 against the plain
Python loop, and lowers them for CUDA.

    python benchmarks/step_kernels64.py --out=$OUT/step_kernels64
    python benchmarks/step_kernels64.py --out=/tmp/step_kernels64 --smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

TILE_ROWS = 32  # at 8x8: the 100 padded rows in 4 tiles
WARPS = 4
#: ``(rows, warps)`` timed on a GPU: every program loads all nine ``(C, C)`` taps (147 KB at 64
#: channels), so larger tiles move fewer taps through the L2 cache and run fewer programs.
TILINGS = [(32, 4), (64, 4), (64, 8), (128, 8)]


def _tile(layout, tiles):
    """``(n, q0)``: this program's pattern and the first row of its tile (from the padded image's
    first row)."""
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _index

    p = _index(pl.program_id(0))
    return p // tiles, (p % tiles) * layout.tile_rows


def forward_kernel(layout, offsets, h, activation, x_ref, d_ref, w_ref, xn_ref, z_ref):
    """One step of one tile: ``z = conv(x, C) + d`` tap by tap, ``x + h act(z)``; both written,
    zero outside the image."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _act, _inside

    n, q0 = _tile(layout, layout.tiles)
    S, M = layout.slack, layout.tile_rows
    rows = pl.ds(S + q0, M)
    z = d_ref[n, rows]
    for t, off in enumerate(offsets):
        z = z + jnp.dot(x_ref[n, pl.ds(S + q0 + off, M)], w_ref[t], preferred_element_type=z.dtype)
    inside = _inside(layout, q0)
    zero = jnp.zeros_like(z)
    xn_ref[n, rows] = jnp.where(inside, x_ref[n, rows] + h * _act(activation, z), zero)
    z_ref[n, rows] = jnp.where(inside, z, zero)


def backward_kernel(layout, offsets, h, activation, g_ref, z_ref, wt_ref, gp_ref, s_ref):
    """One step back of one tile: ``g + conv^T(s)``, ``s = h act'(z) g`` taken at every window row
    from the windows of ``z`` and ``g`` (mirrored taps, transposed channels); the tile's ``s``
    written too, zero outside the image."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from naisnet_jax.fused_block import _inside, _scaled_slope

    n, q0 = _tile(layout, layout.tiles)
    S, M = layout.slack, layout.tile_rows
    rows = pl.ds(S + q0, M)
    g = g_ref[n, rows]
    inside = _inside(layout, q0)
    acc = g
    for t, off in enumerate(offsets):
        window = pl.ds(S + q0 + off, M)  # the mirrored offset: rows r - offset_t
        s = _scaled_slope(activation, h, z_ref[n, window], g_ref[n, window])
        acc = acc + jnp.dot(s, wt_ref[t], preferred_element_type=g.dtype)
    zero = jnp.zeros_like(g)
    gp_ref[n, rows] = jnp.where(inside, acc, zero)
    s_ref[n, rows] = jnp.where(inside, _scaled_slope(activation, h, z_ref[n, rows], g), zero)


def _call(body, layout, N, C, dtype, interpret, warps=WARPS, outputs=2):
    """``pallas_call`` of a per-step kernel: ``outputs`` buffers ``(N, rows, C)``, a program a tile."""
    import jax

    from naisnet_jax import fused_block as fb

    shape = jax.ShapeDtypeStruct((N, layout.rows, C), dtype)
    config = fb.Config(interpret=interpret, tile_rows=layout.tile_rows, num_warps=warps)
    return fb._pallas(body, (shape,) * outputs, N * layout.tiles, config)


def block(steps, h=1.0, activation="relu", interpret=False, tile_rows=TILE_ROWS, warps=WARPS):
    """``x_K`` of a tied 3x3 conv block on the per-step kernels, differentiable (the weight gradient
    by XLA's convolution over the stacked steps, the drive's a sum of the ``s_k``); programs of
    ``tile_rows`` rows on ``warps`` warps."""
    import jax
    import jax.numpy as jnp

    from naisnet_jax.block_vjp import _weight_grad, conv_op
    from naisnet_jax.fused_block import Layout, _sum_to_shape

    def layout_of(x):
        return Layout.of(x.shape[1], x.shape[2], 3, 3, tile_rows)

    def fwd(x0, drive, kernel):
        layout = layout_of(x0)
        N, C = x0.shape[0], x0.shape[-1]
        offsets = layout.offsets(3, 3)
        db = layout.to_buffer(jnp.broadcast_to(drive, x0.shape).astype(x0.dtype))
        taps = kernel.reshape(9, C, C).astype(x0.dtype)
        call = _call(
            functools.partial(forward_kernel, layout, offsets, h, activation), layout, N, C, x0.dtype, interpret, warps
        )
        xs, zs = [layout.to_buffer(x0)], []
        for _ in range(steps):
            x, z = call(xs[-1], db, taps)
            xs.append(x)
            zs.append(z)
        return layout.interior(xs[-1]), (tuple(xs[:-1]), tuple(zs), drive, kernel)

    @jax.custom_vjp
    def run(x0, drive, kernel):
        return fwd(x0, drive, kernel)[0]

    def bwd(res, g):
        xs, zs, drive, kernel = res
        layout = layout_of(g)
        N, H, W, C = g.shape
        mirrored = [-off for off in layout.offsets(3, 3)]
        # tap t of the transposed convolution: the kernel's tap t (read at the mirrored offset), C_out x C_in
        taps_t = jnp.swapaxes(kernel.reshape(9, C, C), 1, 2).astype(g.dtype)
        call = _call(
            functools.partial(backward_kernel, layout, mirrored, h, activation), layout, N, C, g.dtype, interpret, warps
        )
        gb, ss = layout.to_buffer(g), [None] * steps
        for k in reversed(range(steps)):
            gb, ss[k] = call(gb, zs[k], taps_t)
        x = jnp.stack([layout.interior(x) for x in xs]).reshape((-1, H, W, C))
        s = jnp.stack([layout.interior(s) for s in ss])
        dW = _weight_grad(conv_op)(x, s.reshape((-1, H, W, C)), kernel)
        return layout.interior(gb), _sum_to_shape(jnp.sum(s, axis=0), drive.shape).astype(drive.dtype), dW

    run.defvjp(fwd, bwd)
    return run


CHANNELS = 64


def patch_models() -> None:
    """The NAIS nets' tied 64-channel conv blocks (3x3, ReLU or tanh) on these kernels where the
    fused kernels run (a float32 state on a CUDA GPU); every other block as before
    (``train_step.py``'s ``c64="steps"``), at the tiling ``$STEP64_TILING`` names (``rows,warps``)."""
    from naisnet_jax import fused_block

    # $STEP64_TILING="rows,warps" (for example the fastest row of this script's table), else the defaults
    rows, warps = (int(v) for v in os.environ.get("STEP64_TILING", f"{TILE_ROWS},{WARPS}").split(","))
    block_for = functools.partial(block, tile_rows=rows, warps=warps)
    _common.patch_c64_blocks(block_for, fused_block.gpu_kernels_available)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the interpreter in float64 (CPU), then a CUDA lowering")
    args = parser.parse_args(argv)
    _common.importable()
    import fused_block as bench  # benchmarks/fused_block.py: inputs, timing, errors
    import jax
    import jax.numpy as jnp

    from naisnet_jax.block_vjp import conv_op, unroll_tied

    K, rows = args.steps, []
    if args.smoke:
        jax.config.update("jax_enable_x64", True)
        batch, K, C = 2, 3, 16
        x0, drive, kernel, cot = (a.astype(jnp.float64) for a in bench._inputs(batch, (8, 8, C)))
        for activation in ("relu", "tanh"):
            act = jax.nn.relu if activation == "relu" else jnp.tanh

            def loop(x0, drive, kernel, act=act):  # the plain loop: K steps, autodiff
                x = x0
                for _ in range(K):
                    x = x + 0.5 * act(conv_op(x, kernel) + drive)
                return x

            mine = bench._functions(block(K, 0.5, activation, interpret=True))
            ref = bench._functions(loop)
            row = dict(shape=f"8x8x{C}", name=f"interpreter, float64, {activation}")
            row["err_block"] = bench._rel(mine[0](x0, drive, kernel), ref[0](x0, drive, kernel))
            got, want = mine[1](x0, drive, kernel, cot), ref[1](x0, drive, kernel, cot)
            row["err_grads"] = max(bench._rel(a, b) for a, b in zip(got, want))
            rows.append(row)
            print(row, flush=True)
        jax.config.update("jax_enable_x64", False)
        x = jax.ShapeDtypeStruct((args.batch, 8, 8, CHANNELS), jnp.float32)
        w = jax.ShapeDtypeStruct((3, 3, CHANNELS, CHANNELS), jnp.float32)
        for r, nw in TILINGS:
            f, g = bench._functions(block(args.steps, tile_rows=r, warps=nw))
            for name, fn, a in (("forward", f, (x, x, w)), ("gradient", g, (x, x, w, x))):
                text = fn.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
                assert "triton" in text.lower() or "__gpu$xla.gpu.triton" in text, name
                print(f"8x8x{CHANNELS} {name}, {r} rows, {nw} warps: lowered for CUDA, {len(text)} characters")
    else:
        x0, drive, kernel, cot = bench._inputs(args.batch, (8, 8, CHANNELS))
        with jax.default_matmul_precision("highest"):
            ref = bench._functions(functools.partial(unroll_tied, conv_op, steps=K, h=1.0, activation="relu"))
            want_x, want_g = ref[0](x0, drive, kernel), ref[1](x0, drive, kernel, cot)
        stacked = functools.partial(unroll_tied, conv_op, steps=K, h=1.0, activation="relu", scan_unroll=10)
        paths = [("stacked VJP (cuDNN)", stacked)]
        paths += [(f"a Triton kernel a step, {r} rows, {w} warps", block(K, tile_rows=r, warps=w)) for r, w in TILINGS]
        for name, run in paths:
            row = dict(shape=f"8x8x{CHANNELS}", name=name)
            try:
                f, g = bench._functions(run)
                row["err_block"] = bench._rel(f(x0, drive, kernel), want_x)
                row["err_grads"] = max(bench._rel(a, b) for a, b in zip(g(x0, drive, kernel, cot), want_g))
                row["forward_ms"] = 1e3 * bench._time(f, (x0, drive, kernel), args.iters, args.repeats)
                row["gradient_ms"] = 1e3 * bench._time(g, (x0, drive, kernel, cot), args.iters, args.repeats)
            except Exception as e:  # noqa: BLE001 - a path that fails is a row, not the end
                _common.error_row(row, e)
            rows.append(row)
            print(row, flush=True)
    columns = [
        ("shape", "state", "s"),
        ("name", "path", "s"),
        ("forward_ms", "forward ms", ".3f"),
        ("gradient_ms", "forward + gradient ms", ".3f"),
        ("err_block", "x_K rel err", ".1e"),
        ("err_grads", "gradients rel err", ".1e"),
    ]
    header = f"A 64-channel block a kernel a step, K = {K}, ReLU, on {{device}} (errors vs highest precision)"
    _common.report(args.out, "step_kernels64", header, rows, columns)


if __name__ == "__main__":
    main()
