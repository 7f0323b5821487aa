"""``naisnet-verify CHECKPOINT_DIR [--json FILE] [--figures DIR]``: audit a checkpoint's stability.

Exit status: 0 when every block is certified stable, 1 when one is not (or the
model has no NAIS block), 2 on unusable input (missing, corrupt, not a
naisnet-jax checkpoint, arrays that do not fit the model, bad options).
"""

from __future__ import annotations

import argparse
import sys

from naisnet_jax import compile_cache
from naisnet_jax.checkpoint import CheckpointError, quiet_orbax_logging
from naisnet_jax.checks import check_output_dir, check_output_file

from .certify import AuditOptions, audit, check_option
from .report import write_figures, write_json


def audit_and_report(
    checkpoint_dir: str,
    *,
    json_path: str | None = None,
    figures_dir: str | None = None,
    options: AuditOptions | None = None,
    progress: bool | None = None,
) -> int:
    """Audit, print the table, write the certificate and figures; return the exit status."""
    del progress  # the audit reports its phases in the certificate's timings
    try:
        cert = audit(checkpoint_dir, options or AuditOptions())
    except CheckpointError as e:
        print(f"naisnet-verify: unusable checkpoint: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ImportError) as e:
        print(f"naisnet-verify: cannot read the audit's data ({e}); pass --data=random or --data=none", file=sys.stderr)
        return 2
    print(cert.table())
    if figures_dir:
        import matplotlib

        matplotlib.use("Agg")  # the command writes files; it never opens windows
        write_figures(cert, figures_dir)
        print(f"figures: {figures_dir}/")
    if json_path:
        write_json(cert, json_path)
        print(f"certificate: {json_path}")
    return 0 if cert.certified else 1


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="naisnet-verify",
        description="Audit the stability of a naisnet-jax checkpoint (proofs on its float32 operators, "
        "float64 numerics). Exit 0: every block certified; 1: some block not certified; 2: unusable input.",
    )
    parser.add_argument("checkpoint_dir", help="a training checkpoint directory (latest step) or one step's directory")
    parser.add_argument("--json", metavar="FILE", help="write the JSON certificate here")
    parser.add_argument("--figures", metavar="DIR", help="write one eigenvalue figure per block here")
    parser.add_argument("--samples", type=int, default=64, help="inputs to unroll for the trajectory checks")
    parser.add_argument(
        "--data",
        default=None,
        help="dataset for the trajectories (default: the checkpoint's); 'random' for synthetic "
        "inputs, 'none' to skip the data-driven checks",
    )
    parser.add_argument("--data-dir", default=None, help="where that dataset lives")
    parser.add_argument(
        "--sigma-min",
        type=float,
        default=1e-2,
        help="slope threshold of Condition 1's set P (for ReLU, P is 'every unit active')",
    )
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=None,
        help="JAX's persistent compilation cache: a second audit of a model of the same shapes does not "
        "compile again (default: $NAISNET_JAX_CACHE or ~/.cache/naisnet_jax/jax_cache; 'none': off)",
    )
    parser.add_argument(
        "--jacobian-samples",
        type=int,
        default=1,
        help="conv blocks: trajectory Jacobians in P whose radius is estimated (the worst by the inf-norm first)",
    )
    args = parser.parse_args(argv)
    for field in ("samples", "jacobian_samples", "sigma_min"):
        try:
            check_option(field, getattr(args, field), "--" + field.replace("_", "-"))
        except ValueError as e:
            parser.error(str(e))
    try:  # every output can be written, checked before the audit (which writes nothing else)
        if args.json:
            check_output_file("--json", args.json)
        if args.figures:
            check_output_dir("--figures", args.figures)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    quiet_orbax_logging()  # the audit says itself what is wrong with a checkpoint
    compile_cache.enable(args.compilation_cache)
    options = AuditOptions(
        samples=args.samples,
        data=args.data,
        data_dir=args.data_dir,
        sigma_min=args.sigma_min,
        jacobian_samples=args.jacobian_samples,
    )
    sys.exit(audit_and_report(args.checkpoint_dir, json_path=args.json, figures_dir=args.figures, options=options))


if __name__ == "__main__":
    main()
