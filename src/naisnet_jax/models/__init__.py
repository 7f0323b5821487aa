"""Flax modules of NAIS-Net and of the paper's ResNet baselines, and the registry of named models.

The package: :mod:`.options` (every hyper-parameter, once), :mod:`.layers` (what the blocks share:
initial state, initialisers, BatchNorm), :mod:`.nais` (NAIS blocks and nets), :mod:`.resnet` (the
paper's baselines); here, the paper's configurations as named aliases and :data:`MODELS`.

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
- ``"initial_state"`` (FC models and single NAIS blocks): ``x_0``, the state the
  trajectory starts from (zeros, ``u``, or a ResNet's embedding), ``(batch, n)``, or
  ``(batch, H, W, C)`` for a conv block;
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
  stacked on the batch axis (:mod:`naisnet_jax.kernels.stacked`), keeping the states
  (``"stacked"``) or recomputing them (``"stacked_recompute"``); ``"fused"``
  runs a tied block's K steps as one GPU kernel forward and one backward
  (conv blocks: :mod:`naisnet_jax.kernels.conv`; dense blocks up to 128 units:
  :mod:`naisnet_jax.kernels.triton_dense`; Pallas, float32, CUDA) and is ``"stacked"``
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

import dataclasses
import functools
import json
from collections.abc import Callable

import flax.linen as nn

from naisnet_jax.models.layers import (
    BN_EPSILON,
    BN_MOMENTUM,
    PARAM_DTYPE,
    initial_state_x0,
)
from naisnet_jax.models.nais import NaisConvBlock, NaisDenseBlock, NaisNetConv, NaisNetFC
from naisnet_jax.models.options import (
    BLOCK_VJP,
    COMPUTE_DTYPES,
    DRIVE_INITS,
    DRIVE_NORMS,
    INITIAL_STATES,
    PERF_OPTIONS,
    REMAT,
    SPEED_OPTIONS,
    BatchAxis,
    Classifier,
    ComputeDtype,
    ConvOptions,
    DenseOptions,
    DriveNorm,
    HyperParameters,
    KernelSize,
    NaisOptions,
    ResNetConvOptions,
    Stages,
    StateUnusedWarning,
    StepOptions,
    options_of,
    without_speed_options,
)
from naisnet_jax.models.resnet import ResNetConv, ResNetConvBlock, ResNetFC

__all__ = [
    "BatchAxis",
    "BLOCK_VJP",
    "BN_EPSILON",
    "BN_MOMENTUM",
    "COMPUTE_DTYPES",
    "DRIVE_INITS",
    "DRIVE_NORMS",
    "INITIAL_STATES",
    "MODELS",
    "PARAM_DTYPE",
    "PERF_OPTIONS",
    "REMAT",
    "RESNET_VARIANTS",
    "SPEED_OPTIONS",
    "Classifier",
    "ComputeDtype",
    "ConvOptions",
    "DenseOptions",
    "DriveNorm",
    "HyperParameters",
    "KernelSize",
    "NaisConvBlock",
    "NaisDenseBlock",
    "NaisNetCifar1",
    "NaisNetCifar10",
    "NaisNetConv",
    "NaisNetConvTiny",
    "NaisNetFC",
    "NaisNetFCTiny",
    "NaisNetMNIST",
    "NaisOptions",
    "ResNet",
    "ResNetBN",
    "ResNetCifar",
    "ResNetConv",
    "ResNetConvBlock",
    "ResNetConvOptions",
    "ResNetConvTiny",
    "ResNetFC",
    "ResNetNA",
    "ResNetNABN",
    "ResNetSH",
    "ResNetSHBN",
    "ResNetSHNA",
    "ResNetSHNABN",
    "ResNetSHStable",
    "Stages",
    "StateUnusedWarning",
    "StepOptions",
    "accepted_fields",
    "get_model",
    "initial_state_x0",
    "model_spec",
    "options_of",
    "without_speed_options",
    "model_settings",
]

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


def accepted_fields(name: str) -> frozenset[str]:
    """The keyword arguments model ``name`` takes (its class's fields)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    return frozenset(f.name for f in dataclasses.fields(MODELS[name].func)) - {"parent", "name"}


def model_settings(name: str, kwargs) -> dict:
    """Every option of model ``name`` as ``kwargs`` sets it over the name's own values and its
    class's defaults, less :data:`SPEED_OPTIONS` and what the trainer sets for the data and the
    devices (``num_classes``, ``batch_axis``), as JSON reads it back: two runs whose settings are
    equal train the same network, whether or not their keyword arguments name a default."""
    alias = MODELS[name]
    settings = {}
    for f in dataclasses.fields(alias.func):
        if f.default is not dataclasses.MISSING:
            settings[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            settings[f.name] = f.default_factory()
    settings.update(alias.keywords, **dict(kwargs or {}))
    for field in ("parent", "name", "num_classes", "batch_axis"):
        settings.pop(field, None)
    return json.loads(json.dumps(without_speed_options(settings), default=repr))


#: The speed options of a NAIS net on a GPU by default (same values and gradients as the plain
#: step: ``tests/test_perf.py``); on a CPU or TPU ``"fused"`` runs the stacked VJP.
GPU_FAST_PATH = {"block_vjp": "fused", "scan_unroll": 10}


def model_spec(name: str, kwargs, *, fast_path: bool = False, where: str = "kwargs") -> tuple[str, dict]:
    """``(name, keyword arguments)`` of a network, checked: ``kwargs`` must be keyword arguments
    model ``name`` takes (``ValueError`` naming the others, ``where`` says whose they are). With
    ``fast_path`` (the caller's choice for its machine: the trainer asks for it on a GPU), a NAIS
    net gets :data:`GPU_FAST_PATH` unless ``kwargs`` sets its own speed options, or ``remat``,
    ``untied`` or ``adaptive_tol``, forms the fused path does not take."""
    accepted = accepted_fields(name)
    kwargs = dict(kwargs)
    unknown = set(kwargs) - accepted
    if unknown:
        raise ValueError(
            f"{where} has fields {sorted(unknown)} that {name} does not take; it takes {sorted(accepted)}."
        )
    if not fast_path or not set(GPU_FAST_PATH) <= accepted:
        return name, kwargs
    if set(kwargs) & {*GPU_FAST_PATH, "remat", "untied", "adaptive_tol"}:
        return name, kwargs  # speed options of its own, or a form the fused path does not take
    return name, {**kwargs, **GPU_FAST_PATH}


def get_model(name: str, **overrides) -> nn.Module:
    """``MODELS[name](**overrides)``; an unknown name raises ``ValueError`` listing them all, and
    a keyword the model does not take ``ValueError`` listing those it takes."""
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    model_spec(name, overrides, where="get_model(...)")
    return MODELS[name](**overrides)
