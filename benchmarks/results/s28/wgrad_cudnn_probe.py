"""cuDNN's weight gradient over stacked states (K N images) at the fused stages' shapes, against
the library's summing Triton kernel on the same data; plus XLA's sum over the steps."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import fused_block as fb


def timed(f, *a, reps=5, n=10):
    jax.block_until_ready(f(*a))
    jax.block_until_ready(f(*a))
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            out = f(*a)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / n)
    return 1e3 * best


dn = ("NHWC", "HWIO", "NHWC")
for H, C in ((32, 16), (16, 32)):
    K, N = 9, 128
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    layout = fb.Layout.of(H, H, 3, 3, fb.default_tiling(C)[0])
    x = jax.random.normal(k[0], (K, N, H, H, C))
    s = jax.random.normal(k[1], (K, N, H, H, C))
    xs = layout.to_buffer(x)
    ss = layout.to_buffer(s)
    xs = jnp.concatenate([xs, xs[:1]])  # K + 1 states as the kernel takes them
    w = jnp.zeros((3, 3, C, C))

    def cudnn(xi, si):  # dW over the stacked images, SAME
        def f(w_):
            return jax.lax.conv_general_dilated(xi, w_, (1, 1), "SAME", dimension_numbers=dn)

        return jax.linear_transpose(f, w)(si)[0]

    def cudnn_padded(xp, sp):  # over 34x34 padded images, SAME (the padding ring is zero)
        def f(w_):
            return jax.lax.conv_general_dilated(xp, w_, (1, 1), "SAME", dimension_numbers=dn)

        return jax.linear_transpose(f, w)(sp)[0]

    xi = x.reshape(K * N, H, H, C)
    si = s.reshape(K * N, H, H, C)
    xp = jnp.pad(xi, ((0, 0), (1, 1), (1, 1), (0, 0)))
    sp = jnp.pad(si, ((0, 0), (1, 1), (1, 1), (0, 0)))
    lib = jax.jit(functools.partial(fb.fused_weight_grad, layout, kernel_shape=(3, 3, C, C), sum_steps=True))
    ssum = jax.jit(lambda a: jnp.sum(a, axis=0))
    ref = np.asarray(jax.jit(cudnn)(xi, si), np.float64)
    got = np.asarray(lib(xs, ss)[0], np.float64)
    t_cudnn = timed(jax.jit(cudnn), xi, si)
    t_padded = timed(jax.jit(cudnn_padded), xp, sp)
    t_lib, t_sum = timed(lib, xs, ss), timed(ssum, si.reshape(K, N, H, H, C))
    print(
        f"{H}x{H}x{C}: cudnn wgrad {t_cudnn:.4f} ms, on padded 34x34 {t_padded:.4f}, "
        f"library summing kernel {t_lib:.4f}, XLA sum of s over steps {t_sum:.4f}; "
        f"rel diff lib vs cudnn {np.abs(got - ref).max() / np.abs(ref).max():.2e}",
        flush=True,
    )
