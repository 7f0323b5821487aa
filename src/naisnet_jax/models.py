"""Flax modules of NAIS-Net and of the paper's ResNet baselines.

The modules own parameters and call the pure core; the maths lives in
:mod:`naisnet_jax.cell`, :mod:`naisnet_jax.parametrize` and
:mod:`naisnet_jax.unroll`. Conventions: batch first, row vectors, NHWC images.

A NAIS block maps its input ``u`` to the state ``x_K`` of

    x_0 = 0,    x_{k+1} = x_k + h * act(x_k @ A.T + drive),

with ``A = -R.T R - eps I`` (dense; drive ``u @ B.T + b``) or a convolution
with centre taps ``-1 - delta`` (conv; drive ``conv(U, D) + E``). The drive is
computed once per block. ``initial_state="input"`` starts a block at ``x_0 = u``
instead of the paper's ``x_0 = 0`` (see :func:`initial_state_x0`); a block with
one step and ``x_0 = 0`` warns with :class:`StateUnusedWarning`, since
``x_1 = h act(drive)`` never uses its state matrix. State parameters carry the names that
:func:`naisnet_jax.projection.project_params` looks for (``"R"``,
``"state_kernel"``, ``"delta"``), so Algorithms 1 and 2 find every block.

Every model is called as ``model.apply(variables, x, train=..., return_aux=...)``
and returns ``logits`` or ``(logits, aux)``; ``aux`` holds

- ``"trajectory"``: FC models ``(K, batch, n)``, the states ``x_1 .. x_K``;
  conv models a tuple with one ``(K, batch, H, W, C)`` array per block;
- ``"step_logits"`` (FC models only): the classifier applied to every state,
  ``(K, batch, num_classes)``; its last entry equals ``logits``;
- ``"depth"``: int32 ``(num_blocks, batch)``, the steps each pattern took in
  each block (the constant ``K`` unless ``adaptive_tol`` is set).

With ``adaptive_tol`` set, ``K`` above is ``max_steps`` and states after a
pattern stops are frozen copies. BatchNorm statistics live in the
``"batch_stats"`` collection (``mutable=["batch_stats"]`` when ``train=True``).

Performance options of the NAIS blocks and nets (``PERF_OPTIONS``) change speed,
memory or compile time, never the maths:

- ``scan_unroll``: ``lax.scan``'s ``unroll`` for a block's K steps (an int, or
  ``True`` for all of them);
- ``remat``: ``"none"``, ``"block"`` (a block's K steps are recomputed in the
  backward pass; only its input is kept) or ``"step"`` (each step's internals
  are recomputed; the K states are kept);
- ``block_vjp``: ``"autodiff"``, or a tied block's hand-written VJP that
  computes the state weight's gradient with one operation over the K states
  stacked on the batch axis (:mod:`naisnet_jax.block_vjp`), keeping the states
  (``"stacked"``) or recomputing them (``"stacked_recompute"``); ``"fused"``
  runs a tied block's K steps as one GPU kernel forward and one backward
  (conv blocks: :mod:`naisnet_jax.fused_block`; dense blocks up to 128 units:
  :mod:`naisnet_jax.fused_dense`; Pallas, float32, CUDA) and is ``"stacked"``
  wherever those kernels do not run (CPU, TPU, other dtypes, wider blocks);
- ``check_every``, ``compact``: adaptive depth at inference (``adaptive_tol``
  set, ``train=False``) tests for convergence once per ``check_every`` steps and,
  with ``compact``, moves the running patterns into smaller buffers (see
  :func:`naisnet_jax.unroll.unroll_adaptive`); depths and states are unchanged;
- ``stream_slots``: adaptive depth at inference on a batch larger than this runs the
  batch as a stream (:func:`naisnet_jax.unroll.unroll_adaptive_stream`): ``stream_slots``
  patterns in flight, each finished one replaced by the next of the batch, so the work
  follows the mean depth, not the deepest pattern of each group. To score a whole test
  set, apply the net to all of it at once with, say, ``stream_slots=1024``; the outputs
  and depths are those of the plain per-pattern loop (``compact`` then plays no part);
- ``dtype``: the compute dtype (``"bfloat16"``, ...; ``None`` keeps the inputs'
  dtype). Parameters stay float32, pooling and the classifier compute in
  float32; the projections and the verifier never see the compute dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from naisnet_jax import probe
from naisnet_jax.block_vjp import conv_op, dense_op, side_stream_conv, unroll_tied
from naisnet_jax.cell import ACTIVATIONS, check_activation, check_step_size, conv_step, fc_step
from naisnet_jax.checks import check_bool, check_choice, check_int, check_positive
from naisnet_jax.fused_block import unroll_tied_conv
from naisnet_jax.fused_dense import unroll_tied_dense
from naisnet_jax.parametrize import check_eps, conv_state_kernel, fc_state_matrix, zero_delta
from naisnet_jax.projection import check_eta, project_conv, project_fc
from naisnet_jax.unroll import (
    check_scan_unroll,
    unroll,
    unroll_adaptive,
    unroll_adaptive_bounded,
    unroll_adaptive_stream,
)

Array = jax.Array
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5
PARAM_DTYPE = jnp.float32  # as Flax's own layers, also when x64 is enabled


# ----------------------------------------------------- hyper-parameters, once
#
# Every hyper-parameter is a field of exactly one option class below, with its
# default, its meaning and its check; blocks and networks inherit the classes,
# so adding an option means editing one class. The fields are keyword-only
# (``NaisDenseBlock(4, h=0.5)``); a network hands its blocks their options with
# :func:`options_of`. ConvOptions restates two defaults (the paper's CIFAR
# blocks: ``steps=10``, ``activation="relu"``) and nothing else.

INITIAL_STATES = ("zero", "input")
REMAT = ("none", "block", "step")
BLOCK_VJP = {"autodiff": None, "stacked": "store", "stacked_recompute": "recompute", "fused": "store"}
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")
# Options that change speed or memory, never the maths (``dtype`` changes the rounding only).
PERF_OPTIONS = ("scan_unroll", "remat", "block_vjp", "dtype", "check_every", "compact", "stream_slots")
#: The performance options that change neither the parameters nor the values computed (all but
#: the compute ``dtype``): a run or a sweep may resume with others (e.g. on another machine).
SPEED_OPTIONS = tuple(o for o in PERF_OPTIONS if o != "dtype")


def without_speed_options(kwargs) -> dict:
    """``kwargs`` (model options) less :data:`SPEED_OPTIONS`: what a resumed run must match."""
    return {k: v for k, v in dict(kwargs or {}).items() if k not in SPEED_OPTIONS}


class StateUnusedWarning(UserWarning):
    """A NAIS block with one step and ``x_0 = 0`` has a state matrix that never acts."""


class HyperParameters(nn.Module, kw_only=True):
    """Root of the option classes. Each class checks the fields it declares in its own
    ``_check_fields`` (a :func:`flax.linen.nowrap` method); construction runs them all, base
    classes first (so ``eps`` is checked before ``eta``, which depends on it)."""

    def __post_init__(self):
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check_fields")
            if check is not None:
                check(self)
        super().__post_init__()


def options_of(module: nn.Module, options: type) -> dict:
    """The values on ``module`` of every field that the option class ``options`` declares
    (inherited ones included), as keyword arguments for a block of that class."""
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(options) if f.name not in ("parent", "name")}


class Classifier(HyperParameters, kw_only=True):
    """``num_classes``: outputs of the final Dense layer (``"classifier"``)."""

    num_classes: int = 10

    @nn.nowrap
    def _check_fields(self):
        check_int("num_classes", self.num_classes)


class ComputeDtype(HyperParameters, kw_only=True):
    """``dtype``: the compute dtype (``"bfloat16"``, ...; ``None`` keeps the inputs' dtype).
    Parameters stay float32, pooling and the classifier compute in float32."""

    dtype: str | None = None

    @nn.nowrap
    def _check_fields(self):
        check_choice(
            "dtype",
            self.dtype,
            (None,) + COMPUTE_DTYPES,
            why="; None keeps the inputs' dtype, and parameters stay float32 whatever it is",
        )


class KernelSize(HyperParameters, kw_only=True):
    """``kernel_size``: the odd side ``k = 2p+1`` of the ``k x k`` convolutions."""

    kernel_size: int = 3

    @nn.nowrap
    def _check_fields(self):
        check_int("kernel_size", self.kernel_size)
        if self.kernel_size % 2 == 0:
            raise ValueError(
                f"kernel_size={self.kernel_size} is even; the convolutions need an odd size 2p+1 "
                f"(a centre tap for every channel, and SAME padding that keeps the resolution)."
            )


class Stages(HyperParameters, kw_only=True):
    """``stage_sizes[i]`` blocks of ``filters[i]`` channels in stage ``i`` (the paper's CIFAR
    nets: 3 stages of 18 blocks, 16/32/64 filters)."""

    stage_sizes: Sequence[int] = (18, 18, 18)
    filters: Sequence[int] = (16, 32, 64)

    @nn.nowrap
    def _check_fields(self):
        if len(self.stage_sizes) == 0 or len(self.stage_sizes) != len(self.filters):
            raise ValueError(
                f"stage_sizes={tuple(self.stage_sizes)} and filters={tuple(self.filters)} must be "
                f"non-empty and of equal length."
            )
        for i, (size, width) in enumerate(zip(self.stage_sizes, self.filters)):
            check_int(f"stage_sizes[{i}]", size)
            check_int(f"filters[{i}]", width)


class StepOptions(HyperParameters, kw_only=True):
    """One residual step ``x + h act(x A^T + drive)``: step size ``h`` in (0, 1], stability
    margin ``eps`` in ``[EPS_MIN, 0.5)`` (``A = -R^T R - eps I``), ``activation`` ("tanh", "relu")."""

    h: float = 1.0
    eps: float = 0.01
    activation: str = "tanh"

    @nn.nowrap
    def _check_fields(self):
        check_step_size(self.h)
        check_eps(self.eps)
        check_activation(self.activation)


class NaisOptions(ComputeDtype, StepOptions, kw_only=True):
    """Options of every NAIS block (and net, which hands them to its blocks).

    - ``steps``: K, the steps a block unrolls; ``untied``: per-step weights ``A(k), B(k), b(k)``.
    - ``initial_state``: ``"zero"`` (the paper's ``x_0 = 0``) or ``"input"`` (``x_0 = u``).
    - ``adaptive_tol``: ``None`` (fixed depth K) or the tolerance at which a pattern stops,
      after at most ``max_steps`` steps (tied weights only).
    - performance (:data:`PERF_OPTIONS`, see the module docstring): ``scan_unroll``, ``remat``,
      ``block_vjp``, ``check_every``, ``compact``, ``stream_slots`` and ``dtype``.
    """

    steps: int = 30
    initial_state: str = "zero"
    untied: bool = False
    adaptive_tol: float | None = None
    max_steps: int = 100
    scan_unroll: int | bool = 1
    remat: str = "none"
    block_vjp: str = "autodiff"
    check_every: int = 1
    compact: bool = False
    stream_slots: int | None = None

    @nn.nowrap
    def _check_fields(self):
        check_int("steps", self.steps)
        check_int("max_steps", self.max_steps)
        check_choice(
            "initial_state",
            self.initial_state,
            INITIAL_STATES,
            why=": 'zero' is the paper's x_0 = 0, 'input' starts the block at its input u",
        )
        check_bool("untied", self.untied)
        if self.adaptive_tol is not None:
            check_positive("adaptive_tol", self.adaptive_tol)
            if self.untied:
                raise ValueError(
                    f"adaptive_tol={self.adaptive_tol!r} with untied=True: pattern-dependent depth "
                    f"needs tied weights (an untied block has parameters for `steps` steps only)."
                )
        check_scan_unroll(self.scan_unroll)
        check_int("check_every", self.check_every)
        check_bool("compact", self.compact)
        if self.stream_slots is not None:
            check_int("stream_slots", self.stream_slots)
        check_choice("remat", self.remat, REMAT)
        check_choice("block_vjp", self.block_vjp, BLOCK_VJP)
        if self.block_vjp == "autodiff":
            return
        if self.untied or self.adaptive_tol is not None:
            raise ValueError(
                f"block_vjp={self.block_vjp!r} needs a tied block of fixed depth; got "
                f"untied={self.untied}, adaptive_tol={self.adaptive_tol!r}. Use block_vjp='autodiff'."
            )
        if self.remat == "step":
            raise ValueError(
                f"remat='step' with block_vjp={self.block_vjp!r}: the custom VJP chooses its own "
                f"residuals; use block_vjp='stacked_recompute' to recompute the steps."
            )

    @nn.nowrap
    def _unroll(self, step, x0, *, steps, xs, train, trajectory, tied):
        """:func:`_unroll_block` with this block's depth, start and performance options."""
        return _unroll_block(
            step,
            x0,
            steps=steps,
            xs=xs,
            adaptive_tol=self.adaptive_tol,
            max_steps=self.max_steps,
            train=train,
            trajectory=trajectory,
            scan_unroll=self.scan_unroll,
            remat=self.remat,
            block_vjp=self.block_vjp,
            tied=tied,
            check_every=self.check_every,
            compact=self.compact,
            stream_slots=self.stream_slots,
            zero_start=self.initial_state == "zero",
        )

    @nn.nowrap
    def _warn_if_state_unused(self):
        """A block (not a net: its blocks warn when they are built) with one step from ``x_0 = 0``."""
        most = self.steps if self.adaptive_tol is None else self.max_steps
        if most == 1 and self.initial_state == "zero":
            warnings.warn(
                "a NAIS block with steps=1 and initial_state='zero' computes x_1 = h act(drive): its "
                "state matrix / kernel never acts and gets an exactly zero gradient, so the block is "
                "a plain layer. Use initial_state='input' (x_0 = u) or steps > 1 to use it.",
                StateUnusedWarning,
                stacklevel=6,
            )


class DenseOptions(NaisOptions, kw_only=True):
    """Dense NAIS options: ``rank`` of ``R`` (``(rank, n)``, ``None`` for ``n``; at most the
    ``features`` that every dense block and net declares)."""

    rank: int | None = None

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        if self.rank is None:
            return
        check_int("rank", self.rank)
        if self.rank > self.features:
            raise ValueError(f"rank={self.rank} exceeds features={self.features}; R is (rank, n) with rank <= n.")


DRIVE_INITS = ("lecun", "he")


class ConvOptions(KernelSize, NaisOptions, kw_only=True):
    """Conv NAIS options: Algorithm 2's ``eta`` in ``(eps, 1)``; ``learn_delta`` (train the
    centre-tap shifts ``delta``, else ``delta = 0``); ``kernel_size``; ``drive_init``, the
    initial scale of the drive convolution ``D`` (:func:`_drive_init`); ``zero_init_drive``:
    a block started at its input (``x_0 = u``) with a normalised drive starts that BatchNorm's
    scale at zero, so the block starts near the identity, ``x_1 = u + h relu(C u)`` with
    ``C = -I`` plus small off-centre taps (for ``u >= 0``), as the ResNet baseline's
    ``zero_init_residual`` does. Defaults of the paper's CIFAR blocks: ``steps=10``,
    ``activation="relu"``."""

    steps: int = 10
    activation: str = "relu"
    eta: float = 0.5
    learn_delta: bool = False
    drive_init: str = "lecun"
    zero_init_drive: bool = True

    @nn.nowrap
    def _check_fields(self):
        check_eta(self.eta, self.eps)
        check_bool("learn_delta", self.learn_delta)
        check_bool("zero_init_drive", self.zero_init_drive)
        check_choice(
            "drive_init",
            self.drive_init,
            DRIVE_INITS,
            why=": 'lecun' (variance 1 / fan_in); 'he' (2 / fan_in) keeps the spread of ReLU blocks "
            "whose drive is not normalised",
        )


def initial_state_x0(u: Array, state_shape: tuple, dtype, initial_state: str, block: str) -> Array:
    """``x_0`` of a block: zeros of ``state_shape``, or ``u`` itself for ``"input"``.

    ``"input"`` needs ``u.shape == state_shape`` (same width, and for a conv block stride 1);
    otherwise ``ValueError`` naming both shapes.
    """
    if initial_state == "zero":
        return jnp.zeros(state_shape, dtype)
    if tuple(u.shape) != tuple(state_shape):
        raise ValueError(
            f"{block} with initial_state='input' starts at x_0 = u, but its input u has shape "
            f"{tuple(u.shape)} and its state {tuple(state_shape)}; use initial_state='zero' or "
            f"an input of the state's shape (equal width, stride 1)."
        )
    return u.astype(dtype)


def _compute_dtype(dtype):
    return None if dtype is None else jnp.dtype(dtype)


# ----------------------------------------------------------- initialisation


def _fc_init(eps: float) -> Callable:
    """``R`` with N(0, 1/n) entries, then Algorithm 1: feasible from the start."""

    def init(key, shape, dtype=PARAM_DTYPE):
        R = jax.random.normal(key, shape, dtype) / math.sqrt(shape[-1])
        return project_fc(R, eps=eps)

    return init


def _drive_init(name: str) -> Callable:
    """Initialiser of a conv block's drive kernel ``D`` (HWIO): variance ``s / fan_in``, ``s = 1``
    for ``"lecun"`` (Flax's default) and ``s = 2`` for ``"he"``.

    Started at ``x_0 = 0``, a block's first state is ``x_1 = h act(D u + E)``, and at
    initialisation its state kernel is ``-I`` plus off-centre taps of small total weight, so the
    later steps barely move it (for ReLU and ``h = 1``, ``x_2 = x_1 + relu(C x_1 + d)`` adds
    ``relu`` of the small off-centre term only): the block's output is about ``relu(D u)``. Its
    pre-activation has second moment ``s E[u^2]`` and ReLU keeps half of it. Where the drive is
    not normalised, ``"he"`` therefore passes the second moment from block to block and
    ``"lecun"`` halves it at every block (``0.5^54`` over the CIFAR nets). Where the drive is
    normalised (the default, :class:`DriveNorm`) the scale of ``D`` cancels in the forward pass
    but sets the step SGD takes on it: BatchNorm makes the loss invariant to that scale, so the
    gradient shrinks as ``1 / |D|`` and the relative step as ``1 / |D|^2``: ``"he"`` halves
    the effective learning rate of every drive. In two epochs at 0.1 on MNIST
    (``experiments/signal.py``, one seed) NAIS-Net10 did about as well either way (test accuracy
    with batch statistics 93.2% with ``"he"``, 94.3% with ``"lecun"``), so the default stays
    Flax's.
    """
    scale = {"he": 2.0, "lecun": 1.0}[name]
    return nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")


def _conv_init(eps: float, eta: float) -> Callable:
    """State kernel with N(0, 1/(k^2 C)) taps, then Algorithm 2 with ``delta = 0``."""

    def init(key, shape, dtype=PARAM_DTYPE):
        k, _, c, _ = shape[-4:]
        kernel = jax.random.normal(key, shape, dtype) / math.sqrt(k * k * c)
        return project_conv(kernel, zero_delta(shape, dtype), eps=eps, eta=eta)[0]

    return init


_BATCH_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("naisnet_batch_axis", default=None)


@contextlib.contextmanager
def batch_axis(name: str | None) -> Iterator[None]:
    """Inside ``jax.shard_map`` over a batch split on the mesh axis ``name``: every BatchNorm
    built by these models while the context is open averages its batch statistics over that
    axis (``lax.pmean``), so a data-parallel step normalises by the global batch, exactly as
    one device would. Read when a model is traced (applied), not when it is constructed."""
    token = _BATCH_AXIS.set(name)
    try:
        yield
    finally:
        _BATCH_AXIS.reset(token)


def _batch_norm(train: bool, name: str, dtype=None, *, zero_scale: bool = False) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=not train,
        axis_name=_BATCH_AXIS.get() if train else None,
        momentum=BN_MOMENTUM,
        epsilon=BN_EPSILON,
        name=name,
        dtype=_compute_dtype(dtype),
        scale_init=nn.initializers.zeros if zero_scale else nn.initializers.ones,
    )


# ------------------------------------------------------------------ unrolling


def _unroll_block(
    step,
    x0,
    *,
    steps,
    xs,
    adaptive_tol,
    max_steps,
    train,
    trajectory,
    scan_unroll=1,
    remat="none",
    block_vjp="autodiff",
    tied=None,
    check_every=1,
    compact=False,
    stream_slots=None,
    zero_start=False,
):
    """Fixed or adaptive unroll; returns ``(x_K, depth, states or None)``.

    Adaptive: training uses the masked scan (differentiable), evaluation the
    ``while_loop``; a requested trajectory always takes the masked scan, whose
    values and depths are those of the ``while_loop``. ``tied = (op, drive, W,
    h, activation)`` lets a tied block of fixed depth use :func:`unroll_tied`
    (``block_vjp``); ``remat`` wraps the whole unroll (``"block"``) or each
    step (``"step"``) in ``jax.checkpoint``. ``zero_start``: ``x0`` is zero (the paper's
    ``x_0 = 0``), so a tied fast path starts at ``x_1`` (:func:`_from_first_step`).
    """
    batch = x0.shape[0]
    if remat == "step":
        step = jax.checkpoint(step, prevent_cse=False)  # inside a scan: no CSE to prevent
    if adaptive_tol is None:
        tied_run = None  # steps -> the tied fast path's unroll of that many steps, if one applies
        if block_vjp != "autodiff" and not trajectory:
            op, drive, W, h, activation = tied
            if block_vjp == "fused" and op is conv_op:
                tied_run = functools.partial(
                    unroll_tied_conv, drive=drive, kernel=W, h=h, activation=activation, scan_unroll=scan_unroll
                )
            elif block_vjp == "fused" and op is dense_op:
                tied_run = functools.partial(
                    unroll_tied_dense, drive=drive, A=W, h=h, activation=activation, scan_unroll=scan_unroll
                )
            else:
                tied_run = functools.partial(
                    unroll_tied,
                    op,
                    drive=drive,
                    W=W,
                    h=h,
                    activation=activation,
                    residuals=BLOCK_VJP[block_vjp],
                    scan_unroll=scan_unroll,
                )
        if tied_run is not None and zero_start:
            run = _from_first_step(tied_run, drive, h, activation, steps)
        elif tied_run is not None:
            run = functools.partial(tied_run, steps=steps)
        else:
            run = functools.partial(unroll, step, steps=steps, trajectory=trajectory, xs=xs, scan_unroll=scan_unroll)
        out = jax.checkpoint(run)(x0) if remat == "block" else run(x0)
        x, states = out if trajectory else (out, None)
        return x, jnp.full((batch,), steps, jnp.int32), states
    if train or trajectory:
        run = functools.partial(
            unroll_adaptive_bounded,
            step,
            tol=adaptive_tol,
            max_steps=max_steps,
            trajectory=trajectory,
            scan_unroll=scan_unroll,
        )
        out = jax.checkpoint(run)(x0) if remat == "block" else run(x0)
        return out if trajectory else (*out, None)
    streaming = stream_slots is not None and batch > stream_slots
    if check_every == 1 and not compact and not streaming:
        x, depth = unroll_adaptive(step, x0, tol=adaptive_tol, max_steps=max_steps)
        return x, depth, None
    op, drive, W, h, activation = tied  # the drive is per pattern: compaction and streaming move it along
    act = ACTIVATIONS[activation]

    def driven(x, d):
        return x + h * act(op(x, W) + d)

    drives = jnp.broadcast_to(drive, x0.shape)
    common = dict(tol=adaptive_tol, max_steps=max_steps, check_every=check_every)
    if streaming:
        x, depth = unroll_adaptive_stream(driven, x0, drives, slots=stream_slots, **common)
    else:
        x, depth = unroll_adaptive(driven, x0, inputs=drives, compact=compact, **common)
    return x, depth, None


def _from_first_step(tied_run: Callable, drive, h: float, activation: str, steps: int) -> Callable:
    """``x0 -> x_K`` of a tied block started at ``x_0 = 0``, as ``tied_run(x_1, steps=K - 1)``.

    From zero the state term vanishes: ``x_1 = 0 + h act(A 0 + drive) = h act(drive)``, the
    same value bit for bit. So the fast path runs the other ``K - 1`` steps from ``x_1``: one
    step of state products fewer forward and backward, a state fewer saved, and no weight
    gradient term ``x_0^T s_0``, which is zero. Autodiff carries the gradient through
    ``x_1`` to the drive. ``x0`` gives only the shape and dtype.
    """

    def run(x0):
        x1 = jnp.broadcast_to(h * ACTIVATIONS[activation](drive), x0.shape).astype(x0.dtype)
        return tied_run(x1, steps=steps - 1) if steps > 1 else x1

    return run


def _untied_step(step: Callable) -> Callable:
    """``step(x, drive, op)`` -> ``(x, (drive_k, op_k)) -> x_next`` for ``unroll(xs=...)``."""
    return lambda x, params_k: step(x, *params_k)


def _block_output(x, depth, states, return_aux):
    return (x, {"trajectory": states, "depth": depth}) if return_aux else x


# --------------------------------------------------------------- NAIS blocks


class NaisDenseBlock(DenseOptions):
    """Fully connected NAIS block: ``x_{k+1} = x_k + h act(x_k A^T + u B^T + b)``, ``x_0 = 0``
    (or ``x_0 = u`` with ``initial_state="input"``, which needs ``m = n``).

    ``A = -R^T R - eps I`` with ``R`` of shape ``(r, n)``, ``r = rank or n``.
    Parameters: ``"R"`` ``(r, n)`` and ``"input"`` (Dense ``m -> n``: kernel
    ``B^T``, bias ``b``). Untied (per-step ``A(k), B(k), b(k)``): ``"R"``
    ``(K, r, n)`` and ``"input"`` a Dense ``m -> K n`` read as ``(K, n)``.
    ``R`` starts inside Algorithm 1's set. Returns ``x_K``, or ``(x_K, aux)``
    with ``aux = {"trajectory": (K, batch, n), "depth": (batch,)}``.
    """

    features: int

    @nn.nowrap
    def _check_fields(self):
        self._warn_if_state_unused()

    @nn.compact
    def __call__(self, u: Array, *, train: bool = False, return_aux: bool = False):
        if u.ndim != 2:
            raise ValueError(f"NaisDenseBlock input must be (batch, m); got shape {u.shape}.")
        n, K = self.features, self.steps
        per_step = (K,) if self.untied else ()
        R = self.param("R", _fc_init(self.eps), per_step + (self.rank or n, n), PARAM_DTYPE)
        A = fc_state_matrix(R, self.eps)
        dtype = _compute_dtype(self.dtype)
        drive = nn.Dense(n * K if self.untied else n, dtype=dtype, name="input")(u)
        A = A if dtype is None else A.astype(dtype)
        x0 = initial_state_x0(u, (u.shape[0], n), jnp.result_type(drive, A), self.initial_state, "NaisDenseBlock")
        step = functools.partial(fc_step, h=self.h, activation=self.activation)
        if self.untied:
            drives = jnp.moveaxis(drive.reshape(u.shape[0], K, n), 1, 0)  # (K, batch, n)
            step, xs = _untied_step(step), (drives, A)
        else:
            step, xs = functools.partial(step, drive=drive, A=A), None
        x, depth, states = self._unroll(
            step,
            x0,
            steps=K,
            xs=xs,
            train=train,
            trajectory=return_aux or probe.auditing(self),
            tied=(dense_op, drive, A, self.h, self.activation),
        )
        if probe.auditing(self):
            probe.sow_block(
                self,
                kind="dense",
                activation=self.activation,
                h=self.h,
                eps=self.eps,
                untied=self.untied,
                operator=A,
                factor=R,
                u=u,
                x0=x0,
                states=states,
                drive=xs[0] if self.untied else drive,
                input_kernel=self.variables["params"]["input"]["kernel"],
            )
        return _block_output(x, depth, states, return_aux)


class NaisConvBlock(ConvOptions):
    """Convolutional NAIS block: ``X_{k+1} = X_k + h act(conv(X_k, C) + conv(U, D) + E)``.

    ``X_0 = 0``, or ``X_0 = U`` with ``initial_state="input"`` (needs ``strides == 1``
    and ``U`` of ``features`` channels). The state convolution has stride 1, SAME
    padding and an odd ``k x k`` filter whose centre taps are ``-1 - delta_c`` (``delta = 0`` unless
    ``learn_delta``). The input convolution ``D`` (``"input"``) has
    ``strides``, so a stride-2 block halves the resolution. Parameters:
    ``"state_kernel"`` ``(k, k, C, C)``, ``"delta"`` ``(C,)`` if
    ``learn_delta``, ``"input"`` (Conv, kernel ``D``, bias ``E``); untied adds
    a leading ``K`` axis to the first two and gives ``"input"`` ``K C``
    outputs read as ``(K, C)``. ``normalize_drive`` applies BatchNorm
    (``"drive_norm"``) to the drive, whose offset then plays ``E`` (the conv
    has no bias). The state kernel starts inside Algorithm 2's set. Returns
    ``X_K``, or ``(X_K, aux)`` with ``aux = {"trajectory": (K, batch, H, W, C),
    "depth": (batch,)}``.
    """

    features: int
    strides: int = dataclasses.field(default=1, kw_only=True)
    normalize_drive: bool = dataclasses.field(default=False, kw_only=True)

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        check_int("strides", self.strides)
        check_bool("normalize_drive", self.normalize_drive)
        if self.initial_state == "input" and self.strides != 1:
            raise ValueError(
                f"initial_state='input' with strides={self.strides}: x_0 = U needs the input at "
                f"the state's resolution (strides=1); use initial_state='zero'."
            )
        self._warn_if_state_unused()

    @nn.compact
    def __call__(self, u: Array, *, train: bool = False, return_aux: bool = False):
        if u.ndim != 4:
            raise ValueError(f"NaisConvBlock input must be NHWC; got shape {u.shape}.")
        C, K, k = self.features, self.steps, self.kernel_size
        per_step = (K,) if self.untied else ()
        kernel = self.param("state_kernel", _conv_init(self.eps, self.eta), per_step + (k, k, C, C), PARAM_DTYPE)
        if self.learn_delta:
            delta = self.param("delta", nn.initializers.zeros, per_step + (C,), PARAM_DTYPE)
        else:
            delta = zero_delta(kernel.shape, kernel.dtype)
        kernel = conv_state_kernel(kernel, delta)
        drive = nn.Conv(
            C * K if self.untied else C,
            (k, k),
            strides=(self.strides, self.strides),
            padding="SAME",
            use_bias=not self.normalize_drive,
            kernel_init=_drive_init(self.drive_init),
            dtype=_compute_dtype(self.dtype),
            # the fast paths: the drive's kernel gradient beside the backward chain, as the block's
            conv_general_dilated=None if self.block_vjp == "autodiff" else side_stream_conv,
            name="input",
        )(u)
        if self.normalize_drive:
            zero_scale = self.zero_init_drive and self.initial_state == "input"
            drive = _batch_norm(train, "drive_norm", self.dtype, zero_scale=zero_scale)(drive)
        batch, height, width = drive.shape[:3]
        dtype = _compute_dtype(self.dtype) or jnp.result_type(drive, kernel)  # conv: equal dtypes
        drive, kernel = drive.astype(dtype), kernel.astype(dtype)
        x0 = initial_state_x0(u, (batch, height, width, C), dtype, self.initial_state, "NaisConvBlock")
        step = functools.partial(conv_step, h=self.h, activation=self.activation)
        if self.untied:
            drives = jnp.moveaxis(drive.reshape(batch, height, width, K, C), 3, 0)
            step, xs = _untied_step(step), (drives, kernel)
        else:
            step, xs = functools.partial(step, drive=drive, kernel=kernel), None
        x, depth, states = self._unroll(
            step,
            x0,
            steps=K,
            xs=xs,
            train=train,
            trajectory=return_aux or probe.auditing(self),
            tied=(conv_op, drive, kernel, self.h, self.activation),
        )
        if probe.auditing(self):
            probe.sow_block(
                self,
                kind="conv",
                activation=self.activation,
                h=self.h,
                eps=self.eps,
                eta=self.eta,
                untied=self.untied,
                learn_delta=self.learn_delta,
                operator=kernel,
                factor=delta,
                u=u,
                x0=x0,
                states=states,
                drive=xs[0] if self.untied else drive,
                input_stride=self.strides,
                input_kernel=self.variables["params"]["input"]["kernel"],
                input_scale=probe.batch_norm_multiplier(self, "drive_norm") if self.normalize_drive else None,
            )
        return _block_output(x, depth, states, return_aux)


# ----------------------------------------------------------------- NAIS-Nets


class NaisNetFC(DenseOptions, Classifier, kw_only=True):
    """The paper's MNIST net: flatten, one NaisDenseBlock (``"block"``), Dense classifier.

    Parameters: ``"block"`` (see :class:`NaisDenseBlock`) and ``"classifier"``.
    ``initial_state="input"`` (``x_0 = u``) needs ``features`` equal to the flattened input size.
    """

    features: int = 128

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        u = x.reshape(x.shape[0], -1)
        block = NaisDenseBlock(self.features, name="block", **options_of(self, DenseOptions))
        classifier = nn.Dense(self.num_classes, name="classifier")
        if not return_aux:
            return classifier(block(u, train=train))
        _, aux = block(u, train=train, return_aux=True)
        states = aux["trajectory"]
        step_logits = classifier(states)  # states[-1] is x_K
        return step_logits[-1], {
            "step_logits": step_logits,
            "trajectory": states,
            "depth": aux["depth"][None],
        }


DRIVE_NORMS = ("every", "transitions", "none")


class DriveNorm(HyperParameters, kw_only=True):
    """``drive_norm``: which blocks of a conv NAIS-Net put BatchNorm on their drive ``D u``:
    ``"every"`` block (the default), only the first block of every later stage, where width
    and resolution change (``"transitions"``), or ``"none"``.

    The paper builds its CIFAR nets on TensorFlow's official ResNet, whose blocks each hold a
    convolution, BatchNorm and ReLU, and says the unrolled *steps* need no normalisation. So
    the default normalises each block's drive once, outside the dynamics: the drive enters
    every step as a constant, the steps stay unnormalised, and the state Jacobian
    ``I + h diag(act') A``, with it the stability guarantee, is untouched.

    The other readings stay as options. They do not train at the paper's learning rate 0.1:
    from ``x_0 = 0`` a block has no identity path from its input, so 54 blocks form a plain
    network, and without a normalised drive in each block that network sits at chance.
    ``experiments/signal.py`` measures why, block by block, over the first 100 steps on MNIST
    (``experiments/RESULTS.md``, section 5.2):

    - ``"transitions"`` with LeCun drives (the former default) loses its signal at
      initialisation: each block is about ``relu(D u)`` and keeps half the second moment, so
      the logits start at std 6e-5 and no gradient moves anything;
    - with He drives (``drive_init="he"``) the signal survives initialisation (logits std
      0.34), yet SGD at 0.1 collapses the last stage, 18 unnormalised plain blocks feeding the
      classifier, within the first steps (its active ReLU share falls from 49% to 31%) while
      the first stage's states grow to std 408 behind the stage change's BatchNorm: the loss
      stays at ln 10, as with ``"none"``;
    - ``"every"`` learns, but a plain chain of BatchNorm and ReLU amplifies gradients towards
      its input (drive gradient 742 in the first block against 0.73 in the last at step 0),
      so the first step inflates the early drive kernels from norm 4 to 730 and they learn
      little afterwards: from ``x_0 = 0`` the start is slow (NAIS-Net10: loss 2.16 after 100
      steps). Blocks started at ``x_0 = u`` with ``zero_init_drive`` start near the identity
      and learn at once (NAIS-Net1: 0.42 after 100 steps)."""

    drive_norm: str = "every"

    @nn.nowrap
    def _check_fields(self):
        check_choice("drive_norm", self.drive_norm, DRIVE_NORMS)

    @nn.nowrap
    def _normalises_drive(self, stage_change: bool) -> bool:
        return self.drive_norm == "every" or (stage_change and self.drive_norm == "transitions")


class NaisNetConv(ConvOptions, DriveNorm, Classifier, Stages, kw_only=True):
    """Stacked convolutional NAIS-Net: stem, stages of NaisConvBlocks, pool, Dense.

    ``stem`` (3x3 conv to ``filters[0]``) -> BatchNorm (``"stem_bn"``) -> act;
    then stage ``i`` has ``stage_sizes[i]`` blocks of ``filters[i]`` channels
    (``"stage{i}_block{j}"``), each block's ``x_K`` the next block's ``u``.
    The first block of every later stage has a stride-2 input convolution. Every
    block's drive is BatchNormed (``drive_norm``, :class:`DriveNorm`: also only at
    those stage changes, or nowhere). Normalisation acts only on drives and at the stem,
    never inside the state dynamics, so every block keeps its stability
    guarantee. Then global average pooling and ``"classifier"``.

    ``initial_state="input"`` starts every block whose input has its state's
    shape at ``x_0 = u``: all blocks except the first of each later stage,
    whose stride-2 input changes resolution and width (those start at
    ``x_0 = 0``; with one step their state kernel does not act, and they do not
    warn). The first block of stage 0 starts at the stem's output, which has
    ``filters[0]`` channels at full resolution.
    """

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        dtype = _compute_dtype(self.dtype)
        x = nn.Conv(self.filters[0], (3, 3), padding="SAME", use_bias=False, dtype=dtype, name="stem")(x)
        x = ACTIVATIONS[self.activation](_batch_norm(train, "stem_bn", self.dtype)(x))
        states, depths = [], []
        options = options_of(self, ConvOptions)
        for i, (size, width) in enumerate(zip(self.stage_sizes, self.filters)):
            for j in range(size):
                change = i > 0 and j == 0
                with warnings.catch_warnings():
                    if change:  # x_0 = 0 here is the net's choice (see above), not the user's
                        warnings.simplefilter("ignore", StateUnusedWarning)
                    block = NaisConvBlock(
                        width,
                        strides=2 if change else 1,
                        normalize_drive=self._normalises_drive(change),
                        name=f"stage{i}_block{j}",
                        **{**options, "initial_state": "zero" if change else self.initial_state},
                    )
                if return_aux:
                    x, aux = block(x, train=train, return_aux=True)
                    states.append(aux["trajectory"])
                    depths.append(aux["depth"])
                else:
                    x = block(x, train=train)
        x = x if dtype is None else x.astype(jnp.float32)  # pool and classify in float32
        logits = nn.Dense(self.num_classes, name="classifier")(jnp.mean(x, axis=(1, 2)))
        if not return_aux:
            return logits
        return logits, {"trajectory": tuple(states), "depth": jnp.stack(depths)}


# ------------------------------------------------------------ ResNet baselines


class ResNetFC(StepOptions, Classifier, kw_only=True):
    """The 30-layer fully connected ResNets of the paper's MNIST ablation.

    Layer ``k``: ``x_{k+1} = x_k + h act(BN_k(x_k W_k^T [+ u B_k^T] + b_k))``.

    - ``shared`` (SH): one ``W``, ``b`` (and ``B``) used by every layer;
      otherwise a leading ``depth`` axis, one set per layer.
    - ``nonautonomous`` (NA): ``x_0 = 0`` and ``u`` drives every layer through
      ``"input"`` (Dense: kernel ``B^T``, bias ``b``; ``depth n`` outputs if not
      shared); else ``x_0 = act(u E^T + e)`` (``"embed"``: the input layer of an
      ordinary MLP), a bias ``"b"``, and ``u`` is never seen again. (A linear
      ``x_0`` would hand the classifier an unbounded linear path from ``u``: at
      the paper's learning rate 0.1 that path diverged in every seed of
      ResNet-SH, ResNet-BN and ResNet-SH-BN on MNIST.)
    - ``batch_norm`` (BN): BatchNorm ``"bn{k}"`` on layer ``k``'s
      pre-activation, one per layer even when shared (the statistics change
      with depth).
    - ``stable``: ``W = -R^T R - eps I`` with parameter ``"R"`` (otherwise the
      parameter is ``"W"``), so ``project_params`` applies Algorithm 1.

    ``ResNetSHNA`` is therefore a NAIS-Net block without the stability
    parametrisation. Parameters also include ``"classifier"``.
    """

    features: int = 128
    depth: int = 30
    shared: bool = False
    nonautonomous: bool = False
    batch_norm: bool = False
    stable: bool = False

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        check_int("depth", self.depth)
        for switch in ("shared", "nonautonomous", "batch_norm", "stable"):
            check_bool(switch, getattr(self, switch))
        if self.stable and self.batch_norm:
            raise ValueError(
                "stable=True with batch_norm=True is refused: BatchNorm inside the dynamics makes "
                "the Jacobian I + h diag(g act') A with g = gamma / sqrt(var + eps), a data-dependent "
                "scale the projection does not control (var = 1e-4 gives g ~ 95 and rho ~ 68), so "
                "no stability guarantee holds. Use batch_norm=False (NAIS-Net normalises only where "
                "the dimension changes)."
            )

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        u = x.reshape(x.shape[0], -1)
        n, L, batch = self.features, self.depth, u.shape[0]
        per_layer = () if self.shared else (L,)
        if self.stable:
            R = self.param("R", _fc_init(self.eps), per_layer + (n, n), PARAM_DTYPE)
            W = fc_state_matrix(R, self.eps)
        else:
            batch_axis = () if self.shared else (0,)
            init = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=batch_axis)
            W = self.param("W", init, per_layer + (n, n), PARAM_DTYPE)
        if self.nonautonomous:
            drive = nn.Dense(n if self.shared else L * n, name="input")(u)
            if not self.shared:
                drive = jnp.moveaxis(drive.reshape(batch, L, n), 1, 0)  # (L, batch, n)
            x = jnp.zeros((batch, n), jnp.result_type(drive, W))
        else:
            drive = self.param("b", nn.initializers.zeros, per_layer + (n,), PARAM_DTYPE)
        act = ACTIVATIONS[self.activation]
        if not self.nonautonomous:
            x = act(nn.Dense(n, name="embed")(u))
        x0 = x
        states = []
        for k in range(L):
            W_k, d_k = (W, drive) if self.shared else (W[k], drive[k])
            pre = x @ W_k.T + d_k
            if self.batch_norm:
                pre = _batch_norm(train, f"bn{k}")(pre)
            x = x + self.h * act(pre)
            states.append(x)
        if probe.auditing(self):
            self._sow_probe(u, W, drive, x0, jnp.stack(states))
        classifier = nn.Dense(self.num_classes, name="classifier")
        if not return_aux:
            return classifier(x)
        states = jnp.stack(states)
        step_logits = classifier(states)
        return step_logits[-1], {
            "step_logits": step_logits,
            "trajectory": states,
            "depth": jnp.full((1, batch), L, jnp.int32),
        }

    def _sow_probe(self, u, W, drive, x0, states):
        """The residual map's weights for the verifier (stable: a dense NAIS-type block)."""
        variables, batch = self.variables["params"], u.shape[0]
        common = dict(
            activation=self.activation, h=self.h, untied=not self.shared, u=u, x0=x0, states=states, operator=W
        )
        if not self.stable:
            scale = None
            if self.batch_norm:
                scale = jnp.stack([probe.batch_norm_multiplier(self, f"bn{k}") for k in range(self.depth)])
            probe.sow_block(self, kind="dense-baseline", scale=scale, **common)
            return
        if drive.ndim == W.ndim - 1:  # autonomous: the bias b, one per pattern
            drive = jnp.broadcast_to(drive[..., None, :], drive.shape[:-1] + (batch, drive.shape[-1]))
        probe.sow_block(
            self,
            kind="dense",
            eps=self.eps,
            factor=variables["R"],
            drive=drive,
            input_kernel=variables["input"]["kernel"] if self.nonautonomous else None,
            **common,
        )


