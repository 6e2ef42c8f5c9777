"""Many concurrent streams, two engine replicas, Prometheus metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from triton_helpers import grpc_generate, metric_by_instance, metric_sum, metrics, settled, wait_for

pytestmark = pytest.mark.serving

GEN = "splitfuse_generation_tokens_total"


def test_16_concurrent_streams_on_two_replicas(served):
    n, max_tokens = 16, 24
    before = settled(lambda: metric_by_instance(served.metrics_url, GEN))
    total_before = sum(before.values())

    def one(i: int):
        model = "ensemble" if i % 2 == 0 else "llm"
        return grpc_generate(served.grpc_url, model, {
            "text_input": f"request {i}: the quick brown fox", "max_tokens": max_tokens, "temperature": 1.0,
            "seed": i, "ignore_eos": True, "stream": True,
        }, request_id=f"concurrent-{i}")

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    for r in results:
        assert r.error is None
        assert len(r.output_ids) == max_tokens and r.finish_reason == "length"
        assert r.responses[-1].final
    # Every token was counted, and both replicas generated some of them.
    assert wait_for(lambda: metric_sum(served.metrics_url, GEN) - total_before == n * max_tokens)
    after = metric_by_instance(served.metrics_url, GEN)
    assert len(after) == served.instances
    served_by = {inst: after[inst] - before.get(inst, 0.0) for inst in after}
    assert all(v > 0 for v in served_by.values()), served_by


def test_metric_families(served):
    grpc_generate(served.grpc_url, "ensemble", {"text_input": "hello", "max_tokens": 4, "stream": True})
    samples = metrics(served.metrics_url)
    names = {n for n, _, _ in samples}
    for family in ("splitfuse_tokens_per_step", "splitfuse_time_to_first_token_seconds",
                   "splitfuse_inter_token_latency_seconds", "splitfuse_e2e_request_latency_seconds",
                   "splitfuse_request_prompt_tokens", "splitfuse_request_generation_tokens"):
        assert {f"{family}_bucket", f"{family}_count", f"{family}_sum"} <= names
    for name in ("splitfuse_prompt_tokens_total", "splitfuse_generation_tokens_total", "splitfuse_preemptions_total",
                 "splitfuse_requests_finished_total", "splitfuse_kv_cache_usage_ratio", "splitfuse_engine_healthy"):
        assert name in names
    # Steps ran: time in them, the forward pass a part of it.
    step_s, forward_s = (metric_sum(served.metrics_url, n)
                         for n in ("splitfuse_step_seconds_total", "splitfuse_forward_seconds_total"))
    assert step_s >= forward_s > 0
    assert metric_sum(served.metrics_url, "splitfuse_engine_healthy") == served.instances
    states = {(n, lab["state"]) for n, lab, _ in samples if "state" in lab}
    assert {("splitfuse_kv_cache_blocks", "used"), ("splitfuse_kv_cache_blocks", "free"),
            ("splitfuse_requests", "running"), ("splitfuse_requests", "waiting")} <= states
    # Labelled by model and instance: one series per replica.
    instances = {lab["instance"] for n, lab, _ in samples if n == "splitfuse_kv_cache_blocks"}
    assert instances == {f"llm_0_{i}" for i in range(served.instances)}
    assert all(lab.get("model") == "llm" for n, lab, _ in samples if n.startswith("splitfuse_"))
    # Idle: used + free == the pool on each replica, nothing running.
    assert wait_for(lambda: metric_sum(served.metrics_url, "splitfuse_requests") == 0)
    total = int(served.engine_params["num_kv_blocks"]) * served.instances
    assert metric_sum(served.metrics_url, "splitfuse_kv_cache_blocks") == total
