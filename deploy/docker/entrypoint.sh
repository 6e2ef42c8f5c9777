#!/bin/sh
# The images' entrypoint (Dockerfile, Dockerfile.cpu), run under tini: tini is PID 1, forwards
# SIGTERM/SIGINT to this process and reaps orphaned children. `exec` makes the launcher this very
# process, so `docker stop` / a pod's deletion reaches it directly: it drains in-flight
# generations (--drain-timeout, 30 s), then stops Triton (--exit-timeout, 10 s).
#
# The container defaults come first, then the arguments given (`docker run IMAGE ARGS...`, the
# Kubernetes container's args, or the image's CMD `--model /opt/splitfuse/models/demo`); a flag
# given again overrides its default (argparse: the last one wins).
#   --host 0.0.0.0     the container's own interface (the launcher's default is loopback only)
#   8000 http, 8001 grpc, 8002 metrics: Triton; 9000: the OpenAI-compatible front (`--openai-port 0`
#   turns it off; its bearer key comes from env SPLITFUSE_API_KEY); 8003: the launcher's /live and
#   /ready (the HEALTHCHECK asks /ready).
set -eu
exec python3 -m splitfuse.launcher \
    --host 0.0.0.0 --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
    --openai-port 9000 --health-port 8003 \
    "$@"
