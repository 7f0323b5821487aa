"""Algorithms 1 and 2: projections that keep NAIS blocks stable.

Both are pure pytree -> pytree functions, jittable, applied after every
optimiser update::

    params = optax.apply_updates(params, updates)
    params = project_params(params, eps=eps)

or, equivalently, as the *last* transformation of an optax chain::

    tx = optax.chain(optax.sgd(0.1, momentum=0.9), stability_projection(eps=eps))

State parameters are found by leaf name in any params pytree (dict,
``FrozenDict``, ``nnx.State``, ``nnx.Param``-boxed leaves): a leaf named
``"R"`` is a dense NAIS block's (Algorithm 1); a leaf named ``"state_kernel"``,
with the ``"delta"`` beside it if any, a convolutional one's (Algorithm 2).
Leading axes (untied weights: one set per step) are projected step by step.
The result always has the input's tree structure.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from naisnet_jax.cell import check_kernel_shape
from naisnet_jax.checks import check_bool, check_finite, check_number
from naisnet_jax.parametrize import centre_mask, check_eps, zero_delta

Array = jax.Array
FC_KEY = "R"
CONV_KERNEL_KEY = "state_kernel"
CONV_DELTA_KEY = "delta"


def fc_delta(eps: float, relaxed: bool = False) -> float:
    """Algorithm 1's bound on ``||R^T R||_F``: ``1 - 2 eps``, or ``2 (1 - eps)`` relaxed."""
    check_eps(eps)
    check_bool("relaxed", relaxed)
    return 2.0 * (1.0 - eps) if relaxed else 1.0 - 2.0 * eps


def check_eta(eta: float, eps: float, name: str = "eta") -> float:
    """``eta`` must lie in ``(eps, 1)`` (Algorithm 2's target for the centre taps)."""
    return check_number(name, eta, float(eps), 1.0, lo_open=True, hi_open=True, label="(eps, 1)")


# ------------------------------------------------- rounding-aware arithmetic
#
# The projections must land *every* finite input in their set, where the set
# is read in exact arithmetic on the values returned (the verifier checks the
# stored float32 numbers, not what a float32 computation of them says). So
# norms are computed on a power-of-two rescaled copy (no overflow or underflow,
# and the rescaling is exact), with sums in a fixed pairwise order, and every
# comparison and target uses a proven upper bound on the rounding error:
# a sum of ``m`` non-negative terms in any order is within ``(m - 1) u`` of
# exact, a pairwise sum within ``ceil(log2 m) u``, a dot product of length
# ``r`` within ``r u`` of ``|x| . |y|`` (``u`` the unit round-off). Feasible
# points whose membership is proven pass bit-exactly; points within rounding
# of the boundary are treated as infeasible and land a few ulps inside it.


def _unit_roundoff(dtype) -> float:
    return float(jnp.finfo(dtype).eps) / 2


def _gamma(k: int, dtype) -> float:
    """Standard rounding-error factor ``k u / (1 - k u)`` of ``dtype``."""
    ku = k * _unit_roundoff(dtype)
    return ku / (1 - ku)


def _round_down(value: float, dtype) -> float:
    """The largest ``dtype`` number ``<= value`` (as a Python float)."""
    x = np.asarray(value, dtype=dtype)
    if float(x) > value:
        x = np.nextafter(x, np.asarray(-np.inf, dtype))
    return float(x)


def _pow2(k: Array, dtype) -> Array:
    """Exact ``2**k`` for integer ``k`` in the normal range of ``dtype`` (built from bits)."""
    info = jnp.finfo(dtype)
    int_type = jnp.int32 if jnp.dtype(dtype).itemsize == 4 else jnp.int64
    bits = (k.astype(int_type) + (info.maxexp - 1)) << info.nmant
    return jax.lax.bitcast_convert_type(bits, dtype)


