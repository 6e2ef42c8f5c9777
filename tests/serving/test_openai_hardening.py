"""The OpenAI front safe by default (issue 37), against the real tritonserver: request bodies are
bounded while they arrive (413 in OpenAI's error shape, neighbours unharmed)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from openai_helpers import start_api, stop_api

openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

from splitfuse.openai_api.body import DEFAULT_MAX_BODY_BYTES  # noqa: E402

pytestmark = pytest.mark.serving

PROMPT = "the quick brown fox jumps over"
MAX_MODEL_LEN = 2048  # as in test_openai_api.py


@pytest.fixture(scope="module")
def api(served, tmp_path_factory):
    a = start_api(served.model_dir, served.grpc_url, tmp_path_factory.mktemp("openai-hardening"), "api",
                  "--max-model-len", str(MAX_MODEL_LEN))
    yield a
    stop_api(a)


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

