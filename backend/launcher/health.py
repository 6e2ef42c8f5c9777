"""The launcher's own health endpoints (`--health-port`), for an orchestrator's probes.

Triton's /v2/health/live answers nothing while the launcher restarts the server after a fault
(a few seconds), so a liveness probe on it would kill a pod that is healing itself. These two do:

    GET /live   200 while the launcher runs: it serves, or is healing within its restart budget
                (when the budget is used up the launcher exits, and the probe fails)
    GET /ready  200 when Triton's llm model is ready, 503 while no replica can serve (restarting)

Both answer JSON: {"ready": bool, "restarts": n}.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HealthServer:
    def __init__(self, host: str, port: int, ready: Callable[[], bool], restarts: Callable[[], int]) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
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
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="splitfuse-health", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
