"""The projections on any params container: dict, FrozenDict, nnx.State (pure or with
nnx.Param-boxed leaves), and a Linen model bridged to Flax NNX trained in ``nnx.Optimizer``.

References: the plain-dict result (the containers must change nothing but the container),
and float64 numpy for the stable sets of Algorithms 1 and 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict, freeze

import naisnet_jax as nj
from naisnet_jax import models

EPS, ETA = 0.1, 0.3


def _params(seed=0):
    """A params dict with a dense block, a conv block with delta, an untied conv block
    without delta, and parameters that no projection may touch."""
    rng = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(3.0 * rng.standard_normal(s), jnp.float32)  # noqa: E731 - infeasible scales
    return {
        "dense": {"R": n(5, 5), "input": {"kernel": n(3, 5), "bias": n(5)}},
        "stage": {
            "conv": {"state_kernel": n(3, 3, 2, 2), "delta": jnp.asarray([0.95, -2.0], jnp.float32)},
            "untied": {"state_kernel": n(4, 3, 3, 2, 2)},
        },
        "head": {"kernel": n(5, 2), "bias": n(2)},
        "delta": n(2),  # a leaf named delta outside any conv block: not a state parameter
    }


def _boxed_state(params):
    """``params`` as an nnx.State whose leaves are nnx.Param boxes."""
    return nnx.State(jax.tree.map(nnx.Param, params))


def _pure_state(params):
    return nnx.State(params)


def _unbox(tree):
    return jax.tree.map(
        lambda v: v[...] if isinstance(v, nnx.Variable) else v, tree, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )


CONTAINERS = {
    "dict": lambda p: p,
    "FrozenDict": freeze,
    "nnx.State": _pure_state,
    "nnx.State of nnx.Param": _boxed_state,
}


def _to_dict(tree):
    """Any of the containers above as a plain nested dict of numpy arrays."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    elif isinstance(tree, FrozenDict):
        tree = tree.unfreeze()
    return jax.tree.map(np.asarray, _unbox(tree))


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_project_params_keeps_the_container_and_matches_the_dict_result(container):
    params = _params()
    tree = CONTAINERS[container](params)
    out = nj.project_params(tree, eps=EPS, eta=ETA)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert type(out) is type(tree)
    expected = jax.tree.map(np.asarray, nj.project_params(params, eps=EPS, eta=ETA))
    jax.tree.map(np.testing.assert_array_equal, _to_dict(out), expected)
    # and the dict result is Algorithm 1 / 2 itself on each block
    np.testing.assert_array_equal(expected["dense"]["R"], nj.project_fc(params["dense"]["R"], eps=EPS))
    k, d = nj.project_conv(params["stage"]["conv"]["state_kernel"], params["stage"]["conv"]["delta"], eps=EPS, eta=ETA)
    np.testing.assert_array_equal(expected["stage"]["conv"]["state_kernel"], k)
    np.testing.assert_array_equal(expected["stage"]["conv"]["delta"], d)
    k, _ = nj.project_conv(params["stage"]["untied"]["state_kernel"], jnp.zeros((4, 2), jnp.float32), eps=EPS, eta=ETA)
    np.testing.assert_array_equal(expected["stage"]["untied"]["state_kernel"], k)
    for untouched in (("head", "kernel"), ("head", "bias"), ("delta",), ("dense", "input", "kernel")):
        a, b = expected, params
        for key in untouched:
            a, b = a[key], b[key]
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_iter_state_blocks_sees_the_same_blocks_in_every_container(container):
    tree = CONTAINERS[container](_params())
    blocks = dict(nj.iter_state_blocks(tree))
    assert set(blocks) == {("dense",), ("stage", "conv"), ("stage", "untied")}
    assert nj.count_projected_blocks(tree) == 3
    assert set(blocks[("dense",)]) == {"R", "input"}
    np.testing.assert_array_equal(blocks[("dense",)]["input"]["kernel"], _params()["dense"]["input"]["kernel"])
    assert set(blocks[("stage", "conv")]) == {"state_kernel", "delta"}
    assert isinstance(blocks[("stage", "conv")]["delta"], jax.Array)  # unboxed, whatever the container


