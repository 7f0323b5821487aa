"""The fused conv-block kernels (Pallas) against a plain Python loop, in float64.

The tests run with x64 on (``conftest.py``). On a CPU the kernels run in Pallas'
interpreter, statement by statement, which checks their arithmetic and their layout
(padding, slack rows, tiles, mirrored taps of the transposed convolution); the GPU build is checked by lowering the same
kernels to Triton here (a lowering rule Triton lacks fails there, not on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naisnet_jax.models as M
from naisnet_jax.cell import conv_same
from naisnet_jax.kernels import KernelPolicy, common, policy, triton_conv, tuning
from naisnet_jax.kernels import conv as kconv
from naisnet_jax.kernels.stacked import conv_op, unroll_tied

ACTS = {"relu": jax.nn.relu, "tanh": jnp.tanh}


def _loop(x0, drive, kernel, steps, h, activation):
    """The plain-Python meaning of a tied conv block."""
    x = x0
    for _ in range(steps):
        x = x + h * ACTS[activation](conv_same(x, kernel) + drive)
    return x


def _case(shape, k, seed=0, scale=0.15):
    rng = np.random.default_rng(seed)
    N, H, W, C = shape
    x0 = jnp.asarray(rng.standard_normal(shape))
    drive = jnp.asarray(rng.standard_normal(shape))
    kernel = jnp.asarray(scale * rng.standard_normal((k, k, C, C)))
    cot = jnp.asarray(rng.standard_normal(shape))
    return x0, drive, kernel, cot


def _value_and_grads(run, x0, drive, kernel, cot):
    def loss(a, b, c):
        return jnp.vdot(run(a, b, c), cot)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x0, drive, kernel)


CASES = [  # (state shape, kernel size, activation, steps, h, tile rows)
    ((2, 8, 8, 16), 3, "relu", 3, 1.0, 32),  # 100 padded rows over 4 tiles: the last one part padding
    ((1, 5, 7, 16), 5, "tanh", 2, 0.7, 64),  # H != W, 5x5: two rows of padding, one tile
    ((1, 4, 4, 32), 1, "relu", 2, 0.25, 16),  # 1x1 kernel: no padding, no slack
    ((1, 6, 5, 32), 3, "relu", 2, 0.5, None),  # 32 channels at their default tilings (TILINGS, WGRAD_TILINGS)
]


@pytest.mark.parametrize("shape, k, activation, steps, h, tile_rows", CASES, ids=[str(c[:3]) for c in CASES])
def test_kernels_match_the_plain_loop_values_and_gradients(shape, k, activation, steps, h, tile_rows):
    x0, drive, kernel, cot = _case(shape, k)
    fused = functools.partial(
        kconv.unroll_tied_conv,
        steps=steps,
        h=h,
        activation=activation,
        policy=KernelPolicy(interpret=True, tile_rows=tile_rows),
    )
    loop = functools.partial(_loop, steps=steps, h=h, activation=activation)
    value, grads = _value_and_grads(fused, x0, drive, kernel, cot)
    ref_value, ref_grads = _value_and_grads(loop, x0, drive, kernel, cot)
    assert value.dtype == jnp.float64
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_broadcast_drive_and_unrolled_or_looped_tiles():
    """A per-channel drive (shape (C,)) gets a gradient of its own shape; the tiles'
    loop and their unrolled form agree; the forward that keeps no states gives x_K."""
    x0, _, kernel, cot = _case((2, 6, 6, 16), 3, seed=1)
    drive = jnp.linspace(-1.0, 1.0, 16)
    outs = []
    for unrolled in (True, False):
        fused = functools.partial(
            kconv.unroll_tied_conv,
            steps=2,
            h=0.5,
            policy=KernelPolicy(interpret=True, tile_rows=32, unroll_tiles=unrolled),
        )
        outs.append(_value_and_grads(fused, x0, drive, kernel, cot))
    ref = _value_and_grads(functools.partial(_loop, steps=2, h=0.5, activation="relu"), x0, drive, kernel, cot)
    for out in outs:
        assert out[1][1].shape == (16,)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), out, ref)
    config = policy.ConvPlan(interpret=True, tile_rows=32)
    layout, x_last = kconv.fused_forward(x0, drive, kernel, steps=3, h=0.5, activation="relu", save=False, plan=config)
    _, xs, zs = kconv.fused_forward(x0, drive, kernel, steps=3, h=0.5, activation="relu", plan=config)
    np.testing.assert_array_equal(layout.interior(x_last), layout.interior(xs[3]))
    np.testing.assert_allclose(layout.interior(xs[1]), _loop(x0, drive, kernel, 1, 0.5, "relu"), rtol=1e-12)
    np.testing.assert_allclose(layout.interior(zs[0]), conv_same(x0, kernel) + drive, rtol=1e-12)
    padded = layout.padded(xs[2])  # the buffers keep the zero padding of the state
    assert float(jnp.abs(padded[:, 0]).max()) == 0.0 and float(jnp.abs(padded[:, :, -1]).max()) == 0.0


def test_layout_round_trip_and_offsets():
    layout = common.Layout.of(5, 7, 3, 3, tile_rows=16)
    assert layout.padded_width == 9 and layout.padded_rows == 63 and layout.slack == 10
    assert layout.tiles == 4 and layout.rows == 4 * 16 + 20
    assert layout.offsets(3, 3) == [-10, -9, -8, -1, 0, 1, 8, 9, 10]
    x = jnp.arange(2 * 5 * 7 * 3, dtype=jnp.float32).reshape(2, 5, 7, 3)
    buf = layout.to_buffer(x)
    assert buf.shape == (2, layout.rows, 3)
    np.testing.assert_array_equal(layout.interior(buf), x)
    np.testing.assert_array_equal(layout.padded(buf), jnp.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)]))
    # tap (a, b) of the row of pixel (i, j) is the row of pixel (i + a - 1, j + b - 1)
    row = layout.slack + 2 * layout.padded_width + 3  # padded (2, 3) = pixel (1, 2)
    for (a, b), off in zip([(a, b) for a in range(3) for b in range(3)], layout.offsets(3, 3)):
        np.testing.assert_array_equal(buf[0, row + off], x[0, 1 + a - 1, 2 + b - 1])


def test_model_with_fused_blocks_matches_autodiff_through_the_kernels():
    """NaisConvBlock with block_vjp='fused', its kernels in the interpreter (``kernel_interpret``),
    against the plain autodiff scan: output and every parameter's gradient, float64."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 5, 5, 16)))
    ctor = functools.partial(M.NaisConvBlock, 16, steps=2, learn_delta=True, activation="relu")
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), ctor().init(jax.random.key(0), x))

    def value_and_grad(model):
        def loss(v):
            return jnp.sum(jnp.sin(model.apply(v, x)))

        return jax.value_and_grad(loss)(variables)

    ref = value_and_grad(ctor())
    fused = ctor(block_vjp="fused", kernel_interpret=True)
    jaxpr = str(jax.make_jaxpr(lambda v: fused.apply(v, x))(variables))
    out = value_and_grad(fused)
    assert "pallas_call" in jaxpr
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), out, ref)


