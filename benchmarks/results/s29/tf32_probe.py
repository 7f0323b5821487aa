"""Where the TF32 views kernels' time goes: sends of every state by plane, or not.

Run at commit d6089b7, when the TF32 kernels still sent every saved state out by planes
(``_planes_out``); they now send saved states and ``s_k`` a tile at a time, row-major, and
``_planes_out`` only sends the last state and ``g_0``."""

import sys

sys.path.insert(0, "benchmarks")
import fused_block as bench
import jax

from naisnet_jax import fused_block as fb
from naisnet_jax import hopper_tf32 as ht

K, N = 10, 128
orig_out = ht._planes_out


def one_plane(planes, dst, chunks):  # wrong values: only plane 0 goes out
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for s0, size in chunks:
        plgpu.copy_smem_to_gmem(planes.at[0, pl.ds(s0, size)], dst.at[pl.ds(s0, size), pl.ds(0, 4)])


for H, C in ((32, 16), (16, 32)):
    for tf32 in (False, True):
        cfg = fb.Config(tile_rows=fb.default_tiling(C)[0], warpgroups=5 if C == 16 else 3, tf32=tf32)
        x0, drive, kernel, cot = bench._inputs(N, (H, H, C))
        layout = cfg.layout(H, H, 3, 3)
        for save in (True, False):
            for sends in ("all", "one") if tf32 else ("all",):
                ht._planes_out = orig_out if sends == "all" else one_plane
                ht._forward_call.cache_clear()
                ht._backward_call.cache_clear()
                f = jax.jit(
                    lambda a, b, c: fb.fused_forward(a, b, c, steps=K, h=1.0, activation="relu", save=save, config=cfg)[
                        1:
                    ]
                )
                ms = 1e3 * bench._time(f, (x0, drive, kernel), 20, 5)
                line = f"{H}x{H}x{C} tf32={tf32} save={save} sends={sends}: forward {ms:.3f} ms"
                if save:
                    xs, zs = f(x0, drive, kernel)
                    b = jax.jit(
                        lambda g, z, c: fb.fused_backward(
                            layout, g, z, c, steps=K, h=1.0, activation="relu", config=cfg
                        )
                    )
                    line += f", backward {1e3 * bench._time(b, (cot, zs, kernel), 20, 5):.3f} ms"
                print(line, flush=True)
        ht._planes_out = orig_out