class ResNetConvOptions(KernelSize, ComputeDtype, kw_only=True):
    """Options of :class:`ResNetConvBlock`, which :class:`ResNetConv` hands to its blocks.

    ``zero_init_residual``: the BatchNorm scale of each block's branch starts at zero, so
    every block starts as the identity on its (non-negative) input (Goyal et al., 2017), and
    54 blocks train at the paper's learning rate of 0.1 from the first step. Without it the
    54-block net on MNIST starts at a loss above 20 and, at learning rate 0.1, is still at
    chance after 60 steps (a CPU check; with it the loss falls from 2.30 to 1.74)."""

    zero_init_residual: bool = True
    #: Convolutions a block: 1, the paper's baseline (section 5.2 gives ResNet one convolution so
    #: that it has NAIS-Net's parameter count), or 2, He et al.'s basic block
    #: ``relu(x + BN(conv(relu(BN(conv(x))))))``. A NAIS block has two convolutions (drive and
    #: state), so with 2 the 3 x 18-block ResNet (ResNet-110: 1,730,522 parameters on CIFAR-10)
    #: matches NAIS-Net's 1,723,930 within 0.4%, where the one-convolution form has 855,578.
    convs: int = 1

    @nn.nowrap
    def _check_fields(self):
        check_bool("zero_init_residual", self.zero_init_residual)
        check_int("convs", self.convs, 1, 2)


