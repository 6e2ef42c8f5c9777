"""Launching the real Triton Inference Server with the splitfuse model repository.

One job per module:
    triton_install.py  find tritonserver; a backend directory with the stub for this Python
    repository.py      render model_repository/ with the checkpoint and engine parameters
    process.py         run one server process: ports, readiness, drain, stop (`serve()`)
    cli.py             `python -m splitfuse.launcher` (what `make serve` runs)

Tests and benchmarks reuse the pieces:

    with serve(model_dir, params={"num_kv_blocks": "256"}) as server:
        server.grpc_url, server.http_url, server.metrics_url
"""

from splitfuse.launcher.process import TritonServer, free_port, port_is_free, serve
from splitfuse.launcher.repository import default_template_dir, parse_params, render_model_repository
from splitfuse.launcher.triton_install import TritonInstall, build_backend_dir, find_tritonserver, server_env

__all__ = ["TritonInstall", "TritonServer", "build_backend_dir", "default_template_dir", "find_tritonserver",
           "free_port", "parse_params", "port_is_free", "render_model_repository", "serve", "server_env"]
