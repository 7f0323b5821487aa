"""The TF32 wgmma block kernels (``naisnet_jax.kernels.wgmma_tf32``): the window views' addressing
against the planes, the layout they need, the choice of kernels by precision, their shared memory
and warpgroups, and the GPU build lowered for CUDA on this CPU.

Pallas' interpreter cannot run ``wgmma``, so the kernels' values are checked on a GPU
(``benchmarks/hopper_checks.py`` against the stacked VJP at the highest precision, under vmap;
``benchmarks/wgmma_block.py`` against the Triton kernels in the interpreter).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from naisnet_jax.kernels import KernelPolicy, common, policy, tf32_planes, tuning
from naisnet_jax.kernels import conv as kconv
from naisnet_jax.kernels import wgmma_common as wc
from naisnet_jax.kernels import wgmma_tf32 as ht


@pytest.mark.parametrize("H, C", [(32, 16), (16, 32), (8, 64)])
def test_window_views_address_every_window(H, C):
    """Every tap's window, read through its descriptor fields with PTX's unswizzled K-major
    addressing (core matrices of 8 rows x 16 bytes), from a byte image of the planes, equals the
    state's rows ``q0 + offset .. + 64`` for every tile: every instruction's 8 channels, in groups
    of one swizzle width (32 channels at 64: two ``wgmma_m64`` calls a tap)."""
    layout = common.Layout.of(H, H, 3, 3, 64 if C > 32 else tuning.default_tiling(C)[0], align=8)
    group = tf32_planes.swizzle_of(C) // 4  # channels of one wgmma_m64 call
    rng = np.random.default_rng(0)
    state = rng.standard_normal((layout.rows, C)).astype(np.float32)
    planes = np.ascontiguousarray(state.reshape(layout.rows, C // 4, 4).transpose(1, 0, 2))
    memory = planes.view(np.uint8).ravel()  # shared memory, byte-addressed
    plane_bytes = layout.rows * 16
    S = layout.slack
    m, k = np.meshgrid(np.arange(64), np.arange(8), indexing="ij")
    for q0 in range(0, wc.tiles_of(layout) * 64, 64):
        span = q0 * 16  # the span passed to the products starts `reach` rows before the tile
        for off in layout.offsets(3, 3):
            for i in range(C // 8):  # one m64nNk8 per 8 channels
                f = tf32_planes.window_fields(S, off, plane_bytes, i * 8 // group * group)
                addr = span + f["start"] + (i % (group // 8)) * f["k_step"] + (m // 8) * f["sbo"] + (m % 8) * 16
                addr = addr + (k // 4) * f["lbo"] + (k % 4) * 4
                got = memory[addr[..., None] + np.arange(4)].view(np.float32)[..., 0]
                want = state[S + q0 + off + np.arange(64)][:, 8 * i : 8 * i + 8]
                np.testing.assert_array_equal(got, want)


def test_layout_align_keeps_the_image_and_slack():
    """``align=8``: rows a multiple of 8, the same image, at least the slack after it."""
    for H, C in ((32, 16), (16, 32), (8, 16)):
        plain = common.Layout.of(H, H, 3, 3, tuning.default_tiling(C)[0])
        aligned = common.Layout.of(H, H, 3, 3, tuning.default_tiling(C)[0], align=8)
        assert aligned.rows % 8 == 0 and plain.rows <= aligned.rows < plain.rows + 8
        assert aligned.rows - aligned.slack - aligned.padded_rows >= aligned.slack
        x = jnp.asarray(np.random.default_rng(1).standard_normal((2, H, H, C)), jnp.float32)
        buf = aligned.to_buffer(x)
        assert buf.shape == (2, aligned.rows, C)
        np.testing.assert_array_equal(aligned.interior(buf), x)
        np.testing.assert_array_equal(plain.interior(plain.to_buffer(x)), x)


@pytest.mark.parametrize(
    "shape, activation, warpgroups",
    [((32, 32, 16), "relu", 5), ((32, 32, 16), "tanh", 4), ((16, 16, 32), "relu", 3), ((16, 16, 32), "tanh", 3)],
)
def test_warpgroups_divide_tiles_and_fit(shape, activation, warpgroups):
    """The most warpgroups that divide the tiles and whose planes, staging slots (ReLU's sign in
    a byte, tanh's z in four) and taps fit in shared memory; one more does not fit."""
    H, W, C = shape
    layout = common.Layout.of(H, W, 3, 3, tuning.default_tiling(C)[0], align=8)
    nw = ht.choose_warpgroups(layout, C, activation)
    assert nw == warpgroups and wc.tiles_of(layout) % nw == 0
    assert ht.smem_bytes(layout, C, nw, activation) <= wc.SMEM_BYTES
    bigger = [n for n in range(nw + 1, wc.MAX_WARPGROUPS + 1) if wc.tiles_of(layout) % n == 0]
    assert all(ht.smem_bytes(layout, C, n, activation) > wc.SMEM_BYTES for n in bigger)


def test_refusals_name_the_problem():
    layout = common.Layout.of(32, 32, 3, 3, tuning.default_tiling(16)[0], align=8)
    x = jnp.zeros((2, layout.rows, 16), jnp.float32)
    taps = jnp.zeros((9, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"warpgroups=5: a program needs \d+ bytes of shared memory"):
        ht.fused_forward(layout, x, x, taps, steps=2, h=1.0, activation="tanh", save=True, warpgroups=5)
    plain = common.Layout.of(32, 32, 3, 3, tuning.default_tiling(16)[0])
    y = jnp.zeros((2, plain.rows, 16), jnp.float32)
    with pytest.raises(ValueError, match=f"rows are a multiple of 8.*got rows={plain.rows}"):
        ht.fused_forward(plain, y, y, taps, steps=2, h=1.0, activation="relu", save=True, warpgroups=5)
    big = jnp.zeros((2, 64, 64, 16), jnp.float32)
    assert "shared memory" in ht.unsupported(
        common.Layout.of(64, 64, 3, 3, tuning.default_tiling(16)[0], align=8), big, jnp.zeros((3, 3, 16, 16)), "relu"
    )


def _kernels(precision=None, activation="relu", C=16, monkeypatch=None):
    """The wgmma kernels' names in the lowered gradient of a block, under ``precision``."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)  # as on a GPU
    x = jax.ShapeDtypeStruct((4, 16, 16, C), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, C, C), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(
            kconv.unroll_tied_conv(
                a, b, c, steps=3, activation=activation, policy=KernelPolicy(interpret=False, engine="wgmma")
            )
        )

    with jax.default_matmul_precision(precision):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
    return sorted(set(re.findall(r"hopper\w*_kernel", text)))


@pytest.mark.parametrize("activation, C", [("relu", 16), ("tanh", 32)])
def test_tf32_kernels_at_default_precision(activation, C, monkeypatch):
    assert _kernels(None, activation=activation, C=C, monkeypatch=monkeypatch) == [
        "hopper_tf32_backward_kernel",
        "hopper_tf32_forward_kernel",
    ]
    assert _kernels("tensorfloat32", monkeypatch=monkeypatch)[0] == "hopper_tf32_backward_kernel"


@pytest.mark.parametrize("precision", ["float32", "highest"])
def test_three_bf16_products_where_more_is_asked(precision, monkeypatch):
    """Forced (``engine="wgmma"``) at ``float32``/``highest`` precision: the split engine's kernels."""
    assert _kernels(precision, monkeypatch=monkeypatch) == [
        "hopper_backward_kernel",
        "hopper_forward_kernel",
    ]


@pytest.mark.parametrize("precision", ["float32", "highest"])
def test_automatic_choice_above_tf32_takes_the_triton_kernels(precision, monkeypatch):
    """Not forced, a block on a Hopper GPU at ``float32``/``highest`` precision takes the Triton
    kernels (whose products Pallas lowers at that precision), not the wgmma ones (TF32 or about 16
    bits): the fast path keeps float32 accuracy where it is asked for."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    monkeypatch.setattr(common, "hopper_available", lambda: True)
    x = jax.ShapeDtypeStruct((4, 16, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 16, 16), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(kconv.unroll_tied_conv(a, b, c, steps=3))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for p, wgmma in ((None, True), (precision, False)):
        with jax.default_matmul_precision(p):
            text = grad.trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert ("mosaic_gpu" in text) == wgmma and "triton" in text.lower()
        plan = policy.conv_plan(jnp.zeros((4, 16, 16, 16), jnp.float32), jnp.zeros((3, 3, 16, 16)), "relu")
        assert plan is not None and plan.warpgroups == 0 and not plan.tf32  # outside the context: highest


def test_relu_backward_takes_z_or_its_sign():
    """The backward kernel takes ReLU's saved sign, or ``z_k`` itself reduced to its sign first
    (both lower; the staging slots stay a byte an element, so five warpgroups fit)."""
    layout = common.Layout.of(32, 32, 3, 3, tuning.default_tiling(16)[0], align=8)
    g = jax.ShapeDtypeStruct((2, layout.rows, 16), jnp.float32)
    taps = jax.ShapeDtypeStruct((9, 16, 16), jnp.float32)
    for dtype in (wc.SIGN_DTYPE, jnp.float32):
        zs = jax.ShapeDtypeStruct((3, 2, layout.rows, 16), dtype)
        run = jax.jit(
            lambda a, z, t: ht.fused_backward(layout, a, z, t, steps=3, h=1.0, activation="relu", warpgroups=5)
        )
        assert "mosaic_gpu" in run.trace(g, zs, taps).lower(lowering_platforms=("cuda",)).as_text()


def test_sixty_four_channels_single_buffered():
    """At 64 channels the float32 taps take 147 KB, so the state has one buffer in shared memory
    and an 8x8 state's two tiles get a warpgroup each (ReLU); tanh's float32 staging does not fit,
    and the refusal says so. Both kernels lower for CUDA (the values are checked on a GPU by
    ``benchmarks/wgmma_block.py --shapes=8x8x64``)."""
    assert [ht.buffers_of(C) for C in ht.CHANNELS] == [2, 2, 1]
    layout = common.Layout.of(8, 8, 3, 3, 64, align=8)
    assert ht.choose_warpgroups(layout, 64, "relu") == 2
    assert ht.smem_bytes(layout, 64, 2) == layout.rows * 64 * 4 + 2 * 64 * 64 + 2 * 64 * 64 * 4 + 9 * 64 * 64 * 4 + 1024
    x4 = jnp.zeros((2, 8, 8, 64), jnp.float32)
    w = jnp.zeros((3, 3, 64, 64), jnp.float32)
    assert ht.unsupported(layout, x4, w, "relu") is None
    assert "shared memory" in ht.unsupported(layout, x4, w, "tanh")
    assert "16, 32 or 64 channels, got 128" in ht.unsupported(layout, jnp.zeros((2, 8, 8, 128), jnp.float32), w, "relu")
    x = jax.ShapeDtypeStruct((4, layout.rows, 64), jnp.float32)
    taps = jax.ShapeDtypeStruct((9, 64, 64), jnp.float32)
    zs = jax.ShapeDtypeStruct((3, 4, layout.rows, 64), wc.SIGN_DTYPE)
    fwd = jax.jit(
        lambda a, b, t: ht.fused_forward(layout, a, b, t, steps=3, h=1.0, activation="relu", save=True, warpgroups=2)
    )
    bwd = jax.jit(lambda a, z, t: ht.fused_backward(layout, a, z, t, steps=3, h=1.0, activation="relu", warpgroups=2))
    for fn, args in ((fwd, (x, x, taps)), (bwd, (x, zs, taps))):
        assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_wide_path_weight_gradient_from_xla_matches_the_loop():
    """The config of a 64-channel block on the wide path (the TF32 kernels' layout, the kernel's
    gradient by XLA's convolution gradient on the saved states), the block kernels run in the
    interpreter in float64: value and gradients equal the plain loop's."""
    from naisnet_jax.kernels.stacked import conv_op, unroll_tied

    rng = np.random.default_rng(3)
    x0, drive, cot = (jnp.asarray(rng.standard_normal((2, 6, 6, 64))) for _ in range(3))
    kernel = jnp.asarray(0.05 * rng.standard_normal((3, 3, 64, 64)))
    config = policy.ConvPlan(interpret=True, tile_rows=tuning.WIDE_TILE_ROWS, tf32=True, xla_wgrad=True)

    def grads(run):
        return jax.value_and_grad(lambda a, b, c: jnp.vdot(run(a, b, c), cot), argnums=(0, 1, 2))(x0, drive, kernel)

    got = grads(lambda a, b, c: kconv._fused(a, b, c, 3, 0.5, "relu", config))
    want = grads(lambda a, b, c: unroll_tied(conv_op, a, b, c, steps=3, h=0.5, activation="relu"))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("precision", [None, "float32"])
def test_wide_blocks_take_the_tf32_kernels_where_tf32_is_allowed(precision, monkeypatch):
    """On a Hopper GPU at JAX's default precision a 64-channel block's gradient lowers to the TF32
    kernels (forward and backward) and a convolution for its kernel's gradient, no Triton kernel;
    where the precision asks for more than TF32 the block keeps the stacked VJP (no Mosaic
    kernel)."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)  # as on a GPU
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    monkeypatch.setattr(common, "hopper_available", lambda: True)
    x = jax.ShapeDtypeStruct((4, 8, 8, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(kconv.unroll_tied_conv(a, b, c, steps=3, activation="relu"))

    with jax.default_matmul_precision(precision):  # None: JAX's default (the tests' conftest asks "highest")
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
    kernels = sorted(set(re.findall(r"hopper\w*_kernel", text)))
    if precision is None:
        assert kernels == ["hopper_tf32_backward_kernel", "hopper_tf32_forward_kernel"]
        assert "triton" not in text.lower() and "convolution" in text
    else:
        assert kernels == [] and "mosaic_gpu" not in text


@pytest.mark.parametrize("H, W, warpgroups", [(8, 8, 2), (8, 8, 1), (16, 16, 3), (5, 7, 1)])
def test_interior_runs_cover_the_image_once(H, W, warpgroups):
    """``interior_runs``: the copies each warpgroup's tiles send with ``interior=True`` (a run of
    the staging slot's rows to a row of the image), replayed in numpy over every tile, rebuild
    exactly ``Layout.interior`` of the buffer, every pixel written once."""
    layout = common.Layout.of(H, W, 3, 3, 64, align=8)
    C = 4
    buf = np.arange(layout.rows * C, dtype=np.float64).reshape(layout.rows, C)
    image, writes = np.full((H, W, C), np.nan), np.zeros((H, W), int)
    per = wc.tiles_of(layout) // warpgroups
    for w in range(warpgroups):
        for j in range(per):
            q0 = (w * per + j) * 64
            stage = buf[layout.slack + q0 : layout.slack + q0 + 64]  # the tile's rows, as staged
            for a, i, c0, length in ht.interior_runs(layout, q0):
                assert 0 <= a and a + length <= 64 and 0 <= c0 and c0 + length <= W
                image[i, c0 : c0 + length] = stage[a : a + length]
                writes[i, c0 : c0 + length] += 1
    np.testing.assert_array_equal(writes, 1)
    np.testing.assert_array_equal(image, np.asarray(layout.interior(jnp.asarray(buf))))


def test_interior_outputs_need_rows_of_128_bytes():
    """``interior=True`` sends runs from any row of the staging slot, which TMA takes only at
    128-byte boundaries: 16 channels (64-byte rows) are refused by name, before anything is built."""
    layout = common.Layout.of(8, 8, 3, 3, 64, align=8)
    x = jnp.zeros((2, layout.rows, 16), jnp.float32)
    with pytest.raises(ValueError, match="interior=True.*64 bytes"):
        ht.fused_forward(
            layout,
            x,
            x,
            jnp.zeros((9, 16, 16)),
            steps=2,
            h=1.0,
            activation="relu",
            save=True,
            warpgroups=1,
            interior=True,
        )


def test_wide_block_saves_states_as_images_for_the_weight_gradient(monkeypatch):
    """On the wide path the TF32 kernels write the saved states and ``s_k`` as images: the
    lowered gradient of a 64-channel block (as on a Hopper GPU) takes its kernel gradient from a
    convolution over ``(K - 1) N`` images with no copy of the buffers' interiors before it (XLA
    would slice ``(K, N, rows, C)`` buffers otherwise)."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    monkeypatch.setattr(common, "hopper_available", lambda: True)
    N, steps = 4, 3
    x = jax.ShapeDtypeStruct((N, 8, 8, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(kconv.unroll_tied_conv(a, b, c, steps=steps, activation="relu"))

    with jax.default_matmul_precision(None):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
    kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    forward = next(line for line in kernels if "xi8>)" in line.split("->")[-1])
    images = f"tensor<{steps}x{N}x64x64xf32>"  # flat images: (K, N, H W, C)
    assert f"-> ({images}, tensor<{N}x64x64xf32>, tensor<{steps}x{N}x152x64xi8>)" in forward  # x_K apart
    assert any(line.endswith(f"tensor<{N}x152x64xf32>, {images})") for line in kernels)  # (g_0, the s_k)
    convs = [line for line in text.splitlines() if "stablehlo.convolution" in line]
    assert any(f"(tensor<{steps * N}x8x8x64xf32>, tensor<{steps * N}x8x8x64xf32>)" in line for line in convs)
    slices = [line.split(" : ")[-1] for line in text.splitlines() if "stablehlo.slice" in line]
    # only g_0's interior is cut out of its buffer: no stack of K states or s_k is sliced
    assert slices and all(operand.startswith(f"(tensor<{N}x") for operand in slices), slices


def test_wide_block_lowers_under_vmap(monkeypatch):
    """A sweep vmaps the blocks over seeds: at 64 channels the vmapped gradient still lowers for
    CUDA (the taps come in a tap at a time and the saved images flat, so no TMA copy needs more
    than five dimensions), with the TF32 kernels: the forward's outputs carry the seeds' axis in
    front."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    monkeypatch.setattr(common, "hopper_available", lambda: True)
    assert [ht.tap_copies(C) for C in (16, 32, 64)] == [1, 1, 9]
    x = jax.ShapeDtypeStruct((3, 4, 8, 8, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 3, 64, 64), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(kconv.unroll_tied_conv(a, b, c, steps=3, activation="relu"))

    with jax.default_matmul_precision(None):
        grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))
        text = grad.trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2 and "triton" not in text.lower()  # the forward and backward kernels
    assert any("-> (tensor<3x3x4x64x64xf32>, tensor<3x4x64x64xf32>, tensor<3x3x4x152x64xi8>)" in c for c in calls)