class ResNetConvBlock(ResNetConvOptions):
    """Single-convolution residual block ``relu(x + BN(conv(x)))``: He et al.'s block with one
    convolution, as the paper's section 5.2 uses (the ReLU after the sum, as theirs); with
    ``convs=2`` their basic block ``relu(x + BN(conv2(relu(BN(conv(x))))))`` (parameters
    ``"conv2"``, ``"bn2"`` besides; the stride on the first convolution).

    Where width or resolution changes, the shortcut is a strided 1x1
    projection (``"shortcut"``). Parameters: ``"conv"``, ``"bn"``. The Jacobian at a
    state is ``diag(relu') (I + diag(g) C)`` (``g`` BatchNorm's eval multiplier): the
    verifier reports ``rho(I + diag(g) C)``, its value where every unit is active. A
    two-convolution block is not reported (its Jacobian is no single convolution).
    (The form ``x + relu(BN(conv(x)))`` adds a non-negative branch in every block: the
    stream grows by about 0.4 per block and channel, and the 54-block net diverges at
    learning rate 0.1.)
    """

    features: int
    strides: int = dataclasses.field(default=1, kw_only=True)

    @nn.nowrap
    def _check_fields(self):
        check_int("features", self.features)
        check_int("strides", self.strides)

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False) -> Array:
        s, k, dtype = self.strides, self.kernel_size, _compute_dtype(self.dtype)
        y = nn.Conv(self.features, (k, k), strides=(s, s), padding="SAME", use_bias=False, dtype=dtype, name="conv")(x)
        last = self.convs == 1
        y = _batch_norm(train, "bn", self.dtype, zero_scale=self.zero_init_residual and last)(y)
        if not last:
            y = nn.Conv(self.features, (k, k), padding="SAME", use_bias=False, dtype=dtype, name="conv2")(nn.relu(y))
            y = _batch_norm(train, "bn2", self.dtype, zero_scale=self.zero_init_residual)(y)
        square = s == 1 and x.shape[-1] == self.features
        if probe.auditing(self) and last:
            probe.sow_block(
                self,
                kind="conv-baseline",
                activation="relu",
                h=1.0,
                square=square,
                u=x,
                operator=self.variables["params"]["conv"]["kernel"],
                scale=probe.batch_norm_multiplier(self, "bn"),
            )
        if not square:
            x = nn.Conv(self.features, (1, 1), strides=(s, s), use_bias=False, dtype=dtype, name="shortcut")(x)
        return nn.relu(x + y)


