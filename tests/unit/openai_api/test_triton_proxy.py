"""triton_proxy driven directly: what it refuses before any work (dot segments, too many in
flight, a body over the limit), what it does not pass on (hop-by-hop headers, the client's
key), its answer when Triton is not there, and that it never runs without an API key. The
whole path through a real server: tests/serving/test_exposure.py."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from splitfuse.openai_api.config import ApiConfig
from splitfuse.openai_api.protocol import ApiError
from splitfuse.openai_api.triton_proxy import REQUEST_DROP, TritonProxy, _check_path, _headers, install
from splitfuse.utils.ports import free_port


def _request(path: str = "/v2/models/m/infer", body: list[bytes] | None = None,
             headers: list[tuple[bytes, bytes]] | None = None) -> Request:
    chunks = list(body or [b""])

    async def receive():
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers or []}
    return Request(scope, receive)


@pytest.mark.parametrize("path", [b"/v2/../metrics", b"/v2/models/./x", b"/v2/%2e%2e/x", b"/v2/%2E%2E/x",
                                  b"/v2/.%2e/x", b"/v2/models/%2e/x"])
def test_dot_segments_are_refused(path):
    with pytest.raises(ApiError) as e:
        _check_path(path)
    assert e.value.status == 400


def test_plain_paths_pass():
    for path in (b"/v2", b"/v2/", b"/v2/models/ensemble/generate_stream", b"/v2/models/a.b..c/infer"):
        _check_path(path)


def test_hop_by_hop_headers_and_the_key_stay_behind():
    raw = [(b"Authorization", b"Bearer k"), (b"Connection", b"keep-alive, X-Private"), (b"X-Private", b"1"),
           (b"Host", b"front"), (b"Content-Length", b"3"), (b"Transfer-Encoding", b"chunked"),
           (b"Inference-Header-Content-Length", b"42"), (b"Accept", b"a"), (b"Accept", b"b")]
    assert _headers(raw, REQUEST_DROP) == [(b"Inference-Header-Content-Length", b"42"), (b"Accept", b"a"),
                                           (b"Accept", b"b")]


def test_too_many_in_flight_is_refused_before_the_body_is_read():
    proxy = TritonProxy(f"127.0.0.1:{free_port()}", max_body_bytes=10, max_in_flight=2)
    proxy.in_flight = 2
    with pytest.raises(ApiError) as e:
        asyncio.run(proxy.forward(_request(body=[b"x" * 100])))
    assert e.value.status == 503 and "limit 2" in e.value.message and e.value.headers["Retry-After"]
    assert proxy.in_flight == 2


def test_a_body_over_the_limit_is_refused_and_releases_its_place():
    proxy = TritonProxy(f"127.0.0.1:{free_port()}", max_body_bytes=10)
    with pytest.raises(ApiError) as e:  # chunked: no declared length, refused as it arrives
        asyncio.run(proxy.forward(_request(body=[b"x" * 6, b"y" * 6])))
    assert e.value.status == 413 and "limit of 10 bytes" in e.value.message
    with pytest.raises(ApiError) as e:  # declared
        asyncio.run(proxy.forward(_request(body=[b"x"], headers=[(b"content-length", b"11")])))
    assert e.value.status == 413
    assert proxy.in_flight == 0


def test_triton_not_there_is_a_502_and_releases_its_place():
    proxy = TritonProxy(f"127.0.0.1:{free_port()}", max_body_bytes=100)

    async def go():
        try:
            await proxy.forward(_request(body=[b"{}"]))
        finally:
            await proxy.close()

    with pytest.raises(ApiError) as e:
        asyncio.run(go())
    assert e.value.status == 502 and "Triton's HTTP endpoint did not answer" in e.value.message
    assert proxy.in_flight == 0


def test_the_proxy_needs_an_api_key(tiny_llama):
    with pytest.raises(ValueError, match="needs an API key"):
        ApiConfig(model_dir=tiny_llama, triton_http_proxy="127.0.0.1:8000")
    config = ApiConfig(model_dir=tiny_llama)
    from fastapi import FastAPI

    app = FastAPI()
    assert install(app, config, 100) is None and not [r for r in app.routes if r.path.startswith("/v2")]
    config.triton_http_proxy = "127.0.0.1:8000"  # set after validation: install refuses it too
    with pytest.raises(ValueError, match="needs an API key"):
        install(app, config, 100)
    config.api_key = "k"
    assert install(app, config, 100) is not None
    assert {r.path for r in app.routes} >= {"/v2", "/v2/{path:path}"}
