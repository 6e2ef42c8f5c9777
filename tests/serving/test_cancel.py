"""Cancellation frees a sequence's KV blocks; what Triton 2.51 does for ensemble requests."""

from __future__ import annotations

import json
import socket
import time

import pytest
from triton_helpers import GrpcStream, finished_requests, grpc_generate, metric_sum, wait_for

pytestmark = pytest.mark.serving

LONG = {"text_input": "hello world", "max_tokens": 3000, "temperature": 0.0, "ignore_eos": True, "stream": True}


def _used(served) -> float:
    return metric_sum(served.metrics_url, "splitfuse_kv_cache_blocks", state="used")


def _generated(served) -> float:
    return metric_sum(served.metrics_url, "splitfuse_generation_tokens_total")


def _start(served, model: str, request_id: str) -> GrpcStream:
    assert wait_for(lambda: _used(served) == 0), "blocks still in use from an earlier test"
    s = GrpcStream(served.grpc_url)
    s.send(model, LONG, request_id=request_id)
    for _ in range(5):
        resp, err = s.next()
        assert err is None and resp.output_ids
    assert wait_for(lambda: _used(served) > 0)
    return s


def _assert_aborted_early(served, generated_before: float) -> None:
    assert wait_for(lambda: _used(served) == 0, timeout=5.0), "KV blocks not freed after cancellation"
    assert wait_for(lambda: metric_sum(served.metrics_url, "splitfuse_requests", state="running") == 0)
    # Short of the tokens it asked for (5 came before `generated_before`): it was aborted, not
    # finished. (A fixed share of them raced the engine: a single tiny-model sequence now decodes
    # several thousand tokens a second.)
    assert _generated(served) - generated_before < LONG["max_tokens"] - 5


def test_grpc_cancel_frees_kv_blocks(served):
    s = _start(served, "llm", "cancel-grpc")
    before = _generated(served)
    s.close(cancel=True)  # stop_stream(cancel_requests=True)
    _assert_aborted_early(served, before)


def test_http_disconnect_frees_kv_blocks(served):
    assert wait_for(lambda: _used(served) == 0)
    host, port = served.http_url.rsplit(":", 1)
    body = json.dumps(LONG).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    seen = b""
    while seen.count(b"data:") < 5:
        seen += sock.recv(4096)
    before = _generated(served)
    sock.close()
    _assert_aborted_early(served, before)


def test_stop_request_reaches_the_replica_that_holds_the_request(slow_replicas):
    # Several streams, spread over both replicas; each stop lands on whichever replica
    # Triton picks, and each stream still ends with finish_reason "abort". Slowed, the
    # 3000 tokens would take a minute: only the stop can end them in time.
    server = slow_replicas
    streams = [GrpcStream(server.grpc_url) for _ in range(4)]
    try:
        for i, s in enumerate(streams):
            s.send("ensemble", {**LONG, "return_stop_handle": True}, request_id=f"fault-slow-stop-me-{i}")
        handles = []
        for s in streams:
            first, err = s.next()
            assert err is None and first.stop_handle  # generating; the handle comes first
            handles.append(first.stop_handle)
        for handle in handles:
            r = grpc_generate(server.grpc_url, "llm", {"stop": True, "stop_handle": handle})
            assert r.error is None and r.finish_reason == "abort"
        for s in streams:
            rest = s.collect(timeout=60)
            assert rest.error is None and rest.finish_reason == "abort"
    finally:
        for s in streams:
            s.close()
    assert wait_for(lambda: _used(server) == 0)
    # Each replica ended its share as aborts, none at max_tokens.
    assert wait_for(lambda: finished_requests(server.metrics_url, "abort") == len(streams))
    assert finished_requests(server.metrics_url, "length") == 0