def _scale_pow2(x: Array, k: Array) -> Array:
    """``x * 2**k``, exact unless the result leaves the normal range; ``k`` is split in
    four so that every factor is a normal number for any exponent a float can have."""
    k = k.astype(jnp.int32)
    parts = [k // 4] * 3
    parts.append(k - 3 * (k // 4))
    for part in parts:
        x = x * _pow2(part, x.dtype)
    return x


def _exponent(peak: Array) -> Array:
    """``e`` with ``peak = f 2^e``, ``f`` in ``[1/2, 1)`` (``e = 0`` for ``peak = 0``)."""
    return jnp.frexp(peak)[1].astype(jnp.int32)


def _pairwise_sum(x: Array) -> tuple[Array, int]:
    """Sum over the last axis in a fixed pairwise order; returns ``(sum, depth)``.

    Plain-Python meaning: pad to a power of two with zeros, then repeat
    ``x = x[..., 0::2] + x[..., 1::2]`` until one entry is left; ``depth`` is
    the number of rounds (each a separate elementwise add, which XLA does not
    reassociate), so the sum of non-negative terms is within ``depth * u``.
    """
    size = x.shape[-1]
    depth = max(0, math.ceil(math.log2(size))) if size > 1 else 0
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 2**depth - size)])
    for _ in range(depth):
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0], depth


_FINITE_WHY = "; the projection needs finite values (under jax.jit it cannot check and returns NaN instead)"


def _nan_unless_finite(out: Array, *inputs: Array) -> Array:
    """Under ``jit`` a non-finite input gives an all-NaN output (never a finite guess)."""
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in inputs]))
    return jnp.where(ok, out, jnp.nan)


def _float_array(name: str, x: Any) -> Array:
    """``x`` as a JAX array of float32 or float64, the formats whose rounding the projections'
    bounds are proven for (a 16-bit float's unit round-off is too coarse for them)."""
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.float64):
        why = (
            " (keep the parameters in float32: a 16-bit copy of a projected one may round outside the set)"
            if jnp.issubdtype(x.dtype, jnp.floating)
            else ""
        )
        raise ValueError(f"{name} has dtype {x.dtype}; the projection needs float32 or float64{why}.")
    return x


def project_fc(R: Array, *, eps: float, relaxed: bool = False) -> Array:
    """Algorithm 1: project ``R`` onto ``{R : ||R^T R||_F <= delta}``.

    ``delta = 1 - 2 eps`` (default) puts every eigenvalue of
    ``I + h diag(s) A`` with ``A = -R^T R - eps I``, ``s in [s_min, 1]``,
    ``0 < h <= 1``, on the real interval ``[1 - h (1 - eps), 1 - h s_min eps]``
    (critically damped, monotone trajectories). ``relaxed=True`` uses
    ``delta = 2 (1 - eps)``: still stable for ReLU, but eigenvalues may be
    negative and trajectories may oscillate.

    Returns ``R`` itself when its membership is proven, otherwise
    ``c R`` with ``c > 0`` such that the returned values satisfy
    ``||R^T R||_F <= delta`` in exact arithmetic: ``R`` is first rescaled by
    the power of two of its largest entry (exact; no overflow at 1e38, no
    flush to zero of a reciprocal), and ``||R^T R||_F`` is bounded above with
    its rounding error, so the result sits a few ulps inside the boundary
    (relative ``~ r u ||(|R|^T |R|)||_F / ||R^T R||_F``, about 1e-4 for a
    float32 128 x 128 ``R``; 1e-13 in float64). Any finite input lands in the
    set with its direction kept. ``R`` may carry leading axes (per-step
    factors), projected one matrix at a time. Non-finite ``R`` raises
    ``ValueError`` outside ``jit``; under ``jit`` the output is NaN.
    """
    delta = fc_delta(eps, relaxed)
    R = _float_array("R", R)
    if R.ndim < 2:
        raise ValueError(f"R must have shape (..., r, n); got shape {R.shape}.")
    check_finite("R", R, _FINITE_WHY)
    return _project_fc(R, jnp.asarray(_round_down(delta, R.dtype), R.dtype))