def test_fallback_where_the_kernels_do_not_run():
    """On a CPU (and for blocks the kernels do not take) the entry point is the stacked VJP."""
    x0, drive, kernel, _ = _case((2, 5, 5, 3), 3)  # 3 channels: not a kernel's tile
    assert "power of two" in policy.conv_supported(x0, kernel)
    assert policy.conv_supported(*_case((1, 4, 4, 16), 2)[::2]) == "the kernel's size must be odd, got 2x2"
    x0, drive, kernel = (a.astype(jnp.float32) for a in (x0, drive, kernel))
    got = kconv.unroll_tied_conv(x0, drive, kernel, steps=2, h=0.5)
    want = unroll_tied(conv_op, x0, drive, kernel, steps=2, h=0.5, activation="relu")
    np.testing.assert_array_equal(got, want)
    jaxpr = str(jax.make_jaxpr(functools.partial(kconv.unroll_tied_conv, steps=2))(*_case((1, 4, 4, 16), 3)[:3]))
    assert "pallas_call" not in jaxpr  # the CPU runs the stacked VJP
    assert not common.gpu_kernels_available(jnp.zeros((1, 4, 4, 16), jnp.bfloat16))


def test_kernels_follow_the_default_device(monkeypatch):
    """On a CUDA machine the kernels run, unless ``jax.default_device`` puts the model on the CPU
    (a Pallas GPU kernel cannot run there)."""
    import types

    gpu = types.SimpleNamespace(platform="gpu", client=types.SimpleNamespace(platform_version="cuda 12.9"))
    cpu = jax.devices("cpu")[0]
    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: [gpu] if backend is None else real(backend))
    x = jnp.zeros((1, 4, 4, 16), jnp.float32)
    assert common.gpu_kernels_available(x)
    with jax.default_device(cpu):
        assert not common.gpu_kernels_available(x)
    with jax.default_device("cpu"):
        assert not common.gpu_kernels_available(x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tile_rows=48), "tile_rows=48 must be a power of two"),
        (dict(tile_rows=8), "tile_rows=8 must be an integer >= 16"),
        (dict(num_warps=0), "num_warps=0 must be a positive integer"),
        (dict(steps=0), "steps=0 must be a positive integer"),
        (dict(h=1.5), "h=1.5"),
        (dict(activation="gelu"), "activation='gelu'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    x0, drive, kernel, _ = _case((1, 4, 4, 16), 3)
    kwargs = dict(kwargs)
    tiling = {k: kwargs.pop(k) for k in ("tile_rows", "num_warps") if k in kwargs}
    args = dict(steps=2, h=0.5, activation="relu") | kwargs
    with pytest.raises(ValueError, match=match):
        kconv.unroll_tied_conv(x0, drive, kernel, **args, policy=KernelPolicy(interpret=True, **tiling))


def test_policy_is_checked_and_typed():
    """The policy is a frozen value: bad fields are refused where it is made, and the entry points
    refuse anything else in its place."""
    with pytest.raises(ValueError, match="engine='cuda' must be None, 'triton' or 'wgmma'"):
        KernelPolicy(engine="cuda")
    with pytest.raises(ValueError, match="interpret='yes' must be None, True or False"):
        KernelPolicy(interpret="yes")
    with pytest.raises(ValueError, match="warpgroups=3 tunes the wgmma kernels"):
        KernelPolicy(warpgroups=3)
    policy = KernelPolicy(engine="triton")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.engine = "wgmma"
    assert hash(policy) == hash(KernelPolicy(engine="triton"))  # usable as a static argument
    x0, drive, kernel, _ = _case((1, 4, 4, 16), 3)
    with pytest.raises(TypeError, match="policy must be a naisnet_jax.kernels.KernelPolicy, got dict"):
        kconv.unroll_tied_conv(x0, drive, kernel, steps=2, policy={"interpret": True})


def test_forcing_the_kernels_on_a_block_they_do_not_take_names_why():
    x0, drive, kernel, _ = _case((1, 4, 4, 12), 3)
    with pytest.raises(ValueError, match="channels must be a power of two from 16 to 128, got 12"):
        kconv.unroll_tied_conv(x0, drive, kernel, steps=2, policy=KernelPolicy(interpret=True))


def test_interpretation_is_a_policy_field_not_ambient():
    """``KernelPolicy(interpret=True, strict=False)``, passed explicitly, runs a block the kernels
    take in Pallas' interpreter (its value the plain loop's, float64) and a block they do not take
    (12 channels) on the stacked VJP, whose value is also the loop's; the same policy with
    ``strict=True`` refuses that block. The default policy on a CPU never interprets."""
    lenient = KernelPolicy(interpret=True, strict=False)
    for shape, kernels in (((1, 5, 5, 16), True), ((1, 5, 5, 12), False)):
        x0, drive, kernel, _ = _case(shape, 3)
        run = functools.partial(kconv.unroll_tied_conv, steps=3, h=0.5, activation="relu", policy=lenient)
        jaxpr = str(jax.make_jaxpr(run)(x0, drive, kernel))
        assert ("pallas_call" in jaxpr) == kernels, shape
        np.testing.assert_allclose(run(x0, drive, kernel), _loop(x0, drive, kernel, 3, 0.5, "relu"), rtol=1e-12)
        default = functools.partial(kconv.unroll_tied_conv, steps=3, h=0.5, activation="relu")
        assert "pallas_call" not in str(jax.make_jaxpr(default)(x0, drive, kernel))
    with pytest.raises(ValueError, match="got 12"):
        kconv.unroll_tied_conv(x0, drive, kernel, steps=2, policy=KernelPolicy(interpret=True, strict=True))
    with pytest.raises(ValueError, match="strict='no' must be True or False"):
        KernelPolicy(strict="no")


def test_model_option_kernel_interpret_reaches_every_block():
    """``kernel_interpret`` (a model option) builds each fused block's policy: a net whose stages
    have 16 and 12 channels traces the interpreter's kernels for the first and the stacked VJP
    for the second, and its output equals the autodiff net's (float64). Without
    ``block_vjp="fused"``, or with the wgmma engine, the option is refused, naming it."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 6, 1)))
    kw = dict(steps=2, filters=(16, 12))
    net = M.get_model("naisnet_conv_tiny", **kw)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), net.init(jax.random.key(0), x))
    fused = M.get_model("naisnet_conv_tiny", **kw, block_vjp="fused", kernel_interpret=True)
    jaxpr = str(jax.make_jaxpr(lambda v: fused.apply(v, x))(variables))
    assert jaxpr.count("pallas_call") == 1  # the forward kernel of the 16-channel stage's block
    np.testing.assert_allclose(fused.apply(variables, x), net.apply(variables, x), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="kernel_interpret=True runs the fused kernels"):
        M.get_model("naisnet_conv_tiny", kernel_interpret=True)
    with pytest.raises(ValueError, match="kernel_interpret=True runs the fused kernels"):
        M.get_model("naisnet_conv_tiny", block_vjp="fused", kernel_engine="wgmma", kernel_interpret=True)


@pytest.mark.parametrize("engine, kernel_name", [(None, "mosaic_gpu"), ("wgmma", "mosaic_gpu"), ("triton", "triton")])
def test_model_option_picks_the_engine(engine, kernel_name, monkeypatch):
    """``kernel_engine``, a model option, reaches the conv blocks' policy: as on a Hopper GPU the
    net's fused blocks lower to the wgmma kernels by default and with ``"wgmma"``, to the Triton
    kernels with ``"triton"``; without ``block_vjp="fused"`` the option is refused, naming it."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    monkeypatch.setattr(common, "hopper_available", lambda: True)
    net = M.get_model("naisnet_conv_tiny", steps=2, filters=(16, 32), block_vjp="fused", kernel_engine=engine)
    x = jnp.zeros((2, 8, 8, 1), jnp.float32)
    variables = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), x, train=False))
    with jax.default_matmul_precision(None):
        text = jax.jit(lambda v, x: net.apply(v, x, train=False)).trace(variables, x)
        text = text.lower(lowering_platforms=("cuda",)).as_text()
    assert kernel_name in text.lower() and ("mosaic_gpu" in text) == (kernel_name == "mosaic_gpu")
    with pytest.raises(ValueError, match="kernel_engine='triton' picks the fused kernels' engine; it needs"):
        M.get_model("naisnet_conv_tiny", kernel_engine="triton")
    with pytest.raises(ValueError, match="kernel_engine='cuda'"):
        M.get_model("naisnet_conv_tiny", block_vjp="fused", kernel_engine="cuda")


