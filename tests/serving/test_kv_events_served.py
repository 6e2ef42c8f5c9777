"""KV cache events from a real server of two replicas (docs/kv_events.md): each replica's engine
process publishes on kv_events_endpoint's port + its instance index, stamping its batches with
that index; one SUB socket connected to both hears a request's full blocks stored, their hashes
chained as the engine hashes them; the metrics count the events."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import ENGINE_PARAMS, _need_tritonserver
from triton_helpers import grpc_generate, metric_by_instance, wait_for

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "kv_events"))
from kv_subscriber import Subscriber  # noqa: E402

pytestmark = pytest.mark.serving

BLOCK = 16  # the engine's default block_size


def _two_free_ports() -> int:
    from splitfuse.utils.ports import free_port, port_is_free

    for _ in range(50):
        port = free_port()
        if port < 65535 and port_is_free(port + 1, "127.0.0.1"):
            return port
    raise AssertionError("no two free ports in a row")


def _ask(server, prompt: list[int]) -> None:
    r = grpc_generate(server.grpc_url, "llm", {"input_ids": prompt, "max_tokens": 2, "temperature": 0.0,
                                               "ignore_eos": True})
    assert r.error is None


def test_a_requests_blocks_are_published_by_its_replica(tiny_llama, tmp_path):
    _need_tritonserver()
    from splitfuse.engine.block_manager import ROOT_HASH, chain_hash
    from splitfuse.kv_events.events import external_hash
    from splitfuse.launcher import serve

    port = _two_free_ports()
    params = {**ENGINE_PARAMS, "kv_events_endpoint": f"tcp://127.0.0.1:{port}", "kv_events_topic": "kv"}
    with serve(tiny_llama, params, instances=2, workdir=tmp_path) as server, \
            Subscriber(f"tcp://127.0.0.1:{port}", b"kv") as sub:
        sub.socket.connect(f"tcp://127.0.0.1:{port + 1}")
        # ZeroMQ drops what a PUB sends before a subscriber is connected: warm up until both
        # replicas are heard (each request a prompt of its own: every one stores new blocks).
        heard: set[int] = set()
        deadline = time.monotonic() + 60
        warm = 0
        while heard != {0, 1} and time.monotonic() < deadline:
            warm += 1
            _ask(server, [1] + [(warm * 37 + i) % 300 + 3 for i in range(BLOCK + 3)])
            while (message := sub.receive(0.3)) is not None:
                assert message.topic == b"kv"
                heard.add(message.rank)
        assert heard == {0, 1}, f"heard replicas {heard}"
        sub.until_quiet()

        prompt = [1] + [(i * 7) % 300 + 3 for i in range(2 * BLOCK + 7)]  # two full blocks
        _ask(server, prompt)
        stored = [(m.rank, e) for m in sub.until_quiet(1.0) for e in m.events if e[0] == "BlockStored"]
        first = chain_hash(ROOT_HASH, prompt[:BLOCK])
        second = chain_hash(first, prompt[BLOCK : 2 * BLOCK])
        assert [e[1:5] for _, e in stored] == [[[external_hash(first), external_hash(second)], None,
                                                prompt[: 2 * BLOCK], BLOCK]]
        assert stored[0][1][5:] == [None, "GPU", None]
        def counted() -> dict[str, float] | None:
            events = metric_by_instance(server.metrics_url, "splitfuse_kv_events_total")
            return events if len(events) == 2 and all(v > 0 for v in events.values()) else None

        assert wait_for(counted, timeout=10), metric_by_instance(server.metrics_url, "splitfuse_kv_events_total")
        server.stop()