class ResNetConv(ResNetConvOptions, Classifier, Stages, kw_only=True):
    """The paper's CIFAR ResNet baseline (one convolution per block, section 5.2).

    ``stem`` -> ``"stem_bn"`` -> relu, stages of :class:`ResNetConvBlock`
    (``"stage{i}_block{j}"``, stride 2 at the first block of every later
    stage), global average pooling, ``"classifier"``. Each block is one step:
    ``aux["trajectory"]`` holds ``(1, batch, H, W, C)`` per block.
    """

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False, return_aux: bool = False):
        dtype = _compute_dtype(self.dtype)
        x = nn.Conv(self.filters[0], (3, 3), padding="SAME", use_bias=False, dtype=dtype, name="stem")(x)
        x = nn.relu(_batch_norm(train, "stem_bn", self.dtype)(x))
        states, options = [], options_of(self, ResNetConvOptions)
        for i, (size, width) in enumerate(zip(self.stage_sizes, self.filters)):
            for j in range(size):
                strides = 2 if i > 0 and j == 0 else 1
                x = ResNetConvBlock(width, strides=strides, name=f"stage{i}_block{j}", **options)(x, train=train)
                states.append(x[None])
        x = x if dtype is None else x.astype(jnp.float32)  # pool and classify in float32
        logits = nn.Dense(self.num_classes, name="classifier")(jnp.mean(x, axis=(1, 2)))
        if not return_aux:
            return logits
        depth = jnp.ones((len(states), x.shape[0]), jnp.int32)
        return logits, {"trajectory": tuple(states), "depth": depth}


