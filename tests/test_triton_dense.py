"""The fused dense-block kernels (Pallas) against a plain Python loop, in float64.

The tests run with x64 on (``conftest.py``). On a CPU the kernels run in Pallas'
interpreter, which checks their arithmetic, the reverse loop and the padding of the batch
and of the width; the GPU build is checked by lowering the same kernels to Triton here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naisnet_jax.models as M
from naisnet_jax.kernels import KernelPolicy, common
from naisnet_jax.kernels import triton_dense as fd
from naisnet_jax.kernels.stacked import dense_op, unroll_tied

ACTS = {"relu": jax.nn.relu, "tanh": jnp.tanh}


def _loop(x0, drive, A, steps, h, activation):
    """The plain-Python meaning of a tied dense block."""
    x = x0
    for _ in range(steps):
        x = x + h * ACTS[activation](x @ A.T + drive)
    return x


def _case(batch, width, seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    x0, drive, cot = (jnp.asarray(rng.standard_normal((batch, width))) for _ in range(3))
    A = jnp.asarray(scale / np.sqrt(width) * rng.standard_normal((width, width)))
    return x0, drive, A, cot


def _value_and_grads(run, x0, drive, A, cot):
    def loss(a, b, c):
        return jnp.vdot(run(a, b, c), cot)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x0, drive, A)


CASES = [  # (batch, width, activation, steps, h, block rows)
    (16, 16, "tanh", 3, 1.0, 16),  # one program, no padding
    (37, 24, "relu", 4, 0.5, 16),  # batch 37 -> 48 (3 programs), width 24 -> 32
    (5, 100, "tanh", 2, 0.25, 32),  # width 100 -> 128, one program of 32 rows for 5 patterns
]


@pytest.mark.parametrize("batch, width, activation, steps, h, rows", CASES, ids=[str(c[:3]) for c in CASES])
def test_kernels_match_the_plain_loop_values_and_gradients(batch, width, activation, steps, h, rows):
    x0, drive, A, cot = _case(batch, width)
    fused = functools.partial(
        fd.unroll_tied_dense,
        steps=steps,
        h=h,
        activation=activation,
        policy=KernelPolicy(interpret=True, block_rows=rows),
    )
    loop = functools.partial(_loop, steps=steps, h=h, activation=activation)
    value, grads = _value_and_grads(fused, x0, drive, A, cot)
    ref_value, ref_grads = _value_and_grads(loop, x0, drive, A, cot)
    assert value.dtype == jnp.float64
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_broadcast_drive_and_the_forward_without_saved_states():
    """A per-unit drive (shape (n,)) gets a gradient of its own shape; the forward pass that
    saves nothing (no gradient asked) gives the loop's x_K."""
    x0, _, A, cot = _case(6, 16, seed=1)
    drive = jnp.linspace(-1.0, 1.0, 16)
    fused = functools.partial(
        fd.unroll_tied_dense, steps=5, h=0.5, activation="tanh", policy=KernelPolicy(interpret=True)
    )
    loop = functools.partial(_loop, steps=5, h=0.5, activation="tanh")
    np.testing.assert_allclose(fused(x0, drive, A), loop(x0, drive, A), rtol=1e-12)
    (_, grads), (_, ref) = (_value_and_grads(f, x0, drive, A, cot) for f in (fused, loop))
    assert grads[1].shape == (16,)
    for got, want in zip(grads, ref):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("steps, batch", [(1, 16), (300, 48), (257, 32)])
def test_weight_gradient_kernel_sums_every_step(steps, batch):
    """The weight-gradient kernel's partial sums over groups of steps (300 steps: 2 a program;
    257, a prime: 1) add up to sum_k s_k^T x_k, in float64."""
    assert fd._steps_per_program(300) == 2 and fd._steps_per_program(257) == 1
    assert fd._steps_per_program(1000) == 5 and fd._steps_per_program(1) == 1
    rng = np.random.default_rng(steps)
    xs, ss = (rng.standard_normal((steps, batch, 16)) for _ in range(2))
    got = fd.fused_weight_grad(jnp.asarray(xs), jnp.asarray(ss), fd.GPU._replace(interpret=True))
    np.testing.assert_allclose(got, np.einsum("kbi,kbj->ij", ss, xs), rtol=1e-12, atol=1e-11)


def test_model_with_fused_blocks_matches_autodiff_through_the_kernels():
    """NaisDenseBlock with block_vjp='fused', its kernels in the interpreter (``kernel_interpret``),
    against the plain autodiff scan: output and every parameter's gradient, float64."""
    u = jnp.asarray(np.random.default_rng(3).standard_normal((3, 10)))
    ctor = functools.partial(M.NaisDenseBlock, 20, steps=4, activation="tanh", h=0.5)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), ctor().init(jax.random.key(0), u))

    def value_and_grad(model):
        def loss(v):
            return jnp.sum(jnp.sin(model.apply(v, u)))

        return jax.value_and_grad(loss)(variables)

    ref = value_and_grad(ctor())
    fused = ctor(block_vjp="fused", kernel_interpret=True)
    jaxpr = str(jax.make_jaxpr(lambda v: fused.apply(v, u))(variables))
    out = value_and_grad(fused)
    assert "pallas_call" in jaxpr
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), out, ref)