@pytest.mark.parametrize("container", list(CONTAINERS))
def test_stability_projection_keeps_the_updates_structure(container):
    params = CONTAINERS[container](_params())
    grads = CONTAINERS[container](jax.tree.map(jnp.ones_like, _params()))
    tx = optax.chain(optax.sgd(0.5), nj.stability_projection(eps=EPS, eta=ETA))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)
    new = _to_dict(optax.apply_updates(params, updates))
    expected = nj.project_params(jax.tree.map(lambda p: p - 0.5, _params()), eps=EPS, eta=ETA)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), new, _to_dict(expected))
    # non-state leaves get exactly the SGD update (no params + u - params round-off)
    np.testing.assert_array_equal(_to_dict(updates)["head"]["kernel"], np.full((5, 2), -0.5, np.float32))


def test_stability_projection_refuses_updates_shaped_unlike_params():
    tx = nj.stability_projection(eps=EPS)
    with pytest.raises(ValueError, match="differ in structure"):
        tx.update({"R": jnp.ones((2, 2))}, tx.init(None), {"R": jnp.ones((2, 2)), "b": jnp.ones(2)})


# ------------------------------------------------------------------- Flax NNX


def _assert_dense_stable(R, eps, h):
    R = np.asarray(R, np.float64)
    assert np.linalg.norm(R.T @ R, "fro") <= (1 - 2 * eps) * (1 + 1e-5)
    A = -R.T @ R - eps * np.eye(R.shape[1])
    assert np.max(np.abs(np.linalg.eigvals(np.eye(len(A)) + h * A))) < 1


def _assert_conv_stable(kernel, delta, eps, eta):
    k = np.asarray(kernel, np.float64)
    d = np.zeros(k.shape[-1]) if delta is None else np.asarray(delta, np.float64)
    assert np.all(np.abs(d) <= 1 - eta + 1e-7)
    p = k.shape[0] // 2
    np.testing.assert_allclose(np.diagonal(k[p, p]), -1 - d, rtol=1e-6)
    others = np.abs(k).sum(axis=(0, 1, 2)) - np.abs(np.diagonal(k[p, p]))
    assert np.all(others <= (1 - eps - np.abs(d)) * (1 + 1e-5))


@nnx.jit
def _lazy_init(model, x):
    """``nnx.bridge.lazy_init`` compiled (run eagerly, a conv net's init dispatches op by op)."""
    nnx.bridge.lazy_init(model, x, train=False)


@pytest.mark.parametrize(
    "name, kwargs, shape, lr",
    [
        ("naisnet_fc_tiny", {}, (16, 5), 0.1),
        pytest.param("naisnet_conv_tiny", {"learn_delta": True}, (16, 6, 6, 1), 0.5, marks=pytest.mark.slow),
    ],
)
def test_a_bridged_linen_model_trains_in_nnx_optimizer_and_stays_stable(name, kwargs, shape, lr):
    eps, eta = 0.1, 0.5
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    y = jnp.arange(shape[0]) % 3
    model = nnx.bridge.ToNNX(models.get_model(name, eps=eps, **kwargs), rngs=nnx.Rngs(0))
    _lazy_init(model, x)
    # start far outside the stable set: every step must bring it back
    nnx.update(
        model, nj.project_params(jax.tree.map(lambda v: 4.0 * v, nnx.state(model, nnx.Param)), eps=0.4, eta=0.45)
    )
    tx = optax.chain(optax.sgd(lr, momentum=0.9), nj.stability_projection(eps=eps, eta=eta))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    mutable = ["batch_stats"] if "conv" in name else False

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            logits = model(x, train=True, mutable=mutable)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, x, y)) for _ in range(8)]
    assert np.all(np.isfinite(losses)) and min(losses[1:]) < losses[0]
    params = nnx.state(model, nnx.Param)
    blocks = list(nj.iter_state_blocks(params))
    assert len(blocks) == nj.count_projected_blocks(params) == (1 if "fc" in name else 2)
    for _, node in blocks:
        if "R" in node:
            _assert_dense_stable(node["R"], eps, h=1.0)
        else:
            _assert_conv_stable(node["state_kernel"], node.get("delta"), eps, eta)