# -------------------------------------------------------------------- aliases

# Section 5.1: one NAIS block, K = 30, tanh; the state width (128) is our choice. The 30-step FC
# nets start at h = 0.1 (K h = 3, as the package's default config): at h = 1 the NAIS-Net's state
# starts at 14 times its input's spread and its logits at std 13 (SGD at 0.1 then ends at train
# losses in the hundreds), and the shared-weight ResNets add nearly the same tanh vector 30 times
# (logits std 18 to 24); at h = 0.1 every one keeps its input's spread within a factor of 2. The
# paper's ResNet is ResNetFC with h = 1.
_FC_STEP = dict(h=0.1)
NaisNetMNIST = functools.partial(NaisNetFC, num_classes=10, features=128, steps=30, **_FC_STEP)
NaisNetFCTiny = functools.partial(NaisNetFC, num_classes=3, features=6, steps=4)

# Section 5.2: 3 stages x 18 blocks of 16/32/64 filters, ReLU, K = 1 or 10, every block's drive
# normalised (DriveNorm). NAIS-Net10 starts its blocks at x(0) = 0 (the paper's equation 1);
# NAIS-Net1 at x(0) = u, since from x(0) = 0 its one step x_1 = h relu(D u + E) never applies the
# state kernel: the net would be a plain 54-layer network with no stability constraint acting,
# where the paper counts two layers a block (a processing depth of 108).
_CIFAR = dict(stage_sizes=(18, 18, 18), filters=(16, 32, 64))
NaisNetCifar1 = functools.partial(NaisNetConv, steps=1, initial_state="input", **_CIFAR)
NaisNetCifar10 = functools.partial(NaisNetConv, steps=10, **_CIFAR)
ResNetCifar = functools.partial(ResNetConv, **_CIFAR)
NaisNetConvTiny = functools.partial(NaisNetConv, num_classes=3, stage_sizes=(1, 1), filters=(4, 8), steps=2)
ResNetConvTiny = functools.partial(ResNetConv, num_classes=3, stage_sizes=(1, 1), filters=(4, 8))

