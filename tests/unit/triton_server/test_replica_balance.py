"""ReplicaBalance: the replicas' shared loads, and when a replica waits before taking a request."""

from __future__ import annotations

import threading
import time

from splitfuse.triton_server import replica_balance
from splitfuse.triton_server.replica_balance import NOT_TAKING, ReplicaBalance


def _pair(tmp_path, max_wait_s: float = 2.0) -> tuple[ReplicaBalance, ReplicaBalance]:
    return ReplicaBalance(tmp_path, "llm_0_0", max_wait_s), ReplicaBalance(tmp_path, "llm_0_1", max_wait_s)


def test_no_wait_alone_or_at_most_the_least_loaded_peer(tmp_path):
    alone = ReplicaBalance(tmp_path / "alone", "llm_0_0", 2.0)
    alone.post(50)
    assert alone.least_peer_load() is None and alone.wait_turn(lambda: 50) < 0.1
    a, b = _pair(tmp_path / "pair")
    a.post(3)
    b.post(3)
    assert a.least_peer_load() == 3 and b.least_peer_load() == 3
    assert a.wait_turn(lambda: 3) == 0.0  # a tie: both take requests
    assert a.wait_turn(lambda: 2) == 0.0


def test_waits_while_above_the_peer_until_the_loads_even_out(tmp_path):
    a, b = _pair(tmp_path)
    b.post(2)
    held = [5]

    def finish_some() -> None:
        time.sleep(0.1)
        held[0] = 3
        time.sleep(0.1)
        b.post(3)  # the peer took one: now even

    worker = threading.Thread(target=finish_some)
    worker.start()
    waited = a.wait_turn(lambda: held[0])
    worker.join()
    assert 0.15 < waited < 1.5, waited


def test_the_wait_is_capped(tmp_path):
    a, b = _pair(tmp_path, max_wait_s=0.2)
    b.post(0)
    waited = a.wait_turn(lambda: 10)
    assert 0.19 < waited < 1.0, waited
    off = ReplicaBalance(tmp_path, "llm_0_2", 0.0)  # 0 = off
    assert off.wait_turn(lambda: 10) == 0.0


def test_peers_that_take_nothing_or_went_quiet_are_left_out(tmp_path, monkeypatch):
    a, b = _pair(tmp_path)
    b.post(NOT_TAKING)  # a failed engine
    assert a.least_peer_load() is None and a.wait_turn(lambda: 9) < 0.1
    b.post(1)
    assert a.least_peer_load() == 1
    monkeypatch.setattr(replica_balance, "STALE_NS", 50_000_000)
    time.sleep(0.1)  # b stopped touching its slot (a dead or frozen process)
    assert a.least_peer_load() is None
    b.touch()
    assert a.least_peer_load() == 1
    b.close()  # a replica that finalized takes nothing
    assert a.least_peer_load() is None


def test_a_peer_that_starts_later_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(replica_balance, "RESCAN_S", 0.05)
    a = ReplicaBalance(tmp_path, "llm_0_0", 2.0)
    assert a.least_peer_load() is None
    b = ReplicaBalance(tmp_path, "llm_0_1", 2.0)
    b.post(4)
    time.sleep(0.1)
    assert a.least_peer_load() == 4
    # A restarted instance writes into the same file, which its peers keep mapped.
    b2 = ReplicaBalance(tmp_path, "llm_0_1", 2.0)
    b2.post(7)
    assert a.least_peer_load() == 7
