"""What a block tells the stability verifier about itself.

Every block of :mod:`naisnet_jax.models` calls :func:`sow_block` at the end of
its ``__call__``. When the ``"nais_audit"`` collection is mutable (the
verifier applies the model with ``mutable=["nais_audit"]``), the block sows a
:class:`BlockProbe`: its kind, its hyper-parameters, the state operator exactly
as the forward pass computed it (float32 ``A = -R^T R - eps I``, the kernel
with its float32 centre taps), its input, drive and states. Otherwise nothing
is computed or stored, so training pays nothing.

The verifier finds blocks through these probes (at the block's own module
path, which is also where its parameters live), never by class or submodule
names, so any Flax model built from these blocks can be audited in memory.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import struct

from naisnet_jax.checks import check_choice

Array = jax.Array
AUDIT_COLLECTION = "nais_audit"
KINDS = ("dense", "conv", "dense-baseline", "conv-baseline")


@struct.dataclass
class BlockProbe:
    """One block's self-description (a pytree; strings and numbers are static).

    * ``kind``: ``"dense"`` (``x_{k+1} = x_k + h act(x_k A^T + d_k)``),
      ``"conv"`` (the same with ``A`` a SAME-padded convolution),
      ``"dense-baseline"`` / ``"conv-baseline"`` (ResNet weights without the
      stability parametrisation).
    * ``operator``: dense ``A`` ``(n, n)`` or per step ``(K, n, n)``; conv the
      HWIO kernel ``(k, k, C, C)`` (or ``(K, ...)``) with centre taps set;
      baselines the weight (``W``, per layer ``(L, n, n)``, or the conv
      kernel). As computed by the forward pass, in its dtype.
    * ``factor``: dense ``R`` (Algorithm 1's variable); conv ``delta``.
    * ``scale``: a per-unit multiplier between the operator and the
      activation (eval-mode BatchNorm of a baseline, ``(L, n)`` or ``(C,)``);
      ``None`` when there is none.
    * ``input_kernel``, ``input_scale``, ``input_stride``: the linear part
      of the drive ``u -> d`` (Dense kernel ``B^T`` or conv kernel ``D``,
      then a per-channel multiplier such as a drive BatchNorm's), ``None``
      for autonomous blocks.
    * ``u``: the block input; ``drive``: the drive actually added, ``(batch,
      ...)`` for tied blocks, per step ``(K, batch, ...)`` for untied ones
      (``untied``); ``x0``: the initial state;
      ``states``: ``x_1 .. x_K`` ``(K, batch, ...)``.
    """

    kind: str = struct.field(pytree_node=False)
    activation: str = struct.field(pytree_node=False)
    h: float = struct.field(pytree_node=False)
    eps: float | None = struct.field(pytree_node=False, default=None)
    eta: float | None = struct.field(pytree_node=False, default=None)
    untied: bool = struct.field(pytree_node=False, default=False)
    learn_delta: bool = struct.field(pytree_node=False, default=False)
    square: bool = struct.field(pytree_node=False, default=True)
    input_stride: int = struct.field(pytree_node=False, default=1)
    operator: Any = None
    factor: Any = None
    scale: Any = None
    input_kernel: Any = None
    input_scale: Any = None
    u: Any = None
    drive: Any = None
    x0: Any = None
    states: Any = None


def auditing(module: nn.Module) -> bool:
    """True while the verifier applies the model (the audit collection is mutable; never
    during ``init``, whose collections are all mutable)."""
    return module.is_mutable_collection(AUDIT_COLLECTION) and not module.is_initializing()


def sow_block(module: nn.Module, **fields) -> None:
    """Sow a :class:`BlockProbe` built from ``fields`` when auditing; otherwise nothing."""
    if not auditing(module):
        return
    check_choice("kind", fields.get("kind"), KINDS)
    module.sow(AUDIT_COLLECTION, "probe", BlockProbe(**fields))


def batch_norm_multiplier(module: nn.Module, name: str, *, epsilon: float, batch_stats_name: str | None = None):
    """Eval-mode BatchNorm ``name`` (a submodule of ``module``, built with ``epsilon``) as
    ``x -> g x + c``: ``g = scale / sqrt(var + epsilon)`` from the running statistics."""
    import jax.numpy as jnp

    params = module.variables["params"][name]
    var = module.variables["batch_stats"][batch_stats_name or name]["var"]
    scale = params["scale"] if "scale" in params else jnp.ones_like(var)
    return scale / jnp.sqrt(var + epsilon)
