"""Audit a model in memory (:func:`audit_model`) or a checkpoint (:func:`audit`).

The orchestrator: it applies the model with the ``"nais_audit"`` collection
mutable, so every block announces itself (:mod:`naisnet_jax.probe`), groups
the blocks by kind and shape, hands each group to its audit (``_dense``,
``_conv``, ``_baseline``: batched on the device in float64) and decides.

One forward pass, with the variables as given (float32) and the inputs in
float64: the blocks form their operators from the float32 parameters exactly as
in training (``A = -R^T R - eps I`` by ``fc_state_matrix``, the kernel with its
float32 centre taps) and then run the trajectory in float64 arithmetic, since
JAX promotes float32 parameters against float64 states. So the proofs see the
float32 operators the model runs, and the trajectory figures are float64
evaluations of the same operators.

A block is **certified** when Condition 1 (Theorem 1's hypothesis) is *proven*
for the float32 operator it runs with, ``0 < h <= 1``, and no estimate or
measurement contradicts a proven bound (a contradiction means a bug, and
certifies nothing). Estimates (Arnoldi radii) and measurements (trajectories)
never certify. Baseline blocks (plain ResNet weights) are reported and never
certified; a model is certified when it has a NAIS block and every block is.
The verifier reads checkpoints through :mod:`naisnet_jax.checkpoint` and never
imports the trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import time
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from naisnet_jax import checkpoint as ckpt
from naisnet_jax.checks import check_bool, check_finite, check_int, check_number, check_positive
from naisnet_jax.configs import schema
from naisnet_jax.probe import AUDIT_COLLECTION, BlockProbe

from . import _baseline, _conv, _dense
from ._common import Block, all_finite, side_by_side
from ._numerics import float32_h, jit, single_threaded_blas, x64_scope
from .certificate import (
    SCHEMA,
    BlockReport,
    Certificate,
    DataInfo,
    Hyperparameters,
    Source,
    Summary,
    Trajectory,
    Verdict,
    short_repr,
)

# The numeric audit options and their ranges, stated once: AuditOptions and naisnet-verify's flags
# (named ``--samples``, ...) are checked with these.
OPTION_CHECKS = {
    "samples": check_int,
    "sigma_min": functools.partial(check_number, lo=0.0, hi=1.0, lo_open=True),
    "perturbation": check_positive,
    "jacobian_samples": functools.partial(check_int, minimum=0),
    "dense_max_n": functools.partial(check_int, minimum=0),
    "seed": functools.partial(check_int, minimum=0, maximum=2**32 - 2),
}


def check_option(field: str, value: Any, name: str | None = None) -> Any:
    """Check audit option ``field`` (reported as ``name``, by default the field)."""
    return OPTION_CHECKS[field](name or field, value)


#: The values of ``data`` that are not dataset names.
DATA_CHOICES = (None, "random", "none")


def check_data(value: Any, name: str = "data") -> Any:
    """``value`` is ``None`` (the checkpoint's own dataset), ``"random"``, ``"none"`` or the name
    of a dataset (:data:`naisnet_jax.data.DATASET_NAMES`); reported as ``name``."""
    if value in DATA_CHOICES:
        return value
    from naisnet_jax.data import DATASET_NAMES

    if isinstance(value, str) and value in DATASET_NAMES:
        return value
    raise ValueError(
        f"{name}={value!r} is not a dataset name; expected 'random', 'none' or one of {', '.join(DATASET_NAMES)}."
    )


class AuditDataError(ValueError):
    """The dataset that ``AuditOptions.data`` names cannot be fed to the checkpoint's model."""

    def __init__(self, data: str, reason: str):
        self.data, self.reason = data, reason
        super().__init__(f"data={data!r}: {reason}; pass data='random' or data='none'")


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """What the audit looks at.

    ``data`` (checkpoints): ``None`` reads test images of the checkpoint's own dataset;
    ``"random"`` uses standard normal inputs (labelled synthetic); ``"none"`` skips everything
    that needs inputs. ``samples``: inputs to unroll. ``sigma_min``: slopes below it are outside
    Condition 1's set ``P``. ``jacobian_samples``: conv trajectory Jacobians in ``P`` whose radius
    is estimated (the worst by inf-norm first). ``estimate_conv_radius``: estimate
    ``rho(I + h A)`` of conv blocks at their resolution (Arnoldi; dense eigvals up to
    ``dense_max_n``). ``relaxed``: Algorithm 1's bound for in-memory audits (a checkpoint's
    metadata says its own). ``input_shape``: for :func:`audit_model` without ``inputs``.
    ``apply_kwargs``: passed to ``model.apply`` (``{}`` for a model that takes no ``train``).
    ``seed``: of the random draws (Arnoldi start vectors, perturbations, ``data="random"``).
    Every field is checked here; a bad value raises ValueError naming it.
    """

    samples: int = 64
    data: str | None = None
    data_dir: str | None = None
    sigma_min: float = 1e-2
    perturbation: float = 1e-3
    jacobian_samples: int = 1
    estimate_conv_radius: bool = True
    dense_max_n: int = 2048
    relaxed: bool = False
    input_shape: tuple[int, ...] | None = None
    apply_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"train": False})
    seed: int = 0

    def __post_init__(self):
        for field in OPTION_CHECKS:
            check_option(field, getattr(self, field))
        check_data(self.data)
        if self.data_dir is not None and not isinstance(self.data_dir, (str, os.PathLike)):
            raise ValueError(f"data_dir={self.data_dir!r} must be a directory (a path string) or None.")
        for field in ("estimate_conv_radius", "relaxed"):
            check_bool(field, getattr(self, field))
        if self.input_shape is not None:
            object.__setattr__(self, "input_shape", _check_input_shape(self.input_shape))
        kwargs = self.apply_kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                f"apply_kwargs={kwargs!r} must be a dict of keyword arguments for model.apply, such as "
                "{'train': False} ({} for none)."
            )
        if "mutable" in kwargs:
            raise ValueError(
                f"apply_kwargs={dict(kwargs)!r} sets 'mutable', which the audit sets itself "
                f"(mutable=[{AUDIT_COLLECTION!r}])."
            )


