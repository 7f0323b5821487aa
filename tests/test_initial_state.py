"""The ``initial_state`` model option: x_0 = u against plain float64 loops, the exactly zero
state gradient of a one-step block started at 0, the warning, and the shape rules."""

import os
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from references import loop_conv_matrix

from naisnet_jax import models as M

KEY = jax.random.key(0, impl="rbg")


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _conv_same(x, kernel):
    """Stride-1 SAME cross-correlation by the plain-loop matrix (row-major H, W, C)."""
    b, H, W, _ = x.shape
    Mx = loop_conv_matrix(kernel, H, W)
    return (x.reshape(b, -1) @ Mx.T).reshape(b, H, W, kernel.shape[-1])


# ---------------------------------------------------------------------------------------------
# Unrolls from x_0 = u against plain Python loops.


@pytest.mark.parametrize("untied", [False, True])
def test_dense_block_from_input_equals_loop(untied):
    n, K, h, eps = 5, 4, 0.7, 0.03
    block = M.NaisDenseBlock(n, steps=K, h=h, eps=eps, untied=untied, initial_state="input")
    u = np.random.default_rng(0).standard_normal((6, n))
    params = _f64(block.init(KEY, u)["params"])
    x_K, aux = block.apply({"params": params}, u, return_aux=True)
    Rs = params["R"] if untied else [params["R"]] * K
    W, b = params["input"]["kernel"], params["input"]["bias"]
    x = u.copy()  # x_0 = u
    for k in range(K):
        A = -Rs[k].T @ Rs[k] - eps * np.eye(n)
        cols = slice(k * n, (k + 1) * n) if untied else slice(0, n)
        x = x + h * np.tanh(x @ A.T + u @ W[:, cols] + b[cols])
        np.testing.assert_allclose(aux["trajectory"][k], x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(x_K, x, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(aux["initial_state"], u)
    # The paper's x_0 = 0 gives another map.
    assert not np.allclose(M.NaisDenseBlock(n, steps=K, h=h, eps=eps, untied=untied).apply({"params": params}, u), x_K)


def test_conv_block_from_input_equals_loop():
    C, K, h, eps = 3, 3, 0.9, 0.02
    block = M.NaisConvBlock(C, steps=K, h=h, eps=eps, learn_delta=True, initial_state="input")
    rng = np.random.default_rng(1)
    u = rng.standard_normal((2, 5, 4, C))
    params = _f64(block.init(KEY, u)["params"])
    params["delta"] = rng.uniform(-0.3, 0.3, C)
    x_K, aux = block.apply({"params": params}, u, return_aux=True)
    kernel = np.array(params["state_kernel"])
    kernel[1, 1, np.arange(C), np.arange(C)] = -1 - params["delta"]
    drive = _conv_same(u, params["input"]["kernel"]) + params["input"]["bias"]
    x = u.copy()
    for k in range(K):
        x = x + h * np.maximum(_conv_same(x, kernel) + drive, 0)
        np.testing.assert_allclose(aux["trajectory"][k], x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(x_K, x, rtol=0, atol=1e-12)


def test_adaptive_block_from_input_equals_loop():
    """With a stopping threshold, each pattern starts at its own u and stops on its own."""
    n, h, eps, tol, max_steps = 4, 1.0, 0.2, 1e-3, 60
    block = M.NaisDenseBlock(n, h=h, eps=eps, adaptive_tol=tol, max_steps=max_steps, initial_state="input")
    u = np.random.default_rng(2).standard_normal((5, n)) * np.arange(1, 6)[:, None]
    params = _f64(block.init(KEY, u)["params"])
    x_out = block.apply({"params": params}, u, return_aux=True)[1]["trajectory"][-1]
    x_eval = block.apply({"params": params}, u)  # while_loop
    A = -params["R"].T @ params["R"] - eps * np.eye(n)
    drive = u @ params["input"]["kernel"] + params["input"]["bias"]
    for i in range(len(u)):
        x, steps = u[i].copy(), 0
        for _ in range(max_steps):
            x_new = x + h * np.tanh(x @ A.T + drive[i])
            steps += 1
            done = np.linalg.norm(x_new - x) < tol
            x = x_new
            if done:
                break
        assert steps < max_steps
        np.testing.assert_allclose(x_eval[i], x, rtol=0, atol=1e-12)
        np.testing.assert_allclose(x_out[i], x, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# One step from x_0 = 0: the state matrix never acts.


def _grads(make, u):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", M.StateUnusedWarning)
        block = make()
        params = jax.jit(block.init)(KEY, u)["params"]
        loss = lambda p: jnp.sum(jnp.sin(block.apply({"params": p}, u)))  # noqa: E731
        return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(params))


@pytest.mark.parametrize("untied", [False, True])
def test_dense_one_step_state_gradient(untied):
    u = np.random.default_rng(3).standard_normal((4, 5))
    zero = _grads(lambda: M.NaisDenseBlock(5, steps=1, untied=untied), u)
    assert np.all(zero["R"] == 0.0)  # exactly zero, not small
    assert np.abs(zero["input"]["kernel"]).max() > 1e-3  # the rest of the block does learn
    from_u = _grads(lambda: M.NaisDenseBlock(5, steps=1, untied=untied, initial_state="input"), u)
    assert np.abs(from_u["R"]).max() > 1e-3
    if not untied:  # with two steps the paper's x_0 = 0 already uses A
        assert np.abs(_grads(lambda: M.NaisDenseBlock(5, steps=2), u)["R"]).max() > 1e-3


def test_conv_one_step_state_gradient():
    u = np.random.default_rng(4).standard_normal((2, 5, 5, 3))
    zero = _grads(lambda: M.NaisConvBlock(3, steps=1, learn_delta=True), u)
    assert np.all(zero["state_kernel"] == 0.0) and np.all(zero["delta"] == 0.0)
    from_u = _grads(lambda: M.NaisConvBlock(3, steps=1, learn_delta=True, initial_state="input"), u)
    assert np.abs(from_u["state_kernel"]).max() > 1e-3 and np.abs(from_u["delta"]).max() > 1e-3


# ---------------------------------------------------------------------------------------------
# The warning fires exactly for blocks of one (most) step started at 0.


@pytest.mark.parametrize(
    "make, warns",
    [
        (lambda: M.NaisDenseBlock(4, steps=1), True),
        (lambda: M.NaisDenseBlock(4, steps=1, untied=True), True),
        (lambda: M.NaisConvBlock(4, steps=1), True),
        (lambda: M.NaisDenseBlock(4, steps=5, adaptive_tol=1e-3, max_steps=1), True),
        (lambda: M.NaisDenseBlock(4, steps=2), False),
        (lambda: M.NaisDenseBlock(4, steps=1, initial_state="input"), False),
        (lambda: M.NaisConvBlock(4, steps=1, initial_state="input"), False),
        (lambda: M.NaisConvBlock(4, steps=1, adaptive_tol=1e-3, max_steps=5), False),
        (lambda: M.NaisNetFC(steps=1), False),  # the net warns when its block is built
        (lambda: M.NaisNetConv(steps=1), False),
    ],
)
def test_warning_on_construction(make, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    found = [w for w in caught if issubclass(w.category, M.StateUnusedWarning)]
    assert bool(found) == warns, [str(w.message) for w in caught]
    if warns:
        assert "zero gradient" in str(found[0].message)
        assert issubclass(M.StateUnusedWarning, UserWarning)


def _blocks_built(model, x):
    """(name, initial_state) of every NAIS conv/dense block the model builds, and warnings."""
    built = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, (M.NaisConvBlock, M.NaisDenseBlock)) and (context.method_name == "__call__"):
            built.append((context.module.name, context.module.initial_state))
        return next_fun(*args, **kwargs)

    with warnings.catch_warnings(record=True) as caught, nn.intercept_methods(record):
        warnings.simplefilter("always")
        jax.eval_shape(model.init, KEY, x)
    return dict(built), [w for w in caught if issubclass(w.category, M.StateUnusedWarning)]


def test_conv_net_rule_and_warnings():
    x = np.zeros((2, 8, 8, 1))
    tiny = dict(num_classes=3, stage_sizes=(2, 1), filters=(4, 4))
    blocks, caught = _blocks_built(M.NaisNetConv(steps=1, initial_state="input", **tiny), x)
    # Every block starts at its input except the stride-2 first block of stage 1, even though
    # the widths match there: its input has twice the state's resolution.
    assert blocks == {"stage0_block0": "input", "stage0_block1": "input", "stage1_block0": "zero"}
    assert not caught  # that one block's state kernel never acts, but the net chose x_0 = 0 for it
    blocks, caught = _blocks_built(M.NaisNetConv(steps=1, initial_state="zero", **tiny), x)
    assert set(blocks.values()) == {"zero"} and caught  # the user's choice: the blocks warn
    blocks, caught = _blocks_built(
        M.NaisNetConv(steps=1, initial_state="input", **dict(tiny, stage_sizes=(2,), filters=(4,))), x
    )
    assert set(blocks.values()) == {"input"} and not caught
    blocks, caught = _blocks_built(M.NaisNetConv(steps=2, **tiny), x)
    assert set(blocks.values()) == {"zero"} and not caught
    _, caught = _blocks_built(M.NaisNetFC(num_classes=3, features=4, steps=1), np.zeros((2, 4)))
    assert caught
    _, caught = _blocks_built(M.NaisNetFC(num_classes=3, features=4, steps=1, initial_state="input"), np.zeros((2, 4)))
    assert not caught


def test_the_warning_is_shown_once_however_often_the_net_is_traced():
    """Python shows a warning once per place under its default filters, unless the filters
    change in between (which makes it forget what it has shown): building the stride-2 block
    must not change them, or a training run would repeat the warning at every trace."""
    script = (
        "import jax, numpy as np\n"
        "import naisnet_jax.models as M\n"
        "m = M.NaisNetConv(num_classes=3, stage_sizes=(2, 1), filters=(4, 4), steps=1)\n"
        "for _ in range(3):\n"
        "    jax.eval_shape(m.init, jax.random.key(0), np.zeros((2, 8, 8, 1)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("StateUnusedWarning") == 1, run.stderr


def test_conv_net_from_input_trains_its_state_kernels():
    """In NaisNet1 with x_0 = u, a stride-1 block's state kernel gets a gradient; the stride-2
    block (x_0 = 0) gets exactly none."""
    model = M.NaisNetConv(num_classes=3, stage_sizes=(1, 1), filters=(4, 4), steps=1, initial_state="input")
    x = np.random.default_rng(5).standard_normal((3, 8, 8, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", M.StateUnusedWarning)
        variables = jax.jit(model.init)(KEY, x)

        @jax.jit
        @jax.grad
        def grad(p):
            out, _ = model.apply({**variables, "params": p}, x, train=True, mutable=["batch_stats"])
            return jnp.sum(out**2)

        grads = grad(variables["params"])
    assert np.abs(grads["stage0_block0"]["state_kernel"]).max() > 0
    assert np.all(np.asarray(grads["stage1_block0"]["state_kernel"]) == 0.0)


# ---------------------------------------------------------------------------------------------
# Bad values and shapes.


def test_bad_values_and_shapes():
    with pytest.raises(ValueError, match=r"initial_state='ones' must be one of \('zero', 'input'\)"):
        M.NaisDenseBlock(4, initial_state="ones")
    with pytest.raises(ValueError, match="initial_state"):
        M.NaisNetConv(initial_state=None)
    with pytest.raises(ValueError, match="initial_state"):
        M.get_model("naisnet_mnist", initial_state="u")
    with pytest.raises(ValueError, match=r"strides=2"):
        M.NaisConvBlock(4, strides=2, initial_state="input")
    # Shapes are checked while tracing: eval_shape computes nothing.
    with pytest.raises(ValueError, match=r"input u has shape \(2, 7\) and its state \(2, 5\)"):
        jax.eval_shape(M.NaisDenseBlock(5, initial_state="input").init, KEY, np.zeros((2, 7)))
    with pytest.raises(ValueError, match=r"\(2, 6, 6, 3\) and its state \(2, 6, 6, 4\)"):
        jax.eval_shape(M.NaisConvBlock(4, initial_state="input").init, KEY, np.zeros((2, 6, 6, 3)))
    model = M.get_model("naisnet_mnist", initial_state="input")
    with pytest.raises(ValueError, match=r"\(2, 784\) and its state \(2, 128\)"):
        jax.eval_shape(model.init, KEY, np.zeros((2, 28, 28, 1)))
