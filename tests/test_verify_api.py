"""The in-memory audit and the typed certificate: ``audit_model``, JSON round trip, table, HTML,
plots, discovery through the blocks' own probes, and the x64 switch left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from naisnet_jax.verify import (
    SCHEMA,
    AuditOptions,
    Certificate,
    ConvParameters,
    DenseParameters,
    ModelApplyError,
    Verdict,
    audit_model,
)
from references import rho

from naisnet_jax import models


@pytest.fixture(scope="module")
def conv_cert():
    net = models.get_model("naisnet_conv_tiny", activation="tanh", learn_delta=True)
    variables = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 1))
    return audit_model(net, variables, inputs=x)


class TwoTowers(nn.Module):
    """A user's model: blocks under names the verifier has never seen, one of them called twice."""

    @nn.compact
    def __call__(self, x, train=False):
        u = x.reshape(x.shape[0], -1)
        shared = models.NaisDenseBlock(5, steps=3, eps=0.05, h=0.5, activation="tanh", name="left_tower")
        a = shared(u)
        b = shared(u * 2)
        c = models.NaisDenseBlock(5, steps=2, eps=0.2, activation="relu", rank=2, name="odd")(u)
        return nn.Dense(3)(a + b + c)


def test_blocks_are_found_through_their_probes_in_any_model():
    net = TwoTowers()
    variables = net.init(jax.random.PRNGKey(1), jnp.zeros((1, 12)))
    x = np.random.default_rng(1).standard_normal((6, 12))
    cert = audit_model(net, variables, inputs=x)
    assert [b.name for b in cert.blocks] == ["left_tower", "left_tower#1", "odd"]
    assert all(b.kind == "dense" and b.certified for b in cert.blocks), cert.table()
    assert cert.certified and cert.source.kind == "in-memory" and cert.source.model == "TwoTowers"
    odd = cert.block("odd")
    assert odd.trajectory.states == 2 * 6
    # the radius is the float32 operator's, read from the block's own hyper-parameters (eps = 0.2)
    R = np.asarray(variables["params"]["odd"]["R"], np.float32)
    A = np.asarray(-(jnp.asarray(R).T @ jnp.asarray(R)) - jnp.float32(0.2) * jnp.eye(5, dtype=jnp.float32), np.float64)
    assert odd.parameter.rho_I_plus_hA == pytest.approx(rho(np.eye(5) + A), rel=1e-6)
    assert cert.block("left_tower").trajectory.states == 3 * 6
    assert cert.hyperparameters.h == 0.5  # the first block's


def test_certificate_json_round_trip_is_exact_and_strict(conv_cert):
    text = conv_cert.to_json()

    def refuse(const):
        raise ValueError(f"non-standard JSON constant {const}")

    data = json.loads(text, parse_constant=refuse)
    assert data["schema"] == SCHEMA and data["certified"] is True
    again = Certificate.from_json(text)
    assert again == conv_cert
    assert isinstance(again.block(0).parameter, ConvParameters)
    assert again.block(0).verdict is Verdict.CERTIFIED
    assert Certificate.from_json(again.to_json()) == again
    with pytest.raises(ValueError, match="schema"):
        Certificate.from_json(dict(data, schema="naisnet-jax-certificate/1"))


def test_infinite_figures_survive_the_round_trip():
    net = models.get_model("naisnet_fc_tiny", eps=0.1)
    variables = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    params = jax.tree.map(np.asarray, variables["params"])
    params["block"]["R"] = params["block"]["R"] * np.float32(5)  # unstable: no proof, infinite gamma
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 1))
    cert = audit_model(net, {"params": params}, inputs=x)
    assert not cert.certified
    assert Certificate.from_json(cert.to_json()) == cert
    assert isinstance(cert.block("block").parameter, DenseParameters)


def test_table_html_and_verdict(conv_cert):
    table = conv_cert.table()
    assert "stage0_block0" in table and "stage1_block0" in table and "CERTIFIED" in table
    assert "proven" in table and "estimate" in table
    html = conv_cert._repr_html_()
    assert html.count("<tr>") == 1 + len(conv_cert.blocks) and "stage1_block0" in html


def test_plot_returns_a_figure_without_choosing_a_backend(conv_cert):
    import matplotlib

    backend = matplotlib.get_backend()
    fig = conv_cert.plot("stage0_block0")
    assert len(fig.axes) == 2 and matplotlib.get_backend() == backend
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    fig2 = conv_cert.plot(1, ax=ax)
    assert fig2 is ax.figure
    labels = [line.get_label() for line in ax.lines]
    assert "unit circle" in labels and any(lab.startswith("proven bound") for lab in labels)
    patches = ax.patches
    assert patches and not any(p.get_fill() for p in patches)  # outlines, not filled discs
    plt.close("all")


def test_audit_without_inputs_needs_a_shape_and_bad_variables_are_named():
    net = models.get_model("naisnet_fc_tiny")
    variables = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    with pytest.raises(ValueError, match="needs inputs"):
        audit_model(net, variables)
    cert = audit_model(net, variables, options=AuditOptions(input_shape=(8, 8, 1)))
    assert cert.certified and cert.block("block").trajectory is None and cert.data.samples == 0
    with pytest.raises(ModelApplyError, match="cannot apply NaisNetFC"):
        audit_model(net, variables, options=AuditOptions(input_shape=(9, 9, 1)))
    with pytest.raises(ValueError, match="samples=0"):
        AuditOptions(samples=0)


