"""Train from a config file: ``python -m experiments.main --config=... --workdir=...``.

Intentionally kept short: it parses flags and hands over to the library
(the same as the installed ``naisnet-train`` command).
"""

from naisnet_jax.train_cli import main

if __name__ == "__main__":
    main()