def test_automatic_choice_by_channels(monkeypatch):
    """Where the GPU kernels run, the automatic choice takes blocks of up to AUTO_MAX_CHANNELS
    (16 and 32: NAIS-Net10's first two stages), each at its width's tiling, and leaves 64
    channels to the stacked VJP."""
    monkeypatch.setattr(common, "gpu_kernels_available", lambda x0: True)
    configs = []
    real = kconv._fused
    monkeypatch.setattr(kconv, "_fused", lambda *args: configs.append(args[-1]) or real(*args))
    assert tuning.AUTO_MAX_CHANNELS == 32
    for C, tiling in ((16, (256, 8)), (32, (128, 8)), (64, None)):
        configs.clear()
        x0, drive, kernel, _ = (a.astype(jnp.float32) for a in _case((1, 4, 4, C), 3))
        jaxpr = str(jax.make_jaxpr(lambda a, b, c: kconv.unroll_tied_conv(a, b, c, steps=2))(x0, drive, kernel))
        assert ("pallas_call" in jaxpr) == (tiling is not None), C
        assert [(c.tile_rows, c.num_warps, c.interpret) for c in configs] == ([(*tiling, False)] if tiling else [])
    assert tuning.wgrad_tiling(32) == (32, 2) and tuning.wgrad_tiling(16) == (32, 1)  # 16: one warp


