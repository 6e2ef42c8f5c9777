# splitfuse-triton on NVIDIA's Triton container. 25.07 (Triton 2.59) is the first release with
# NVIDIA's August 2025 fixes for the Python backend's shared-memory chain (CVE-2025-23319,
# -23320, -23334) and HTTP chunked encoding (CVE-2025-23310, -23311); older images are affected.
# The launcher and the model repository are tested with Triton 2.51 (the nvidia-pytriton 0.7.0
# wheel on CPU machines); TRITON_IMAGE picks another release.
#
#   docker build -t splitfuse-triton .
#   docker run --gpus all --shm-size 1g -p 8000:8000 -p 8001:8001 -p 8002:8002 splitfuse-triton
#   docker run --gpus all --shm-size 1g -p 8000-8002:8000-8002 -v /path/to/ckpt:/models/ckpt \
#       -e SPLITFUSE_TRITON_ADMIN_KEY splitfuse-triton --model /models/ckpt --param dtype=bfloat16
#
# `docker stop` sends SIGTERM to the launcher (PID 1), which lets in-flight generations finish
# for --drain-timeout seconds (default 30) before stopping Triton: use `docker stop -t 60`.
#
# Not built or run on the development machines (no Docker engine there).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.07-py3
FROM ${TRITON_IMAGE}

# Ubuntu 24.04 based images mark the system Python as externally managed; the engine must go
# into that Python (the one the Python backend stub embeds).
ENV PIP_BREAK_SYSTEM_PACKAGES=1
# g++ builds the CPU kernels and the launcher's argument shim (which keeps the admin key off
# tritonserver's command line) on the machine that runs them.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Plain `torch` from PyPI is the CUDA build; pin it to match your driver.
ARG TORCH_SPEC=torch
RUN pip install --no-cache-dir "${TORCH_SPEC}"

WORKDIR /opt/splitfuse
COPY pyproject.toml README.md ./
COPY backend/ backend/
COPY kernels/ kernels/
# The launcher needs tritonclient (model config protos) but not nvidia-pytriton: the container
# has its own tritonserver in /opt/tritonserver, which the launcher finds.
RUN pip install --no-cache-dir ".[triton]" "tritonclient[grpc,http]"

COPY model_repository/ model_repository/
COPY client_examples/ client_examples/
ENV SPLITFUSE_MODEL_REPOSITORY=/opt/splitfuse/model_repository \
    SPLITFUSE_TRITON_ROOT=/opt/tritonserver

# A tiny random-weight demo checkpoint, so the image serves something out of the box; the
# argument shim built ahead.
RUN python3 -m splitfuse.demo_model /opt/splitfuse/models/demo --arch llama --size tiny \
    && python3 -c "from splitfuse.launcher.hidden_args import shim; assert shim() is not None"

EXPOSE 8000 8001 8002
# In a container the ports must be reachable through the container's own interface; the
# launcher's default elsewhere is loopback only.
ENTRYPOINT ["python3", "-m", "splitfuse.launcher", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
CMD ["--model", "/opt/splitfuse/models/demo"]
