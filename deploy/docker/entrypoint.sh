#!/bin/sh
# The images' entrypoint (Dockerfile, Dockerfile.cpu), run under tini: tini is PID 1, forwards
# SIGTERM/SIGINT to this process and reaps orphaned children. `exec` makes the launcher this very
# process, so `docker stop` / a pod's deletion reaches it directly: it drains in-flight
# generations (--drain-timeout, 30 s), then stops Triton (--exit-timeout, 10 s).
#
# The container defaults come first, then the arguments given (`docker run IMAGE ARGS...`, the
# Kubernetes container's args, or the image's CMD `--model /opt/splitfuse/models/demo`); a flag
# given again overrides its default (argparse: the last one wins).
#   --host 0.0.0.0     the public ports on the container's own interface: 9000 the OpenAI-compatible
#                      front (its bearer key from env SPLITFUSE_API_KEY; `--openai-port 0` turns it
#                      off), 8002 Triton's metrics, 8003 the launcher's /live and /ready (HEALTHCHECK)
#   --triton-host 127.0.0.1   Triton's HTTP (8000) and gRPC (8001) ports stay on the container's
#                      loopback: they have no authentication, and reach every guide the engine has.
#                      `--triton-proxy` serves Triton's HTTP API through 9000 behind the API key;
#                      `--triton-host 0.0.0.0` opens both ports (only behind a network policy).
set -eu
exec python3 -m splitfuse.launcher \
    --host 0.0.0.0 --triton-host 127.0.0.1 --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
    --openai-port 9000 --health-port 8003 \
    "$@"