@pytest.mark.parametrize("activation, C", [("relu", 16), ("tanh", 16), ("relu", 32)])
def test_kernels_lower_to_triton(activation, C, monkeypatch):
    """The GPU build: forward and backward kernels lower for CUDA (Triton) on this CPU (32
    channels: their own tilings, two warps for the weight gradient). The weight-gradient kernel
    also sums the drive's gradient, which the input-gradient chain needs, so it stays on the main
    stream (no second-stream annotation)."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)  # as on a GPU
    x = jax.ShapeDtypeStruct((4, 16, 16, C), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, C, C), jnp.float32)

    def loss(a, b, c):
        return jnp.sum(
            kconv.unroll_tied_conv(a, b, c, steps=3, h=1.0, activation=activation, policy=KernelPolicy(interpret=False))
        )

    for fn, side_stream in ((loss, False), (jax.grad(loss, argnums=(0, 1, 2)), True)):
        text = jax.jit(fn).trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower() or "__gpu$xla.gpu.triton" in text
        assert '_xla_stream_annotation = "1"' not in text
        assert ('"_weight_grad_sum_kernel"' in text) == side_stream


@pytest.mark.parametrize("C", [16, 32])
def test_kernels_under_vmap_as_in_a_sweep(C):
    """A sweep vmaps the model over seeds (each seed its own kernel): the batched kernels
    give every seed the plain loop's values and gradients, and lower to Triton (32 channels:
    at their own tilings)."""
    rng = np.random.default_rng(5)
    x0, drive = (jnp.asarray(rng.standard_normal((2, 1, 5, 5, C))) for _ in range(2))
    kernel = jnp.asarray(0.1 * rng.standard_normal((2, 3, 3, C, C)))

    def loss(run):
        return lambda a, b, c: jnp.sum(jnp.sin(run(a, b, c)))

    fused = functools.partial(kconv.unroll_tied_conv, steps=2, h=0.5, policy=KernelPolicy(interpret=True, tile_rows=32))
    loop = functools.partial(_loop, steps=2, h=0.5, activation="relu")
    got = jax.vmap(jax.value_and_grad(loss(fused), argnums=(0, 1, 2)))(x0, drive, kernel)
    want = jax.vmap(jax.value_and_grad(loss(loop), argnums=(0, 1, 2)))(x0, drive, kernel)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), got, want)
    gpu = functools.partial(kconv.unroll_tied_conv, steps=2, policy=KernelPolicy(interpret=False))
    spec = jax.ShapeDtypeStruct((2, 4, 8, 8, C), jnp.float32)
    kspec = jax.ShapeDtypeStruct((2, 3, 3, C, C), jnp.float32)
    lowered = jax.jit(jax.vmap(jax.grad(loss(gpu), argnums=(0, 1, 2)))).trace(spec, spec, kspec)
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text().lower()


@pytest.mark.parametrize("C, chunks, shape", [(16, 4, (2, 8, 8)), (16, 1, (3, 6, 5)), (32, 2, (2, 8, 8))])
def test_weight_gradient_kernel_sums_the_drive_gradient(monkeypatch, C, chunks, shape):
    """The weight-gradient kernel, one program a run of a pattern's rows over every step (a
    pattern split between ``chunks`` programs), also returns ``sum_k s_k``, the drive's gradient.
    A block's value and gradients equal the plain loop's (float64, interpreter), the kernel's two
    outputs equal a float64 numpy sum over the taps and a plain sum of the ``s_k``, and the
    block's backward pass lowers to that kernel, its loops pipelined (``WGRAD_STAGES``)."""
    x0, drive, kernel, cot = _case((shape[0], shape[1], shape[2], C), 3, seed=5)
    fused = functools.partial(kconv.unroll_tied_conv, steps=4, h=0.5, policy=KernelPolicy(interpret=True, tile_rows=32))
    loop = functools.partial(_loop, steps=4, h=0.5, activation="relu")
    got = _value_and_grads(fused, x0, drive, kernel, cot)
    want = _value_and_grads(loop, x0, drive, kernel, cot)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), got, want)

    layout = common.Layout.of(shape[1], shape[2], 3, 3, 32)
    runs = triton_conv._wgrad_runs(layout, C)
    assert runs % chunks == 0 and triton_conv._chunks_of(runs, chunks) == chunks  # really split
    rng = np.random.default_rng(6)
    xs = layout.to_buffer(jnp.asarray(rng.standard_normal((5, shape[0], *shape[1:], C))))
    ss = layout.to_buffer(jnp.asarray(rng.standard_normal((4, shape[0], *shape[1:], C))))
    config = kconv.GPU._replace(interpret=True, tile_rows=32)
    dW, total = triton_conv.weight_grad(layout, xs, ss, kernel.shape, config, chunks=chunks)
    padded = np.asarray(layout.padded(xs[:4]))
    s_img = np.asarray(layout.interior(ss))
    want_dW = np.zeros(kernel.shape)
    for a in range(3):
        for b in range(3):
            window = padded[:, :, a : a + shape[1], b : b + shape[2]]
            want_dW[a, b] = np.einsum("knijc,knijd->cd", window, s_img)
    np.testing.assert_allclose(dW, want_dW, rtol=1e-10, atol=1e-10)
    want_sum = np.asarray(layout.interior(ss)).sum(axis=0)
    np.testing.assert_allclose(layout.interior(total), want_sum, rtol=1e-12, atol=1e-12)

    spec = jax.ShapeDtypeStruct((shape[0], *shape[1:], C), jnp.float32)
    kspec = jax.ShapeDtypeStruct(kernel.shape, jnp.float32)

    def loss(x0, drive, kernel):
        return kconv.unroll_tied_conv(
            x0, drive, kernel, steps=4, h=0.5, policy=KernelPolicy(interpret=False, tile_rows=32)
        ).sum()

    grad = jax.jit(jax.grad(loss, argnums=(1, 2)))
    lowered = grad.trace(spec, spec, kspec).lower(lowering_platforms=("cuda",)).as_text()
    assert f'name = "_weight_grad_sum_kernel", num_stages = {tuning.WGRAD_STAGES}' in lowered


