"""What an audit reports: the table, the JSON certificate and one figure per block
(:func:`audit_and_report`, which ``naisnet-verify`` runs, and the writers it uses).

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
import sys

from naisnet_jax.checkpoint import CheckpointError, run_checkpoint_dir
from naisnet_jax.checks import check_output_dir, check_output_file

from .certify import AuditDataError, AuditOptions, audit, check_options


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


EXIT_CERTIFIED, EXIT_NOT_CERTIFIED, EXIT_USAGE = 0, 1, 2


def usage_error(message: str) -> int:
    """``error: <message>`` as one line on stderr; returns the usage exit status."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return EXIT_USAGE


def audit_and_report(
    checkpoint_dir: str,
    *,
    json_path: str | None = None,
    figures_dir: str | None = None,
    options: AuditOptions | None = None,
    progress: bool | None = None,
) -> int:
    """Audit, print the table, write the certificate and figures; return the exit status.

    ``checkpoint_dir`` may be a run's workdir: the ``checkpoints/`` inside it is audited, and a
    line on stderr says so. The outputs are checked before the audit; a refusal is one
    ``error:`` line and status 2.
    """
    del progress  # the audit reports its phases in the certificate's timings
    options = check_options(options)
    try:  # every output can be written, checked before the audit (which writes nothing else)
        if json_path:
            check_output_file("--json", json_path)
        if figures_dir:
            check_output_dir("--figures", figures_dir)
    except ValueError as e:
        return usage_error(e)
    inner = run_checkpoint_dir(checkpoint_dir)
    if inner is not None:
        print(f"note: {checkpoint_dir} is a run's workdir; auditing its checkpoints in {inner}", file=sys.stderr)
        checkpoint_dir = inner
    try:
        cert = audit(checkpoint_dir, options)
    except AuditDataError as e:
        return usage_error(f"--data={e.data}: {e.reason}; pass --data=random or --data=none")
    except CheckpointError as e:
        return usage_error(f"unusable checkpoint: {e}")
    except (FileNotFoundError, ImportError) as e:
        which = f"--data={options.data}" if options.data else "the checkpoint's dataset"
        return usage_error(f"cannot read {which} ({e}); pass --data=random or --data=none")
    print(cert.table())
    try:  # checked above; a disk that fills up or a directory removed meanwhile still ends in one line
        if figures_dir:
            import matplotlib

            matplotlib.use("Agg")  # the command writes files; it never opens windows
            write_figures(cert, figures_dir)
            print(f"figures: {os.path.join(figures_dir, '')}")
        if json_path:
            write_json(cert, json_path)
            print(f"certificate: {json_path}")
    except OSError as e:
        return usage_error(f"the audit ran, but its output cannot be written ({e})")
    return EXIT_CERTIFIED if cert.certified else EXIT_NOT_CERTIFIED
