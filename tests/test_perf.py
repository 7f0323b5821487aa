"""Performance options (scan unrolling, ...) against the plain loop and the default path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naisnet_jax as nj
from naisnet_jax import models as M

KEY = jax.random.key(0, impl="rbg")


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _fc_system(rng, n=5, batch=3):
    R = nj.project_fc(jnp.asarray(rng.standard_normal((n, n))), eps=0.05)
    A = np.asarray(nj.fc_state_matrix(R, 0.05))
    drive = rng.standard_normal((batch, n))
    return A, drive


# ------------------------------------------------------------------ scan_unroll


@pytest.mark.parametrize("scan_unroll", [1, 2, 3, 7, True, False])
def test_unroll_scan_unroll_matches_python_loop(scan_unroll):
    rng = np.random.default_rng(0)
    A, drive = _fc_system(rng)
    step = functools.partial(nj.fc_step, drive=jnp.asarray(drive), A=jnp.asarray(A), h=0.6)
    x, xs = nj.unroll(step, jnp.zeros((3, 5)), steps=7, trajectory=True, scan_unroll=scan_unroll)
    ref, traj = np.zeros((3, 5)), []
    for _ in range(7):
        ref = ref + 0.6 * np.tanh(ref @ A.T + drive)
        traj.append(ref)
    np.testing.assert_allclose(x, ref, rtol=1e-12)
    np.testing.assert_allclose(xs, np.stack(traj), rtol=1e-12)


def test_unroll_untied_and_bounded_accept_scan_unroll():
    rng = np.random.default_rng(1)
    As = np.stack([_fc_system(rng)[0] for _ in range(4)])
    drives = rng.standard_normal((4, 3, 5))
    x = nj.unroll(lambda x, p: nj.fc_step(x, p[1], p[0]), jnp.zeros((3, 5)), steps=4,
                  xs=(jnp.asarray(As), jnp.asarray(drives)), scan_unroll=3)
    ref = np.zeros((3, 5))
    for k in range(4):
        ref = ref + np.tanh(ref @ As[k].T + drives[k])
    np.testing.assert_allclose(x, ref, rtol=1e-12)

    A, drive = _fc_system(rng, batch=6)
    drive = drive * np.linspace(0.1, 5, 6)[:, None]
    step = functools.partial(nj.fc_step, drive=jnp.asarray(drive), A=jnp.asarray(A))
    x0 = jnp.zeros((6, 5))
    ref_x, ref_depth = nj.unroll_adaptive(step, x0, tol=1e-3, max_steps=60)
    for u in (4, True):
        x, depth = nj.unroll_adaptive_bounded(step, x0, tol=1e-3, max_steps=60, scan_unroll=u)
        np.testing.assert_array_equal(depth, ref_depth)
        np.testing.assert_allclose(x, ref_x, rtol=0, atol=1e-13)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", None])
def test_bad_scan_unroll_is_refused(bad):
    with pytest.raises(ValueError, match="scan_unroll="):
        nj.unroll(lambda x: x, jnp.zeros((1, 2)), steps=3, scan_unroll=bad)
    with pytest.raises(ValueError, match="scan_unroll="):
        M.NaisNetFC(scan_unroll=bad)
    with pytest.raises(ValueError, match="scan_unroll="):
        M.NaisConvBlock(4, scan_unroll=bad)


def _value_and_grad(model, variables, x, train=True):
    """Loss and parameter gradients of a model (float64 parameters)."""

    def loss(params):
        v = dict(variables, params=params)
        if "batch_stats" in v:
            logits, _ = model.apply(v, x, train=train, mutable=["batch_stats"])
        else:
            logits = model.apply(v, x, train=train)
        return jnp.sum(jnp.sin(logits))

    return jax.jit(jax.value_and_grad(loss))(variables["params"])


def _init(model, x):
    return _f64(jax.jit(model.init)(KEY, x))


def test_models_scan_unroll_same_values_and_gradients():
    x_fc = np.random.default_rng(2).standard_normal((4, 7))
    x_conv = np.random.default_rng(3).standard_normal((2, 6, 6, 3))
    cases = [
        (functools.partial(M.NaisNetFC, num_classes=3, features=5, steps=5), x_fc),
        (functools.partial(M.NaisNetFC, num_classes=3, features=5, steps=3, untied=True), x_fc),
        (functools.partial(M.NaisConvBlock, 4, steps=3), x_conv),
    ]
    for ctor, x in cases:
        variables = _init(ctor(), x)
        ref = _value_and_grad(ctor(), variables, x)
        out = _value_and_grad(ctor(scan_unroll=2), variables, x)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13), out, ref)
