"""The API key check, as plain ASGI middleware.

Plain ASGI, not Starlette's BaseHTTPMiddleware: that one runs the route in a task of its own
and hands it a `receive` that never reports the client's disconnect, so a request whose client
left would run its generation to the end. Here a checked request reaches the app with the
server's own `receive`, untouched.

Every path needs the key except OPEN_PATHS (probes and the API's own description), so a route
mounted later is guarded without being listed anywhere.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from splitfuse.openai_api.protocol import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Open without a key: the liveness probe and the OpenAPI document (with its viewers).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

MISSING_KEY = "a valid API key is required: send the header 'Authorization: Bearer <key>'"
# WebSocket close code for a policy violation (RFC 6455).
WS_POLICY_VIOLATION = 1008


class ApiKeyMiddleware:
    """Answers 401 in OpenAI's error shape unless `Authorization: Bearer <api_key>` is sent."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would let every client in")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    def allowed(self, scope: Scope) -> bool:
        if scope.get("path") in OPEN_PATHS:
            return True
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        # Constant time: the compare must not tell how much of a guessed key was right.
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION})
            return
        body = json.dumps(ApiError(401, MISSING_KEY, code="invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
