"""Prefix caching through the real server: a request whose long prefix an earlier one computed
reports the cached tokens, and the engines compute only the rest (counted in the metrics). A
cache_salt keeps tenants apart: no hit across salts, and num_cached_tokens is reported only to
salted requests unless the operator allows it (report_num_cached_tokens)."""

from __future__ import annotations

import random

import pytest
from triton_helpers import grpc_generate, metric_sum, settled, wait_for

pytestmark = pytest.mark.serving

BLOCK_SIZE = 16  # the test server's (EngineConfig default)


def _totals(url: str) -> tuple[float, float, float]:
    return (metric_sum(url, "splitfuse_prefix_cache_queries_total"),
            metric_sum(url, "splitfuse_prefix_cache_hits_total"),
            metric_sum(url, "splitfuse_prompt_tokens_total"))


def test_second_request_with_the_same_long_prefix_reports_cached_tokens(served):
    assert "block_size" not in served.engine_params
    rng = random.Random(1234)
    prefix = [1] + [rng.randrange(3, 400) for _ in range(199)]  # 200 tokens: 12 full blocks
    prompts = [prefix + [rng.randrange(3, 400) for _ in range(5)] for _ in range(4)]
    before = settled(lambda: _totals(served.metrics_url))
    cached = []
    for p in prompts:  # one after another, so each finds what the earlier ones computed
        r = grpc_generate(served.grpc_url, "llm", {
            "input_ids": p, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "return_num_cached_tokens": True, "cache_salt": "tenant-prefix-test",
        })
        assert r.error is None and len(r.output_ids) == 4
        cached.append(r.responses[-1].num_cached_tokens)
    full_blocks = (len(prefix) // BLOCK_SIZE) * BLOCK_SIZE
    # Each of the two replicas computes the prefix once at most: the first request misses,
    # and of the other three at least two land where the prefix is cached.
    assert cached[0] == 0
    assert set(cached) <= {0, full_blocks}, cached
    assert cached[1:].count(full_blocks) >= 4 - 1 - (served.instances - 1), cached
    # The metrics count the same tokens: looked up, found, and only the rest computed (what
    # shortens the time to the first token).
    total_prompt = sum(len(p) for p in prompts)
    expected = (before[0] + total_prompt, before[1] + sum(cached), before[2] + total_prompt - sum(cached))
    assert wait_for(lambda: _totals(served.metrics_url) == expected), (_totals(served.metrics_url), expected)


def test_ensemble_returns_num_cached_tokens(served):
    text = "a system prompt that many chat requests share, " * 12
    cached = []
    for _ in range(3):
        r = grpc_generate(served.grpc_url, "ensemble", {
            "text_input": text, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "return_num_cached_tokens": True, "return_num_input_tokens": True, "cache_salt": "tenant-ensemble",
        })
        assert r.error is None
        last = r.responses[-1]
        cached.append(last.num_cached_tokens)
        num_input = r.responses[0].num_input_tokens
    assert all(c is not None and 0 <= c < num_input for c in cached), cached
    assert max(cached) == (num_input - 1) // BLOCK_SIZE * BLOCK_SIZE  # a repeat hits all but the last block


def test_cache_salt_keeps_tenants_apart_and_num_cached_tokens_needs_one(served):
    rng = random.Random(99)
    prompt = [1] + [rng.randrange(3, 400) for _ in range(100)]  # 6 full blocks
    full_blocks = (len(prompt) // BLOCK_SIZE) * BLOCK_SIZE

    def run(salt: str | None, **extra):
        values = {"input_ids": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **extra}
        if salt is not None:
            values["cache_salt"] = salt
        return grpc_generate(served.grpc_url, "llm", values)

    # Unsalted: the count would say whether another client sent this prompt; refused, clearly.
    refused = run(None, return_num_cached_tokens=True)
    assert refused.error is not None and "cache_salt" in refused.error and "report_num_cached_tokens" in refused.error
    plain = [run(None) for _ in range(served.instances)]  # cached on every replica now
    assert all(r.error is None for r in plain)
    # Tenant B finds none of it, whichever replica it lands on; tenant B's own repeats do hit
    # (once it ran on that replica), and the tokens never change.
    b = [run("tenant-b", return_num_cached_tokens=True) for _ in range(served.instances + 2)]
    assert b[0].responses[-1].num_cached_tokens == 0
    assert all(r.output_ids == plain[0].output_ids for r in b)
    assert {r.responses[-1].num_cached_tokens for r in b} <= {0, full_blocks}
    assert sum(r.responses[-1].num_cached_tokens == 0 for r in b) <= served.instances
    c = run("tenant-c", return_num_cached_tokens=True)
    assert c.responses[-1].num_cached_tokens == 0 and c.output_ids == plain[0].output_ids
