"""Files the audit writes: the JSON certificate and one figure per block.

Certificate schema ``naisnet-jax-certificate/2`` (:mod:`.certificate`). Top level: ``schema``,
``certified``, ``reason``, ``summary``, ``checkpoint`` (where the parameters came from: ``kind``,
``path``, ``step``, ``epoch``, ``model``, ``model_kwargs``, ``dataset``, ``digest``), ``versions``,
``device``, ``precision``, ``hyperparameters``, ``tolerances``, ``data``, ``seconds``, ``timings``,
``figure_status`` (the status of every figure: proven / computed / estimate / measured / setting)
and ``blocks``: ``name``, ``kind``, ``verdict``, ``certified``, ``reason``, ``parameter``,
``trajectory``, ``spectrum``.

Changes from schema 1 that readers may meet: block ``parameter`` gained the proven figures
(``condition1_proven``, ``rho_I_plus_hA_bound`` / ``inf_norm_bound_I_plus_hA``,
``rho_bar_bound``, ``eig_M_lower`` / ``eig_M_upper``, ``device_independent``);
``trajectory.rho_J_max`` is now the largest radius over visited states *in* Condition 1's set
``P`` (``null`` when none is; it used to clip slopes up to ``sigma_min``), ``rho_J_max_raw`` is
renamed ``rho_J_max_visited``; conv ``inf_norm_J_max`` uses the slopes actually visited (not
clipped), with ``inf_norm_J_max_in_P`` beside it; ``tolerances.parameter_rel_tol`` is gone (no
slack: ``parameter_slack`` is 0); the private ``_eigenvalues`` / ``_discs`` became ``spectrum``.
"""

from __future__ import annotations

import os
import re


def write_json(cert, path: str) -> None:
    """``cert.to_json()`` to ``path``, atomically (the old file or the new one, never a mix)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(cert.to_json())
        os.replace(tmp, path)
    finally:  # a write that failed leaves nothing behind
        if os.path.exists(tmp):
            os.remove(tmp)


def figure_name(block_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", block_name).strip("_") + ".png"


def write_figures(cert, directory: str) -> list[str]:
    """One PNG per block with a spectrum (``figure_name(block)``); returns the paths."""
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for block in cert.blocks:
        if block.spectrum is None:
            continue
        fig = cert.plot(block.name)
        path = os.path.join(directory, figure_name(block.name))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
