"""The models' hyper-parameters, each a field of exactly one option class with its default,
its meaning and its check. Blocks and networks inherit the classes, so adding an option means
editing one class; a network hands its blocks their options with :func:`options_of`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from naisnet_jax.cell import check_activation, check_step_size
from naisnet_jax.checks import check_bool, check_choice, check_int, check_positive
from naisnet_jax.parametrize import check_eps
from naisnet_jax.projection import check_eta
from naisnet_jax.unroll import (
    check_scan_unroll,
)

Array = jax.Array


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
#: The fused conv blocks' engines a model may name (``None``: by card; naisnet_jax.kernels.policy).
KERNEL_ENGINES = (None, "triton", "wgmma")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")
# Options that change speed or memory, never the maths (``dtype`` changes the rounding only).
PERF_OPTIONS = (
    "scan_unroll",
    "remat",
    "block_vjp",
    "kernel_engine",
    "kernel_interpret",
    "dtype",
    "check_every",
    "compact",
    "stream_slots",
)
#: The performance options that change neither the parameters nor the values computed (all but
#: the compute ``dtype``): a run or a sweep may resume with others (e.g. on another machine).
SPEED_OPTIONS = tuple(o for o in PERF_OPTIONS if o != "dtype")


def without_speed_options(kwargs) -> dict:
    """``kwargs`` (model options) less :data:`SPEED_OPTIONS`: what a resumed run must match."""
    return {k: v for k, v in dict(kwargs or {}).items() if k not in SPEED_OPTIONS}


class StateUnusedWarning(UserWarning):
    """A NAIS block with one step and ``x_0 = 0`` has a state matrix that never acts."""


_NET_CHOSE_ZERO_START = contextvars.ContextVar("net_chose_zero_start", default=False)


@contextlib.contextmanager
def net_chose_zero_start(chose: bool = True):
    """Blocks built inside start from ``x_0 = 0`` because their net says so (a stride-2 block),
    not the user: they do not warn. A context variable, not a warning filter: changing the
    filters makes Python forget which warnings it has shown, so every later trace would warn again."""
    token = _NET_CHOSE_ZERO_START.set(chose)
    try:
        yield
    finally:
        _NET_CHOSE_ZERO_START.reset(token)


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

    @nn.nowrap
    def _patterns(self, x) -> Any:
        """A dense net's input ``(batch, ...)`` flattened to ``(batch, features)`` (an empty
        batch too); anything without a batch axis is refused, naming the net."""
        if x.ndim < 2:
            raise ValueError(f"{type(self).__name__} input must be batched, (batch, ...); got shape {x.shape}.")
        return x.reshape(x.shape[0], math.prod(x.shape[1:]))

    @nn.nowrap
    def _check_images(self, x) -> None:
        """A convolutional net's input is a batch of images, NHWC."""
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__} input must be NHWC (batch, H, W, C); got shape {x.shape}.")


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


class BatchAxis(HyperParameters, kw_only=True):
    """``batch_axis``: the name of the mapped axis the batch is split over (a ``jax.shard_map``
    mesh axis, a ``jax.vmap`` ``axis_name``). Every BatchNorm of the model then takes its
    training statistics over the whole batch, across that axis, as one device would; ``None``:
    over the rows this program holds. Set by the program that maps the model (the trainer's
    data-parallel step); it changes no parameter, and evaluation reads the running averages."""

    batch_axis: str | None = None

    @nn.nowrap
    def _check_fields(self):
        if self.batch_axis is not None and (not isinstance(self.batch_axis, str) or not self.batch_axis):
            raise ValueError(f"batch_axis={self.batch_axis!r} must be None or the name of a mapped axis.")


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
        for name in ("stage_sizes", "filters"):
            value = getattr(self, name)
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise ValueError(f"{name}={value!r} must be a sequence of positive integers, one a stage.")
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
      ``block_vjp``, ``kernel_engine`` (with ``block_vjp="fused"``: the conv blocks' engine,
      ``None`` by card, ``"triton"`` or ``"wgmma"``), ``kernel_interpret`` (with
      ``block_vjp="fused"``: the blocks the kernels take run them in Pallas' interpreter, on any
      backend, the others the stacked VJP; for tests on a CPU), ``check_every``, ``compact``,
      ``stream_slots`` and ``dtype``.
    """

    steps: int = 30
    initial_state: str = "zero"
    untied: bool = False
    adaptive_tol: float | None = None
    max_steps: int = 100
    scan_unroll: int | bool = 1
    remat: str = "none"
    block_vjp: str = "autodiff"
    kernel_engine: str | None = None
    kernel_interpret: bool = False
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
        check_choice("kernel_engine", self.kernel_engine, KERNEL_ENGINES)
        if self.kernel_engine is not None and self.block_vjp != "fused":
            raise ValueError(
                f"kernel_engine={self.kernel_engine!r} picks the fused kernels' engine; it needs "
                f"block_vjp='fused', got {self.block_vjp!r}."
            )
        check_bool("kernel_interpret", self.kernel_interpret)
        if self.kernel_interpret and (self.block_vjp != "fused" or self.kernel_engine == "wgmma"):
            raise ValueError(
                f"kernel_interpret=True runs the fused kernels in Pallas' interpreter; it needs "
                f"block_vjp='fused' and an engine other than 'wgmma' (which the interpreter cannot "
                f"run), got block_vjp={self.block_vjp!r}, kernel_engine={self.kernel_engine!r}."
            )
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
    def _warn_if_state_unused(self):
        """A block (not a net: its blocks warn when they are built) with one step from ``x_0 = 0``."""
        most = self.steps if self.adaptive_tol is None else self.max_steps
        if most == 1 and self.initial_state == "zero" and not _NET_CHOSE_ZERO_START.get():
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


class ConvOptions(KernelSize, BatchAxis, NaisOptions, kw_only=True):
    """Conv NAIS options: Algorithm 2's ``eta`` in ``(eps, 1)``; ``learn_delta`` (train the
    centre-tap shifts ``delta``, else ``delta = 0``); ``kernel_size``; ``drive_init``, the
    initial scale of the drive convolution ``D`` (:func:`naisnet_jax.models.layers.drive_init`);
    ``zero_init_drive``: a block started at its input (``x_0 = u``) with a normalised drive
    starts that BatchNorm's scale at zero, so the block starts near the identity,
    ``x_1 = u + h relu(C u)`` with ``C = -I`` plus small off-centre taps (for ``u >= 0``), as the
    ResNet baseline's ``zero_init_residual`` does. Defaults of the paper's CIFAR blocks:
    ``steps=10``, ``activation="relu"``."""

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


class ResNetConvOptions(KernelSize, BatchAxis, ComputeDtype, kw_only=True):
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