def _check_input_shape(value: Any) -> tuple[int, ...]:
    """``value`` is a non-empty sequence of positive integers (the shape of one input); as a tuple."""
    try:
        shape = () if isinstance(value, (str, bytes)) else tuple(value)
    except TypeError:
        shape = ()
    if not shape:
        raise ValueError(
            f"input_shape={value!r} must be None or a non-empty sequence of positive integers "
            "(the shape of one input, such as (28, 28, 1))."
        )
    for i, d in enumerate(shape):
        check_int(f"input_shape[{i}]", d)
    return tuple(int(d) for d in shape)


def check_options(options: Any) -> AuditOptions:
    """``options`` is an :class:`AuditOptions` (returned) or ``None`` (the defaults)."""
    if options is None:
        return AuditOptions()
    if isinstance(options, AuditOptions):
        return options
    hint = ": pass AuditOptions(**options)" if isinstance(options, Mapping) else ""
    raise TypeError(
        f"options={_describe(options)} must be an AuditOptions or None; got a {type(options).__name__}{hint}"
    )


# ------------------------------------------------------------------ discovery


class ModelApplyError(ValueError):
    """The model could not be applied to the variables and inputs given."""


def _probes(model, variables, x, apply_kwargs) -> list[tuple[str, BlockProbe]]:
    """Apply the model once with the audit collection mutable; the blocks' probes in call order,
    named by module path (``"stage0_block0"``; a block called twice gets ``"#1"``...)."""
    import flax.errors

    try:
        _, state = _apply(model, dict(apply_kwargs))(variables, x)
    except (flax.errors.FlaxError, TypeError, ValueError) as e:
        hint = ""
        if isinstance(e, TypeError) and "unexpected keyword argument" in str(e) and apply_kwargs:
            hint = (
                f"; the audit calls model.apply(variables, x, **apply_kwargs) with the option "
                f"apply_kwargs={dict(apply_kwargs)!r}: pass AuditOptions(apply_kwargs=...) with the call "
                "arguments your model takes ({} for none)"
            )
        raise ModelApplyError(
            f"cannot apply {type(model).__name__} to these variables and inputs of shape "
            f"{tuple(x.shape)}: {type(e).__name__}: {e}{hint}"
        ) from e
    tree = state.get(AUDIT_COLLECTION, {})
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, BlockProbe))[0]
    out = []
    for path, probe in found:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        # path: module names ..., "probe", call index
        *modules, _, call = keys
        name = "/".join(modules) or ("R" if probe.kind == "dense" else "W")
        out.append((name if call == "0" else f"{name}#{call}", probe))
    return out


