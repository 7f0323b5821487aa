"""One way to write things: every hyper-parameter is declared once, every check is written once.

(1) The blocks and networks inherit their hyper-parameters from option classes, so a field that
two models share is one ``dataclasses.Field`` object, and a network hands its block every option
of the block's option class (checked on the modules it actually builds). (2) The source tree
defines each ``check_*`` function once, and the wording of the shared checks appears nowhere else.
(3) A bad value gets the very same message, raised by the same function, whichever entry point
(model, core function, projection, config, checkpoint metadata, verifier) receives it.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import math
import pathlib
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from naisnet_jax.verify import AuditOptions, audit_model, conv_inf_norm_bound, conv_operator, gershgorin
from naisnet_jax.verify import cli as verify_cli
from naisnet_jax.verify.spectral import fft_conv_spectrum

import naisnet_jax as nj
from naisnet_jax import checkpoint as ckpt
from naisnet_jax import checks, train
from naisnet_jax import models as M
from naisnet_jax.cell import check_activation, check_kernel_shape, check_step_size
from naisnet_jax.configs import default
from naisnet_jax.kernels.stacked import dense_op, unroll_tied
from naisnet_jax.parametrize import check_eps
from naisnet_jax.projection import check_eta

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "naisnet_jax").rglob("*.py")) + sorted((ROOT / "verify").rglob("*.py"))
MODEL_CLASSES = (
    M.NaisDenseBlock,
    M.NaisConvBlock,
    M.NaisNetFC,
    M.NaisNetConv,
    M.ResNetFC,
    M.ResNetConvBlock,
    M.ResNetConv,
)
OPTION_CLASSES = tuple(
    c for c in vars(M).values() if isinstance(c, type) and issubclass(c, M.HyperParameters) and c not in MODEL_CLASSES
)
# What a model class itself declares: its architecture, never a hyper-parameter another model shares.
OWN_FIELDS = {
    M.NaisDenseBlock: {"features"},
    M.NaisConvBlock: {"features", "strides", "normalize_drive"},
    M.NaisNetFC: {"features"},
    M.NaisNetConv: set(),
    M.ResNetConv: set(),
    M.ResNetFC: {"features", "depth", "shared", "nonautonomous", "batch_norm", "stable"},
    M.ResNetConvBlock: {"features", "strides"},
}
RESTATED_DEFAULTS = {"steps", "activation"}  # ConvOptions restates these two defaults (CIFAR: 10, relu)
FLAX_FIELDS = {"parent", "name"}


def own_annotations(cls) -> set[str]:
    return set(vars(cls).get("__annotations__", {})) - FLAX_FIELDS


def declarer(cls, name: str) -> type:
    """The class in ``cls``'s MRO whose body declares field ``name``."""
    return next(c for c in cls.__mro__ if name in own_annotations(c))


def field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - FLAX_FIELDS


# ------------------------------------------------------------ (1) declared once


def test_models_declare_only_their_own_architecture():
    for cls in MODEL_CLASSES:
        assert own_annotations(cls) == OWN_FIELDS[cls], cls.__name__


def test_each_hyper_parameter_is_one_declaration_shared_by_every_model():
    for cls in MODEL_CLASSES:
        for name in field_names(cls) - OWN_FIELDS[cls]:
            home = declarer(cls, name)
            assert home in OPTION_CLASSES, (cls.__name__, name, home.__name__)
            # dataclasses reuse the base class's Field object: the very same declaration
            assert cls.__dataclass_fields__[name] is home.__dataclass_fields__[name], (cls.__name__, name)
    homes = collections.Counter(name for c in OPTION_CLASSES for name in own_annotations(c))
    assert {name for name, count in homes.items() if count > 1} == RESTATED_DEFAULTS
    assert declarer(M.ConvOptions, "steps") is M.ConvOptions and declarer(M.DenseOptions, "steps") is M.NaisOptions
    for a, b in [(M.NaisNetFC, M.ResNetFC), (M.NaisDenseBlock, M.NaisConvBlock), (M.NaisNetConv, M.ResNetConv)]:
        for name in (field_names(a) & field_names(b)) - OWN_FIELDS[a] - RESTATED_DEFAULTS:
            assert a.__dataclass_fields__[name] is b.__dataclass_fields__[name], (a.__name__, b.__name__, name)


