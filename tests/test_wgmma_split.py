"""The Hopper (wgmma) block kernels: their split products against float64, the choice of
engine and warpgroups, clear refusals, and the GPU build lowered for CUDA on this CPU.

Pallas' interpreter cannot run ``wgmma``, so the kernels' values are checked on a GPU
(``benchmarks/hopper_checks.py``: against the stacked VJP at the highest precision, under vmap;
``benchmarks/results/hopper_checks_h100``). Here the arithmetic they rely on (the bfloat16 split)
is checked against float64, and everything a CPU can build is built.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from naisnet_jax.kernels import KernelPolicy, common, tuning
from naisnet_jax.kernels import conv as kconv
from naisnet_jax.kernels import wgmma_common as wc
from naisnet_jax.kernels import wgmma_split as hb
from naisnet_jax.kernels.common import scaled_slope


def _tf32(a):
    """float32 -> float64 through TF32 (round to nearest on a 10-bit mantissa)."""
    bits = (a.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("jit", [False, True])
def test_split_carries_sixteen_bits(jit):
    """``hi + lo`` equals ``x`` to 2^-16 relative (float64 reference); ``hi`` is ``x`` truncated to
    bfloat16, so it round-trips exactly; under jit too (the low half must not vanish)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-20, 20, 4096))).astype(np.float32)
    split = jax.jit(hb.split_bf16) if jit else hb.split_bf16
    hi, lo = (np.asarray(v.astype(jnp.float32), np.float64) for v in split(jnp.asarray(x)))
    x64 = x.astype(np.float64)
    assert np.all(np.abs(hi) <= np.abs(x64))  # truncation toward zero
    assert np.all(hi.astype(np.float32).view(np.uint32) & 0xFFFF == 0)
    assert np.max(np.abs(hi + lo - x64) / np.abs(x64)) <= 2.0**-16
    assert np.max(np.abs(lo) / np.abs(x64)) < 2.0**-7


