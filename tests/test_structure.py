"""How the code is put together: short functions, and no state that a traced program reads from
where it was traced (the BatchNorm axis is a model field; the kernels' interpreter is a policy
field, tested in ``tests/test_conv_kernels.py``)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from naisnet_jax import models as M
from naisnet_jax.models.layers import BN_MOMENTUM

REPO = pathlib.Path(__file__).resolve().parents[1]
#: The most lines a function of the package may span (its signature, docstring and body).
MAX_LINES = 80
#: Modules whose functions the length rule leaves to their own restructuring (none left).
LENGTH_EXEMPT_MODULES: set[str] = set()


def is_kernel_body(path: pathlib.Path, node: ast.FunctionDef) -> bool:
    """A Pallas kernel body: a function of ``src/naisnet_jax/kernels/`` whose name ends in
    ``_kernel`` (the convention every engine follows for what it hands to ``pallas_call`` or to
    Mosaic GPU). A kernel is one program's straight-line code; splitting it would only hide
    its schedule."""
    return path.parent.name == "kernels" and node.name.endswith("_kernel")


def lengths_in(path: pathlib.Path, source: str) -> list[tuple[int, str]]:
    """``(lines, "path:name")`` of every function in ``source`` (the file at ``path``, relative to
    the repository), nested ones too, the kernel bodies left out."""
    return [
        (node.end_lineno - node.lineno + 1, f"{path}:{node.name}")
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_kernel_body(path, node)
    ]


def function_lengths() -> list[tuple[int, str]]:
    """:func:`lengths_in` over ``src/`` and ``verify/``, the exempt modules left out."""
    out = []
    for root in (REPO / "src" / "naisnet_jax", REPO / "verify"):
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(REPO / "src" / "naisnet_jax" / "verify"):
                continue  # a link to verify/ in an editable install
            if path.parent.name == "naisnet_jax" and path.name in LENGTH_EXEMPT_MODULES:
                continue
            out += lengths_in(path.relative_to(REPO), path.read_text())
    return out


def test_no_function_is_longer_than_eighty_lines():
    long = sorted((n, name) for n, name in function_lengths() if n > MAX_LINES)
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_the_length_rule_has_teeth():
    """An 81-line function is counted as 81 lines, outside the kernels' folder and inside it; a
    nested ``*_kernel`` function is counted outside it and left out inside it. The walk over the
    package finds its functions (hundreds) and none of its kernel bodies."""
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    source = f'def big():\n    """doc"""\n{body}\n\ndef outer():\n    def big_kernel():\n        pass\n'
    models, kernels = pathlib.Path("src/naisnet_jax/models/m.py"), pathlib.Path("src/naisnet_jax/kernels/k.py")
    assert (81, f"{models}:big") in lengths_in(models, source)
    assert (2, f"{models}:big_kernel") in lengths_in(models, source)
    assert (81, f"{kernels}:big") in lengths_in(kernels, source)
    assert not any(name.endswith("big_kernel") for _, name in lengths_in(kernels, source))
    lengths = function_lengths()
    assert len(lengths) > 300
    names = {name for _, name in lengths}
    assert "src/naisnet_jax/models/nais.py:_unroll" in names and "verify/certify.py:_audit" in names
    assert not any(name.endswith(("_forward_kernel", "_backward_kernel")) for name in names)


# ------------------------------------------------------------------ BatchNorm across a mapped axis


def _conv_same(u: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Stride-1 SAME convolution, NHWC x HWIO, in float64 numpy loops."""
    kh, kw = kernel.shape[:2]
    p, q = kh // 2, kw // 2
    padded = np.pad(u, [(0, 0), (p, p), (q, q), (0, 0)])
    out = np.zeros(u.shape[:3] + (kernel.shape[-1],))
    for a in range(kh):
        for b in range(kw):
            window = padded[:, a : a + u.shape[1], b : b + u.shape[2], :]
            out += np.einsum("nhwi,io->nhwo", window, kernel[a, b])
    return out


