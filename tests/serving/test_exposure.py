"""What a server started by the launcher exposes: Triton's admin APIs (shared memory, model
repository, model config, statistics, trace, logging) answer only with the admin header, over
gRPC and HTTP, while inference, health, metadata and metrics stay open; the admin key is never
on a command line (tritonserver's, or the stubs') nor in the stubs' environment."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from conftest import ENGINE_PARAMS
from triton_helpers import InferenceServerException, child_pids, grpc_generate

from splitfuse.kernels.toolchain import compiler
from splitfuse.launcher.process import ADMIN_HEADER, GRPC_ADMIN_HEADER

pytestmark = pytest.mark.serving

ADMIN_KEY = "test-admin-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C++ compiler: an admin key cannot be kept off the command line here")
    from splitfuse.launcher import serve

    with serve(tiny_llama, ENGINE_PARAMS, workdir=tmp_path_factory.mktemp("exposure"), admin_key=ADMIN_KEY) as srv:
        yield srv


def _http(server, method: str, path: str, body: dict | None = None, admin: bool = False) -> int:
    headers = {"Content-Type": "application/json", **({ADMIN_HEADER: ADMIN_KEY} if admin else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _descendants(pid: int) -> list[int]:
    out, frontier = [], [pid]
    while frontier:
        kids = child_pids(frontier.pop())
        out += kids
        frontier += kids
    return out


def test_the_admin_key_is_on_no_command_line_and_in_no_stub_environment(server):
    pids = [server.process.pid, *_descendants(server.process.pid)]
    assert len(pids) >= 3  # tritonserver and the stubs of llm and preprocessing
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert ADMIN_KEY.encode() not in cmdline, pid
    assert b"--grpc-restricted-protocol=" in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    for pid in pids[1:]:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert ADMIN_KEY.encode() not in environ and b"SPLITFUSE_SECRET_" not in environ, pid
        assert b"argv_secrets" not in environ  # LD_PRELOAD is back as it was for the stubs


def test_grpc_admin_apis_need_the_header(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    admin = {GRPC_ADMIN_HEADER: ADMIN_KEY}
    refused = [
        lambda h: client.get_model_config("llm", headers=h),
        lambda h: client.get_inference_statistics("llm", headers=h),
        lambda h: client.get_model_repository_index(headers=h),
        lambda h: client.get_log_settings(headers=h),
        lambda h: client.get_trace_settings(headers=h),
        lambda h: client.get_system_shared_memory_status(headers=h),
    ]
    for call in refused:
        with pytest.raises(InferenceServerException, match="restricted"):
            call(None)
        with pytest.raises(InferenceServerException, match="restricted"):
            call({GRPC_ADMIN_HEADER: "a-wrong-key"})
        call(admin)  # the operator's key opens it
    with pytest.raises(InferenceServerException, match="restricted"):
        client.unload_model("llm")
    # Open to everyone: health, metadata, inference.
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("llm")
    assert client.get_model_metadata("llm").name == "llm" and client.get_server_metadata().name
    r = grpc_generate(server.grpc_url, "llm", {"text_input": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.error is None and len(r.output_ids) == 3


def test_http_admin_apis_need_the_header(server):
    for method, path, body in [("GET", "/v2/models/llm/config", None), ("GET", "/v2/models/llm/stats", None),
                               ("POST", "/v2/repository/index", {}), ("GET", "/v2/logging", None),
                               ("GET", "/v2/trace/setting", None), ("GET", "/v2/systemsharedmemory/status", None)]:
        assert _http(server, method, path, body) == 403, path
        assert _http(server, method, path, body, admin=True) == 200, path
    assert _http(server, "GET", "/v2/health/ready") == 200
    assert _http(server, "GET", "/v2/models/llm") == 200  # metadata
    with urllib.request.urlopen(server.metrics_url, timeout=30) as r:
        assert b"splitfuse_engine_healthy" in r.read()
