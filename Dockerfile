# splitfuse-triton on NVIDIA's Triton container of the matching release:
# 24.10 ships Triton 2.51, the version the launcher and the model repository are tested with
# (through the nvidia-pytriton 0.7.0 wheel on CPU machines).
#
#   docker build -t splitfuse-triton .
#   docker run --gpus all --shm-size 1g -p 8000:8000 -p 8001:8001 -p 8002:8002 splitfuse-triton
#   docker run --gpus all --shm-size 1g -p 8000-8002:8000-8002 -v /path/to/ckpt:/models/ckpt \
#       splitfuse-triton --model /models/ckpt --param dtype=bfloat16 --param kv_cache_memory_gb=20
#
# `docker stop` sends SIGTERM to the launcher (PID 1), which lets in-flight generations finish
# for --drain-timeout seconds (default 30) before stopping Triton: use `docker stop -t 60`.
#
# Not built or run on the development machines (no Docker engine there).
FROM nvcr.io/nvidia/tritonserver:24.10-py3

# The container's Python (3.10) is the one its Python backend stub embeds, so the engine is
# installed into it. Plain `torch` from PyPI is the CUDA build; pin it to match your driver.
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

# A tiny random-weight demo checkpoint, so the image serves something out of the box.
RUN python3 -m splitfuse.demo_model /opt/splitfuse/models/demo --arch llama --size tiny

EXPOSE 8000 8001 8002
# In a container the ports must be reachable through the container's own interface; the
# launcher's default elsewhere is loopback only.
ENTRYPOINT ["python3", "-m", "splitfuse.launcher", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
CMD ["--model", "/opt/splitfuse/models/demo"]
