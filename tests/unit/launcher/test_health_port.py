"""The launcher's health port (splitfuse.launcher.health) over real sockets: idle connections are
closed after the socket timeout, at most max_connections are held at once (more are closed at
once, not queued), and probes are answered again once the idle ones are gone."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from splitfuse.launcher.health import HealthServer

TIMEOUT_S = 0.5


@pytest.fixture
def health():
    state = {"ready": True}
    server = HealthServer("127.0.0.1", 0, ready=lambda: state["ready"], restarts=lambda: 2,
                          socket_timeout_s=TIMEOUT_S, max_connections=2)
    server.start()
    yield server, state
    server.stop()


def _get(server: HealthServer, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed `sock` (None: still open after limit_s)."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return None
    except ConnectionResetError:
        data = b""
    return time.monotonic() - start if data == b"" else None


def test_probes_and_ready(health):
    server, state = health
    assert _get(server, "/ready") == (200, {"ready": True, "restarts": 2})
    state["ready"] = False
    assert _get(server, "/ready")[0] == 503 and _get(server, "/live")[0] == 200
    assert _get(server, "/nope")[0] == 404


def test_an_idle_connection_is_closed_after_the_timeout(health):
    server, _ = health
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        took = _closed_after(idle, TIMEOUT_S + 10)  # wide margin: a loaded 2-core machine
    assert took is not None, "the idle connection was never closed"
    assert took >= TIMEOUT_S * 0.8


def test_connections_beyond_the_bound_are_refused_not_queued(health):
    server, _ = health
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        time.sleep(0.1)  # both accepted, each holding one of the two slots
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            took = _closed_after(extra, TIMEOUT_S * 0.8)  # closed before any idle one times out
        assert took is not None, "a third connection was held beyond max_connections=2"
    finally:
        for s in idle:
            s.close()
    # Once the slots are free the probe is served again.
    deadline = time.monotonic() + 10
    while True:
        try:
            if _get(server, "/live")[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the health port did not serve again"
        time.sleep(0.05)