@jax.jit
def _project_fc(R: Array, delta_low: Array) -> Array:
    """Body of :func:`project_fc` (one compiled program per shape, also when called eagerly);
    ``delta_low`` is the largest float ``<= delta``."""
    dtype = R.dtype
    r, n = R.shape[-2:]
    tiny = float(jnp.finfo(dtype).tiny)
    # R = 2^e U with the largest |U| in [1/2, 1): exact, overflow-free.
    e = _exponent(jnp.max(jnp.abs(R), axis=(-2, -1), keepdims=True))
    U = _scale_pow2(R, -e)
    hi = jax.lax.Precision.HIGHEST
    gram = jnp.einsum("...ri,...rj->...ij", U, U, precision=hi)
    gram_abs = jnp.einsum("...ri,...rj->...ij", jnp.abs(U), jnp.abs(U), precision=hi)
    flat = (*gram.shape[:-2], n * n)
    sq, depth = _pairwise_sum((gram * gram).reshape(flat))
    sq_abs, _ = _pairwise_sum((gram_abs * gram_abs).reshape(flat))
    # ||U^T U||_F (exact) <= ||fl(U^T U)||_F + gamma_r ||(|U|^T |U|)||_F, each Frobenius
    # norm computed within gamma_(depth + 3); the flush of tiny products adds at most
    # (r + 1) n^2 tiny. The last factor covers the rounding of this very expression.
    c_sum = 1 + _gamma(depth + 8, dtype)
    upper = (jnp.sqrt(sq) + 2 * _gamma(r + 2, dtype) * jnp.sqrt(sq_abs)) * c_sum + (r + 1) * n * n * tiny
    upper = upper[..., None, None]
    # ||R^T R||_F = 4^e ||U^T U||_F <= delta  <=>  ||U^T U||_F <= delta 4^-e
    feasible = upper <= _scale_pow2(jnp.full_like(upper, delta_low), -2 * e)
    # U s with s^2 upper (1 + slack) = delta_low: exact ||(U s)^T (U s)||_F <= delta even after
    # rounding U s, s and the quotient; the slack also keeps the result a fixed point.
    s = jnp.sqrt(delta_low / (upper * (1 + _gamma(4 * depth + 32, dtype))))
    out = jnp.where(feasible, R, U * s)
    return _nan_unless_finite(out, R)


def project_conv(kernel: Array, delta: Array, *, eps: float, eta: float) -> tuple[Array, Array]:
    """Algorithm 2: keep a convolutional state kernel inside its Gershgorin set.

    Per output channel ``c`` (``kernel`` is HWIO ``(k, k, C, C)``):

    1. ``delta_c <- clip(delta_c, -1 + eta, 1 - eta)``;
    2. the centre tap of channel ``c``'s own filter, ``kernel[p, p, c, c]``,
       is set to ``-1 - delta_c``;
    3. if the absolute sum of every *other* tap feeding channel ``c`` (all
       positions of all input channels) exceeds ``1 - eps - |delta_c|``,
       those taps are scaled down so the sum equals it.

    Afterwards every Gershgorin disc of the dense convolution operator ``A``
    lies in ``{z : |z + 1| <= 1 - eps}`` and ``||I + h A||_inf <= 1 - h eps``
    for ``0 < h <= 1``. Leading axes (per-step kernels) are allowed, with
    ``delta`` of shape ``(..., C)``. Returns ``(kernel, delta)``.

    Step 3 holds in exact arithmetic on the returned values: the sums are
    bounded with their rounding error on a power-of-two rescaled copy, so any
    finite kernel (taps of 1e-30 or 3e37 alike) is rescaled with its
    direction kept, never zeroed by an overflowing sum; a channel within
    rounding of its budget is scaled to a few ulps inside it (relative
    ``~ log2(k^2 C) u``). Non-finite input raises ``ValueError`` outside
    ``jit``; under ``jit`` the output is NaN.
    """
    check_eps(eps)
    check_eta(eta, eps)
    kernel, delta = _float_array("kernel", kernel), _float_array("delta", delta)
    check_kernel_shape(kernel.shape)
    c = kernel.shape[-1]
    if delta.shape != kernel.shape[:-4] + (c,):
        raise ValueError(
            f"delta must have shape {kernel.shape[:-4] + (c,)} for a state kernel of "
            f"shape {kernel.shape}; got {delta.shape}."
        )
    check_finite("kernel", kernel, _FINITE_WHY)
    check_finite("delta", delta, _FINITE_WHY)
    dtype = kernel.dtype
    return _project_conv(
        kernel,
        delta,
        jnp.asarray(_round_down(1.0 - eps, dtype), dtype),
        jnp.asarray(_round_down(1.0 - eta, dtype), dtype),
    )


