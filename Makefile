# splitfuse-triton: two commands on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Demo checkpoint built locally when MODEL is not given.
DEMO_MODEL ?= models/demo
MODEL ?=
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI-compatible front beside Triton (0: not started).
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=

.PHONY: install kernels perf-tools serve test test-fast demo-model bench clean

install: $(VENV)/.installed

# torch 2.13.0 is pinned first: it is the CPU build that lies on these machines' disk
# (an unpinned torch would pull a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[triton,serve,dev]'
	$(MAKE) kernels
	touch $@

# The C++ CPU kernels, compiled for this machine's CPU (-march=native) into a cache keyed by
# sources, compiler and CPU flags; also built on first use. No compiler: the torch path runs.
kernels:
	$(PY) -m splitfuse.kernels.cpu.build

$(DEMO_MODEL)/config.json: | install
	$(PY) -m splitfuse.demo_model $(DEMO_MODEL) --arch llama --size tiny

demo-model: $(DEMO_MODEL)/config.json

serve: install kernels $(if $(MODEL),,$(DEMO_MODEL)/config.json)
	$(PY) -m splitfuse.launcher --model "$(if $(MODEL),$(MODEL),$(DEMO_MODEL))" \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT) $(SERVE_ARGS)

# genai-perf 0.0.16 (its own venv) and the perf_analyzer 2.50 binary it drives, under perf/
# (git-ignored; see perf/README.md). `make test` runs the genai-perf test with them; when the
# set-up cannot fetch them, that test skips and says why.
perf-tools:
	-perf/setup_genai_perf.sh

test: install kernels perf-tools
	$(PY) -m pytest -q -rs --timeout=900 $(PYTEST_ARGS) tests

bench: install
	$(PY) perf/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info models
