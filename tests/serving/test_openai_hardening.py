"""The OpenAI front safe by default (issue 37), against the real tritonserver: request bodies are
bounded while they arrive (413 in OpenAI's error shape, neighbours unharmed), and the launcher's
Ctrl-C drains Triton before the front stops, so open streams end with a finish_reason and
`data: [DONE]` and whole requests get their answer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai_helpers import start_api, stop_api
from triton_helpers import metric_sum, wait_for

openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

from splitfuse.launcher import find_tritonserver, free_port  # noqa: E402
from splitfuse.openai_api.body import DEFAULT_MAX_BODY_BYTES  # noqa: E402

pytestmark = pytest.mark.serving

PROMPT = "the quick brown fox jumps over"
MAX_MODEL_LEN = 2048  # as in test_openai_api.py


@pytest.fixture(scope="module")
def api(openai_front):
    """The session's shared front (conftest.py), started with --max-model-len MAX_MODEL_LEN."""
    return openai_front


def _sse_events(response: requests.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            yield line.removeprefix("data: ")


def _read_stream(events: Iterator[str]) -> tuple[list[dict], list[str]]:
    """(the JSON chunks, every payload) until the stream ends."""
    payloads = list(events)
    return [json.loads(p) for p in payloads if p != "[DONE]"], payloads


def _assert_too_large(status: int, body: dict, limit: int) -> None:
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error", err
    assert str(limit) in err["message"] and "--max-body-bytes" in err["message"], err


# ---- request body bound ---------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_and_a_concurrent_stream_finishes_intact(api):
    body = {"model": api.model, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    whole = requests.post(api.base_url + "/v1/completions", json=body, timeout=120).json()
    with requests.post(api.base_url + "/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=120) as streamed:
        assert streamed.status_code == 200
        events = _sse_events(streamed)
        first = json.loads(next(events))
        # While that stream is open: a prompt whose body is one byte over the default limit
        # (declared by Content-Length, refused before it is read), through the SDK.
        with pytest.raises(openai.APIStatusError) as e:
            api.client().completions.create(model=api.model, prompt="a" * DEFAULT_MAX_BODY_BYTES, max_tokens=1)
        _assert_too_large(e.value.status_code, {"error": e.value.body}, DEFAULT_MAX_BODY_BYTES)
        chunks, payloads = _read_stream(events)
    chunks = [first, *chunks]
    assert payloads[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
    # The front goes on answering.
    again = requests.post(api.base_url + "/v1/completions", json=body, timeout=120).json()
    assert again["choices"][0]["text"] == whole["choices"][0]["text"]


def test_cache_salt_is_passed_to_the_engine_and_bounded(api, served):
    """A salted request computes its prompt apart from the unsalted one (the server's prefix-cache
    counters show a miss), and gets the same greedy tokens; an empty salt is a 400 naming it."""
    client = api.client()
    prompt = "a prompt long enough to fill a few KV blocks of sixteen tokens each, " * 4
    plain = client.completions.create(model=api.model, prompt=prompt, max_tokens=4, temperature=0)
    hits = lambda: metric_sum(served.metrics_url, "splitfuse_prefix_cache_hits_total")  # noqa: E731
    queries = lambda: metric_sum(served.metrics_url, "splitfuse_prefix_cache_queries_total")  # noqa: E731
    for salt in ("tenant-x", "tenant-y"):
        before_hits, before_queries = hits(), queries()
        salted = client.completions.create(model=api.model, prompt=prompt, max_tokens=4, temperature=0,
                                           extra_body={"cache_salt": salt})
        assert salted.choices[0].text == plain.choices[0].text
        assert wait_for(lambda: queries() > before_queries)
        assert hits() == before_hits  # a new salt finds nothing cached, on either replica
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=api.model, prompt=prompt, max_tokens=4, extra_body={"cache_salt": ""})


def test_a_chunked_body_is_cut_at_the_limit_not_read_to_its_end(served, tmp_path):
    """A chunked body declares no length: the front must stop reading at the limit. The client
    below would send 1 GiB; it gets the 413 after the limit plus what the sockets buffer."""
    limit = 100_000
    small = start_api(served.model_dir, served.grpc_url, tmp_path, "small", "--max-model-len", str(MAX_MODEL_LEN),
                      "--max-body-bytes", str(limit))
    sent = 0

    def endless() -> Iterator[bytes]:
        nonlocal sent
        yield json.dumps({"model": small.model, "max_tokens": 1})[:-1].encode() + b', "prompt": "'
        for _ in range(2**14):
            sent += 2**16
            yield b"a" * 2**16
        yield b'"}'

    try:
        r = requests.post(small.base_url + "/v1/completions", data=endless(),
                          headers={"Content-Type": "application/json"}, timeout=120)
        _assert_too_large(r.status_code, r.json(), limit)
        # (2.7 MB here: the kernel's socket buffers; reading to the end would take all 1 GiB.)
        assert sent < 2**26, f"{sent} bytes were taken before the 413"
        # A body within the limit is served.
        ok = requests.post(small.base_url + "/v1/completions", timeout=120,
                           json={"model": small.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        stop_api(small)


# ---- graceful stop of the launcher ----------------------------------------------------------


class Launcher:
    """`python -m splitfuse.launcher` with the OpenAI front, its output collected line by line."""

    def __init__(self, model: str, repo: Path, drain_timeout_s: float) -> None:
        self.ports = [free_port() for _ in range(4)]
        http, grpc, metrics, self.openai_port = self.ports
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.openai_url = f"http://127.0.0.1:{self.openai_port}"
        cmd = [sys.executable, "-m", "splitfuse.launcher", "--model", model, "--http-port", str(http),
               "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(self.openai_port),
               "--param", "device=cpu", "--param", "num_kv_blocks=4096", "--param", "num_threads=1",
               "--drain-timeout", str(drain_timeout_s), "--model-repository-out", str(repo)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready, self.draining = threading.Event(), threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("splitfuse.launcher: ready"):
                self.ready.set()
            if line.startswith("splitfuse.launcher: draining"):
                self.draining.set()

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def close(self) -> None:
        """Never leave a tritonserver behind: a second signal kills it."""
        for _ in range(2):
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        self.reader.join(timeout=5)


def test_ctrl_c_ends_open_streams_with_a_finish_reason_and_done(tiny_model_factory, tmp_path):
    """Ctrl-C with a stream and a whole request in flight through the front: Triton drains
    first (a new request then gets a 503 from the front), the rest is aborted, the stream's last
    chunk carries its finish_reason followed by [DONE], the whole request gets its answer, and
    the launcher exits 0. Before, the front stopped first and cut the stream short."""
    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # Long enough that neither generation can end within the drain (the tiny model makes
    # ~1,400-3,000 tokens/s per sequence on these CPUs); 4096 blocks hold both.
    model = tiny_model_factory("llama", max_position_embeddings=32768)
    launcher = Launcher(model, tmp_path / "repo", drain_timeout_s=3.0)
    try:
        assert launcher.ready.wait(600), launcher.log()
        name = Path(model).name
        long = {"model": name, "prompt": PROMPT, "max_tokens": 30000, "temperature": 0, "ignore_eos": True}
        url = launcher.openai_url + "/v1/completions"
        whole: dict = {}
        waiting = threading.Thread(target=lambda: whole.update(requests.post(url, json=long, timeout=300).json()))
        waiting.start()
        with requests.post(url, json={**long, "stream": True}, stream=True, timeout=300) as streamed:
            assert streamed.status_code == 200
            events = _sse_events(streamed)
            first = json.loads(next(events))
            assert wait_for(lambda: metric_sum(launcher.metrics_url, "splitfuse_requests", state="running") == 2,
                            timeout=60), "the whole request did not reach the engine"
            launcher.proc.send_signal(signal.SIGINT)
            assert launcher.draining.wait(60), launcher.log()
            late = requests.post(url, json={**long, "max_tokens": 4}, timeout=60)
            assert late.status_code == 503, late.text
            assert late.json()["error"]["type"] == "server_error" and "shutting down" in late.json()["error"]["message"]
            chunks, payloads = _read_stream(events)
        waiting.join(timeout=120)
        assert not waiting.is_alive() and "choices" in whole, (whole, launcher.log())
        chunks = [first, *chunks]
        assert payloads[-1] == "[DONE]", payloads[-3:]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] in ("abort", "length"), chunks[-1]
        choice = whole["choices"][0]
        assert choice["finish_reason"] in ("abort", "length") and choice["text"], whole
        assert whole["usage"]["completion_tokens"] >= 1
        assert launcher.proc.wait(timeout=120) == 0, launcher.log()
        with pytest.raises(requests.ConnectionError):  # the front stopped with the launcher
            requests.get(launcher.openai_url + "/health", timeout=5)
    finally:
        launcher.close()
    out = "".join(launcher.lines)
    assert "tritonserver exited with code 0" in out, out[-4000:]
