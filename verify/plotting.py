"""Figures of the certificate (matplotlib imported here only, no backend chosen)."""

from __future__ import annotations

import numpy as np


def plot_block(block, ax=None):
    """Spectrum of ``I + h A`` of one block against its proven bound and the unit circle.

    Gershgorin discs are drawn as outlines (no fill), eigenvalues as crosses, the proven bound
    (``rho`` bound for dense blocks, ``||I + h A||_inf`` bound for conv blocks) as a dashed
    circle. With ``ax`` the overview goes there; without, a new figure holds the overview and a
    zoom on the region near ``z = 1`` where stability is decided. Returns the Figure.
    """
    import matplotlib.pyplot as plt

    sp = block.spectrum
    if sp is None:
        raise ValueError(f"block {block.name!r} has no spectrum to draw ({block.parameter})")
    if ax is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.8))
    else:
        fig, axes = ax.figure, [ax]
    eig = np.asarray(sp.eigenvalues, dtype=complex)
    centres, radii = np.asarray(sp.disc_centres, float), np.asarray(sp.disc_radii, float)
    # one outline per distinct disc (hundreds of identical discs draw as one)
    discs = np.unique(np.round(np.stack([centres, radii], axis=1), 12), axis=0) if len(centres) else []
    for a in axes:
        _draw_spectrum(a, sp, eig, discs)
    reach = [1.0]
    if len(discs):
        reach += list(np.abs(discs[:, 0]) + discs[:, 1])
    if len(eig):
        reach.append(float(np.max(np.abs(eig))))
    lim = 1.1 * max(reach)
    axes[0].set(xlim=(-lim, lim), ylim=(-lim, lim), title="spectrum and Gershgorin discs of I + hA")
    if len(axes) > 1:
        _zoom_on_margin(axes[1], sp, eig)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7, frameon=False)
    status = block.verdict.value
    fig.suptitle(f"{block.name} ({block.kind}): spectrum of I + hA - {status}")
    if ax is None:
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _draw_spectrum(a, sp, eig, discs) -> None:
    """On axes ``a``: the Gershgorin discs' outlines, the unit circle, the proven bound (dashed)
    and the eigenvalues (crosses)."""
    from matplotlib.patches import Circle

    t = np.linspace(0, 2 * np.pi, 4000)
    for i, (c, r) in enumerate(discs):
        label = "Gershgorin discs" if i == 0 else None
        a.add_patch(Circle((c, 0.0), r, fill=False, lw=0.6, color="C0", alpha=0.7, label=label))
    a.plot(np.cos(t), np.sin(t), "k-", lw=0.9, label="unit circle")
    if sp.bound is not None and np.isfinite(sp.bound):
        label = f"proven bound {sp.bound:.6g} ({sp.bound_label})"
        a.plot(sp.bound * np.cos(t), sp.bound * np.sin(t), "--", color="C2", lw=1.0, label=label)
    if len(eig):
        label = "eigenvalues" if sp.all_eigenvalues else "dominant eigenvalue(s), estimate"
        a.plot(eig.real, eig.imag, "x", color="C3", ms=5, mew=1.0, label=label)
    a.axhline(0, color="k", lw=0.3)
    a.set_aspect("equal")
    a.set(xlabel="Re", ylabel="Im")


def _zoom_on_margin(a, sp, eig) -> None:
    """Axes ``a`` zoomed on the margin: the proven bound against the unit circle, in the
    direction of the dominant eigenvalue (``z = 1`` when there is none)."""
    theta = float(np.angle(eig[np.argmax(np.abs(eig))])) if len(eig) else 0.0
    bound = sp.bound if sp.bound is not None and np.isfinite(sp.bound) else None
    inner = bound if bound is not None else (float(np.max(np.abs(eig))) if len(eig) else 0.9)
    d = max(abs(1.0 - inner), 1e-9)
    centre = (1.0 - d / 2) * np.exp(1j * theta)
    half = 1.5 * d
    a.set(
        xlim=(centre.real - half, centre.real + half),
        ylim=(centre.imag - half, centre.imag + half),
        title="zoom: proven bound vs unit circle",
    )
    a.ticklabel_format(useOffset=False)