def test_hyper_parameters_are_keyword_only():
    for cls in MODEL_CLASSES:
        positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only and f.name not in FLAX_FIELDS]
        assert positional == (["features"] if "features" in positional else []), cls.__name__
    with pytest.raises((TypeError, ValueError)):
        M.NaisConvBlock(4, 2)  # the second argument is not `steps` (nor anything else) by position


NETS_AND_BLOCKS = [
    (M.NaisNetFC, M.NaisDenseBlock, M.DenseOptions),
    (M.NaisNetConv, M.NaisConvBlock, M.ConvOptions),
    (M.ResNetConv, M.ResNetConvBlock, M.ResNetConvOptions),
]


@pytest.mark.parametrize("net, block, options", NETS_AND_BLOCKS, ids=lambda c: c.__name__)
def test_a_network_shares_with_its_block_exactly_the_block_options(net, block, options):
    assert (field_names(net) & field_names(block)) - {"features"} == field_names(options)


def built_blocks(model, x, block_cls) -> list:
    """The ``block_cls`` modules ``model.init`` calls (shapes only, nothing compiled)."""
    seen = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, block_cls) and context.method_name == "__call__":
            seen.append(context.module)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
    return seen


# Non-default option values, in groups that may be combined (untied, adaptive depth and the
# custom VJP exclude one another).
COMMON = dict(h=0.5, eps=0.05, steps=2, initial_state="input", dtype="float32")
GROUPS = [
    dict(untied=True, remat="step"),
    dict(adaptive_tol=1e-2, max_steps=3, check_every=2, compact=True, remat="block", stream_slots=5),
    dict(block_vjp="stacked", scan_unroll=2),
]
CASES = [
    (
        M.NaisNetFC(features=6, num_classes=3, rank=2, activation="relu", **COMMON, **g),
        M.NaisDenseBlock,
        M.DenseOptions,
        (2, 6),
    )
    for g in GROUPS
]
CASES += [
    (
        M.NaisNetConvTiny(kernel_size=5, eta=0.3, learn_delta=True, activation="tanh", **COMMON, **g),
        M.NaisConvBlock,
        M.ConvOptions,
        (2, 6, 6, 1),
    )
    for g in GROUPS
]
CASES += [(M.ResNetConvTiny(kernel_size=5, dtype="float32"), M.ResNetConvBlock, M.ResNetConvOptions, (2, 6, 6, 1))]


@pytest.mark.parametrize("model, block_cls, options, shape", CASES, ids=lambda v: getattr(v, "__name__", None))
def test_networks_hand_every_option_to_the_blocks_they_build(model, block_cls, options, shape):
    blocks = built_blocks(model, jnp.zeros(shape, jnp.float32), block_cls)
    assert blocks
    for block in blocks:
        for name in field_names(options):
            expected = getattr(model, name)
            if name == "initial_state" and getattr(block, "strides", 1) != 1:
                expected = "zero"  # a stage's first block changes shape: it starts at x_0 = 0
            assert getattr(block, name) == expected, (block.name, name)


# ------------------------------------------------------------ (2) written once


def _definitions(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith("check")
    ]


def test_every_check_function_is_defined_once():
    where = collections.defaultdict(list)
    for path in SOURCES:
        for name in _definitions(path):
            where[name.lstrip("_")].append(str(path.relative_to(ROOT)))
    where.pop("check_fields")  # the option classes' per-class hook, one per class by design
    repeated = {name: files for name, files in where.items() if len(files) > 1}
    assert not repeated


