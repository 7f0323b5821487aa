"""``naisnet-train --config=FILE --workdir=DIR [--config.field=value ...]``.

Parses flags only; the work is :func:`naisnet_jax.train.train_and_evaluate`.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (resumed if present).")
config_flags.DEFINE_config_file("config", None, "A get_config() file, e.g. src/naisnet_jax/configs/default.py.", lock_config=True)
flags.mark_flags_as_required(["config", "workdir"])


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from naisnet_jax import train

    try:
        result = train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except (ValueError, train.TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ValueError) else 1)
    print(f"test accuracy {result['test_accuracy']:.4f} after epoch {result['epoch']}")


def main():
    app.run(_main)


if __name__ == "__main__":
    main()