@pytest.mark.parametrize("axis", [None, "shards"])
def test_batch_norm_takes_its_statistics_across_the_models_batch_axis(axis):
    """A conv NAIS block with a normalised drive, built with ``batch_axis`` and run in training
    under ``jax.vmap(axis_name=...)`` over two shards of a batch: its BatchNorm's running mean
    and variance are those of the whole batch's drive (numpy, float64), the same in both
    shards; built without it, each shard's are its own rows'."""
    rng = np.random.default_rng(0)
    u = rng.standard_normal((2, 3, 5, 5, 2))  # (shards, rows, H, W, C_in)
    block = M.NaisConvBlock(4, steps=2, normalize_drive=True, batch_axis=axis)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), block.init(jax.random.key(0), jnp.asarray(u[0])))

    def train_apply(x):
        _, updates = block.apply(variables, x, train=True, mutable=["batch_stats"])
        return updates["batch_stats"]["drive_norm"]

    stats = jax.vmap(train_apply, axis_name="shards")(jnp.asarray(u))
    D = np.asarray(variables["params"]["input"]["kernel"])
    drive = _conv_same(u.reshape(6, 5, 5, 2), D).reshape(2, 3 * 5 * 5, 4)  # no bias: BatchNorm's offset
    rows = drive.reshape(1, -1, 4) if axis else drive
    mean, var = rows.mean(axis=1), rows.var(axis=1)
    expected_mean = np.broadcast_to((1 - BN_MOMENTUM) * mean, (2, 4))
    expected_var = np.broadcast_to(BN_MOMENTUM + (1 - BN_MOMENTUM) * var, (2, 4))
    np.testing.assert_allclose(stats["mean"], expected_mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(stats["var"], expected_var, rtol=1e-10, atol=1e-12)
    if axis is None:  # the two shards' own statistics differ: the comparison can tell them apart
        assert np.ptp(np.asarray(stats["mean"]), axis=0).max() > 1e-3


def test_batch_axis_reaches_every_batch_norm_of_a_net():
    """A net hands ``batch_axis`` to its blocks (one field, passed down): the NAIS conv net's
    and the conv ResNet's blocks are built with it, and a bad value is refused, naming it."""
    x = jnp.zeros((2, 8, 8, 1))
    for name in ("naisnet_conv_tiny", "resnet_conv_tiny"):
        net = M.get_model(name, batch_axis="data")
        variables = net.init(jax.random.key(0), x)
        with pytest.raises(NameError, match="data"):  # training outside the mapped axis: unbound
            net.apply(variables, x, train=True, mutable=["batch_stats"])
        net.apply(variables, x, train=False)  # evaluation reads the running averages
    with pytest.raises(ValueError, match="batch_axis=''"):
        M.get_model("naisnet_conv_tiny", batch_axis="")


# ------------------------------------------------------------------ the initializer's threefry


def test_initializer_takes_the_gpu_threefry_kernel_in_its_own_lowering_only():
    """The compiled initializer's random draws lower to XLA's GPU threefry kernel (a custom call,
    lowered here for CUDA on any machine), while the process-wide option stays off: a plain
    lowering of the same function afterwards has the unrolled rounds, not the kernel. Its values
    are eager ``init``'s."""
    from naisnet_jax import train

    args = (M.get_model("naisnet_conv_tiny"), (8, 8, 1), 0.01, 0.9, False)
    text = train._lowered_initializer(*args, platforms=("cuda",)).as_text()
    assert "cu_threefry2x32_ffi" in text
    assert jax.config.jax_threefry_gpu_kernel_lowering is False
    plain = jax.jit(train._initializer(*args)).trace(jax.random.PRNGKey(0)).lower(lowering_platforms=("cuda",))
    assert "cu_threefry2x32_ffi" not in plain.as_text()
    compiled, _ = train._compiled_initializer(*args)(jax.random.PRNGKey(3))
    eager, _ = train._initializer(*args)(jax.random.PRNGKey(3))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), compiled, eager)
