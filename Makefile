# Two commands on a fresh machine with Python 3.10+:  make demo   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# tensorflow-cpu and the CPU build of torch keep the development install small; users pick
# the full packages through the extras (crossfeed[tf], crossfeed[torch]).
DEV_PINS := "tensorflow-cpu==2.21.0" "torch==2.13.0"

.PHONY: install prometheus demo shell test test-fast typecheck bench bench-env mutants lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(DEV_PINS)
	$(PIP) install -q -e ".[torch,beam,http,jax,grain,text,metrics,dev]"
	touch $@

# the Prometheus server the metrics tests scrape with (Debian's package; CI runs as root)
PROMETHEUS := $(shell command -v prometheus 2>/dev/null)
prometheus:
ifeq ($(PROMETHEUS),)
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
endif

install: $(VENV)/.installed

# make cannot change the calling shell: `make shell` (and the end of `make demo`) print how to put
# `crossfeed` on PATH
ACTIVATE_NOTE := "crossfeed is installed in $(VENV)/bin: run 'source $(VENV)/bin/activate' to use the bare 'crossfeed' command (or run $(VENV)/bin/crossfeed)"

demo: install
	$(PY) -m crossfeed.demo demo_out
	@echo $(ACTIVATE_NOTE)

shell:
	@echo $(ACTIVATE_NOTE)

test: install prometheus
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(MAKE) typecheck
	$(PY) -m pytest -q

# the fast tier, to run while editing: every test not marked `slow` (pyproject's markers: fresh
# interpreters per framework, real clusters, kill and soak tests, multihost, fault matrices)
test-fast: install prometheus
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "not slow"

# mypy cannot follow setuptools' package-dir mapping (adapters/ and beam_jobs/ install as
# crossfeed.adapters and crossfeed.beam_jobs), so it checks a tree of links laid out as installed
TYPECHECK_TREE := build/typecheck
typecheck: install
	rm -rf $(TYPECHECK_TREE)/crossfeed
	mkdir -p $(TYPECHECK_TREE)/crossfeed
	ln -s $(CURDIR)/crossfeed/* $(TYPECHECK_TREE)/crossfeed/
	ln -s $(CURDIR)/adapters $(TYPECHECK_TREE)/crossfeed/adapters
	ln -s $(CURDIR)/beam_jobs $(TYPECHECK_TREE)/crossfeed/beam_jobs
	cd $(TYPECHECK_TREE) && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml -p crossfeed

bench: install
	$(PY) -m benchmarks.run_all

# mosaic streaming for benchmarks/bench_cache.py only, without its CUDA/torchvision dependencies
bench-env: install
	$(PIP) install -q --no-deps -r benchmarks/requirements-bench.txt

mutants: install  # break each fast path on purpose: a test must fail for every one
	$(PY) benchmarks/mutate_fast_paths.py

lint: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) demo_out benchmarks/_data
