"""``naisnet-verify CHECKPOINT_DIR [--json FILE]``: audit a checkpoint's stability.

Exit status: 0 when every block is certified stable, 1 when one is not (or the
model has no NAIS block), 2 on unusable input (missing, corrupt, not a
naisnet-jax checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys

from naisnet_jax.checkpoint import CheckpointError

from .certify import AuditOptions, audit
from .report import block_figure, figure_name, table, write_json


def audit_and_report(checkpoint_dir: str, *, json_path: str | None = None, figures_dir: str | None = None,
                     options: AuditOptions = AuditOptions(), progress: bool | None = None) -> int:
    """Audit, print the table, write the certificate and figures; return the exit status."""
    if progress is None:
        progress = sys.stderr.isatty()
    try:
        report = audit(checkpoint_dir, options, progress=progress)
    except CheckpointError as e:
        print(f"naisnet-verify: unusable checkpoint: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ImportError) as e:
        print(f"naisnet-verify: cannot read the audit's data ({e}); pass --data=random or --data=none",
              file=sys.stderr)
        return 2
    print(table(report))
    if figures_dir:
        os.makedirs(figures_dir, exist_ok=True)
        h = report["hyperparameters"]["h"]
        for block in report["blocks"]:
            if "_discs" in block["parameter"] or "_eigenvalues" in block["parameter"]:
                block_figure(block, h, os.path.join(figures_dir, figure_name(block["name"])))
        print(f"figures: {figures_dir}/")
    if json_path:
        write_json(report, json_path)
        print(f"certificate: {json_path}")
    return 0 if report["certified"] else 1


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="naisnet-verify",
        description="Audit the stability of a naisnet-jax checkpoint (float64). Exit 0: every block "
        "certified; 1: some block not certified; 2: unusable checkpoint.",
    )
    parser.add_argument("checkpoint_dir", help="a training checkpoint directory (latest step) or one step's directory")
    parser.add_argument("--json", metavar="FILE", help="write the JSON certificate here")
    parser.add_argument("--figures", metavar="DIR", help="write one eigenvalue figure per block here")
    parser.add_argument("--samples", type=int, default=64, help="inputs to unroll for the trajectory checks")
    parser.add_argument("--data", default=None,
                        help="dataset for the trajectories (default: the checkpoint's); 'random' for synthetic "
                        "inputs, 'none' to skip the data-driven checks")
    parser.add_argument("--data-dir", default=None, help="where that dataset lives")
    parser.add_argument("--sigma-min", type=float, default=1e-2, help="slope threshold of the unsaturated set P")
    parser.add_argument("--jacobian-samples", type=int, default=1,
                        help="conv blocks: trajectory Jacobians whose exact radius is computed (the worst by the "
                        "inf-norm bound first)")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples={args.samples} must be a positive integer")
    if args.jacobian_samples < 0:
        parser.error(f"--jacobian-samples={args.jacobian_samples} must be >= 0")
    options = AuditOptions(samples=args.samples, data=args.data, data_dir=args.data_dir, sigma_min=args.sigma_min,
                           jacobian_samples=args.jacobian_samples)
    sys.exit(audit_and_report(args.checkpoint_dir, json_path=args.json, figures_dir=args.figures, options=options))


if __name__ == "__main__":
    main()