def _code_strings(path: pathlib.Path) -> list[str]:
    """String literals of a file (f-string pieces included), docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


# wording of a rule -> the one file allowed to write it
WORDING = {
    "a positive integer": "checks.py",
    "a non-negative integer": "checks.py",
    "must be one of": "checks.py",
    "is outside": "checks.py",
    "is not a number": "checks.py",
    "non-finite entries": "checks.py",
    "must be True or False": "checks.py",
    "float32 floor": "parametrize.py",
    "odd square filter": "cell.py",
    "square channels": "cell.py",
    "(eps, 1)": "projection.py",
    "h <= 1": "cell.py",
}


def test_the_wording_of_each_rule_lives_in_one_file():
    for path in SOURCES:
        for text in _code_strings(path):
            for words, home in WORDING.items():
                assert words not in text or path.name == home, (str(path.relative_to(ROOT)), text)


# ------------------------------------------------------------ (3) one message everywhere


def message_of(fn) -> tuple[str, tuple[str, str]]:
    """``fn()``'s error message and where the error (or the one it wraps) was raised."""
    with pytest.raises(ValueError) as info:
        fn()
    inner = info.value
    while inner.__context__ is not None and inner.__suppress_context__:  # a CheckpointError's cause
        inner = inner.__context__
    frame = traceback.extract_tb(inner.__traceback__)[-1]
    return str(info.value), (pathlib.Path(frame.filename).name, frame.name)


def reference(check, *args) -> tuple[str, tuple[str, str]]:
    return message_of(lambda: check(*args))


def config(**changes):
    """The default config with ``changes``, built from a plain dict (no ConfigDict type checks)."""
    return ml_collections.ConfigDict({**default.get_config().to_dict(), **changes})


def metadata(**changes):
    base = dict(
        model="naisnet_fc_tiny",
        num_classes=3,
        input_shape=(6,),
        dataset="digits",
        channel_mean=(0.0,) * 6,
        channel_std=(1.0,) * 6,
        eps=0.01,
        h=1.0,
    )
    return ckpt.CheckpointMetadata(**{**base, **changes})


R2, K3 = jnp.eye(2), jnp.zeros((3, 3, 2, 2))


def entry_points(name, value):
    """(prefix, call) for every entry point that receives hyper-parameter ``name`` = ``value``."""
    kw = {name: value}
    models = [
        lambda: M.get_model("naisnet_fc_tiny", **kw),
        lambda: M.get_model("naisnet_conv_tiny", **kw),
        lambda: M.NaisDenseBlock(4, **kw),
        lambda: M.NaisConvBlock(4, **kw),
    ]
    if name == "eps":
        core = [
            lambda: M.get_model("resnet_sh_stable", eps=value),
            lambda: nj.project_fc(R2, eps=value),
            lambda: nj.project_conv(K3, jnp.zeros(2), eps=value, eta=0.6),
            lambda: nj.fc_delta(value),
            lambda: nj.stability_projection(eps=value),
            lambda: nj.fc_state_matrix(R2, value),
        ]
    elif name == "h":
        core = [
            lambda: M.get_model("resnet_sh", h=value),
            lambda: conv_inf_norm_bound(K3, h=value),
            lambda: nj.fc_step(jnp.zeros((1, 2)), 0.0, -R2, h=value),
            lambda: nj.conv_step(jnp.zeros((1, 4, 4, 2)), 0.0, K3, h=value),
            lambda: unroll_tied(dense_op, jnp.zeros((1, 2)), jnp.zeros((1, 2)), -R2, steps=2, h=value),
        ]
    else:  # eta, with eps = 0.01 (the conv models only)
        models = models[1::2]
        core = [
            lambda: nj.project_conv(K3, jnp.zeros(2), eps=0.01, eta=value),
            lambda: nj.stability_projection(eps=0.01, eta=value),
        ]
    yield from (("", call) for call in models + core)
    yield "config.", lambda: train.validate_config(config(**({"eps": 0.01} if name == "eta" else {}), **kw))
    yield "checkpoint metadata: ", lambda: metadata(**kw)


@pytest.mark.parametrize(
    "name, value, check",
    [
        ("eps", 0.7, check_eps),
        ("eps", 1e-8, check_eps),
        ("eps", math.nan, check_eps),
        ("eps", "0.1", check_eps),
        ("h", 1.5, check_step_size),
        ("h", 0.0, check_step_size),
        ("h", True, check_step_size),
        ("eta", 0.005, lambda eta: check_eta(eta, 0.01)),
    ],
)
def test_a_bad_hyper_parameter_gets_one_message_from_one_function_everywhere(name, value, check):
    expected, origin = reference(check, value)
    assert expected.startswith(f"{name}={value!r} ")
    for prefix, call in entry_points(name, value):
        assert message_of(call) == (prefix + expected, origin)