@pytest.mark.parametrize("C, chunks", [(16, 1), (16, 8), (32, 4)])
def test_weight_gradient_kernel_ignores_the_slack(C, chunks):
    """The weight-gradient kernel masks only the windows of a state's first and last tiles, which
    reach into the slack rows (``triton_conv._edge_split``): with NaN in every slack row (the
    forward kernels leave them unwritten), it gives the ``dW`` and the sum of zeroed slack,
    which equals a float64 numpy sum over the taps, for programs that take edge tiles only, inner
    tiles only, or both (interpreter)."""
    layout = common.Layout.of(14, 14, 3, 3, 32)  # 8 tiles of 32 rows; windows reach 17 rows either way
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 2, 14, 14, C))
    s = rng.standard_normal((3, 2, 14, 14, C))
    xs, ss = layout.to_buffer(jnp.asarray(x)), layout.to_buffer(jnp.asarray(s))
    end = layout.slack + layout.tiles * layout.tile_rows
    slack = np.r_[0 : layout.slack, end : layout.rows]
    xs_nan, ss_nan = xs.at[:, :, slack].set(np.nan), ss.at[:, :, slack].set(np.nan)
    config = kconv.GPU._replace(interpret=True, tile_rows=32)
    dW, total = triton_conv.weight_grad(layout, xs_nan, ss_nan, (3, 3, C, C), config, chunks=chunks)
    padded = np.pad(x, [(0, 0), (0, 0), (1, 1), (1, 1), (0, 0)])
    want = np.zeros((3, 3, C, C))
    for a in range(3):
        for b in range(3):
            want[a, b] = np.einsum("knijc,knijd->cd", padded[:, :, a : a + 14, b : b + 14], s)
    np.testing.assert_allclose(dW, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layout.interior(total), s.sum(axis=0), rtol=1e-12, atol=1e-12)

    rows = triton_conv._wgrad_rows(layout, C)[0]
    count = triton_conv._wgrad_runs(layout, C) // chunks
    splits = [
        tuple(int(v) for v in triton_conv._edge_split(layout, layout.offsets(3, 3), rows, c * count, count))
        for c in range(chunks)
    ]
    assert splits[0][0] == 1 and splits[-1][1] == count - 1  # the first and last tiles masked
    assert sum(b - a for a, b in splits) == 6  # the six inner tiles not
    if chunks > 1:
        assert (0, count) in splits  # a program of inner tiles only
    with pytest.raises(ValueError, match="chunks=3 must divide the 8 runs"):
        triton_conv.weight_grad(layout, xs, ss, (3, 3, C, C), config, chunks=3)


