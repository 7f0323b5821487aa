"""Why the TF32 backward at 32x32x16 is slower than the bf16x3 one: its s_k staging."""

import sys
import types

sys.path.insert(0, "benchmarks")
import fused_block as bench
import jax

from naisnet_jax import fused_block as fb

src = open("src/naisnet_jax/hopper_tf32.py").read()
WAIT = "        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging slot's last copy has read it\n"
STAGE = (
    "        sstage[wg] = s\n"
    "        plgpu.commit_smem()  # also: every thread is done with z's slot j % slots before it is refilled\n"
    "        plgpu.copy_smem_to_gmem(sstage.at[wg], ss_ref.at[k, n, pl.ds(S + first[j], M)])\n"
)
assert WAIT in src and STAGE in src
variants = {
    "as is": src,
    "no wait (racy)": src.replace(WAIT, ""),
    "no s out (wrong)": src.replace(WAIT, "").replace(STAGE, "        plgpu.commit_smem()\n"),
}
K, N = 10, 128
for H, C, nw in ((32, 16, 5), (16, 32, 3)):
    x0, drive, kernel, cot = bench._inputs(N, (H, H, C))
    cfg = fb.Config(tile_rows=fb.default_tiling(C)[0], warpgroups=nw, tf32=True)
    layout = cfg.layout(H, H, 3, 3)
    _, zs = jax.jit(lambda a, b, c: fb.fused_forward(a, b, c, steps=K, h=1.0, activation="relu", config=cfg)[1:])(
        x0, drive, kernel
    )
    for name, text in variants.items():
        mod = types.ModuleType("ht_probe")
        mod.__dict__["__name__"] = "ht_probe"
        exec(compile(text, "ht_probe", "exec"), mod.__dict__)
        fb.hopper_tf32 = mod
        b = jax.jit(lambda g, z, c: fb.fused_backward(layout, g, z, c, steps=K, h=1.0, activation="relu", config=cfg))
        print(f"{H}x{H}x{C} backward, {name}: {1e3 * bench._time(b, (cot, zs, kernel), 20, 5):.3f} ms", flush=True)