@functools.lru_cache(maxsize=16)
def _apply_cached(model, kwargs_items):
    kwargs = dict(kwargs_items)
    return jit(lambda variables, x: model.apply(variables, x, mutable=[AUDIT_COLLECTION], **kwargs))


def _apply(model, kwargs):
    try:
        return _apply_cached(model, tuple(sorted(kwargs.items())))
    except TypeError:  # an unhashable model or argument: no cache
        return jit(lambda variables, x: model.apply(variables, x, mutable=[AUDIT_COLLECTION], **kwargs))


# ------------------------------------------------------------------ the audit


def audit_model(model, variables, *, inputs=None, options: AuditOptions | None = None) -> Certificate:
    """Audit a Flax model and its variables in memory; returns a :class:`Certificate`.

    ``model`` is any Flax Linen module built from naisnet-jax blocks (they announce
    themselves; eps, h and the activation are read from them), ``variables`` its
    ``{"params": ..., "batch_stats": ...}``; ``inputs`` a batch of real (normalised) inputs for
    the trajectory figures, or ``None`` for the parameter-level audit only (then
    ``options.input_shape`` gives the shape of one input). Runs in float64 inside
    :func:`naisnet_jax.verify._numerics.x64_scope`: JAX's global x64 setting is left as it was.

    Refused: a ``model`` that is not a Flax module, ``variables`` that are not a dict and
    ``options`` that are not an :class:`AuditOptions` (TypeError); variables or inputs holding
    NaN or inf, an empty batch (ValueError); a model that cannot be applied (ModelApplyError).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"audit_model(model=...) got a {type(model).__name__}; expected a Flax Linen module built from "
            "naisnet-jax blocks (for example naisnet_jax.models.get_model(...)), with its variables as the second "
            "argument. To audit a checkpoint directory, use audit(path)."
        )
    options = check_options(options)
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables={_describe(variables)}; expected the model's variables, a dict such as "
            "{'params': ...} (what model.init returns)"
        )
    check_finite_variables(variables)
    if inputs is not None:
        if not np.ndim(inputs) or np.shape(inputs)[0] == 0:
            raise ValueError(
                f"inputs has shape {tuple(np.shape(inputs))}: no input to unroll; expected a batch of at least "
                "one input (shape (n, ...), n >= 1), or inputs=None with options.input_shape for the "
                "parameter-level audit only."
            )
        check_finite("inputs", inputs, ": the trajectory checks need finite inputs (normalised images)")
    with x64_scope():
        return _audit(
            model,
            variables,
            inputs,
            options,
            Source(kind="in-memory", model=type(model).__name__),
            "in-memory inputs" if inputs is not None else "none",
        )


def _describe(value: Any) -> str:
    """``repr(value)`` (cut short), or an array's shape and dtype."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"<array of shape {tuple(value.shape)}, {value.dtype}>"
    return short_repr(value, 80)


def check_finite_variables(variables) -> None:
    """Refuse variables holding NaN or inf, naming each such leaf: no stability can be proven for
    them, and the numerics would fail deep inside an eigen-solver instead."""
    check_finite(
        "variables",
        variables,
        ": no stability can be proven for such parameters; audit a checkpoint from before the divergence",
    )


class _Clock:
    """Wall and CPU seconds of an audit's phases: ``timings[phase]`` and ``timings[phase + " (cpu)"]``."""

    def __init__(self):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.cpu = self.cpu_start
        self.timings: dict[str, float] = {}

    def lap(self, phase: str, t0: float) -> float:
        """Add the seconds since ``t0`` (wall) and since the last lap (CPU) to ``phase``; returns now."""
        now, c = time.perf_counter(), time.process_time()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - t0
        self.timings[phase + " (cpu)"] = self.timings.get(phase + " (cpu)", 0.0) + c - self.cpu
        self.cpu = c
        return now

    def total(self) -> dict[str, float]:
        """The timings with the audit's total so far."""
        self.timings["total"] = time.perf_counter() - self.start
        self.timings["total (cpu)"] = time.process_time() - self.cpu_start
        return self.timings