@jax.jit
def _project_conv(kernel: Array, delta: Array, one_minus_eps: Array, one_minus_eta: Array) -> tuple[Array, Array]:
    """Body of :func:`project_conv` (one compiled program per shape, also when called eagerly);
    ``one_minus_*`` are the largest floats ``<= 1 - eps``, ``<= 1 - eta``."""
    dtype = kernel.dtype
    u, tiny = _unit_roundoff(dtype), float(jnp.finfo(dtype).tiny)
    delta = jnp.clip(delta, -one_minus_eta, one_minus_eta).astype(dtype)
    mask = centre_mask(kernel.shape, dtype)
    others = kernel * (1 - mask)  # exact: the centre taps become 0
    k, c = kernel.shape[-4], kernel.shape[-1]
    m = k * k * c
    # (..., k, k, C_in, C_out) -> (..., C_out, k k C_in): one row per output channel
    rows = jnp.moveaxis(jnp.abs(others).reshape(kernel.shape[:-4] + (m, c)), -1, -2)
    e = _exponent(jnp.max(rows, axis=-1))  # (..., C)
    radius, depth = _pairwise_sum(_scale_pow2(rows, -e[..., None]))
    upper = radius * (1 + _gamma(depth + 4, dtype)) + m * tiny  # >= exact radius / 2^e
    # budget = 1 - eps - |delta| (exact) >= fl(round_down(1 - eps) - |delta|) - 4u
    budget = jnp.maximum((one_minus_eps - jnp.abs(delta)) - 4 * u, 0).astype(dtype)
    feasible = upper <= _scale_pow2(budget, -e)
    scale = budget / (upper * (1 + _gamma(2 * depth + 8, dtype)))  # applies to the rescaled taps
    expand = lambda x: x[..., None, None, None, :]  # noqa: E731 - (..., C) -> tap axes
    rescaled = _scale_pow2(others, -expand(e)) * expand(scale).astype(dtype)
    others = jnp.where(expand(feasible), kernel, rescaled)  # feasible taps pass bit-exactly
    centre = expand(-1.0 - delta).astype(dtype)
    out = jnp.where(mask > 0, centre, others)
    return _nan_unless_finite(out, kernel, delta), delta


# --------------------------------------------------------------------------- trees
#
# The functions below walk any pytree (dict, FrozenDict, nnx.State, leaves wrapped
# in nnx.Param or nn.Partitioned, NamedTuples, ...) with jax.tree_util's path
# functions and never rebuild a container by hand, so their output has exactly
# the input's tree structure.

_STATE_NAMES = (FC_KEY, CONV_KERNEL_KEY, CONV_DELTA_KEY)
_WRAPPER_ATTRS = ("value", "raw_value")  # nnx.Variable / nn.Partitioned hold the array here


def _entry_name(entry) -> str:
    """The name a key-path entry gives its child: dict key, attribute, or index."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _leaf_names(path) -> tuple[str, ...]:
    """A leaf's path as names, without the trailing ``.value`` of boxed leaves
    (``nnx.Param``, ``nn.Partitioned``): ``("block", "R")`` for both a plain
    ``{"block": {"R": array}}`` and ``{"block": {"R": nnx.Param(array)}}``."""
    path = list(path)
    while path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name in _WRAPPER_ATTRS:
        path.pop()
    return tuple(_entry_name(e) for e in path)


def _state_leaves(tree: Any):
    """``(leaves, treedef, blocks)``: the flattened tree and, per NAIS block
    (keyed by its parent path, in flattening order), the leaf index of each
    state parameter it holds, e.g. ``{("block",): {"R": 3}}``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    blocks: dict[tuple[str, ...], dict[str, int]] = {}
    named = [(_leaf_names(path), i) for i, (path, _) in enumerate(flat)]
    for path, _ in flat:  # a state leaf given as a list of numbers would be skipped, unprojected
        k = len(path)
        while k and isinstance(path[k - 1], jax.tree_util.SequenceKey):
            k -= 1
        if 0 < k < len(path) and _entry_name(path[k - 1]) in _STATE_NAMES:
            raise TypeError(
                f"params{jax.tree_util.keystr(path[:k])} is a nested list or tuple; a NAIS block's "
                f"{_entry_name(path[k - 1])!r} must be one array (jnp.asarray it)."
            )
    parents = {names[:-1] for names, _ in named if names and names[-1] in (FC_KEY, CONV_KERNEL_KEY)}
    for names, i in named:
        if names and names[-1] in _STATE_NAMES and names[:-1] in parents:
            blocks.setdefault(names[:-1], {})[names[-1]] = i
    return [leaf for _, leaf in flat], treedef, blocks


