"""Bad input to the public verifier API (``naisnet_jax.verify``): each is refused with one clear
ValueError or TypeError naming the argument, its value and what was expected, never a deep
internal error, a NaN "bound" or a silently wrong result.

 1. non-finite kernels and matrices to the Gershgorin bounds
 2. counts out of range (n, max_iters, max_restarts, ...) to the spectral estimators
 3. an empty matrix to spectral_radius          4. a start vector v0 of the wrong shape
 5. what is not a certificate to Certificate.from_json
 6. a block index out of range                  7. options that are not AuditOptions, no variables
 8. AuditOptions fields of the wrong type or out of range
 9. a plain Flax model that takes no ``train``: the error names apply_kwargs
"""

from __future__ import annotations

import json
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import naisnet_jax.verify as V
import numpy as np
import pytest
from naisnet_jax.verify.report import audit_and_report

from naisnet_jax import models


@pytest.fixture(scope="module")
def conv_model():
    net = models.get_model("naisnet_conv_tiny", activation="tanh")
    variables = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    inputs = np.random.default_rng(0).standard_normal((2, 8, 8, 1))
    return net, variables, inputs


@pytest.fixture(scope="module")
def cert(conv_model):
    net, variables, inputs = conv_model
    return V.audit_model(net, variables, inputs=inputs, options=V.AuditOptions(estimate_conv_radius=False))


def double(v):
    return 2 * v


# ------------------------------------------------------------------ 1. non-finite input to the bounds


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_gershgorin_bounds_refuse_non_finite_kernels(bad):
    kernel = np.full((3, 3, 2, 2), 0.01)
    kernel[0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match=r"^kernel has 1 non-finite entries \(NaN or inf\) out of 36; no bound"):
        V.conv_inf_norm_bound(kernel)
    with pytest.raises(ValueError, match=r"^kernel has 1 non-finite entries .* no Gershgorin discs"):
        V.gershgorin(kernel)
    with pytest.raises(ValueError, match=r"^A has 1 non-finite entries \(NaN or inf\) out of 4; no Gershgorin discs"):
        V.dense_gershgorin(np.array([[1.0, bad], [0.0, 1.0]]))


def test_gershgorin_bounds_of_finite_input_are_unchanged():
    kernel = np.random.default_rng(0).standard_normal((3, 3, 2, 2)) * 0.05
    centres, radii = V.gershgorin(kernel)
    bound = V.conv_inf_norm_bound(kernel, h=0.5)
    assert np.isclose(bound, np.max(np.abs(1 + 0.5 * np.asarray(centres)) + 0.5 * np.asarray(radii)))
    c, r = V.dense_gershgorin(np.array([[1.0, -2.0], [3.0, 4.0]]))
    assert np.allclose(c, [1, 4]) and np.allclose(r, [2, 3])


def test_gershgorin_under_jit_is_not_checked_and_still_traces():
    centres, _ = jax.jit(V.gershgorin)(jnp.zeros((3, 3, 1, 1)))
    assert centres.shape == (1,)


# ------------------------------------------------------------------ 2. counts out of range


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: V.power_norm_estimate(double, 5, max_iters=0), "max_iters=0 must be a positive integer"),
        (lambda: V.power_norm_estimate(double, 0), "n=0 must be a positive integer"),
        (lambda: V.power_norm_estimate(double, 2.5), "n=2.5 must be a positive integer"),
        (lambda: V.power_norm_estimate(double, 5, tol=float("nan")), "tol=nan is outside"),
        (lambda: V.arnoldi_eigs(double, 50, max_restarts=-1), "max_restarts=-1 must be a non-negative integer"),
        (lambda: V.arnoldi_eigs(double, 2.5), "n=2.5 must be a positive integer"),
        (lambda: V.arnoldi_eigs(double, 50, krylov_dim="x"), "krylov_dim='x' must be a positive integer"),
        (lambda: V.spectral_radius(double, n=5000, max_restarts=-1), "max_restarts=-1 must be a non-negative"),
        (lambda: V.spectral_radius(double, n=3, dense_max_n=-1), "dense_max_n=-1 must be a non-negative"),
        (lambda: V.spectral_radius(np.eye(3), n=0), "n=0 must be a positive integer"),
        (lambda: V.spectral_radius_info(double, n=3, tol=0.0), "tol=0.0 is outside"),
    ],
)
def test_counts_out_of_range_are_refused(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_deprecated_power_norm_bound_checks_its_counts_too():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=re.escape("max_iters=0 must be a positive integer")):
            V.power_norm_bound(double, 5, max_iters=0)