def _audit_inputs(inputs, options: AuditOptions) -> tuple[np.ndarray, bool]:
    """``(x, use_data)``: the float64 batch the forward pass runs on (the real inputs, or one zero
    input of ``options.input_shape`` for the parameter-level audit), and whether the trajectory
    figures use it."""
    use_data = inputs is not None and options.data != "none"
    if use_data:
        return np.asarray(inputs, np.float64), True
    if options.input_shape is not None or inputs is not None:
        shape = np.shape(inputs)[1:] if inputs is not None else tuple(options.input_shape)
        return np.zeros((1,) + tuple(shape), np.float64), False
    raise ValueError(
        "audit_model needs inputs (a batch of real inputs) or options.input_shape "
        "(the shape of one input, for the parameter-level audit only)"
    )


@dataclasses.dataclass
class _Figures:
    """What an audit computed, block by block (keyed by block index)."""

    dense: dict
    dense_trajectories: dict
    conv: dict
    conv_trajectories: dict
    baselines: dict
    overflow: dict[int, str]  # NAIS blocks whose float32 operator is not finite: why
    no_states: dict[int, str]  # blocks whose trajectory figures are skipped: why


def _figures(blocks: list[Block], options: AuditOptions, clock: _Clock, t: float) -> _Figures:
    """Every block's proofs and estimates, and the trajectory figures of those with usable states."""
    by_kind = {
        kind: [b for b in blocks if b.kind == kind] for kind in ("dense", "conv", "dense-baseline", "conv-baseline")
    }
    overflow = {b.index: why for b in blocks if b.kind in ("dense", "conv") and (why := non_finite_operator(b))}
    no_states = {b.index: why for b in blocks if b.p64 is not None and (why := _unusable_states(b, overflow))}

    def traced(kind):
        return [b for b in by_kind[kind] if b.p64 is not None and b.index not in no_states]

    dense_par = _dense.parameters(by_kind["dense"], options)
    t = clock.lap("dense: proofs", t)
    with single_threaded_blas():  # small host eigenproblems: BLAS threads only fight XLA's
        dense_traj = _dense.trajectories(traced("dense"), options)
    t = clock.lap("dense: trajectories", t)
    with single_threaded_blas():  # the two share no state: their programs compile side by side
        conv_par, conv_traj = side_by_side(
            functools.partial(_conv.parameters, by_kind["conv"], options),
            functools.partial(_conv.trajectories, traced("conv"), options),
        )
    t = clock.lap("conv: proofs, radius estimates and trajectories", t)
    base = {**_baseline.dense(by_kind["dense-baseline"], options), **_baseline.conv(by_kind["conv-baseline"], options)}
    clock.lap("baselines", t)
    return _Figures(dense_par, dense_traj, conv_par, conv_traj, base, overflow, no_states)


def _report(b: Block, figures: _Figures, use_data: bool) -> BlockReport:
    """Block ``b``'s report: a NAIS block's verdict (:func:`_decide`), or a baseline's."""
    if b.kind not in ("dense", "conv"):
        params, spectrum = figures.baselines[b.index]
        reason = "baseline: plain ResNet weights with no stability parametrisation"
        return BlockReport(b.name, b.kind, Verdict.BASELINE, reason, params, None, spectrum)
    dense = b.kind == "dense"
    params, spectrum = (figures.dense if dense else figures.conv)[b.index]
    traj = (figures.dense_trajectories if dense else figures.conv_trajectories).get(b.index)
    if traj is None and use_data:
        traj = Trajectory(
            states=0,
            states_in_P_fraction=0.0,
            unsaturated_fraction=0.0,
            slope_min=0.0,
            rho_J_max=None,
            skipped=figures.no_states.get(b.index, "no states recorded for this block"),
        )
    if b.index in figures.overflow:
        verdict, reason = Verdict.NOT_PROVEN, figures.overflow[b.index]
    else:
        verdict, reason = _decide(b, params, traj)
    return BlockReport(b.name, b.kind, verdict, reason, params, traj, spectrum)


