"""Triton's HTTP API through the front: `/v2/...` forwarded to Triton's HTTP endpoint.

Triton's own endpoints have no authentication, so the launcher keeps them on loopback. Clients
that need Triton's protocol (tritonclient.http, generate / generate_stream, KServe v2 infer)
reach it here, on the front's port, behind the same API key as /v1: the key check is the app's
middleware (auth.py), which guards every path but a few open ones, so nothing is checked twice.
A request body is read within the front's body limit (body.read_body, 413 beyond) and sent
whole; the response is relayed as it arrives (generate_stream's events one by one), never
gathered. Triton's admin APIs still need their own header, which passes like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from yarl import URL

from splitfuse.openai_api.body import read_body
from splitfuse.openai_api.config import ApiConfig
from splitfuse.openai_api.http_errors import RETRY_AFTER_S
from splitfuse.openai_api.protocol import ApiError

# Proxied requests at once (open streams included); one more gets a 503 before any work.
MAX_IN_FLIGHT = 256
# Seconds to get a connection to Triton; a generation may then take as long as it takes.
CONNECT_TIMEOUT_S = 10.0
METHODS = ("GET", "POST")
# Headers of one hop only (RFC 9110 7.6.1): never passed on.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade"})
# Also dropped on the way in: the client's key is the front's business, not Triton's, and the
# length and host are the new request's own.
REQUEST_DROP = HOP_BY_HOP | {"authorization", "host", "content-length"}
# What aiohttp would otherwise add by itself: the request reaches Triton as the client sent it
# (an Accept-Encoding the client never sent would get it a compressed body it cannot read).
NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")


def _headers(raw: list[tuple[bytes, bytes]], drop: frozenset[str]) -> list[tuple[bytes, bytes]]:
    """`raw` without `drop` and without the headers its Connection header names."""
    drop = drop | {v.strip().lower() for k, value in raw if k.lower() == b"connection"
                   for v in value.decode("latin-1").split(",")}
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in drop]


def _check_path(raw_path: bytes) -> None:
    """No dot segments: the forwarded path must stay under /v2 whatever Triton makes of it."""
    segments = raw_path.split(b"/")
    if any(s in (b".", b"..") or s.lower() in (b"%2e", b"%2e%2e", b".%2e", b"%2e.") for s in segments):
        raise ApiError(400, "the path has a '.' or '..' segment")


class _Relay(StreamingResponse):
    """Triton's response, relayed as it arrives; `done` runs however the relay ends (finished,
    the client gone, or never started)."""

    def __init__(self, upstream: aiohttp.ClientResponse, headers: list[tuple[bytes, bytes]], done) -> None:
        super().__init__(self._chunks(upstream), status_code=upstream.status)
        self.raw_headers = headers  # Triton's, duplicates kept (a Mapping would merge them)
        self._upstream, self._done = upstream, done

    @staticmethod
    async def _chunks(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        async for chunk in upstream.content.iter_any():
            yield chunk

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._upstream.content.at_eof():
                self._upstream.release()
            else:  # the client left mid-stream: drop the connection, so Triton sees it go too
                self._upstream.close()
            self._done()


class TritonProxy:
    """Forwards requests to Triton's HTTP endpoint `triton_http_url` (host:port)."""

    def __init__(self, triton_http_url: str, max_body_bytes: int, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.base = f"http://{triton_http_url}"
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the event loop that serves the requests.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_in_flight),
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S),
                auto_decompress=False, skip_auto_headers=NO_AUTO_HEADERS)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _release(self) -> None:
        self.in_flight -= 1

    async def forward(self, request: Request) -> Response:
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        _check_path(raw_path)
        if self.in_flight >= self.max_in_flight:
            raise ApiError(503, f"too many requests to Triton's API in flight through this server (limit "
                                f"{self.max_in_flight}); retry", type_="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += 1
        relayed = False
        try:
            try:
                body = await read_body(request, self.max_body_bytes)
            except ClientDisconnect:  # gone before its body was in: nobody to answer
                return Response(status_code=499)
            query = request.scope.get("query_string", b"")
            url = URL(self.base + raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else ""),
                      encoded=True)
            headers = [(k.decode("latin-1"), v.decode("latin-1"))
                       for k, v in _headers(request.headers.raw, REQUEST_DROP)]
            try:
                upstream = await self._client().request(request.method, url, headers=headers,
                                                        data=body if body or request.method != "GET" else None,
                                                        allow_redirects=False)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise ApiError(502, f"Triton's HTTP endpoint did not answer: {type(e).__name__}: {e}",
                               type_="server_error") from None
            relayed = True
            return _Relay(upstream, _headers(list(upstream.raw_headers), HOP_BY_HOP), self._release)
        finally:
            if not relayed:
                self._release()


def install(app: FastAPI, config: ApiConfig, max_body_bytes: int) -> TritonProxy | None:
    """Forward /v2 and /v2/... to `config.triton_http_proxy` (nothing when that is None);
    requests are read within `max_body_bytes`. The app's key middleware guards the routes."""
    if not config.triton_http_proxy:
        return None
    if config.api_key is None:  # ApiConfig refuses this too; never an open path to Triton
        raise ValueError("forwarding Triton's HTTP API needs an API key")
    proxy = TritonProxy(config.triton_http_proxy, max_body_bytes)

    async def forward(request: Request) -> Response:
        return await proxy.forward(request)

    for path in ("/v2", "/v2/{path:path}"):
        app.add_route(path, forward, methods=list(METHODS), include_in_schema=False)

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            try:
                yield state
            finally:
                await proxy.close()

    app.router.lifespan_context = lifespan
    app.state.triton_proxy = proxy
    return proxy
