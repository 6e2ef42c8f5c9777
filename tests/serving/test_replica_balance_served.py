"""Two replicas share a burst of requests evenly (replica_balance.py), on the real server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from triton_helpers import grpc_generate, metric_by_instance, metric_sum, settled, wait_for

pytestmark = pytest.mark.serving

FINISHED = "splitfuse_requests_finished_total"


def test_a_burst_is_shared_evenly_by_the_replicas(slow_replicas):
    """Triton hands each request to whichever replica takes it first; a replica holding more than
    the other waits before taking another, so 16 requests that all stay in flight (slowed to 20 ms
    a step) split 8 / 8. Without that (replica_balance_max_wait_ms=0) they split 9/7, 7/9, 6/10 on
    the tiny model."""
    server, n = slow_replicas, 16
    assert wait_for(lambda: metric_sum(server.metrics_url, "splitfuse_requests") == 0, timeout=30)
    for burst in range(2):
        # Settled: earlier requests' ends reach the metrics up to half a second late.
        before = settled(lambda: metric_by_instance(server.metrics_url, FINISHED))

        def one(i: int):
            return grpc_generate(server.grpc_url, "llm", {
                "text_input": f"burst {burst} request {i}", "max_tokens": 48, "ignore_eos": True, "stream": True,
            }, request_id=f"fault-slow-burst-{burst}-{i}")

        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
        assert all(r.error is None and len(r.output_ids) == 48 for r in results)
        after = settled(lambda: metric_by_instance(server.metrics_url, FINISHED))
        counts = sorted(after[k] - before.get(k, 0.0) for k in after)
        assert sum(counts) == n and len(counts) == 2 and counts[1] - counts[0] <= 1, counts
    # The waits are counted (here at least one per burst: the first request's replica held more).
    assert metric_sum(server.metrics_url, "splitfuse_replica_balance_waits_total") >= 2
    assert metric_sum(server.metrics_url, "splitfuse_replica_balance_wait_seconds_total") > 0