def test_fallback_where_the_kernels_do_not_run():
    """On a CPU (and for blocks the kernels do not take) the entry point is the stacked VJP."""
    x0, drive, A, _ = _case(4, 200)
    assert fd.kernel_supported(x0, A) == "the width must be at most 128, got 200"
    assert "must map the state's 16 values to 16" in fd.kernel_supported(x0[:, :16], A[:8, :16])
    x0, drive, A = (a.astype(jnp.float32) for a in _case(4, 32)[:3])
    got = fd.unroll_tied_dense(x0, drive, A, steps=3, h=0.5)
    want = unroll_tied(dense_op, x0, drive, A, steps=3, h=0.5, activation="tanh")
    np.testing.assert_array_equal(got, want)
    jaxpr = str(jax.make_jaxpr(functools.partial(fd.unroll_tied_dense, steps=2))(x0, drive, A))
    assert "pallas_call" not in jaxpr  # the CPU runs the stacked VJP


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_rows=24), "block_rows=24 must be a power of two"),
        (dict(block_rows=8), "block_rows=8 must be an integer >= 16"),
        (dict(num_warps=0), "num_warps=0 must be a positive integer"),
        (dict(steps=0), "steps=0 must be a positive integer"),
        (dict(h=1.5), "h=1.5"),
        (dict(activation="gelu"), "activation='gelu'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    x0, drive, A, _ = _case(4, 16)
    kwargs = dict(kwargs)
    tuning_args = {k: kwargs.pop(k) for k in ("block_rows", "num_warps") if k in kwargs}
    args = dict(steps=2, h=0.5, activation="relu") | kwargs
    with pytest.raises(ValueError, match=match):
        fd.unroll_tied_dense(x0, drive, A, **args, policy=KernelPolicy(interpret=True, **tuning_args))


def test_forcing_the_kernels_on_a_block_they_do_not_take_names_why():
    x0, drive, A, _ = _case(2, 130)
    with pytest.raises(ValueError, match="the width must be at most 128, got 130"):
        fd.unroll_tied_dense(x0, drive, A, steps=2, policy=KernelPolicy(interpret=True))


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_kernels_lower_to_triton(activation, monkeypatch):
    """The GPU build: forward and backward kernels lower for CUDA (Triton) on this CPU, the
    stacked weight gradient inside a computation annotated for a second stream."""
    monkeypatch.setattr(common, "gpu_backend", lambda: True)  # as on a GPU
    x = jax.ShapeDtypeStruct((128, 100), jnp.float32)
    a = jax.ShapeDtypeStruct((100, 100), jnp.float32)

    def loss(x0, d, A):
        return jnp.sum(
            fd.unroll_tied_dense(x0, d, A, steps=3, h=1.0, activation=activation, policy=KernelPolicy(interpret=False))
        )

    for fn, side_stream in ((loss, False), (jax.grad(loss, argnums=(0, 1, 2)), True)):
        text = jax.jit(fn).trace(x, x, a).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower() or "__gpu$xla.gpu.triton" in text
        assert ('_xla_stream_annotation = "1"' in text) == side_stream


def test_kernels_under_vmap_as_in_a_sweep():
    """A sweep vmaps the model over seeds (each seed its own matrix): the batched kernels
    give every seed the plain loop's values and gradients, and lower to Triton."""
    rng = np.random.default_rng(5)
    x0, drive = (jnp.asarray(rng.standard_normal((2, 3, 16))) for _ in range(2))
    A = jnp.asarray(0.1 * rng.standard_normal((2, 16, 16)))

    def loss(run):
        return lambda a, b, c: jnp.sum(jnp.sin(run(a, b, c)))

    fused = functools.partial(fd.unroll_tied_dense, steps=3, h=0.5, policy=KernelPolicy(interpret=True))
    loop = functools.partial(_loop, steps=3, h=0.5, activation="tanh")
    got = jax.vmap(jax.value_and_grad(loss(fused), argnums=(0, 1, 2)))(x0, drive, A)
    want = jax.vmap(jax.value_and_grad(loss(loop), argnums=(0, 1, 2)))(x0, drive, A)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), got, want)
    gpu = functools.partial(fd.unroll_tied_dense, steps=2, policy=KernelPolicy(interpret=False))
    spec = jax.ShapeDtypeStruct((2, 32, 64), jnp.float32)
    aspec = jax.ShapeDtypeStruct((2, 64, 64), jnp.float32)
    lowered = jax.jit(jax.vmap(jax.grad(loss(gpu), argnums=(0, 1, 2)))).trace(spec, spec, aspec)
    assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text().lower()
