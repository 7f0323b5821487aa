"""int8 against bfloat16 ReLU sign: the wgmma block's value and gradients must match bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import fused_block as fb
from naisnet_jax import hopper_block as hb


def run(dt, H, C, seed=0):
    hb.MASK_DTYPE = jnp.dtype(dt)
    hb._forward_call.cache_clear()
    hb._backward_call.cache_clear()
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x0 = jax.random.normal(k[0], (128, H, H, C))
    d = jax.random.normal(k[1], (128, H, H, C))
    w = 0.1 * jax.random.normal(k[2], (3, 3, C, C))
    ct = jax.random.normal(k[3], (128, H, H, C))

    def f(a, b, c):
        return jnp.vdot(fb.unroll_tied_conv(a, b, c, steps=9, activation="relu", engine="wgmma", interpret=False), ct)

    val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x0, d, w)
    return [np.asarray(val)] + [np.asarray(g) for g in grads]


ok = True
for H, C in ((32, 16), (16, 32)):
    a, b = run("bfloat16", H, C), run("int8", H, C)
    same = [np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b)]
    ok &= all(same)
    print(
        f"{H}x{H}x{C}: value/dx0/ddrive/dW bitwise equal int8 vs bf16: {same}; "
        f"finite {all(np.isfinite(x).all() for x in b)}"
    )
print("MASK CHECK", "PASS" if ok else "FAIL")