def test_arnoldi_batch_refuses_negative_restarts():
    ops = V.stack_operators([V.dense_operator(jnp.eye(4)), V.dense_operator(2 * jnp.eye(4))])
    with pytest.raises(ValueError, match=re.escape("max_restarts=-1 must be a non-negative integer")):
        V.arnoldi_eigs_batch(ops, 4, max_restarts=-1)


def test_valid_counts_give_the_same_figures():
    assert V.power_norm_estimate(double, 5) == pytest.approx(2.0)
    assert V.spectral_radius(np.diag([0.5, -3.0, 1.0])) == pytest.approx(3.0)
    assert abs(V.arnoldi_eigs(double, 50, max_restarts=0).eigenvalues[0]) == pytest.approx(2.0)


# ------------------------------------------------------------------ 3. an empty matrix


def test_spectral_radius_refuses_an_empty_matrix():
    with pytest.raises(ValueError, match=r"op has shape \(0, 0\): an empty matrix has no eigenvalues"):
        V.spectral_radius(np.zeros((0, 0)))
    with pytest.raises(ValueError, match="empty matrix"):
        V.spectral_radius_info(jnp.zeros((0, 0)), method="arnoldi")


# ------------------------------------------------------------------ 4. v0 of the wrong shape


def test_arnoldi_refuses_a_start_vector_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"v0 has shape \(3,\) \(float64\); expected shape \(50,\)"):
        V.arnoldi_eigs(double, 50, v0=jnp.ones(3))
    with pytest.raises(ValueError, match=r"v0 has shape \(1, 50\) .* expected shape \(50,\)"):
        V.arnoldi_eigs(double, 50, v0=jnp.ones((1, 50)))
    with pytest.raises(ValueError, match=r"v0 has 1 non-finite entries"):
        V.arnoldi_eigs(double, 3, v0=jnp.array([1.0, jnp.nan, 0.0]))
    ops = V.stack_operators([V.dense_operator(jnp.eye(4)), V.dense_operator(2 * jnp.eye(4))])
    with pytest.raises(ValueError, match=r"v0 has shape \(4,\) .* expected shape \(2, 4\)"):
        V.arnoldi_eigs_batch(ops, 4, v0=jnp.ones(4))
    assert abs(V.arnoldi_eigs(double, 50, v0=jnp.ones(50)).eigenvalues[0]) == pytest.approx(2.0)


# ------------------------------------------------------------------ 5. Certificate.from_json


@pytest.mark.parametrize(
    "text, error, message",
    [
        ("/tmp/certificate.json", ValueError, r"got a string that is not JSON, '/tmp/certificate.json' \(a path\?"),
        ("garbage", ValueError, r"expects the certificate's JSON text or its dict; got a string that is not JSON"),
        ("", ValueError, r"expects the certificate's JSON text or its dict; got an empty string"),
        ("[1,2]", ValueError, r"the JSON text holds \[1, 2\] \(list\), not a certificate"),
        (None, TypeError, r"expects the certificate's JSON text or its dict; got None \(NoneType\)"),
        (5, TypeError, r"got 5 \(int\)"),
        ({"schema": "naisnet-jax-certificate/1"}, ValueError, r"certificate schema 'naisnet-jax-certificate/1'"),
        ({}, ValueError, r"certificate schema None; this code reads"),
    ],
)
def test_from_json_refuses_what_is_not_a_certificate(text, error, message):
    with pytest.raises(error, match=message):
        V.Certificate.from_json(text)


def test_from_json_names_the_missing_or_malformed_field(cert):
    good = json.loads(cert.to_json())
    assert V.Certificate.from_json(good) == cert == V.Certificate.from_json(cert.to_json())

    no_blocks = {k: v for k, v in good.items() if k != "blocks"}
    with pytest.raises(ValueError, match=r"^not a certificate: missing field 'blocks'$"):
        V.Certificate.from_json(no_blocks)

    def lstm(d):
        d["blocks"][0]["kind"] = "lstm"

    def no_parameter(d):
        del d["blocks"][1]["parameter"]

    def bad_verdict(d):
        d["blocks"][0]["verdict"] = "maybe"

    for damage, message in (
        (lstm, r"block 0: kind='lstm' must be one of \('dense', 'conv'"),
        (no_parameter, r"not a certificate: block 1: missing field 'parameter'"),
        (bad_verdict, r"not a certificate: block 0 \('stage0_block0'\) is malformed"),
    ):
        damaged = json.loads(cert.to_json())
        damage(damaged)
        with pytest.raises(ValueError, match=message):
            V.Certificate.from_json(damaged)

    not_a_list = dict(good, blocks=3)
    with pytest.raises(ValueError, match=r"not a certificate: blocks=3 must be a list"):
        V.Certificate.from_json(not_a_list)