def test_a_bad_activation_gets_one_message_everywhere():
    expected, origin = reference(check_activation, "gelu")
    x, A = jnp.zeros((1, 2)), -jnp.eye(2)
    for call in [
        lambda: M.get_model("naisnet_fc_tiny", activation="gelu"),
        lambda: M.ResNetSH(activation="gelu"),
        lambda: M.NaisConvBlock(4, activation="gelu"),
        lambda: nj.fc_step(x, 0.0, A, activation="gelu"),
        lambda: nj.activation_slope("gelu", x),
        lambda: unroll_tied(dense_op, x, x, A, steps=2, activation="gelu"),
    ]:
        assert message_of(call) == (expected, origin)


@pytest.mark.parametrize("shape", [(4, 4, 2, 2), (3, 5, 2, 2), (3, 3, 2, 3), (3, 3, 2)])
def test_a_bad_kernel_shape_gets_one_message_everywhere(shape):
    expected, origin = reference(check_kernel_shape, shape)
    K = np.zeros(shape)
    calls = [
        lambda: nj.conv_step(jnp.zeros((1, 4, 4, shape[-1])), 0.0, jnp.asarray(K)),
        lambda: nj.project_conv(jnp.asarray(K), jnp.zeros(shape[-1:]), eps=0.1, eta=0.5),
        lambda: nj.conv_state_kernel(jnp.asarray(K), jnp.zeros(shape[-1:])),
        lambda: gershgorin(K),
        lambda: conv_inf_norm_bound(K),
    ]
    if len(shape) == 4:
        calls.append(lambda: fft_conv_spectrum(K, (5, 5)))
        if shape[2] == shape[3]:  # a general conv operator may change the width: same check, one rule less
            calls.append(lambda: conv_operator(K, (5, 5)))
    for call in calls:
        assert message_of(call) == (expected, origin)


@pytest.mark.parametrize("value", [0, -3, 2.5, True, None])
def test_a_bad_count_gets_one_message_everywhere(value):
    def tail(name):
        return reference(checks.check_int, name, value)

    assert message_of(lambda: M.NaisNetFC(steps=value)) == tail("steps")
    assert message_of(lambda: M.NaisConvBlock(4, max_steps=value)) == tail("max_steps")
    assert message_of(lambda: nj.unroll(lambda x: x, jnp.zeros(2), steps=value)) == tail("steps")
    assert message_of(lambda: AuditOptions(samples=value)) == tail("samples")
    assert message_of(lambda: train.validate_config(config(batch_size=value))) == tail("config.batch_size")
    message, origin = tail("num_classes")
    assert message_of(lambda: metadata(num_classes=value)) == ("checkpoint metadata: " + message, origin)


def test_the_verify_command_line_uses_the_audit_options_check(capsys):
    message, _ = reference(checks.check_int, "--samples", 0)
    with pytest.raises(SystemExit) as info:
        verify_cli.main(["/nonexistent", "--samples", "0"])
    assert info.value.code == 2 and capsys.readouterr().err.strip().endswith(message)


def test_non_finite_values_get_one_message_everywhere():
    R = jnp.array([[1.0, jnp.nan], [0.0, 1.0]], jnp.float32)
    message, origin = message_of(lambda: nj.project_fc(R, eps=0.1))
    assert origin == ("checks.py", "check_finite") and message.startswith("R has 1 non-finite entries (NaN or inf)")
    model = M.NaisNetFCTiny()
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 5)))
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v.at[0, 0].set(jnp.inf) if jax.tree_util.keystr(p).endswith("['R']") else v, variables
    )
    message, origin = message_of(lambda: audit_model(model, variables, inputs=jnp.zeros((1, 5))))
    assert origin == ("checks.py", "check_finite")
    assert message.startswith(
        "variables has 1 non-finite entries (NaN or inf): variables['params']['block']['R'] (1 of "
    )