def test_three_products_beat_tf32():
    """A tile's product ``(4096 x 144) @ (144 x 16)`` as ``hi w_hi + lo w_hi + hi w_lo`` (exact
    products, float64 sums: what the tensor cores do with float32 accumulation, to rounding) lies
    within 5e-5 of float64, at least ten times closer than TF32."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4096, 144)).astype(np.float32)
    w = (0.1 * rng.standard_normal((144, 16))).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    (xh, xl), (wh, wl) = (
        [np.asarray(v.astype(jnp.float32), np.float64) for v in hb.split_bf16(jnp.asarray(a))] for a in (x, w)
    )
    split = xh @ wh + xl @ wh + xh @ wl
    scale = np.max(np.abs(ref))
    err_split = np.max(np.abs(split - ref)) / scale
    err_tf32 = np.max(np.abs(_tf32(x) @ _tf32(w) - ref)) / scale
    assert err_split < 5e-5
    assert err_split * 10 < err_tf32


@pytest.mark.parametrize(
    "shape, warpgroups",
    [((32, 32, 16), 5), ((16, 16, 32), 3), ((8, 8, 16), 4)],
)
def test_warpgroups_divide_tiles_and_fit(shape, warpgroups):
    """The most warpgroups (at most five) that divide the 64-row tiles and fit in shared memory."""
    H, W, C = shape
    rows, _ = tuning.default_tiling(C)
    layout = common.Layout.of(H, W, 3, 3, rows)
    nw = hb.choose_warpgroups(layout, C)
    assert nw == warpgroups
    assert wc.tiles_of(layout) % nw == 0
    assert hb.smem_bytes(layout, C, nw) <= wc.SMEM_BYTES


@pytest.mark.parametrize(
    "shape, k, dtype, activation, words",
    [
        ((2, 8, 8, 64), 3, jnp.float32, "relu", "16 or 32 channels, got 64"),
        ((2, 8, 8, 16), 5, jnp.float32, "relu", "3x3 kernels, got 5x5"),
        ((2, 8, 8, 16), 3, jnp.float64, "relu", "float32 states, got float64"),
        ((2, 64, 64, 16), 3, jnp.float32, "relu", "shared memory"),
    ],
)
def test_unsupported_blocks_say_why(shape, k, dtype, activation, words):
    C = shape[-1]
    x0 = jnp.zeros(shape, dtype)
    kernel = jnp.zeros((k, k, C, C), dtype)
    layout = common.Layout.of(shape[1], shape[2], k, k, tuning.default_tiling(C)[0])
    assert words in hb.unsupported(layout, x0, kernel, activation)
    with pytest.raises(ValueError, match="engine='wgmma' does not take this block"):
        kconv.unroll_tied_conv(x0, x0, kernel, steps=2, policy=KernelPolicy(interpret=False, engine="wgmma"))


def test_bad_engine_arguments_are_refused():
    x0 = jnp.zeros((2, 8, 8, 16), jnp.float32)
    kernel = jnp.zeros((3, 3, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="engine='cutlass' must be None, 'triton' or 'wgmma'"):
        kconv.unroll_tied_conv(x0, x0, kernel, steps=2, policy=KernelPolicy(engine="cutlass"))
    with pytest.raises(ValueError, match="warpgroups=2 tunes the wgmma kernels"):
        kconv.unroll_tied_conv(x0, x0, kernel, steps=2, policy=KernelPolicy(warpgroups=2))
    with pytest.raises(ValueError, match=r"interpreter \(interpret=True\) cannot run wgmma"):
        kconv.unroll_tied_conv(x0, x0, kernel, steps=2, policy=KernelPolicy(interpret=True, engine="wgmma"))
    with pytest.raises(ValueError, match="warpgroups=3 must be a positive divisor of the state's 4 tiles"):
        kconv.unroll_tied_conv(
            x0, x0, kernel, steps=2, policy=KernelPolicy(interpret=False, engine="wgmma", warpgroups=3)
        )


def _lowered(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("activation, C", [("relu", 16), ("tanh", 32)])
def test_kernels_lower_for_cuda(activation, C, monkeypatch):
    """The GPU build: forward and backward kernels lower to Mosaic GPU on this CPU (the weight
    gradient stays Triton's, on its second stream)."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)  # as on a GPU
    x = jax.ShapeDtypeStruct((4, 16, 16, C), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, C, C), jnp.float32)

    def loss(a, b, c):
        run = kconv.unroll_tied_conv(
            a, b, c, steps=3, activation=activation, policy=KernelPolicy(interpret=False, engine="wgmma")
        )
        return jnp.sum(run)

    forward = _lowered(loss, x, x, w)
    assert forward.count("custom_call @mosaic_gpu_v2") == 1 and "triton" not in forward.lower()
    backward = _lowered(jax.grad(loss, argnums=(0, 1, 2)), x, x, w)
    assert backward.count("custom_call @mosaic_gpu_v2") == 2  # forward (saving states) and backward
    assert "__gpu$xla.gpu.triton" in backward or "triton" in backward.lower()  # the weight gradient


@pytest.mark.parametrize("activation, saved", [("relu", jnp.int8), ("tanh", jnp.float32)])
def test_forward_saves_relu_sign_in_a_quarter_of_the_bytes(activation, saved):
    """For ReLU the forward kernel saves ``1[z_k > 0]`` in int8 instead of ``z_k`` (tanh keeps
    float32 ``z_k``); the states stay float32."""
    layout = common.Layout.of(16, 16, 3, 3, 128)
    buf = jax.ShapeDtypeStruct((4, layout.rows, 16), jnp.float32)
    taps = jax.ShapeDtypeStruct((9, 16, 16), jnp.float32)
    fwd = functools.partial(hb.fused_forward, layout, steps=3, h=1.0, activation=activation, save=True, warpgroups=2)
    xs, zs = jax.eval_shape(fwd, buf, buf, taps)
    assert (xs.shape, xs.dtype) == ((4, 4, layout.rows, 16), jnp.float32)
    assert (zs.shape, zs.dtype) == ((3, 4, layout.rows, 16), saved)
    assert wc.saves_mask(activation) == (activation == "relu")