# ------------------------------------------------------------------ 6. a block index out of range


def test_a_block_index_out_of_range_names_the_blocks(cert):
    names = [b.name for b in cert.blocks]
    message = rf"block=99 is out of range: the certificate has {len(names)} blocks.*{re.escape(repr(names))}"
    with pytest.raises(ValueError, match=message):
        cert.block(99)
    with pytest.raises(ValueError, match=message):
        cert.plot(99)
    with pytest.raises(TypeError, match=r"block=1.5 must be a block's name \(a string\) or its index"):
        cert.block(1.5)
    with pytest.raises(KeyError, match="no block 'nope'"):
        cert.block("nope")
    assert cert.block(0) is cert.blocks[0] and cert.block(-1) is cert.blocks[-1]
    assert cert.block(np.int64(1)) is cert.block(names[1])


# ------------------------------------------------------------------ 7. options and variables


def test_options_must_be_audit_options(conv_model, tmp_path):
    net, variables, inputs = conv_model
    message = r"options=\{'samples': 4\} must be an AuditOptions or None; got a dict: pass AuditOptions\(\*\*options\)"
    with pytest.raises(TypeError, match=message):
        V.audit_model(net, variables, inputs=inputs, options={"samples": 4})
    with pytest.raises(TypeError, match=message):
        V.audit(str(tmp_path), {"samples": 4})
    with pytest.raises(TypeError, match=message):
        audit_and_report(str(tmp_path), options={"samples": 4})


def test_variables_must_be_given(conv_model):
    net, _, inputs = conv_model
    with pytest.raises(TypeError, match=r"^variables=None; expected the model's variables, a dict such as \{'params'"):
        V.audit_model(net, None, inputs=inputs)
    with pytest.raises(TypeError, match=r"^variables=<array of shape \(3,\), float64>; expected"):
        V.audit_model(net, np.zeros(3), inputs=inputs)


# ------------------------------------------------------------------ 8. AuditOptions fields


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("seed", "x", r"seed='x' must be an integer in \[0, 4294967294\]"),
        ("seed", -1, r"seed=-1 must be an integer in"),
        ("dense_max_n", -5, r"dense_max_n=-5 must be a non-negative integer"),
        ("dense_max_n", 2.0, r"dense_max_n=2.0 must be a non-negative integer"),
        ("input_shape", 64, r"input_shape=64 must be None or a non-empty sequence of positive integers"),
        ("input_shape", (), r"input_shape=\(\) must be None or a non-empty sequence"),
        ("input_shape", (8, 0, 1), r"input_shape\[1\]=0 must be a positive integer"),
        ("input_shape", "881", r"input_shape='881' must be None or a non-empty sequence"),
        ("estimate_conv_radius", "no", r"estimate_conv_radius='no' must be True or False"),
        ("relaxed", 1, r"relaxed=1 must be True or False"),
        ("apply_kwargs", None, r"apply_kwargs=None must be a dict of keyword arguments for model.apply"),
        ("apply_kwargs", {"mutable": True}, r"apply_kwargs=\{'mutable': True\} sets 'mutable'"),
        ("data_dir", 3, r"data_dir=3 must be a directory \(a path string\) or None"),
    ],
)
def test_every_audit_option_is_checked_at_construction(field, value, message):
    with pytest.raises(ValueError, match=message):
        V.AuditOptions(**{field: value})


def test_valid_audit_options_are_kept():
    options = V.AuditOptions(input_shape=[8, 8, 1], seed=3, dense_max_n=0, apply_kwargs={}, data_dir="/tmp")
    assert options.input_shape == (8, 8, 1) and options.seed == 3 and options.dense_max_n == 0


# ------------------------------------------------------------------ 9. a plain Flax model


def test_a_model_without_train_gets_a_hint_naming_apply_kwargs():
    dense = nn.Dense(3)
    variables = dense.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
    inputs = np.ones((2, 4))
    with pytest.raises(V.ModelApplyError, match=r"unexpected keyword argument 'train'.*AuditOptions\(apply_kwargs="):
        V.audit_model(dense, variables, inputs=inputs)
    cert = V.audit_model(dense, variables, inputs=inputs, options=V.AuditOptions(apply_kwargs={}))
    assert not cert.certified and "no blocks found" in cert.reason
