#!/usr/bin/env bash
# Makes sure the real Fashion-MNIST IDX files are on this machine (Debian: dataset-fashion-mnist).
set -euo pipefail
DIR="${NAISNET_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
FILES="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
missing=0
for f in $FILES; do [ -f "$DIR/$f" ] || missing=1; done
[ "$missing" = 0 ] && exit 0
if [ "$DIR" = /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "Fashion-MNIST not found under $DIR: installing Debian's package dataset-fashion-mnist ..."
  apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null
  for f in $FILES; do [ -f "$DIR/$f" ] || { echo "error: $DIR/$f still missing after installing dataset-fashion-mnist" >&2; exit 1; }; done
  exit 0
fi
cat >&2 <<MSG
error: the Fashion-MNIST IDX files are missing from $DIR.
Install them with:   sudo apt-get install dataset-fashion-mnist
or download the four files ($FILES)
into a folder and point NAISNET_FASHION_MNIST_DIR at it.
MSG
exit 1
