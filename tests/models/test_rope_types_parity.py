"""Llama with yarn and with dynamic NTK rope through the engine: greedy tokens identical to
transformers' generate(do_sample=False), fp32, for prompts below and past yarn's original
context, prefix caching on (the second round hits it), through the fused C++ decoder and the
torch path. Dynamic NTK runs where it is the default rope (max_model_len is capped at
max_position_embeddings); the tables themselves are checked in tests/unit/layers/test_rope_tables.py."""

from __future__ import annotations

import json
import random

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import decoder as cpu_decoder
from test_parity import _hf_reference

ROPES = {
    # attention factor from mscale / mscale_all_dim (not 1), betas moved from their defaults
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                 beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
}


@pytest.mark.parametrize("rope,cpu_path,token_budget,block_size",
                         [("yarn", "fast", 7, 4), ("yarn", "fallback", 64, 16), ("dynamic", "fast", 64, 16)],
                         indirect=["cpu_path"])
def test_llama_rope_type_matches_hf(tiny_model_factory, rope, cpu_path, token_budget, block_size):
    path = tiny_model_factory("llama", rope_parameters=ROPES[rope], max_position_embeddings=128)
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in (5, 20, 45, 90)]
    refs = _hf_reference(path, prompts, lambda i: 12)
    params = [SamplingParams(max_tokens=12, temperature=0.0)] * len(prompts)
    with LLM(path, dtype="float32", token_budget=token_budget, block_size=block_size, enable_prefix_caching=True,
             **cpu_path) as llm:
        first = llm.generate(prompts, params)
        again = llm.generate(prompts, params)
        llm.engine.check_invariants()
        if cpu_path["attention_backend"] == "cpu" and cpu_decoder.available():
            assert llm.engine.runner.decoder_layers == "one C++ call"
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.token_ids for o in first] == refs
    assert [o.token_ids for o in again] == refs
