"""The launcher's own health endpoints (`--health-port`), for an orchestrator's probes.

Triton's /v2/health/live answers nothing while the launcher restarts the server after a fault
(a few seconds), so a liveness probe on it would kill a pod that is healing itself. These two do:

    GET /live   200 while the launcher runs: it serves, or is healing within its restart budget
                (when the budget is used up the launcher exits, and the probe fails)
    GET /ready  200 when Triton's llm model is ready (and the OpenAI front answers, when there is
                one), 503 while no replica can serve (restarting) or the front is down

Both answer JSON: {"ready": bool, "restarts": n}.

A probe port must not be held by idle clients: a connection that sends no request within
SOCKET_TIMEOUT_S is closed, and at most MAX_CONNECTIONS are served at once (one thread each);
beyond that a new connection is closed at once rather than queued.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Seconds a connection may stay silent (no request, or a slow one) before it is closed.
SOCKET_TIMEOUT_S = 5.0
# Connections served at once (a thread each): probes need a few.
MAX_CONNECTIONS = 16


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # every slot taken: refuse now, no thread queued
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HealthServer:
    def __init__(self, host: str, port: int, ready: Callable[[], bool], restarts: Callable[[], int],
                 socket_timeout_s: float = SOCKET_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout_s  # socketserver sets it on the connection: idle ones end

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path not in ("/live", "/ready"):
                    self._answer(404, {"error": "unknown path: /live or /ready"})
                    return
                is_ready = owner.ready()
                ok = is_ready if self.path == "/ready" else True
                self._answer(200 if ok else 503, {"ready": is_ready, "restarts": owner.restarts()})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # probes every few seconds: no access log
                pass

        self.ready, self.restarts = ready, restarts
        self.httpd = _BoundedHTTPServer((host, port), Handler, max_connections)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="splitfuse-health", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
