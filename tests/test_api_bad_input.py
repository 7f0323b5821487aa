"""The library's functions, called from Python with input a notebook user plausibly gets wrong:
each is refused in one message that names the value and what was expected, or (a pattern that
blows up in an adaptive unroll) gets the result the documented plain-Python loop gives."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import naisnet_jax as nj
from naisnet_jax import models

R4 = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
A4 = -np.eye(4, dtype=np.float32)
K3 = np.zeros((3, 3, 2, 2), np.float32)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: nj.project_fc(R4, eps=0.1, relaxed="no"), "relaxed='no'"),
        (lambda: nj.project_params({"b": {"R": R4}}, eps=0.1, relaxed=1), "relaxed=1"),
        (lambda: nj.stability_projection(eps=0.01, relaxed="yes"), "relaxed='yes'"),
        (lambda: nj.stability_projection(eps=0.01, expect_blocks="no"), "expect_blocks='no'"),
        (lambda: nj.unroll(lambda x: x, jnp.ones((2, 4)), steps=2, trajectory="yes"), "trajectory='yes'"),
        (
            lambda: nj.unroll_adaptive_bounded(lambda x: x, jnp.ones((2, 4)), tol=0.1, max_steps=2, trajectory=0),
            "trajectory=0",
        ),
    ],
)
def test_a_flag_that_is_not_a_bool_is_refused(call, name):
    """A string such as 'no' is truthy: taken as given it would select the relaxed bound."""
    with pytest.raises(ValueError, match=f"^{name} must be True or False"):
        call()


def _reference_depths(step, x0, tol, max_steps):
    """The documented plain-Python loop of ``unroll_adaptive``, pattern by pattern (float64)."""
    depths = []
    for row in np.asarray(x0, np.float64):
        x, depth = row, 0
        for _ in range(max_steps):
            with np.errstate(all="ignore"):
                x_new = np.asarray(step(x[None]), np.float64)[0]
                done = np.sqrt(np.sum((x_new - x) ** 2)) < tol
            depth += 1
            x = x_new
            if done:
                break
        depths.append(depth)
    return depths


def test_a_pattern_that_blows_up_runs_every_step_and_never_reads_as_converged():
    """A NaN update compares false with ``tol``: by the documented loop the pattern is not done, so
    it runs all ``max_steps``; the other pattern still stops at its own step."""

    def step(x):  # a positive pattern grows to inf (then inf - inf = NaN), a negative one settles
        return jnp.where(x[:, :1] > 0, x * 1e20 + 1.0, 0.5 * x)

    x0 = jnp.asarray([[1.0] * 4, [-1.0] * 4], jnp.float32)
    want = _reference_depths(step, x0, 1e-3, 40)
    assert want[0] == 40 and want[1] < 40
    x, depth = nj.unroll_adaptive(step, x0, tol=1e-3, max_steps=40)
    assert depth.tolist() == want and not np.isfinite(np.asarray(x[0])).all()
    _, depth = nj.unroll_adaptive_bounded(step, x0, tol=1e-3, max_steps=40)
    assert depth.tolist() == want
    _, depth = nj.unroll_adaptive(lambda x, _: step(x), x0, tol=1e-3, max_steps=40, inputs=x0, check_every=3)
    assert depth.tolist() == want
    _, depth = nj.unroll_adaptive_stream(lambda x, i: step(x + 0 * i), x0, x0, tol=1e-3, max_steps=40, slots=2)
    assert depth.tolist() == want


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_the_projections_take_float32_or_float64_only(dtype):
    """A 16-bit float's round-off is too coarse for the proven bounds (and bfloat16 once failed
    deep inside with a broadcasting error); integers are not parameters."""
    with pytest.raises(ValueError, match=f"^R has dtype {jnp.dtype(dtype).name}; the projection needs float32"):
        nj.project_fc(jnp.asarray(R4).astype(dtype), eps=0.1)
    with pytest.raises(ValueError, match=f"R has dtype {jnp.dtype(dtype).name}"):
        nj.project_params({"block": {"R": jnp.asarray(R4).astype(dtype)}}, eps=0.1)
    with pytest.raises(ValueError, match=f"^kernel has dtype {jnp.dtype(dtype).name}"):
        nj.project_conv(jnp.asarray(K3).astype(dtype), jnp.zeros(2), eps=0.1, eta=0.5)


def test_the_projection_takes_a_nested_list():
    got = nj.project_fc([[3.0, 0.0], [0.0, 4.0]], eps=0.1)
    want = nj.project_fc(jnp.asarray([[3.0, 0.0], [0.0, 4.0]]), eps=0.1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: nj.fc_step(jnp.zeros((1, 4)), jnp.ones((3, 4)), A4),
            r"^drive of shape \(3, 4\) does not broadcast to the state x of shape \(1, 4\)",
        ),
        (
            lambda: nj.fc_step(jnp.zeros((2, 4)), jnp.ones((2, 3)), A4),
            r"^drive of shape \(2, 3\) does not broadcast to the state x of shape \(2, 4\)",
        ),
        (
            lambda: nj.fc_step(jnp.zeros((2, 3)), jnp.ones((2, 3)), A4),
            r"^state x has 3 features but A has shape \(4, 4\)",
        ),
        (
            lambda: nj.conv_step(jnp.zeros((5, 5, 2)), jnp.zeros((5, 5, 2)), K3),
            r"^state x must be NHWC \(batch, H, W, C\); got shape \(5, 5, 2\)",
        ),
        (
            lambda: nj.conv_step(jnp.zeros((1, 5, 5, 2)), jnp.zeros((2, 5, 5, 2)), K3),
            r"^drive of shape \(2, 5, 5, 2\) does not broadcast",
        ),
        (
            lambda: nj.conv_step(jnp.zeros((1, 5, 5, 2)), jnp.zeros((1, 5, 5, 2)), jnp.zeros((2, 3, 3, 2, 2))),
            r"^kernel of shape \(2, 3, 3, 2, 2\) is not \(k, k, C_in, C_out\) HWIO",
        ),
        (
            lambda: nj.unroll_tied_dense(jnp.zeros((2, 4)), jnp.ones((2, 4)), jnp.ones((4, 3)), steps=3),
            r"^state matrix A must be square \(n, n\); got shape \(4, 3\)",
        ),
        (
            lambda: nj.unroll_tied_dense(jnp.zeros((2, 4)), jnp.ones((3, 4)), A4, steps=3),
            r"^drive of shape \(3, 4\) does not broadcast",
        ),
        (
            lambda: nj.unroll_tied_conv(
                jnp.zeros((1, 5, 5, 2)), jnp.zeros((1, 5, 5, 2)), jnp.ones((2, 2, 2, 2)), steps=3
            ),
            r"^kernel of shape \(2, 2, 2, 2\) has a 2x2 filter \(even\)",
        ),
        (
            lambda: nj.unroll_tied_conv(jnp.zeros((1, 5, 5, 3)), jnp.zeros((1, 5, 5, 3)), K3, steps=3),
            r"^state x of shape \(1, 5, 5, 3\) has 3 channels but the state kernel has shape \(3, 3, 2, 2\)",
        ),
        (
            lambda: nj.fc_state_matrix(jnp.asarray(R4).at[0, 0].set(jnp.nan), eps=0.1),
            r"^R has 1 non-finite entries \(NaN or inf\) out of 16",
        ),
    ],
)
def test_a_step_refuses_arrays_that_do_not_fit(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_drive_that_broadcasts_still_steps():
    x = jnp.ones((3, 4))
    got = nj.fc_step(x, jnp.full((4,), 0.5), jnp.asarray(A4), h=0.5)
    np.testing.assert_allclose(got, np.ones((3, 4)) + 0.5 * np.tanh(-1.0 + 0.5), rtol=1e-6)


def test_get_model_names_a_keyword_the_model_does_not_take():
    with pytest.raises(
        ValueError,
        match=r"^get_model\(\.\.\.\) has fields \['featurs'\] that naisnet_mnist does not take; it takes .*'features'",
    ):
        models.get_model("naisnet_mnist", featurs=32)
    with pytest.raises(ValueError, match=r"^unknown model \['x'\]; valid names:"):
        models.get_model(["x"])


def test_a_net_names_an_input_without_a_batch_axis_and_scores_an_empty_batch():
    key = jax.random.PRNGKey(0)
    fc, conv = models.get_model("naisnet_fc_tiny"), models.get_model("naisnet_conv_tiny")
    with pytest.raises(ValueError, match=r"^NaisNetFC input must be batched, \(batch, \.\.\.\); got shape \(64,\)"):
        fc.init(key, jnp.zeros((64,)))
    for shape in ((8, 8, 1), (2, 64)):
        with pytest.raises(
            ValueError, match=rf"^NaisNetConv input must be NHWC \(batch, H, W, C\); got shape {re_shape(shape)}"
        ):
            conv.init(key, jnp.zeros(shape))
    resnet = models.get_model("resnet_conv_tiny")
    with pytest.raises(ValueError, match=r"^ResNetConv input must be NHWC"):
        resnet.init(key, jnp.zeros((8, 8, 1)))
    variables = fc.init(key, jnp.zeros((2, 8, 8, 1)))
    assert fc.apply(variables, jnp.zeros((0, 8, 8, 1))).shape == (0, fc.num_classes)
    batch = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8, 8, 1)), jnp.float32)
    flat = fc.apply(variables, batch.reshape(3, math.prod(batch.shape[1:])))
    np.testing.assert_array_equal(fc.apply(variables, batch), flat)  # the flattening is the same either way


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


D24 = jnp.ones((2, 4))


@pytest.mark.parametrize(
    "call",
    [
        lambda: nj.unroll(lambda x: x + D24, jnp.zeros((1, 4)), steps=3),
        lambda: nj.unroll(lambda x, a: x + a, jnp.zeros((1, 4)), steps=2, xs=jnp.ones((2, 2, 4))),
        lambda: nj.unroll_adaptive(lambda x: x + D24, jnp.zeros((1, 4)), tol=1e-3, max_steps=5),
        lambda: nj.unroll_adaptive_bounded(lambda x: x + D24, jnp.zeros((1, 4)), tol=1e-3, max_steps=5),
        lambda: nj.unroll_adaptive_stream(
            lambda x, i: x + D24, jnp.zeros((1, 4)), jnp.zeros((1, 4)), tol=1e-3, max_steps=5, slots=1
        ),
    ],
)
def test_a_step_that_changes_the_state_shape_is_named(call):
    """``lax``'s loops would say that their carry changed type; the message names the step."""
    with pytest.raises(ValueError, match=r"^step maps the state x0 of shape \(1, 4\) \(float\d+\) to shape \(2, 4\)"):
        call()


