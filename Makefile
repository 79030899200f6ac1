# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install kvgate, run `kvgate demo` on the embedded default
#   make test   - create .venv, install kvgate with test extras, run the whole test suite
# TORCH_SPEC: the CPU wheel lies on disk on the project's machines; on a GPU host pass
#   TORCH_SPEC=torch (or your CUDA build) instead.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/kvgate demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(PYTEST_ARGS)

bench: setup
	mkdir -p bench-results
	$(VENV)/bin/kvgate bench --json bench-results/bench.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
