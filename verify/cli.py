"""``naisnet-verify CHECKPOINT_DIR [--json FILE] [--figures DIR]``: audit a checkpoint's stability.

Exit status: 0 when every block is certified stable, 1 when one is not (or the
model has no NAIS block), 2 on unusable input (missing, corrupt, not a
naisnet-jax checkpoint, arrays that do not fit the model, data that cannot be
read, bad options, a ``--json`` file or ``--figures`` directory that cannot be
written). Every refusal is one line on stderr that starts ``error:``; exit 1 is
the verdict alone. Paths go through ``os.path.expanduser`` once, as
``naisnet-train``'s ``--workdir`` does.
"""

from __future__ import annotations

import argparse
import os
import sys

from naisnet_jax import compile_cache
from naisnet_jax.checkpoint import quiet_orbax_logging

from .certify import AuditOptions, check_data, check_option
from .report import audit_and_report, usage_error


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage and a second line)
        sys.exit(usage_error(f"{message} (see naisnet-verify --help)"))


def main(argv=None) -> None:
    parser = _Parser(
        prog="naisnet-verify",
        description="Audit the stability of a naisnet-jax checkpoint (proofs on its float32 operators, "
        "float64 numerics). Exit 0: every block certified; 1: some block not certified; 2: unusable input.",
    )
    parser.add_argument(
        "checkpoint_dir",
        help="a training checkpoint directory (latest step), one step's directory, or a run's workdir "
        "(its checkpoints/ is audited)",
    )
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
        "--compilation_cache",  # naisnet-train's spelling
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
    try:
        for field in ("samples", "jacobian_samples", "sigma_min"):
            check_option(field, getattr(args, field), "--" + field.replace("_", "-"))
        check_data(args.data, "--data")
    except ValueError as e:
        sys.exit(usage_error(e))
    for field in ("checkpoint_dir", "json", "figures", "data_dir"):  # one reading of a path, as naisnet-train's
        if getattr(args, field):
            setattr(args, field, os.path.expanduser(getattr(args, field)))
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
