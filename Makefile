# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/demo

.PHONY: demo test test-slow install data clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Debian's package puts the real Fashion-MNIST IDX files under /usr/share/datasets/fashion-mnist/.
data:
	@bash scripts/ensure_fashion_mnist.sh

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP) data
	$(PY) -m experiments.demo --workdir=$(WORKDIR)

clean:
	rm -rf $(VENV) runs