def test_relu_sign_gives_the_same_slope_exactly():
    """The backward kernel's slope from the saved sign (as the forward kernel writes it: 1 where
    ``z > 0`` and a pixel, else 0, through int8 and back) is bit for bit the slope from
    ``z``, at zeros, signed zeros, subnormals and infinities too; tanh keeps ``z``."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal(4096).astype(np.float32) * np.float32(10.0) ** rng.integers(-45, 5, 4096)
    z[:8] = [0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf, 1e-38, -1e-38]
    g = rng.standard_normal(4096).astype(np.float32)
    sign = jnp.where(jnp.asarray(z) > 0, 1.0, 0.0).astype(wc.SIGN_DTYPE).astype(jnp.float32)
    for h in (1.0, 0.25):
        ref = np.where(z > 0, np.float32(h) * g, np.float32(0.0))
        got = np.asarray(scaled_slope("relu", h, sign, jnp.asarray(g)))
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_each_kernel_is_built_once_per_shape(monkeypatch):
    """Blocks of one shape share one Mosaic kernel (NAIS-Net10: 4 built, not 72): three blocks'
    gradients lower to one forward and one backward kernel, called three times each."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    x = jax.ShapeDtypeStruct((4, 16, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 3, 16, 16), jnp.float32)

    def loss(a, b, ws):
        for i in range(3):
            a = kconv.unroll_tied_conv(a, b, ws[i], steps=2, policy=KernelPolicy(interpret=False, engine="wgmma"))
        return jnp.sum(a)

    text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), x, x, w)
    assert text.count("custom_call @mosaic_gpu_v2") == 2
    kernels = re.findall(r"func\.func private @(\S+)\(", text)
    calls = [name for name in kernels if text.count(f"call @{name}(") == 3]
    assert len(calls) >= 2


@pytest.mark.parametrize("hopper, engine", [(True, "wgmma"), (False, "triton")])
def test_automatic_engine_by_card(hopper, engine, monkeypatch):
    """Where the GPU kernels run, at JAX's default precision, a Hopper card gets the wgmma kernels
    for blocks they take (16 and 32 channels), any other card the Triton ones."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    monkeypatch.setattr(common, "hopper_available", lambda: hopper)
    x = jax.ShapeDtypeStruct((4, 16, 16, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.float32)
    with jax.default_matmul_precision(None):  # JAX's default (the tests' conftest asks "highest")
        text = _lowered(functools.partial(kconv.unroll_tied_conv, steps=2), x, x, w)
    assert ("custom_call @mosaic_gpu_v2" in text) == (engine == "wgmma")
    assert ("triton" in text.lower()) == (engine == "triton")


def test_kernels_lower_under_vmap(monkeypatch):
    """A sweep vmaps the model over seeds: the batched kernels lower too."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    x = jax.ShapeDtypeStruct((2, 4, 16, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((2, 3, 3, 16, 16), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(kconv.unroll_tied_conv(a, b, c, steps=2, policy=KernelPolicy(interpret=False, engine="wgmma")))

    text = _lowered(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))), x, x, w)
    assert text.count("custom_call @mosaic_gpu_v2") == 2


def test_kernel_size_does_not_grow_with_depth(monkeypatch):
    """The K steps are a loop inside each kernel, not unrolled: the gradient's lowered program at
    K = 200 is the size of K = 2's (what keeps compile time flat in K)."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    x = jax.ShapeDtypeStruct((4, 16, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 16, 16), jnp.float32)

    def size(steps):
        def loss(a, b, c):
            return jnp.sum(
                kconv.unroll_tied_conv(a, b, c, steps=steps, policy=KernelPolicy(interpret=False, engine="wgmma"))
            )

        return len(_lowered(jax.grad(loss, argnums=(0, 1, 2)), x, x, w))

    assert size(200) < 1.02 * size(2)
