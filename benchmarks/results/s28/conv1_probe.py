"""One 3x3 conv step at NAIS-Net10's drive shapes: cuDNN (XLA) against the wgmma forward kernel with
steps=1, 20 chained calls inside one jit, ms a call."""

import functools
import time

import jax
import jax.numpy as jnp

from naisnet_jax import fused_block as fb
from naisnet_jax import hopper_block as hb


def timed(f, x, reps=5):
    jax.block_until_ready(f(x))
    jax.block_until_ready(f(x))
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return 1e3 * best / 20


for H, C in ((32, 16), (16, 32)):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (128, H, H, C))
    w = 0.1 * jax.random.normal(k[1], (3, 3, C, C))
    b = jax.random.normal(k[2], (C,))
    dn = ("NHWC", "HWIO", "NHWC")

    @jax.jit
    def cudnn(x):
        for _ in range(20):
            x = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn) + b
        return x

    @jax.jit
    def cudnn_dgrad(x):
        def f(u):
            return jax.lax.conv_general_dilated(u, w, (1, 1), "SAME", dimension_numbers=dn)

        for _ in range(20):
            x = jax.vjp(f, x)[1](x)[0]
        return x

    layout = fb.Layout.of(H, H, 3, 3, fb.default_tiling(C)[0])
    nw = hb.choose_warpgroups(layout, C)
    taps = fb._taps(w)
    db = layout.to_buffer(jnp.broadcast_to(b, x.shape))

    def kern(xb, act):
        return hb.fused_forward(layout, xb, db, taps, steps=1, h=1.0, activation=act, save=False, warpgroups=nw)[0][0]

    @functools.partial(jax.jit, static_argnums=1)
    def hop(xb, act):
        for _ in range(20):
            xb = kern(xb, act)
        return xb

    @jax.jit
    def hop_nhwc(x):
        for _ in range(20):
            x = layout.interior(kern(layout.to_buffer(x), "relu"))
        return x

    xb = layout.to_buffer(x)
    print(
        f"{H}x{H}x{C} nw={nw}: cudnn fprop+bias {timed(cudnn, x):.4f} ms, cudnn dgrad {timed(cudnn_dgrad, x):.4f}, "
        f"wgmma step relu {timed(lambda v: hop(v, 'relu'), xb):.4f}, tanh {timed(lambda v: hop(v, 'tanh'), xb):.4f}, "
        f"with pad+slice {timed(hop_nhwc, x):.4f}",
        flush=True,
    )
