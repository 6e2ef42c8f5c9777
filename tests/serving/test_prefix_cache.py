"""Prefix caching through the real server: a request whose long prefix an earlier one computed
reports the cached tokens, and the engines compute only the rest (counted in the metrics)."""

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
            "return_num_cached_tokens": True,
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
            "return_num_cached_tokens": True, "return_num_input_tokens": True,
        })
        assert r.error is None
        last = r.responses[-1]
        cached.append(last.num_cached_tokens)
        num_input = r.responses[0].num_input_tokens
    assert all(c is not None and 0 <= c < num_input for c in cached), cached
    assert max(cached) == (num_input - 1) // BLOCK_SIZE * BLOCK_SIZE  # a repeat hits all but the last block
