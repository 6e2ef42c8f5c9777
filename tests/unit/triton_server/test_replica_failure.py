"""A replica whose engine failed for good retires while a peer serves, and the last one standing
unloads the model (replica_failure.py)."""

from __future__ import annotations

import threading
import time

from splitfuse.errors import REPLICA_RETIRED
from splitfuse.triton_server.replica_failure import RETIRED_HOLD_S, ReplicaFailure


def _failure(peers: list[bool]):
    unloaded = threading.Event()
    logs: list[str] = []
    rf = ReplicaFailure("llm", "llm_0_0", lambda: peers[0], lambda name: unloaded.set(), logs.append)
    return rf, unloaded, logs


def test_with_a_serving_peer_it_retires_and_refuses_retryably():
    peers = [True]
    rf, unloaded, logs = _failure(peers)
    rf.failed("engine_restarts=3 spent")
    assert rf.refusing and not unloaded.wait(0.2)
    assert rf.refusal().startswith(REPLICA_RETIRED) and "engine_restarts=3 spent" in rf.refusal()
    assert "retires" in logs[0] and "stays ready" in logs[0]
    rf.tick()  # the peer still serves
    assert rf.refusing and not unloaded.is_set()
    peers[0] = False  # the last peer is gone: the model unloads, so that it reports not ready
    rf.tick()
    assert unloaded.wait(5) and not rf.refusing and "unloading" in logs[-1]


def test_without_a_serving_peer_it_unloads_at_once():
    rf, unloaded, logs = _failure([False])
    rf.failed("broken")
    assert unloaded.wait(5) and not rf.retired and "unloading 'llm'" in logs[0]


def test_hold_ends_early_when_the_server_drains():
    rf, _, _ = _failure([True])
    rf.failed("broken")
    start = time.monotonic()
    rf.hold(lambda: time.monotonic() - start > 0.3)
    assert 0.3 <= time.monotonic() - start < RETIRED_HOLD_S