def test_an_adaptive_unroll_needs_a_batch_axis():
    for call in (
        lambda: nj.unroll_adaptive(lambda x: 0.5 * x, jnp.float32(1), tol=1e-3, max_steps=5),
        lambda: nj.unroll_adaptive_bounded(lambda x: 0.5 * x, jnp.float32(1), tol=1e-3, max_steps=5),
    ):
        with pytest.raises(
            ValueError, match=r"^x0 must have a leading batch axis \(patterns, \.\.\.\); got shape \(\)"
        ):
            call()


def test_a_stage_list_and_a_stride_are_checked():
    with pytest.raises(ValueError, match=r"^stage_sizes=2 must be a sequence of positive integers, one a stage"):
        models.get_model("naisnet_conv_tiny", stage_sizes=2)
    with pytest.raises(ValueError, match=r"^stride=0 must be a positive integer"):
        nj.conv_same(jnp.zeros((1, 5, 5, 2)), K3, stride=0)


@pytest.mark.parametrize(
    "params, where",
    [
        ({"block": {"R": [[3.0, 0.0], [0.0, 4.0]]}}, r"\['block'\]\['R'\]"),
        ([{"state_kernel": (1.0, 2.0)}], r"\[0\]\['state_kernel'\]"),
    ],
)
def test_a_state_parameter_given_as_a_list_is_refused_not_left_unprojected(params, where):
    """Flattened, a nested list is many leaves and none is named R: it would come back as it went."""
    with pytest.raises(TypeError, match=f"^params{where} is a nested list or tuple; a NAIS block's"):
        nj.project_params(params, eps=0.1)
    with pytest.raises(TypeError, match=f"^params{where} is a nested list or tuple"):
        nj.count_projected_blocks(params)