def test_weight_gradient_kernel_takes_its_width_tiling():
    """``tuning.WGRAD_TILINGS``: at 32 channels the weight-gradient kernel runs 32-row tiles on two
    warps, split between ``WGRAD_CHUNKS[32]`` programs a pattern (the grid); its ``dW`` matches
    numpy (float64, interpreter)."""
    layout = common.Layout.of(16, 16, 3, 3, 128)
    assert triton_conv._wgrad_rows(layout, 32) == (32, 2)
    runs = triton_conv._wgrad_runs(layout, 32)
    chunks = triton_conv._chunks_of(runs, tuning.WGRAD_CHUNKS[32])
    assert runs == 12 and chunks == 4
    xs = jax.ShapeDtypeStruct((4, 2, layout.rows, 32), jnp.float32)
    ss = jax.ShapeDtypeStruct((3, 2, layout.rows, 32), jnp.float32)
    gpu = functools.partial(triton_conv.weight_grad, layout, kernel_shape=(3, 3, 32, 32), config=kconv.GPU)
    text = jax.jit(gpu).trace(xs, ss).lower(lowering_platforms=("cuda",)).as_text()
    assert 'name = "_weight_grad_sum_kernel", num_stages = 2 : i32, num_warps = 2 : i32' in text
    assert f"grid_x = {2 * chunks} : i32" in text  # two patterns, each split between `chunks` programs

    small = common.Layout.of(5, 6, 3, 3, 32)
    rng = np.random.default_rng(7)
    xb = small.to_buffer(jnp.asarray(rng.standard_normal((4, 2, 5, 6, 32))))
    sb = small.to_buffer(jnp.asarray(rng.standard_normal((3, 2, 5, 6, 32))))
    config = kconv.GPU._replace(interpret=True, tile_rows=32)
    dW, total = triton_conv.weight_grad(small, xb, sb, (3, 3, 32, 32), config)
    want = np.einsum(
        "kpi,kpo->io",
        np.asarray(small.padded(xb[:3])).reshape(3, -1, 32),
        np.asarray(small.padded(sb)).reshape(3, -1, 32),
    )
    assert np.allclose(dW[1, 1], want, rtol=1e-12, atol=1e-10)  # the centre tap against numpy
    np.testing.assert_allclose(small.interior(total), np.asarray(small.interior(sb)).sum(0), rtol=1e-12)
