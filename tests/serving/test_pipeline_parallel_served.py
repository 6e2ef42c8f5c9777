"""Served with pipeline parallelism: a real tritonserver started with `--param
pipeline_parallel_size=2` (the Triton instance is the first stage's rank 0; the second stage is a
process the instance's stub starts) answers concurrent greedy requests (two steps in flight, the
last stage sampling) with the tokens of the offline engine with one stage."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ENGINE_PARAMS, offline_greedy, one_instance_server, served_greedy
from test_tensor_parallel_served import _ranks

pytestmark = pytest.mark.serving

PP_SETTINGS = {"pipeline_parallel_size": "2", "num_threads": "2", "tensor_parallel_timeout_s": "10"}


def test_served_with_two_stages_matches_one_stage_offline(tiny_llama, tmp_path):
    with one_instance_server(tiny_llama, PP_SETTINGS, tmp_path) as (_, server):
        assert len(_ranks(server.process.pid)) == 1, "the instance should have started the second stage"
        rng = random.Random(3)
        prompts = [[1] + [rng.randrange(3, 400) for _ in range(n)] for n in (4, 37, 9, 21)]
        one_stage = {**ENGINE_PARAMS, "num_threads": PP_SETTINGS["num_threads"]}
        want = offline_greedy(tiny_llama, one_stage, prompts, max_tokens=12)
        # At once: two steps in flight, the last stage sampling each.
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: served_greedy(server.grpc_url, p, max_tokens=12), prompts))
        for r, expected in zip(got, want):
            assert r.error is None, r.error
            assert r.output_ids == expected
