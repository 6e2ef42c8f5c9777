"""The scripts in client_examples/ run against the test server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openai_helpers import start_api, stop_api

pytestmark = pytest.mark.serving

EXAMPLES = Path(__file__).resolve().parents[2] / "client_examples"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_grpc_stream_example(served):
    out = _run(sys.executable, str(EXAMPLES / "grpc_stream.py"), "--url", served.grpc_url, "--max-tokens", "8")
    assert "finish: length" in out.stderr or "finish: stop" in out.stderr
    out = _run(sys.executable, str(EXAMPLES / "grpc_stream.py"), "--url", served.grpc_url, "--max-tokens", "3000",
               "--cancel-after", "3")
    assert "cancelled by the client" in out.stderr


def test_http_stream_example(served):
    for extra in ([], ["--no-stream"]):
        out = _run(sys.executable, str(EXAMPLES / "http_stream.py"), "--url", served.http_url, "--max-tokens", "8",
                   *extra)
        assert "finish:" in out.stderr


def test_concurrent_clients_example(served):
    out = _run(sys.executable, str(EXAMPLES / "concurrent_clients.py"), "--url", served.grpc_url, "--clients", "8",
               "--max-tokens", "16")
    assert out.stdout.startswith("8 clients")


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_example(served):
    out = _run("bash", str(EXAMPLES / "curl.sh"), served.http_url)
    assert out.stdout.count('"text_output"') >= 3 and "error" not in out.stdout


def test_ensemble_chat_example(served):
    out = _run(sys.executable, str(EXAMPLES / "ensemble_chat.py"), "--url", served.grpc_url, "--max-tokens", "8",
               "Say hello")
    assert "finish: length" in out.stderr or "finish: stop" in out.stderr


def test_openai_chat_example(served, tmp_path):
    api = start_api(served.model_dir, served.grpc_url, tmp_path, "examples-api")
    try:
        out = _run(sys.executable, str(EXAMPLES / "openai_chat.py"), "--base-url", api.base_url + "/v1",
                   "--max-tokens", "8", "Say hello")
    finally:
        stop_api(api)
    assert f"[model {api.model}, finish: " in out.stderr and "completion tokens" in out.stderr