def test_schema_1_dict_access_still_works_with_a_warning(conv_cert):
    with pytest.warns(DeprecationWarning, match="schema-1 dict access"):
        assert conv_cert["certified"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert [b["name"] for b in conv_cert["blocks"]] == ["stage0_block0", "stage1_block0"]


def test_the_audit_leaves_jax_x64_as_it_was(tmp_path):
    """In a fresh interpreter with x64 off (as a user's training script), the audit runs in float64
    inside its own scope and the user's float32 arrays and config are unchanged afterwards."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from naisnet_jax import models
        from naisnet_jax.verify import audit_model
        assert not jax.config.jax_enable_x64
        net = models.get_model("naisnet_fc_tiny")
        v = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
        cert = audit_model(net, v, inputs=np.random.default_rng(0).standard_normal((3, 8, 8, 1)))
        assert cert.certified, cert.table()
        assert not jax.config.jax_enable_x64
        assert jnp.zeros(3).dtype == jnp.float32 and (jnp.ones(2) * 0.5).dtype == jnp.float32
        assert v["params"]["block"]["R"].dtype == jnp.float32
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_ENABLE_X64")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_readme_audit_snippet_runs():
    """The README's in-memory audit, as written (a notebook cell)."""
    import pathlib
    import re

    import matplotlib.pyplot as plt

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Auditing a model or a checkpoint") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md#auditing", "exec"), scope)  # noqa: S102 - our own documentation
    cert = scope["cert"]
    assert cert.certified and scope["block"].parameter.inf_norm_bound_I_plus_hA < 1
    assert scope["fig"].axes
    plt.close("all")


def test_non_finite_parameters_are_refused_naming_the_leaf():
    net = TwoTowers()
    variables = net.init(jax.random.PRNGKey(1), jnp.zeros((1, 12)))
    R = np.array(variables["params"]["odd"]["R"])
    R[0, 0] = np.inf
    bad = {"params": {**variables["params"], "odd": {**variables["params"]["odd"], "R": R}}}
    with pytest.raises(ValueError, match=r"'odd'\]\['R'\] \(1 of "):
        audit_model(net, bad, inputs=np.ones((2, 12)))


def test_groups_audited_side_by_side_in_threads_give_the_same_certificate(monkeypatch):
    """A cold audit compiles one program per block shape; ``map_groups`` runs shape groups in
    threads (one per group on a machine of many cores), and ``side_by_side`` runs the conv proofs
    beside the conv trajectories. Threads must change nothing: each re-enters the float64 scope
    (thread-local in JAX) and keeps its own keys. Forced to 4 workers here, the certificate equals
    the one-thread certificate figure for figure."""
    from naisnet_jax.verify import _common, _conv

    net = models.get_model("naisnet_conv_tiny", activation="tanh", learn_delta=True, stage_sizes=(2, 1))
    variables = net.init(jax.random.PRNGKey(3), jnp.zeros((1, 8, 8, 1)))
    x = np.random.default_rng(3).standard_normal((4, 8, 8, 1))
    options = AuditOptions(estimate_conv_radius=True)
    plain = _common.map_groups
    calls = []

    def threaded(fn, groups, *, workers=None):
        calls.append(len(list(groups)))
        return plain(fn, groups, workers=4)

    one = audit_model(net, variables, inputs=x, options=options)
    monkeypatch.setattr(_conv, "map_groups", threaded)  # the name the conv audit calls
    monkeypatch.setattr(_common, "map_groups", threaded)  # the one side_by_side calls
    four = audit_model(net, variables, inputs=x, options=options)
    assert calls and max(calls) >= 2  # the parameters and the trajectories of >= 2 shape groups
    assert calls[0] == 2  # first the conv proofs and trajectories side by side, then their groups
    drop = ("seconds", "timings", "created")
    a = {k: v for k, v in one.to_dict().items() if k not in drop}
    b = {k: v for k, v in four.to_dict().items() if k not in drop}
    assert a == b


def test_map_groups_keeps_order_and_the_float64_scope_in_every_thread():
    from naisnet_jax.verify import _common
    from naisnet_jax.verify._numerics import x64_scope

    def dtype_of(g):
        return (g, str(jnp.asarray(1.0).dtype), jax.config.jax_default_matmul_precision)

    with x64_scope():
        out = _common.map_groups(dtype_of, [[i] for i in range(6)], workers=3)
    assert [o[0] for o in out] == [[i] for i in range(6)]
    assert {o[1] for o in out} == {"float64"} and {o[2] for o in out} == {"highest"}


def test_shares_of_units_are_float64_counts():
    """``unsaturated_fraction`` is a count over (steps x inputs x units) computed in float64: a
    float32 mean of the boolean mask (what ``jnp.mean`` gives even inside x64) is ~1e-8 off."""
    net = models.get_model("naisnet_fc_tiny", activation="relu", steps=7, features=10)
    variables = net.init(jax.random.PRNGKey(4), jnp.zeros((1, 8, 8, 1)))
    x = np.random.default_rng(4).standard_normal((3, 8, 8, 1))
    t = audit_model(net, variables, inputs=x).block("block").trajectory
    total = t.states * 10  # 7 steps x 3 inputs x 10 units = 210: k / 210 is inexact in float32
    count = t.unsaturated_fraction * total
    assert 0 < t.unsaturated_fraction < 1
    assert abs(count - round(count)) < 1e-9, count