def _conv_group(leaves: list, block: dict[str, int]):
    """The key under which a conv block's projection is batched with its like: the shapes
    and dtypes of its kernel and delta (``None`` for a block without delta)."""
    spec = lambda i: (tuple(jnp.shape(leaves[i])), jnp.result_type(leaves[i]))  # noqa: E731
    delta = block.get(CONV_DELTA_KEY)
    return spec(block[CONV_KERNEL_KEY]), None if delta is None else spec(delta)


def _project_conv_group(leaves: list, members: list[dict[str, int]], eps: float, eta: float) -> dict[int, Any]:
    """Algorithm 2 on the stacked kernels (and deltas, else ``delta = 0``) of like blocks: one
    projection for a stage's blocks instead of one per block (on a GPU, a handful of kernels
    instead of a handful per block). Every block's result is the one it gets on its own: the
    projection acts on each kernel and channel separately."""
    for block in members:  # each block's own shape in the error, not the stack's
        check_kernel_shape(jnp.shape(leaves[block[CONV_KERNEL_KEY]]))
    kernels = jnp.stack([jnp.asarray(leaves[b[CONV_KERNEL_KEY]]) for b in members])
    has_delta = CONV_DELTA_KEY in members[0]
    if has_delta:
        deltas = jnp.stack([jnp.asarray(leaves[b[CONV_DELTA_KEY]]) for b in members])
    else:
        deltas = zero_delta(kernels.shape, kernels.dtype)
    kernels, deltas = project_conv(kernels, deltas, eps=eps, eta=eta)
    out = {}
    for i, block in enumerate(members):
        out[block[CONV_KERNEL_KEY]] = kernels[i]
        if has_delta:
            out[block[CONV_DELTA_KEY]] = deltas[i]
    return out


def _projected_leaves(tree: Any, eps: float, eta: float, relaxed: bool):
    """``(leaves, treedef, projected)``; ``projected`` maps leaf index -> new value.
    Algorithm 1 per ``"R"``; Algorithm 2 once per group of like conv blocks
    (:func:`_project_conv_group`)."""
    leaves, treedef, blocks = _state_leaves(tree)
    projected: dict[int, Any] = {}
    groups: dict[Any, list[dict[str, int]]] = {}
    for block in blocks.values():
        if FC_KEY in block:
            i = block[FC_KEY]
            projected[i] = project_fc(jnp.asarray(leaves[i]), eps=eps, relaxed=relaxed)
        if CONV_KERNEL_KEY in block:
            groups.setdefault(_conv_group(leaves, block), []).append(block)
    for members in groups.values():
        projected.update(_project_conv_group(leaves, members, eps, eta))
    return leaves, treedef, projected


def project_params(params: Any, *, eps: float, eta: float = 0.5, relaxed: bool = False) -> Any:
    """Project every NAIS block's state parameters in a params pytree.

    Blocks are found by leaf name: a leaf named ``"R"`` gets Algorithm 1; a
    leaf named ``"state_kernel"`` gets Algorithm 2 together with the
    ``"delta"`` beside it (same parent path), or with ``delta = 0`` when the
    block has none. Conv blocks whose kernels (and deltas) share shape and dtype are
    projected in one call on their stack (a stage's blocks: a few GPU kernels in the
    training step instead of a few per block), each with exactly its own result. Every
    other leaf is returned as is, and the result has exactly the structure of
    ``params``: a dict, a ``FrozenDict``, an ``nnx.State``, leaves boxed in
    ``nnx.Param``, ...
    """
    check_eps(eps)
    check_eta(eta, eps)
    leaves, treedef, projected = _projected_leaves(params, eps, eta, relaxed)
    return jax.tree_util.tree_unflatten(treedef, [projected.get(i, leaf) for i, leaf in enumerate(leaves)])


