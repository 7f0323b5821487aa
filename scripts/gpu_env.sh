# Source this on a GPU machine that has jax/flax/optax/orbax but no internet (for example a
# lent cloud box): it runs the checkout without installing it, with missing pure-Python wheels
# carried in .whl/ and the datasets carried in .data/ (both git-ignored).
#   .whl/   ml_collections-*.whl (and any other missing wheel)
#   .data/  fashion-mnist/{train,t10k}-*-ubyte.gz, mnist/mnist.pkl.gz
#   .tree_manifest.json  written in the checkout by `python -m experiments.sweep_report`, so
#           that every record names the commit and says whether the copy differs from it
#   source scripts/gpu_env.sh && python3 -m experiments.ablation ...
[ -f .tree_manifest.json ] || echo "gpu_env: no .tree_manifest.json here: records will name the script 'unknown'" >&2
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
fi
# naisnet_jax.verify lives in verify/ (mapped by pyproject); without an install, link it in.
[ -e src/naisnet_jax/verify ] || ln -s ../../verify src/naisnet_jax/verify
export PYTHONPATH="$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export NAISNET_FASHION_MNIST_DIR="$PWD/.data/fashion-mnist" NAISNET_MNIST_DIR="$PWD/.data/mnist"
export PYTHONUNBUFFERED=1
