"""The audit's outputs: a JSON certificate, a table on stdout, one figure per block.

Certificate schema (``"schema": "naisnet-jax-certificate/1"``), top level:

* ``certified`` (bool) and ``reason``; ``summary`` (block counts, largest radii);
* ``checkpoint`` (path, step, epoch, model, model_kwargs, dataset, digest),
  ``versions``, ``device``, ``precision``, ``hyperparameters`` (eps, eta, h,
  relaxed, activation), ``tolerances``, ``data`` (source, samples), ``seconds``;
* ``blocks``: one entry per block with ``name``, ``kind`` (``dense``, ``conv``,
  ``dense-baseline``, ``conv-baseline``), ``certified``, ``reason``, and
  ``parameter`` (the projection condition, its figures, ``rho_I_plus_hA``)
  and, with data, ``trajectory`` (``rho_J_max``, ``unsaturated_fraction``,
  ``states_in_P_fraction``, ``rho_bar_theorem``, ``rho_bar_measured``,
  ``gamma_theorem`` and ``gamma_measured`` (the paper's ``h ||B|| / (1 - rho_bar)``
  with either rho_bar), ``gamma_bound`` (a gain proved on the visited region,
  infinite when saturated units leave no margin), ``io_gain_measured`` and
  ``io_gain_within_bound``, and for tanh blocks ``equilibrium``).
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np


def _clean(obj):
    """JSON-safe copy: drop private ``_`` keys, numpy to Python, non-finite to strings."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else str(v)
    if isinstance(obj, complex):
        return [obj.real, obj.imag]
    return obj


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(report), f, indent=2)


def _fmt(v, spec=".6f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)


def table(report: dict) -> str:
    """A plain-text table, one row per block."""
    head = ["block", "kind", "condition", "rho(I+hA)", "bound", "max rho(J) data", "unsat", "gain", "gamma", "status"]
    rows = []
    for b in report["blocks"]:
        p, t = b["parameter"], b.get("trajectory", {})
        bound = p.get("inf_norm_bound_I_plus_hA", p.get("frobenius_RtR"))
        rows.append([
            b["name"], b["kind"],
            "-" if "condition_holds" not in p else ("holds" if p["condition_holds"] else "VIOLATED"),
            _fmt(p.get("rho_I_plus_hA", p.get("rho_I_plus_hW_per_layer_max"))),
            _fmt(bound, ".4f"),
            _fmt(t.get("rho_J_max")),
            "-" if "unsaturated_fraction" not in t else f"{100 * t['unsaturated_fraction']:.1f}%",
            _fmt(t.get("io_gain_measured"), ".3g"),
            _fmt(t.get("gamma_measured"), ".3g"),
            "certified" if b["certified"] else "NOT certified",
        ])
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    verdict = "CERTIFIED" if report["certified"] else "NOT CERTIFIED"
    out.append("")
    out.append(f"{verdict}: {report['reason']}  ({report['summary']['certified_blocks']}/"
               f"{report['summary']['blocks']} blocks; data: {report['data']['source']}; "
               f"{report.get('seconds', 0):.1f} s on {report['device']})")
    bound_note = ("bound: ||R^T R||_F for dense blocks, the Gershgorin bound on ||I + hA||_inf for conv blocks; "
                  "gain: measured input-output gain; gamma: h ||B|| / (1 - rho_bar) with the measured rho_bar")
    out.append(bound_note)
    return "\n".join(out)


def block_figure(block: dict, h: float, path: str) -> None:
    """Eigenvalues of ``I + h A`` in the complex plane with the Gershgorin discs and
    the unit circle: the whole picture on the left, a zoom on the spectrum on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = block["parameter"]
    eig = np.asarray(p.get("_eigenvalues", []), dtype=complex)
    discs = p.get("_discs")
    t = np.linspace(0, 2 * np.pi, 2000)
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.6))
    points = list(eig)
    if discs is not None:
        centres, radii = (np.asarray(v, dtype=float) for v in discs)
        points += list(centres + radii) + list(centres - radii)
    points = np.asarray(points if points else [1.0], dtype=complex)
    for ax in axes:
        ax.plot(np.cos(t), np.sin(t), "k-", lw=0.8, label="unit circle")
        if discs is not None:
            for i, (c, r) in enumerate(zip(*discs)):
                ax.add_patch(plt.Circle((float(c), 0.0), float(r), fill=True, alpha=0.06, color="C0",
                                        label="Gershgorin discs" if i == 0 else None))
        if len(eig):
            ax.plot(eig.real, eig.imag, "x", color="C3", ms=5,
                    label="eigenvalues" if p.get("_all_eigenvalues", True) else "dominant eigenvalue(s)")
        ax.axhline(0, color="k", lw=0.3)
        ax.axvline(0, color="k", lw=0.3)
        ax.set_aspect("equal")
        ax.set(xlabel="Re", ylabel="Im")
    lim = max(1.15, float(np.max(np.abs(points))) * 1.05)
    axes[0].set(xlim=(-lim, lim), ylim=(-lim, lim))
    focus = eig if len(eig) else points  # zoom on the spectrum itself
    lo, hi = focus.real.min(), focus.real.max()
    span = max(hi - lo, float(np.abs(focus.imag).max()) * 2, 1e-3) * 0.6
    mid = (lo + hi) / 2
    axes[1].set(xlim=(mid - span, mid + span), ylim=(-span, span), title="zoom on the eigenvalues")
    axes[0].legend(loc="lower left", fontsize=8)
    status = "certified" if block["certified"] else "NOT certified"
    rho = p.get("rho_I_plus_hA")
    fig.suptitle(f"{block['name']}: spectrum of I + {h:g} A"
                 + (f", rho = {rho:.6f}" if rho is not None else "") + f" ({status})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure_name(block_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", block_name).strip("_") + ".png"
