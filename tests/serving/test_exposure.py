"""What a server started by the launcher exposes: Triton's admin APIs (shared memory, model
repository, model config, statistics, trace, logging) answer only with the admin header, over
gRPC and HTTP, while inference, health, metadata and metrics stay open; the admin key is never
on a command line (tritonserver's, or the stubs') nor in the stubs' environment.

And what the images' entrypoint exposes (deploy/docker/entrypoint.sh, run as the image runs it):
the OpenAI front, metrics and health on every interface, Triton's unauthenticated HTTP and gRPC
ports on loopback only; with --triton-proxy, Triton's HTTP API through the front's port, behind
its API key (openai_api/triton_proxy.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
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


# ---- the images' entrypoint: Triton's ports on loopback, its HTTP API through the front ------

ENTRYPOINT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "entrypoint.sh"
API_KEY = "test-api-" + os.urandom(8).hex()
BEARER = {"Authorization": f"Bearer {API_KEY}"}


def _non_loopback_ipv4() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing), else the
    first of `hostname -I`; None when it has only loopback."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 9))
        ip = s.getsockname()[0]
        if not ipaddress.ip_address(ip).is_loopback and ip != "0.0.0.0":
            return ip
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for ip in subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split():
            if ipaddress.ip_address(ip).version == 4 and not ipaddress.ip_address(ip).is_loopback:
                return ip
    return None


@dataclass
class Entrypoint:
    ports: dict[str, int]
    ip: str | None
    lines: list[str]

    def url(self, name: str, host: str = "127.0.0.1") -> str:
        return f"{host}:{self.ports[name]}"


@pytest.fixture(scope="module")
def entrypoint(tiny_llama, tmp_path_factory):
    """The launcher as the images run it (their entrypoint's defaults: --host 0.0.0.0, Triton's
    ports on loopback), on free ports, with the front forwarding Triton's HTTP API."""
    from splitfuse.launcher import find_tritonserver, free_port

    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "health", "openai")}
    cmd = ["sh", str(ENTRYPOINT), "--model", tiny_llama, "--instances", "1", "--triton-proxy",
           "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
           "--metrics-port", str(ports["metrics"]), "--health-port", str(ports["health"]),
           "--openai-port", str(ports["openai"]), "--model-repository-out", str(tmp_path_factory.mktemp("ep") / "repo"),
           *(f"--param={k}={v}" for k, v in ENGINE_PARAMS.items())]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               SPLITFUSE_API_KEY=API_KEY)
    env.pop("SPLITFUSE_TRITON_ADMIN_KEY", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("splitfuse.launcher: ready"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(600) and proc.poll() is None, "".join(lines[-40:])
        yield Entrypoint(ports, _non_loopback_ipv4(), lines)
    finally:
        proc.send_signal(signal.SIGTERM)  # what tini forwards; a second signal kills at once
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def _connects(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=10).close()
        return True
    except ConnectionRefusedError:
        return False


def _status(url: str, headers: dict | None = None, data: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_entrypoint_keeps_tritons_ports_on_loopback(entrypoint):
    ep = entrypoint
    if ep.ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    for name in ("http", "grpc"):
        assert _connects("127.0.0.1", ep.ports[name]), f"Triton's {name} port is not up on loopback"
        assert not _connects(ep.ip, ep.ports[name]), f"Triton's {name} port answers on {ep.ip}"
    # The public ones answer on the machine's address: the front asks for its key.
    assert _status(f"http://{ep.ip}:{ep.ports['openai']}/v1/models") == 401
    assert _status(f"http://{ep.ip}:{ep.ports['openai']}/v1/models", BEARER) == 200
    assert _status(f"http://{ep.ip}:{ep.ports['metrics']}/metrics") == 200
    assert _status(f"http://{ep.ip}:{ep.ports['health']}/ready") == 200


def _preprocess_inputs(text: str) -> list:
    t = httpclient.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
    return [t]


def test_tritonclient_http_through_the_front_with_the_key(entrypoint):
    front = httpclient.InferenceServerClient(entrypoint.url("openai"))
    direct = httpclient.InferenceServerClient(entrypoint.url("http"))
    assert front.is_server_ready(headers=BEARER) and front.is_model_ready("llm", headers=BEARER)
    assert front.get_model_metadata("preprocessing", headers=BEARER)["name"] == "preprocessing"
    text = "The proxy relays " + os.urandom(4).hex()
    want = direct.infer("preprocessing", _preprocess_inputs(text)).as_numpy("input_ids")
    got = front.infer("preprocessing", _preprocess_inputs(text), headers=BEARER)
    assert got.as_numpy("input_ids").tolist() == want.tolist() and want.size > 3
    # A compressed answer passes as it is (the client decompresses it itself).
    gz = front.infer("preprocessing", _preprocess_inputs(text), headers=BEARER, response_compression_algorithm="gzip")
    assert gz.as_numpy("input_ids").tolist() == want.tolist()
    # Triton's admin APIs keep needing their own header behind the front.
    with pytest.raises(InferenceServerException) as e:
        front.get_model_repository_index(headers=BEARER)
    assert "restricted" in str(e.value) or e.value.status() == "403"


def _post(url: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    return urllib.request.urlopen(req, timeout=120)


def test_generate_and_generate_stream_through_the_front(entrypoint):
    body = {"text_input": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    path = "/v2/models/ensemble/generate"
    with _post(f"http://{entrypoint.url('http')}{path}", body) as r:
        want = json.load(r)["text_output"]
    with _post(f"http://{entrypoint.url('openai')}{path}", body, BEARER) as r:
        assert json.load(r)["text_output"] == want
    with _post(f"http://{entrypoint.url('openai')}{path}_stream", {**body, "stream": True}, BEARER) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in (raw.decode().rstrip("\r\n") for raw in r) if line.startswith("data:")]
    assert len(events) > 1 and "".join(e.get("text_output", "") for e in events) == want


def test_triton_through_the_front_needs_the_key(entrypoint):
    front = httpclient.InferenceServerClient(entrypoint.url("openai"))
    for headers in (None, {"Authorization": "Bearer a-wrong-key"}, {"Authorization": API_KEY}):
        with pytest.raises(InferenceServerException) as e:
            front.infer("preprocessing", _preprocess_inputs("hello"), headers=headers)
        assert e.value.status() == "401", e.value
        assert _status(f"http://{entrypoint.url('openai')}/v2/health/ready", headers) == 401
    body = json.dumps({"text_input": "hello", "max_tokens": 2}).encode()
    assert _status(f"http://{entrypoint.url('openai')}/v2/models/ensemble/generate", None, body) == 401


def _raw_post(port: int, path: str, headers: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a socket of its own: (status, response body start)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        with contextlib.suppress(OSError):  # the server may answer and close before the body is in
            s.sendall(body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 32:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def test_the_front_bounds_what_it_forwards(entrypoint):
    port = entrypoint.ports["openai"]
    auth = f"Authorization: Bearer {API_KEY}\r\n"
    path = "/v2/models/preprocessing/infer"
    # Declared too large: refused before any of it is read.
    status, body = _raw_post(port, path, f"{auth}Content-Length: {2**40}\r\n", b"")
    assert status == 413, body
    limit = int(re.search(rb"limit of (\d+) bytes", body).group(1))
    # Chunked, no declared length: refused once more than the limit has arrived.
    chunk = b"x" * 65536
    stream = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(limit // len(chunk) + 2)) + b"0\r\n\r\n"
    status, body = _raw_post(port, path, f"{auth}Transfer-Encoding: chunked\r\n", stream)
    assert status == 413 and f"limit of {limit} bytes".encode() in body, body
    # Dot segments never reach Triton; the front and Triton still serve.
    assert _status(f"http://127.0.0.1:{port}/v2/models/%2e%2e/%2e%2e/metrics", BEARER) == 400
    front = httpclient.InferenceServerClient(entrypoint.url("openai"))
    assert front.infer("preprocessing", _preprocess_inputs("still served"), headers=BEARER).as_numpy("input_ids").size