def _verdict(blocks: list[Block], reports: tuple[BlockReport, ...], overflow: dict[int, str]) -> tuple[bool, str]:
    """``(certified, reason)`` of the whole model: every block certified, and at least one NAIS block."""
    nais = [r for r in reports if r.kind in ("dense", "conv")]
    certified = bool(nais) and all(r.certified for r in reports)
    if not reports:
        return certified, "no blocks found (the model announces no naisnet-jax block)"
    if not nais:
        return certified, "baseline model: no NAIS block to certify"
    failed = [
        r.name + (" (its float32 operator overflows)" if b.index in overflow else "")
        for b, r in zip(blocks, reports)
        if not r.certified
    ]
    return certified, "every block certified stable" if not failed else f"not proven stable: {', '.join(failed)}"


def _hyperparameters(blocks: list[Block], options: AuditOptions) -> Hyperparameters | None:
    """The model's hyper-parameters as its first NAIS block (else its first block) announces them."""
    first = next((b.p32 for b in blocks if b.kind in ("dense", "conv")), blocks[0].p32 if blocks else None)
    if first is None:
        return None
    return Hyperparameters(
        eps=first.eps, eta=first.eta, h=first.h, relaxed=options.relaxed, activation=first.activation
    )


def _summary(reports: tuple[BlockReport, ...]) -> Summary:
    """The largest radii and bounds over the blocks, and the count certified."""

    def finite_max(xs):
        xs = [x for x in xs if x is not None and np.isfinite(x)]
        return max(xs) if xs else None

    nais = [r for r in reports if r.kind in ("dense", "conv")]
    return Summary(
        blocks=len(reports),
        certified_blocks=sum(r.certified for r in reports),
        rho_I_plus_hA_max=finite_max([r.parameter.rho_I_plus_hA for r in reports]),
        rho_bound_max=finite_max(
            [
                getattr(r.parameter, "rho_I_plus_hA_bound", None)
                or getattr(r.parameter, "inf_norm_bound_I_plus_hA", None)
                for r in nais
            ]
        ),
        rho_J_trajectory_max=finite_max([r.trajectory.rho_J_max for r in reports if r.trajectory is not None]),
    )


def _audit(
    model,
    variables,
    inputs,
    options: AuditOptions,
    source: Source,
    data_source: str,
    hyper: Hyperparameters | None = None,
) -> Certificate:
    clock = _Clock()
    t = time.perf_counter()
    x, use_data = _audit_inputs(inputs, options)
    found = _probes(model, variables, jnp.asarray(x, jnp.float64), options.apply_kwargs)
    jax.block_until_ready(found)
    t = clock.lap("forward pass (float32 operators, float64 states)", t)
    key = jax.random.PRNGKey(options.seed)
    blocks = [
        Block(i, name, p, p if use_data else None, jax.random.fold_in(key, i)) for i, (name, p) in enumerate(found)
    ]
    figures = _figures(blocks, options, clock, t)
    reports = tuple(_report(b, figures, use_data) for b in blocks)
    certified, reason = _verdict(blocks, reports, figures.overflow)
    timings = clock.total()
    return Certificate(
        certified=certified,
        reason=reason,
        blocks=reports,
        summary=_summary(reports),
        hyperparameters=hyper if hyper is not None else _hyperparameters(blocks, options),
        source=source,
        data=DataInfo(source=data_source if use_data else "none", samples=int(len(inputs)) if use_data else 0),
        device=str(jax.devices()[0]),
        precision="float64, matmul precision HIGHEST (proofs on float32 operators)",
        versions=_versions(),
        seconds=timings["total"],
        timings=timings,
        tolerances={
            "sigma_min": options.sigma_min,
            "perturbation": options.perturbation,
            "arnoldi_rel_tol": 1e-10,
            "parameter_slack": 0.0,
        },
        schema=SCHEMA,
    )


