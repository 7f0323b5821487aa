"""The audit's result: a typed, versioned certificate.

A :class:`Certificate` holds one :class:`BlockReport` per block the model
announced (see :mod:`naisnet_jax.probe`), each with its parameter-level
figures, its figures along real trajectories and the data to draw its
spectrum. Every figure has a *status*, given by :data:`FIGURE_STATUS` and
written into the JSON:

* ``proven``: an inequality proven for the float32 values the model runs
  with (the operator formed exactly as the forward pass forms it, converted
  to float64, rounding of the proof's own arithmetic bounded). "Certified"
  rests on these alone.
* ``computed``: a direct float64 evaluation (a dense eigen-decomposition, a
  norm) accurate to rounding, not a proof.
* ``estimate``: an iterative result (Arnoldi, power iteration), reported
  with its residual; never the basis of "certified".
* ``measured``: a figure of the sampled inputs' trajectories; another sample
  gives another value.
* ``setting``: a hyper-parameter or a quantity derived from one.

``to_json()`` / ``from_json()`` round-trip (schema :data:`SCHEMA`);
``table()`` and ``_repr_html_()`` summarise; ``plot(block)`` draws a block's
spectrum against its proven bound and the unit circle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import html
import json
import math
import typing
from collections.abc import Mapping

import numpy as np

from naisnet_jax.checks import check_choice

SCHEMA = "naisnet-jax-certificate/2"
STATUSES = ("proven", "computed", "estimate", "measured", "setting")


def _fig(status: str, doc: str, default=dataclasses.MISSING):
    """A dataclass field that carries its status and a one-line meaning."""
    assert status in STATUSES, status
    kwargs = {} if default is dataclasses.MISSING else {"default": default}
    return dataclasses.field(metadata={"status": status, "doc": doc}, **kwargs)


class Verdict(str, enum.Enum):
    """Outcome of a block (diffrax ``RESULTS`` in spirit: one name per way it can end)."""

    CERTIFIED = "certified"  # Condition 1 proven for the float32 operator
    NOT_PROVEN = "not proven"  # the proof did not go through (unstable, or too close to tell)
    BASELINE = "baseline"  # plain ResNet weights: reported, never certified


# ------------------------------------------------------------------ per-block figures


@dataclasses.dataclass(frozen=True)
class DenseParameters:
    """Parameter-level figures of a dense block ``A = -R^T R - eps I`` (worst over untied steps).

    Condition 1 (Theorem 1's hypothesis) for the float32 ``A``: with ``M = -(A + A^T) / 2`` and
    ``kappa >= ||(A - A^T) / 2||_2``, ``J = I + h diag(s) A`` has radius below 1 for every slope in
    ``(0, 1]`` when ``h (a^2 + kappa^2) < 2 a`` at ``a = lam_min(M)`` and ``a = lam_max(M)`` (for a
    symmetric ``A``: ``lam_min(M) > 0`` and ``h lam_max(M) < 2``); see ``verify/_dense.py``.
    """

    condition: str = _fig("setting", "Algorithm 1's inequality")
    delta: float = _fig("setting", "Algorithm 1's bound on ||R^T R||_F")
    frobenius_RtR: float = _fig("computed", "||R^T R||_F of the stored float32 R, float64")
    condition_holds: bool = _fig("proven", "||R^T R||_F <= delta in exact arithmetic (no slack)")
    symmetric: bool = _fig(
        "computed",
        "the float32 A the model runs is exactly symmetric (float32 R^T R need not be; the proof allows a skew part)",
    )
    skew_norm_bound: float = _fig("proven", "upper bound on ||(A - A^T) / 2||_2 of the float32 A")
    eig_M_lower: float | None = _fig("proven", "lower bound on the smallest eigenvalue of M = -A (float32 A)")
    eig_M_upper: float | None = _fig("proven", "upper bound on the largest eigenvalue of M = -A (float32 A)")
    rho_I_plus_hA_bound: float | None = _fig("proven", "upper bound on rho(I + h A) for the float32 A")
    rho_bar_bound: float | None = _fig("proven", "upper bound on rho(J) over Condition 1's set P (slopes >= sigma_min)")
    condition1_proven: bool = _fig("proven", "Condition 1 holds for every sigma > 0 (tanh) / on P (ReLU)")
    device_independent: bool = _fig(
        "proven", "Condition 1 also holds for every float32 evaluation of A (any summation order, any device)"
    )
    eig_A: tuple[float, float] | None = _fig(
        "computed", "smallest and largest eigenvalue of the float32 A (eigvalsh; None: A is not finite)"
    )
    lemma_interval_I_plus_hA: tuple[float, float] = _fig(
        "setting", "the Lemma's interval for the eigenvalues of I + h A"
    )
    rho_I_plus_hA: float | None = _fig(
        "computed", "rho(I + h A) of the float32 A, symmetric eigen-solver (None: A is not finite)"
    )
    rho_I_plus_hA_eigvals: float | None = _fig("computed", "the same by the general eigen-solver (cross-check)")
    steps: int = _fig("setting", "number of state matrices (1 tied, K untied)", 1)


@dataclasses.dataclass(frozen=True)
class ConvParameters:
    """Parameter-level figures of a conv block (kernel with its float32 centre taps ``c``).

    The row of ``J = I + h diag(s) A`` for channel ``c`` has absolute sum at most
    ``f(s) = |1 + h s c_c| + h s r_c`` (Gershgorin: ``r_c`` sums every other tap; border rows
    only lose taps). ``f`` is convex with ``f(0) = 1``, so ``||J||_inf < 1`` for every slope in
    ``(0, 1]`` iff ``f(1) < 1``, i.e. the bound on ``||I + h A||_inf`` is below 1.
    """

    condition: str = _fig("setting", "Algorithm 2's inequalities")
    centres: tuple[float, float] = _fig("computed", "smallest and largest centre tap (float32 values)")
    radius_max: float = _fig("computed", "largest off-centre absolute tap sum of a channel")
    budget_min: float = _fig("setting", "smallest budget 1 - eps - |delta_c|")
    radius_over_budget_max: float = _fig("computed", "largest radius / budget")
    condition_holds: bool = _fig(
        "proven", "radius_c <= 1 - eps - |delta_c| (and |delta_c| <= 1 - eta) exactly, no slack"
    )
    inf_norm_bound_I_plus_hA: float = _fig("proven", "upper bound on ||I + h A||_inf >= rho(I + h A)")
    rho_bar_bound: float = _fig("proven", "upper bound on ||J||_inf over Condition 1's set P")
    condition1_proven: bool = _fig("proven", "||J||_inf < 1 for every slope in (0, 1] (hence rho(J) < 1)")
    state_shape: tuple[int, ...] | None = _fig("setting", "(H, W, C) of the state", None)
    rho_I_plus_hA: float | None = _fig(
        "estimate", "rho(I + h A) at the block's resolution (Arnoldi, or dense eigvals for small states)", None
    )
    rho_method: str | None = _fig("setting", "how rho_I_plus_hA was obtained", None)
    rho_residual: float | None = _fig("estimate", "||J v - lambda v|| of the Ritz pair", None)
    rho_converged: bool | None = _fig("estimate", "Arnoldi met its tolerance", None)
    steps: int = _fig("setting", "number of kernels (1 tied, K untied)", 1)


@dataclasses.dataclass(frozen=True)
class BaselineParameters:
    """Plain ResNet weights: the radius of each residual map's linear part (never certified)."""

    note: str | None = _fig("setting", "why no radius was computed", None)
    layers: int | None = _fig("setting", "layers sharing the figure", None)
    rho_I_plus_hA: float | None = _fig(
        "computed", "rho(I + h diag(g) W) (dense) or rho(I + diag(g) C) (conv, Arnoldi estimate), worst layer", None
    )
    rho_per_layer: tuple[float, ...] | None = _fig("computed", "the radius of every layer", None)
    rho_method: str | None = _fig("setting", "how the radius was obtained", None)
    rho_converged: bool | None = _fig("estimate", "Arnoldi met its tolerance", None)
    inf_norm_bound_I_plus_hA: float | None = _fig("proven", "Gershgorin bound on ||I + diag(g) C||_inf", None)


@dataclasses.dataclass(frozen=True)
class Equilibrium:
    """tanh blocks: ``x* = -A^{-1} d`` and the contraction of ``x_k - x*`` (measured on the sample)."""

    residual_rel_max: float = _fig("measured", "max_b ||x_K - x*|| / ||x*||")
    secant_slope_min: float = _fig("measured", "smallest secant slope tanh(z)/z met")
    residual_energy_ratio_max: float | None = _fig("measured", "dense: max ||x_K - x*||_M / ||x_0 - x*||_M", None)
    contraction_energy_norm: float | None = _fig("computed", "dense: proven per-step contraction in ||.||_M", None)
    energy_norm_bound_holds: bool | None = _fig("measured", "dense: the trajectory obeys it", None)
    two_norm_increases: int | None = _fig("measured", "dense: steps where ||x_k - x*||_2 grew", None)
    two_norm_monotone: bool | None = _fig("measured", "dense: ||x_k - x*||_2 never grew", None)
    x_star_error_bound_inf: float | None = _fig("computed", "conv: bound on the error of the computed x*", None)
    solver_iterations: int | None = _fig("setting", "conv: fixed-point iterations", None)
    contraction_inf_norm: float | None = _fig("computed", "conv: per-step contraction in ||.||_inf", None)
    inf_norm_bound_holds: bool | None = _fig("measured", "conv: the trajectory obeys it", None)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """Jacobians ``J = I + h diag(act'(.)) A`` at the states the sampled inputs visit.

    Condition 1's set ``P``: every slope ``>= sigma_min`` (for ReLU: every unit active).
    """

    states: int = _fig("measured", "visited states (steps x inputs)")
    states_in_P_fraction: float = _fig("measured", "share of visited states in P")
    unsaturated_fraction: float = _fig("measured", "share of units with slope >= sigma_min")
    slope_min: float = _fig("measured", "smallest slope met")
    rho_J_max: float | None = _fig(
        "measured",
        "largest rho(J) over visited states in P (None: no state in P); dense: eigen-solver, conv: Arnoldi estimate",
    )
    rho_J_max_visited: float | None = _fig("measured", "dense: largest rho(J) over all visited states", None)
    rho_J_sampled: tuple[float, ...] | None = _fig("estimate", "conv: Arnoldi radii of the worst states in P", None)
    inf_norm_J_max: float | None = _fig("measured", "conv: largest ||J||_inf over visited states", None)
    inf_norm_J_max_in_P: float | None = _fig("measured", "conv: largest ||J||_inf over visited states in P", None)
    rho_bar_theorem: float | None = _fig(
        "computed", "the theorem's worst case for slopes in [max(slope_min, sigma_min), 1]", None
    )
    rho_bar_measured: float | None = _fig("measured", "rho_J_max (dense) or inf_norm_J_max (conv)", None)
    B_norm_2: float | None = _fig("computed", "dense: ||B||_2 of the input map", None)
    B_norm_inf: float | None = _fig("computed", "conv: ||B||_inf of the input map", None)
    gamma_theorem: float | None = _fig("computed", "h ||B|| / (1 - rho_bar_theorem)", None)
    gamma_measured: float | None = _fig("measured", "h ||B|| / (1 - rho_bar_measured)", None)
    io_gain_measured: float | None = _fig("measured", "max ||x_K(u + w) - x_K(u)|| / ||w|| over the sample", None)
    gamma_bound: float | None = _fig("computed", "a gain proved on the visited region (inf: no margin)", None)
    io_gain_within_bound: bool | None = _fig("measured", "io_gain_measured <= gamma_bound", None)
    equilibrium: Equilibrium | None = _fig("measured", "tanh, tied weights", None)
    skipped: str | None = _fig("setting", "why no trajectory figures", None)


@dataclasses.dataclass(frozen=True)
class Spectrum:
    """What the block's figure draws: eigenvalues and Gershgorin discs of ``I + h A``."""

    eigenvalues: tuple[complex, ...] = _fig("estimate", "all eigenvalues (small states) or the dominant pair")
    all_eigenvalues: bool = _fig("setting", "eigenvalues holds the whole spectrum")
    disc_centres: tuple[float, ...] = _fig("computed", "Gershgorin centres of I + h A")
    disc_radii: tuple[float, ...] = _fig("computed", "Gershgorin radii of I + h A")
    bound: float | None = _fig("proven", "the proven bound drawn as a circle", None)
    bound_label: str | None = _fig("setting", "what that bound is", None)


Parameters = DenseParameters | ConvParameters | BaselineParameters
_PARAMETER_TYPES = {
    "dense": DenseParameters,
    "conv": ConvParameters,
    "dense-baseline": BaselineParameters,
    "conv-baseline": BaselineParameters,
}


@dataclasses.dataclass(frozen=True)
class BlockReport:
    name: str
    kind: str  # "dense", "conv", "dense-baseline", "conv-baseline"
    verdict: Verdict
    reason: str
    parameter: Parameters
    trajectory: Trajectory | None = None
    spectrum: Spectrum | None = None

    @property
    def certified(self) -> bool:
        return self.verdict is Verdict.CERTIFIED


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    eps: float | None
    eta: float | None
    h: float
    relaxed: bool
    activation: str


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the audited parameters came from (a checkpoint, or a model in memory)."""

    kind: str  # "checkpoint" or "in-memory"
    model: str | None = None
    path: str | None = None
    step: int | None = None
    epoch: int | None = None
    model_kwargs: dict | None = None
    dataset: str | None = None
    digest: str | None = None


@dataclasses.dataclass(frozen=True)
class DataInfo:
    source: str
    samples: int


@dataclasses.dataclass(frozen=True)
class Summary:
    blocks: int
    certified_blocks: int
    rho_I_plus_hA_max: float | None  # computed / estimate, over blocks
    rho_bound_max: float | None  # proven, over NAIS blocks
    rho_J_trajectory_max: float | None  # measured


# ------------------------------------------------------------------ the certificate


@dataclasses.dataclass(frozen=True)
class Certificate:
    """The audit of one model: ``certified`` iff it has a NAIS block and every block is certified."""

    certified: bool
    reason: str
    blocks: tuple[BlockReport, ...]
    summary: Summary
    hyperparameters: Hyperparameters | None
    source: Source
    data: DataInfo
    device: str
    precision: str
    versions: dict
    tolerances: dict
    seconds: float
    timings: dict
    schema: str = SCHEMA

    # ---------------------------------------------------------------- access

    def block(self, name: str | int) -> BlockReport:
        """The report of block ``name`` (its module path, ``"a/b"``) or index (negative ones count
        from the end). An unknown name raises KeyError, an index out of range ValueError, anything
        else TypeError; each names the blocks."""
        names = [b.name for b in self.blocks]
        if isinstance(name, (int, np.integer)) and not isinstance(name, (bool, np.bool_)):
            if -len(self.blocks) <= name < len(self.blocks):
                return self.blocks[name]
            where = (
                f"the certificate has {len(names)} blocks, indices 0 to {len(names) - 1}"
                if names
                else "the certificate has no blocks"
            )
            raise ValueError(f"block={name!r} is out of range: {where}; blocks: {names}")
        if not isinstance(name, str):
            raise TypeError(
                f"block={name!r} must be a block's name (a string) or its index (an integer); blocks: {names}"
            )
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no block {name!r}; blocks: {names}")

    def __getitem__(self, key: str):
        """Deprecated: the schema-1 dict access (``cert["certified"]``); use the attributes."""
        import warnings

        warnings.warn(
            "Certificate[...] is the schema-1 dict access; use attributes (cert.certified, "
            "cert.blocks, cert.to_json())",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.to_dict()[key]

    # ----------------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        """The JSON-ready dict (non-finite floats as strings, complex numbers as ``[re, im]``)."""
        out = _encode(self)
        out["checkpoint"] = out.pop("source")  # schema-1 name of that section
        for b in out["blocks"]:
            b["certified"] = b["verdict"] == Verdict.CERTIFIED.value
        out["figure_status"] = figure_status()
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **{"indent": 2, **kwargs})

    @classmethod
    def from_json(cls, text: str | Mapping) -> Certificate:
        """Read back :meth:`to_json` (a string, or the parsed dict).

        Raises TypeError for anything else (a file object, ``None``) and ValueError for text that
        is not JSON (a path: read the file first), another schema, or a certificate with a field
        missing or malformed (the message names it).
        """
        data = _certificate_dict(text)
        if data.get("schema") != SCHEMA:
            raise ValueError(f"certificate schema {data.get('schema')!r}; this code reads {SCHEMA!r}")
        _require(data, _FIELDS, "not a certificate")
        data = dict(data)
        data["source"] = data.pop("checkpoint")
        data.pop("figure_status", None)
        if not isinstance(data["blocks"], (list, tuple)):
            raise ValueError(f"not a certificate: blocks={short_repr(data['blocks'])} must be a list of block reports")
        blocks = []
        for i, b in enumerate(data.pop("blocks")):
            if not isinstance(b, Mapping):
                raise ValueError(
                    f"not a certificate: block {i} is {short_repr(b)}; expected a block report (an object)"
                )
            _require(b, _BLOCK_FIELDS, f"not a certificate: block {i}")
            b = dict(b)
            b.pop("certified", None)
            try:
                check_choice(f"block {i}: kind", b["kind"], tuple(_PARAMETER_TYPES))
            except ValueError as e:
                raise ValueError(f"not a certificate: {e}") from None
            with _malformed(f"block {i} ({b.get('name')!r})"):
                b["parameter"] = _decode(_PARAMETER_TYPES[b["kind"]], b["parameter"])
                blocks.append(_decode(BlockReport, b))
        data["blocks"] = tuple(blocks)
        with _malformed("its header"):
            return _decode(cls, data)

    # ------------------------------------------------------------- display

    def table(self) -> str:
        """Plain-text table, one row per block, with the proven figures marked."""
        head = [
            "block",
            "kind",
            "Condition 1",
            "proven bound",
            "rho(I+hA) est.",
            "max rho(J) in P",
            "in P",
            "gain",
            "status",
        ]
        rows = [_row(b) for b in self.blocks]
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
        out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
        out += ["", self.verdict_line(), _LEGEND]
        return "\n".join(out)

    def verdict_line(self) -> str:
        verdict = "CERTIFIED" if self.certified else "NOT CERTIFIED"
        return (
            f"{verdict}: {self.reason}  ({self.summary.certified_blocks}/{self.summary.blocks} blocks; "
            f"data: {self.data.source}; {self.seconds:.1f} s on {self.device})"
        )

    def _repr_html_(self) -> str:
        head = [
            "block",
            "kind",
            "Condition 1 (proven)",
            "proven bound",
            "rho(I+hA) (estimate)",
            "max rho(J) in P (measured)",
            "in P",
            "gain (measured)",
            "status",
        ]
        cells = lambda r, tag: "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in r)  # noqa: E731
        rows = "".join(f"<tr>{cells(_row(b), 'td')}</tr>" for b in self.blocks)
        colour = "green" if self.certified else "crimson"
        return (
            f"<div><p style='color:{colour}'><b>{html.escape(self.verdict_line())}</b></p>"
            f"<table><thead><tr>{cells(head, 'th')}</tr></thead><tbody>{rows}</tbody></table>"
            f"<p><small>{html.escape(_LEGEND)}</small></p></div>"
        )

    def plot(self, block: str | int, ax=None):
        """The spectrum of ``I + h A`` of ``block``: eigenvalues, Gershgorin disc outlines, the
        proven bound and the unit circle. Returns the matplotlib Figure (draws into ``ax`` when
        given; otherwise a new figure with an overview and a zoom near ``z = 1``). Does not
        choose a matplotlib backend."""
        from .plotting import plot_block

        return plot_block(self.block(block), ax=ax)


_LEGEND = (
    "Condition 1: proven for the float32 operator; proven bound: rho bound (dense) or "
    "||I + hA||_inf bound (conv); rho(I+hA) est.: eigen-solver (dense) or Arnoldi estimate (conv); "
    "rho(J) in P, in P, gain: measured on the sampled inputs"
)


def _fmt(v, spec=".6f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)


def _row(b: BlockReport) -> list[str]:
    p, t = b.parameter, b.trajectory
    if isinstance(p, DenseParameters):
        proof, bound = ("yes" if p.condition1_proven else "NO"), p.rho_I_plus_hA_bound
    elif isinstance(p, ConvParameters):
        proof, bound = ("yes" if p.condition1_proven else "NO"), p.inf_norm_bound_I_plus_hA
    else:
        proof, bound = "-", p.inf_norm_bound_I_plus_hA
    return [
        b.name,
        b.kind,
        proof,
        _fmt(bound),
        _fmt(p.rho_I_plus_hA),
        _fmt(t.rho_J_max) if t else "-",
        f"{100 * t.states_in_P_fraction:.1f}%" if t and t.skipped is None else "-",
        _fmt(t.io_gain_measured, ".3g") if t else "-",
        "certified" if b.certified else ("baseline" if b.verdict is Verdict.BASELINE else "NOT certified"),
    ]


# The fields from_json needs: the certificate's (``source`` written as ``checkpoint``) and a block's.
_FIELDS = (
    "certified",
    "reason",
    "blocks",
    "summary",
    "hyperparameters",
    "checkpoint",
    "data",
    "device",
    "precision",
    "versions",
    "tolerances",
    "seconds",
    "timings",
)
_BLOCK_FIELDS = ("name", "kind", "verdict", "reason", "parameter")


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _certificate_dict(text) -> Mapping:
    """The certificate's dict from :meth:`Certificate.from_json`'s argument, or a one-line error."""
    expects = "Certificate.from_json expects the certificate's JSON text or its dict"
    if isinstance(text, Mapping):
        return text
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"{expects}; got {short_repr(text)} ({type(text).__name__})")
    if not text.strip():
        raise ValueError(f"{expects}; got an empty string")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(
            f"{expects}; got a string that is not JSON, {short_repr(text)} "
            "(a path? read the file first: Certificate.from_json(open(path).read()))"
        ) from None
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{expects}; the JSON text holds {short_repr(data)} ({type(data).__name__}), not a certificate"
        )
    return data


def _require(data: Mapping, fields: tuple[str, ...], what: str) -> None:
    missing = [f for f in fields if f not in data]
    if missing:
        raise ValueError(f"{what}: missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")


@contextlib.contextmanager
def _malformed(where: str):
    """Turn a decoding failure (a field of the wrong type, a bad value) into one ValueError
    naming the part of the certificate it happened in."""
    try:
        yield
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(f"not a certificate: {where} is malformed ({type(e).__name__}: {e})") from None


def figure_status() -> dict[str, str]:
    """``{"<Class>.<field>": status}`` for every figure of the schema."""
    out = {}
    for cls in (DenseParameters, ConvParameters, BaselineParameters, Trajectory, Equilibrium, Spectrum):
        for f in dataclasses.fields(cls):
            out[f"{cls.__name__}.{f.name}"] = f.metadata["status"]
    return out


# ------------------------------------------------------------------ encoding


def _encode(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (complex, np.complexfloating)):
        return [_encode(float(obj.real)), _encode(float(obj.imag))]
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else str(v)
    return obj


def _decode(tp, value):
    """Inverse of ``_encode`` guided by the type annotation ``tp``."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _decode(args[0], value)
        return value  # the parameter union is decoded by the caller
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        return tp(**{k: _decode(hints[k], v) for k, v in value.items() if k in names})
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value))
    if tp is float:
        return float(value)
    if tp is complex:
        return complex(float(value[0]), float(value[1])) if isinstance(value, list) else complex(value)
    if tp is int:
        return int(value)
    return value