# Section 5.1's ablation: 30-layer ResNets with switches SH, NA, BN, Stable.
ResNet = functools.partial(ResNetFC, **_FC_STEP)
ResNetSH = functools.partial(ResNetFC, shared=True, **_FC_STEP)
ResNetNA = functools.partial(ResNetFC, nonautonomous=True, **_FC_STEP)
ResNetBN = functools.partial(ResNetFC, batch_norm=True, **_FC_STEP)
ResNetSHNA = functools.partial(ResNetFC, shared=True, nonautonomous=True, **_FC_STEP)
ResNetSHBN = functools.partial(ResNetFC, shared=True, batch_norm=True, **_FC_STEP)
ResNetNABN = functools.partial(ResNetFC, nonautonomous=True, batch_norm=True, **_FC_STEP)
ResNetSHNABN = functools.partial(ResNetFC, shared=True, nonautonomous=True, batch_norm=True, **_FC_STEP)
ResNetSHStable = functools.partial(ResNetFC, shared=True, stable=True, **_FC_STEP)

# Paper label -> alias, in the paper's order of switches.
RESNET_VARIANTS: dict[str, Callable[..., nn.Module]] = {
    "ResNet": ResNet,
    "ResNet-SH": ResNetSH,
    "ResNet-NA": ResNetNA,
    "ResNet-BN": ResNetBN,
    "ResNet-SH-NA": ResNetSHNA,
    "ResNet-SH-BN": ResNetSHBN,
    "ResNet-NA-BN": ResNetNABN,
    "ResNet-SH-NA-BN": ResNetSHNABN,
    "ResNet-SH-Stable": ResNetSHStable,
}

MODELS: dict[str, Callable[..., nn.Module]] = {
    "naisnet_mnist": NaisNetMNIST,
    "naisnet_fc_tiny": NaisNetFCTiny,
    "naisnet_cifar1": NaisNetCifar1,
    "naisnet_cifar10": NaisNetCifar10,
    "naisnet_conv_tiny": NaisNetConvTiny,
    "resnet_cifar": ResNetCifar,
    "resnet_conv_tiny": ResNetConvTiny,
    **{label.lower().replace("-", "_"): alias for label, alias in RESNET_VARIANTS.items()},
}


def get_model(name: str, **overrides) -> nn.Module:
    """``MODELS[name](**overrides)``; an unknown name raises ``ValueError`` listing them all."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    return MODELS[name](**overrides)