def test_another_client_cannot_stop_a_generation_by_its_request_id(slow_replicas):
    """Request ids are the clients' choice: a second client that sends `stop` with the first
    one's id (or a made-up handle) ends nothing; only the generation's own handle does."""
    server = slow_replicas
    victim = GrpcStream(server.grpc_url)
    try:
        victim.send("llm", {**LONG, "return_stop_handle": True}, request_id="fault-slow-victim")
        first, err = victim.next()
        assert err is None and first.stop_handle
        generated = _generated(server)
        by_id = grpc_generate(server.grpc_url, "llm", {"stop": True}, request_id="fault-slow-victim")
        assert by_id.error is not None and "stop_handle" in by_id.error
        for guess in ("fault-slow-victim", first.stop_handle.split(".")[0] + ".0", first.stop_handle + "x"):
            r = grpc_generate(server.grpc_url, "llm", {"stop": True, "stop_handle": guess},
                              request_id="fault-slow-victim")
            assert r.error is None and r.finish_reason == "abort"  # the same answer as a real stop
        time.sleep(0.3)  # a stop would have ended it by now (stops are applied within 10 ms)
        going_on = victim.collect(timeout=30, max_responses=60)  # slowed: 20 ms a token, past the sleep
        # (60 responses: at least 60 tokens, grouped by stream_interval)
        assert going_on.error is None and len(going_on.output_ids) >= 60 and not going_on.finish_reason
        assert wait_for(lambda: _generated(server) > generated)
        r = grpc_generate(server.grpc_url, "llm", {"stop": True, "stop_handle": first.stop_handle})
        assert r.error is None
        rest = victim.collect(timeout=60)
        assert rest.error is None and rest.finish_reason == "abort"
    finally:
        victim.close()
    assert wait_for(lambda: _used(server) == 0)


def _running(server) -> float:
    return metric_sum(server.metrics_url, "splitfuse_requests", state="running")


def _holds(condition, seconds: float) -> bool:
    """condition() true at every look for `seconds` (looks every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.1)
    return condition()


# A cancellation made to `llm` ends its generation within this long; one made to `ensemble`
# is checked to leave its generation running for as long.
CANCEL_WINDOW_S = 3.0


def test_ensemble_cancel_is_not_forwarded_but_explicit_stop_works(slow_replicas):
    """Triton 2.51 does not forward an ensemble request's cancellation to its decoupled step:
    the generation runs on after the client cancels. A `stop` request with the stop handle of
    its first response, sent to `llm` (any replica), aborts it. The generations are slowed (20 ms a step: 3,000
    tokens would take a minute), so neither can end by itself during the test, and what is
    checked is the one running request, not counters other tests' requests also move."""
    server = slow_replicas
    assert wait_for(lambda: _running(server) == 0 and _used(server) == 0, timeout=60), "an earlier request still runs"
    # The control: cancelled on a stream to `llm` itself, a generation ends at once.
    direct = GrpcStream(server.grpc_url)
    direct.send("llm", LONG, request_id="fault-slow-cancel-direct")
    assert direct.next()[1] is None
    assert wait_for(lambda: _running(server) == 1)
    direct.close(cancel=True)
    assert wait_for(lambda: _running(server) == 0 and _used(server) == 0, timeout=CANCEL_WINDOW_S)

    s = GrpcStream(server.grpc_url)
    s.send("ensemble", {**LONG, "return_stop_handle": True}, request_id="fault-slow-cancel-ensemble")
    first, err = s.next()
    assert err is None and first.stop_handle
    assert wait_for(lambda: _running(server) == 1)
    s.close(cancel=True)
    generated = _generated(server)
    assert _holds(lambda: _running(server) == 1, CANCEL_WINDOW_S), \
        "Triton now forwards ensemble cancellation: update the README and this test"
    assert _generated(server) > generated  # still generating for the client that left
    r = grpc_generate(server.grpc_url, "llm", {"stop": True, "stop_handle": first.stop_handle})
    assert r.error is None and r.finish_reason == "abort"
    assert wait_for(lambda: _running(server) == 0 and _used(server) == 0, timeout=CANCEL_WINDOW_S), \
        "the stop request did not end the generation"
