# syntax=docker/dockerfile:1
# splitfuse-triton, GPU image: NVIDIA's Triton container (its own tritonserver in /opt/tritonserver)
# with CUDA PyTorch. 25.07 (Triton 2.59) is the first release with NVIDIA's August 2025 fixes for
# the Python backend's shared-memory chain (CVE-2025-23319, -23320, -23334) and HTTP chunked
# encoding (CVE-2025-23310, -23311); older images are affected. The launcher and the model
# repository are tested with Triton 2.51 (the nvidia-pytriton 0.7.0 wheel on CPU machines);
# TRITON_IMAGE picks another release (25.07 or later). The CPU image: Dockerfile.cpu.
#
#   docker build -t splitfuse-triton:gpu .
#   docker run --gpus all --shm-size 1g -p 8002-8003:8002-8003 -p 9000:9000 splitfuse-triton:gpu
#   docker run --gpus all --shm-size 1g -p 8002-8003:8002-8003 -p 9000:9000 \
#       -v /path/to/ckpt:/models/ckpt:ro -e SPLITFUSE_API_KEY splitfuse-triton:gpu \
#       --model /models/ckpt --param dtype=bfloat16 --admin-key-file /run/secrets/admin-key
#   Read-only:  docker run --read-only --tmpfs /tmp --tmpfs /cache:uid=1000,gid=1000 ...
#
# Ports: 9000 the OpenAI-compatible front (API key), 8002 Triton's metrics, 8003 the launcher's
# /live and /ready; Triton's 8000 HTTP and 8001 gRPC only on the container's loopback (no
# authentication: `--triton-proxy` serves the HTTP API through 9000 behind the key; see
# docs/security.md). deploy/docker/entrypoint.sh holds those defaults; the arguments
# given (or CMD) follow them. Under tini (PID 1) SIGTERM reaches the launcher, which lets
# in-flight generations finish for --drain-timeout seconds (30) before stopping Triton (10 s):
# `docker stop -t 60`.
#
# Stages: `base` (Triton + torch, shared), `build` (g++: the CPU kernels, the argument shim, the
# package's wheel, a demo checkpoint), the runtime (no compiler; the built files copied in).
# Not built or run on the development machines (no container engine there).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.07-py3

FROM ${TRITON_IMAGE} AS base
# Ubuntu 24.04 based images mark the system Python as externally managed; the engine must go
# into that Python (the one the Python backend stub embeds).
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1
# Plain `torch` from PyPI is the CUDA build; pin it to match your driver (TORCH_SPEC=torch==X.Y.Z,
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 for a given CUDA).
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple "${TORCH_SPEC}"

FROM base AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY backend/ backend/
COPY kernels/ kernels/
COPY model_repository/ model_repository/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir "$(ls /wheels/splitfuse_triton-*.whl)"
# The CPU kernels for x86-64-v3 (AVX2+FMA) by default, so they run on any such node, not just on
# CPUs like the build machine's (SPLITFUSE_CPU_ISA=native: this CPU's instruction set, for nodes
# exactly like it); the argument shim (it keeps the admin key off tritonserver's command line).
ARG SPLITFUSE_CPU_ISA=avx2
RUN mkdir -p /opt/splitfuse/lib \
    && SPLITFUSE_CPU_ISA="${SPLITFUSE_CPU_ISA}" SPLITFUSE_KERNEL_CACHE=/opt/splitfuse/cpu_kernels \
       python3 -c "from splitfuse.kernels.cpu.build import build; print(build())" \
    && XDG_CACHE_HOME=/tmp/shim python3 -c "import shutil; from splitfuse.launcher.hidden_args import shim; \
shutil.copy(shim(), '/opt/splitfuse/lib/libsplitfuse_argv_secrets.so')" \
    && python3 -m splitfuse.tools.demo_model /opt/splitfuse/models/demo --arch llama --size tiny

FROM base
# tini: PID 1 that forwards signals to the launcher and reaps orphans (`docker run --init` alike).
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/*
# The `serve` extra without nvidia-pytriton (this image has its own tritonserver, newer than the
# wheel's 2.51): tritonclient for the model configs and the OpenAI front's client, fastapi and
# uvicorn for the front, aiohttp and yarl for its --triton-proxy; `triton` (triton-lang) for the GPU kernels.
COPY --from=build /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir "$(ls /tmp/wheels/splitfuse_triton-*.whl)[triton]" \
        "tritonclient[all]" fastapi uvicorn aiohttp yarl \
    && rm -rf /tmp/wheels
ARG SPLITFUSE_CPU_ISA=avx2
COPY --from=build /opt/splitfuse/ /opt/splitfuse/
COPY deploy/docker/entrypoint.sh /opt/splitfuse/entrypoint.sh
# Caches: XDG_CACHE_HOME (GGUF conversions; the launcher's files) and triton-lang's kernels go to
# /cache, the one writable place besides /tmp (a read-only root filesystem: mount both).
# SPLITFUSE_KERNEL_CACHE and SPLITFUSE_ARGV_SHIM: the files built above. A node whose CPU lacks
# x86-64-v3 runs the engine's torch path (this image has no compiler to rebuild the kernels).
RUN mkdir -p /cache && chown 1000:1000 /cache
ENV SPLITFUSE_TRITON_ROOT=/opt/tritonserver \
    SPLITFUSE_KERNEL_CACHE=/opt/splitfuse/cpu_kernels \
    SPLITFUSE_CPU_ISA=${SPLITFUSE_CPU_ISA} \
    SPLITFUSE_ARGV_SHIM=/opt/splitfuse/lib/libsplitfuse_argv_secrets.so \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton
# uid 1000: triton-server, the non-root user of NVIDIA's Triton images.
USER 1000:1000
WORKDIR /tmp
# The public ports only: Triton's 8000 (HTTP) and 8001 (gRPC) listen on the container's loopback
# (deploy/docker/entrypoint.sh); 9000 forwards Triton's HTTP API with --triton-proxy.
EXPOSE 8002 8003 9000
# The launcher's /ready: Triton's llm model ready (503 while a crashed server is being restarted).
# Start period sized for Llama-3.1-8B in bf16: the launcher's ready timeout, 600 s + 30 s/GB x 16.1 GB
# = 1082 s, plus its own start: 1200 s. A .gguf's first-start conversion comes on top.
HEALTHCHECK --interval=15s --timeout=5s --start-period=1200s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8003/ready', timeout=4)"]
ENTRYPOINT ["tini", "--", "/opt/splitfuse/entrypoint.sh"]
CMD ["--model", "/opt/splitfuse/models/demo"]