def non_finite_operator(b: Block) -> str | None:
    """Why no stability can be proven for a NAIS block whose float32 operator is not finite
    (finite parameters too large for float32: ``R^T R`` of an ``R`` of 1e30 is inf), or
    ``None`` when it is finite. The verdict on such a block is "not proven", with this reason."""
    factor = b.p32.factor if b.kind == "dense" else None
    largest = (
        f" (largest |R| = {float(np.max(np.abs(np.asarray(factor, np.float64)))):.3g}; float32 holds magnitudes "
        f"up to {float(np.finfo(np.float32).max):.3g})"
        if factor is not None and np.size(factor)
        else ""
    )
    try:
        check_finite(
            "the float32 operator A",
            np.asarray(b.p32.operator),
            f": the parameters overflow float32{largest}; no stability can be proven",
        )
    except ValueError as e:
        return str(e)
    return None


def _unusable_states(b: Block, overflow: dict[int, str]) -> str | None:
    """Why a block's trajectory figures are skipped (its operator or its float64 states are not
    finite), or ``None``."""
    if b.index in overflow:
        return "the float32 operator is not finite"
    p = b.p64
    for name, value in (("input", p.u), ("drive", p.drive), ("initial state", p.x0), ("states", p.states)):
        if value is not None and not all_finite(value):
            return f"the {name} of the float64 pass is not finite (the parameters or an earlier block overflow)"
    return None


def _decide(b: Block, par, traj) -> tuple[Verdict, str]:
    """Certified iff Condition 1 is proven for the float32 operator, ``0 < h <= 1``, and no
    estimate or measurement exceeds a proven bound."""
    h = float32_h(b.p32.h)
    reasons, notes = [], []
    if not par.condition1_proven:
        if b.kind == "dense":
            why = (
                f"proven eigenvalues of -(A + A^T)/2 in [{par.eig_M_lower}, {par.eig_M_upper}] and skew part "
                f"<= {par.skew_norm_bound:.3g} do not give h (a^2 + kappa^2) < 2a at both ends"
            )
            reasons.append(
                f"Condition 1 not proven for the float32 operator ({why}; rho(I + hA) bound "
                f"{par.rho_I_plus_hA_bound:.9g})"
            )
        else:
            reasons.append(
                f"Condition 1 not proven for the float32 operator (Gershgorin bound on "
                f"||I + hA||_inf = {par.inf_norm_bound_I_plus_hA:.9g} >= 1)"
            )
    if not par.condition_holds:
        (reasons if reasons else notes).append(f"projection condition violated ({par.condition})")
    if not 0 < h <= 1:
        reasons.append(f"step size h={h} outside (0, 1]")
    rho = par.rho_I_plus_hA
    bound = par.rho_I_plus_hA_bound if b.kind == "dense" else par.inf_norm_bound_I_plus_hA
    if rho is not None and rho >= 1 and par.condition1_proven:
        reasons.append(f"inconsistent: estimated rho(I + hA) = {rho:.9g} >= 1 against a proof")
    elif rho is not None and bound is not None and rho > bound * (1 + 1e-8) + 1e-12:
        reasons.append(f"inconsistent: estimated rho(I + hA) = {rho:.9g} above the proven bound {bound:.9g}")
    # (the trajectory runs with h in float64, the proof with float32(h): 1e-6 covers that)
    if traj is not None and traj.rho_J_max is not None and traj.rho_J_max > par.rho_bar_bound * (1 + 1e-6) + 1e-12:
        reasons.append(
            f"inconsistent: a visited Jacobian in P has radius {traj.rho_J_max:.9g} above the "
            f"proven bound {par.rho_bar_bound:.9g}"
        )
    if reasons:
        return Verdict.NOT_PROVEN, "; ".join(reasons)
    text = "Condition 1 proven for the float32 operator"
    if b.kind == "dense" and not par.device_independent:
        notes.append("the margin is within float32 rounding of another device's evaluation of A")
    return Verdict.CERTIFIED, text + ("" if not notes else " (note: " + "; ".join(notes) + ")")