def iter_state_blocks(params: Any):
    """Yield ``(path, node)`` for every NAIS block in a params pytree.

    ``path`` is the tuple of names leading to the block (the parent of its
    ``"R"`` or ``"state_kernel"`` leaf); ``node`` is a plain nested dict of the
    block's sub-tree with unboxed array leaves (``node["R"]``, or
    ``node["state_kernel"]`` and maybe ``node["delta"]``, and the block's
    other parameters such as ``node["input"]["kernel"]``), whatever container
    ``params`` is. Plain-Python meaning::

        for path in parents_of_state_leaves(params):   # flattening order
            yield path, {rest: leaf for (path + rest), leaf in leaves(params)}
    """
    flat = [(_leaf_names(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
    _, _, blocks = _state_leaves(params)
    for parent in blocks:
        node: dict = {}
        for names, leaf in flat:
            if len(names) > len(parent) and names[: len(parent)] == parent:
                *inner, last = names[len(parent) :]
                target = node
                for name in inner:
                    target = target.setdefault(name, {})
                target[last] = leaf
        yield parent, node


def count_projected_blocks(params: Any) -> int:
    """Number of NAIS blocks :func:`project_params` would project."""
    return len(_state_leaves(params)[2])


class NoNaisBlockWarning(UserWarning):
    """:func:`stability_projection` was initialised on parameters that hold no NAIS block, so it
    projects nothing."""


def stability_projection(
    *, eps: float, eta: float = 0.5, relaxed: bool = False, expect_blocks: bool = True
) -> optax.GradientTransformation:
    """Optax transform that makes ``params + updates`` satisfy Algorithms 1 and 2.

    The returned updates are ``project_params(params + updates) - params`` on
    the state parameters and the incoming updates, untouched, everywhere else,
    so ``optax.apply_updates(params, updates)`` lands exactly on the projected
    parameters. It reads ``params``, so it must be the **last** transformation
    of a chain (anything after it would move the parameters off the set).
    Works on any params pytree (dict, ``FrozenDict``, ``nnx.State`` inside
    ``nnx.Optimizer``); the updates keep their structure.

    Blocks are found by leaf name (``"R"``, ``"state_kernel"``; see the module). Parameters with
    none pass through unchanged, and ``init(params)`` says so once with a :class:`NoNaisBlockWarning`
    (a model whose state parameter is named otherwise would train unprojected). Pass
    ``expect_blocks=False`` where no block is the intent: one optimiser shared by NAIS-Nets and
    the plain ResNet baselines.
    """
    fc_delta(eps, relaxed)
    check_eta(eta, eps)
    check_bool("expect_blocks", expect_blocks)

    def init_fn(params):
        if expect_blocks and params is not None and count_projected_blocks(params) == 0:
            warnings.warn(
                f"stability_projection: the parameters hold no NAIS block (no leaf named {FC_KEY!r} or "
                f"{CONV_KERNEL_KEY!r}), so it projects nothing; pass expect_blocks=False if that is meant "
                "(a baseline without the stable parametrisation).",
                NoNaisBlockWarning,
                stacklevel=2,
            )
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("stability_projection needs params: call tx.update(updates, state, params).")
        u_leaves, u_def = jax.tree_util.tree_flatten(updates)
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        if len(u_leaves) != len(p_leaves):
            raise ValueError(
                f"stability_projection: updates and params differ in structure "
                f"({len(u_leaves)} vs {len(p_leaves)} leaves): {u_def} vs {p_def}."
            )
        new_params = optax.apply_updates(params, updates)
        leaves, _, projected = _projected_leaves(new_params, eps, eta, relaxed)
        # Only the state parameters change; elsewhere updates pass through
        # untouched (no params + u - params round-off).
        out = [(projected[i] - p_leaves[i]).astype(u.dtype) if i in projected else u for i, u in enumerate(u_leaves)]
        return jax.tree_util.tree_unflatten(u_def, out), state

    return optax.GradientTransformation(init_fn, update_fn)
