"""Speculative decoding served: a real tritonserver started with `--param speculative_method=ngram`
and one with a draft model streams the tokens the offline engine gives without speculation (a
response may carry several tokens), and counts proposed / accepted tokens in its metrics."""

from __future__ import annotations

import random

import pytest
from conftest import ENGINE_PARAMS, offline_greedy, one_instance_server
from triton_helpers import GrpcStream, metric_sum, settled, wait_for

pytestmark = pytest.mark.serving

METHODS = ["ngram", "draft"]


@pytest.fixture(scope="module", params=METHODS)
def spec_server(request, tiny_llama, tmp_path_factory):
    settings = {"speculative_method": request.param, "num_speculative_tokens": "4"}
    if request.param == "draft":
        settings["speculative_model"] = tiny_llama  # drafting for itself: every proposal accepted
    with one_instance_server(tiny_llama, settings, tmp_path_factory.mktemp(f"triton-{request.param}")) as (params,
                                                                                                         server):
        yield request.param, params, server


def test_served_speculation_streams_the_plain_greedy_tokens(spec_server, tiny_llama):
    method, params, server = spec_server
    rng = random.Random(3)
    prompts = []
    for n in (4, 9, 15):
        segment = [rng.randrange(3, 400) for _ in range(n)]
        prompts.append([1] + segment * 3)
    want = offline_greedy(tiny_llama, ENGINE_PARAMS, prompts, max_tokens=24)  # no speculation
    for prompt, expected in zip(prompts, want):
        with GrpcStream(server.grpc_url) as stream:
            stream.send("llm", {"input_ids": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
                        dtypes={"input_ids": "INT32"})
            result = stream.collect()
        assert result.error is None, result.error
        assert result.output_ids == expected, f"{method}: served tokens differ from plain decoding"
        assert result.finish_reason == "length"
        if method == "draft":
            # Accepted proposals arrive together: fewer responses than tokens.
            assert len(result.data) < len(expected)
    # The counters are published by the model's housekeeping thread, a little after the responses.
    def totals():
        return tuple(metric_sum(server.metrics_url, f"splitfuse_spec_{kind}_tokens_total")
                     for kind in ("draft", "accepted"))

    assert wait_for(lambda: totals()[1] > 0, timeout=30), totals()
    proposed, accepted = settled(totals)
    assert 0 < accepted <= proposed
    if method == "draft":
        assert accepted == proposed