def _versions() -> dict:
    import flax
    import jaxlib

    from naisnet_jax import __version__

    return {
        "naisnet_jax": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------ checkpoints


def _inputs(meta: ckpt.CheckpointMetadata, options: AuditOptions) -> tuple[np.ndarray | None, str]:
    """Normalised inputs for the trajectories, and where they came from."""
    shape = tuple(meta.input_shape)
    if options.data == "none":
        return None, "none"
    if options.data == "random":
        rng = np.random.default_rng(options.seed)
        return rng.standard_normal((options.samples,) + shape), f"synthetic: {options.samples} standard normal inputs"
    from naisnet_jax import data as data_lib

    name = check_data(options.data) or meta.dataset
    if name not in data_lib.DATASET_NAMES:  # options.data is checked: the checkpoint's own dataset
        raise ckpt.CheckpointError(
            f"the checkpoint's dataset {name!r} is unknown (valid: {', '.join(data_lib.DATASET_NAMES)}); "
            f"pass --data=random or --data=none"
        )
    data_dir = options.data_dir or schema.complete(meta.config)["data_dir"]
    ds = data_lib.load_dataset(name, data_dir=data_dir, limit_test=options.samples)
    if options.data is not None and tuple(ds.test_images.shape[1:]) != shape:
        raise AuditDataError(
            options.data,
            f"its images have shape {tuple(ds.test_images.shape[1:])}, but the checkpoint's model "
            f"({meta.model}, trained on {meta.dataset!r}) takes inputs of shape {shape}",
        )
    images = ds.test_images[: options.samples].astype(np.float64) / 255.0
    return (images - np.asarray(meta.channel_mean)) / np.asarray(
        meta.channel_std
    ), f"{name} test split: first {len(images)} images"


def audit(checkpoint_dir: str, options: AuditOptions | None = None, *, step: int | None = None) -> Certificate:
    """Audit the checkpoint in ``checkpoint_dir`` (the latest step, or ``step``; a step's own
    directory works too, and so does a run's workdir, for the ``checkpoints/`` inside it) and
    return its :class:`Certificate`.

    Raises :class:`naisnet_jax.checkpoint.CheckpointError` when the directory is not a usable
    naisnet-jax checkpoint or its arrays do not fit the model its metadata describes, and
    TypeError when ``options`` is not an :class:`AuditOptions`.
    """
    options = check_options(options)
    checkpoint_dir = ckpt.run_checkpoint_dir(checkpoint_dir) or checkpoint_dir
    t0 = time.perf_counter()
    with x64_scope():
        state, raw = ckpt.load(checkpoint_dir, step=step)
        meta = ckpt.CheckpointMetadata.from_json(raw)
        if not isinstance(state, dict) or "params" not in state:
            raise ckpt.CheckpointError("the checkpoint holds no 'params' tree.")
        model = meta.build_model()
        variables = {"params": state["params"]}
        if state.get("batch_stats"):
            variables["batch_stats"] = state["batch_stats"]
        try:
            check_finite_variables(variables)
        except ValueError as e:
            raise ckpt.CheckpointError(str(e)) from None
        inputs, data_source = _inputs(meta, options)
        options = dataclasses.replace(options, relaxed=meta.relaxed, input_shape=meta.input_shape)
        source = Source(
            kind="checkpoint",
            model=meta.model,
            path=str(checkpoint_dir),
            step=meta.step,
            epoch=meta.epoch,
            model_kwargs=dict(meta.model_kwargs),
            dataset=meta.dataset,
            digest=meta.digest,
        )
        hyper = Hyperparameters(
            eps=meta.eps,
            eta=meta.eta,
            h=float(getattr(model, "h", meta.h)),
            relaxed=meta.relaxed,
            activation=str(getattr(model, "activation", "relu")),
        )
        try:
            cert = _audit(model, variables, inputs, options, source, data_source, hyper)
        except ModelApplyError as e:
            raise ckpt.CheckpointError(
                f"the checkpoint's arrays do not fit the model its metadata describes "
                f"({meta.model}, {dict(meta.model_kwargs)}): {type(e).__name__}: {e}"
            ) from e
    seconds = time.perf_counter() - t0
    return dataclasses.replace(cert, seconds=seconds, timings={**cert.timings, "total (with loading)": seconds})
