"""Embedding requests (SamplingParams.embed) through the engine's own forward: pooled final
hidden states against transformers', SplitFuse chunks, batching with generations, KV freed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitfuse import SamplingParams
from splitfuse.config import EngineConfig
from splitfuse.engine.llm_engine import LLMEngine
from splitfuse.engine.sequence import RequestOutput

PROMPTS = [[5, 17, 42, 9, 3], list(range(3, 80)), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """The final output of each request, stepping the engine until all have finished."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_invariants()
    return final


def hf_pooled(model_dir: str, prompt: list[int], pooling: str) -> np.ndarray:
    """transformers' pooled final hidden state: hidden_states[-1] is after the final norm."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


@pytest.fixture(scope="module", params=["last", "mean"])
def engine(request, tiny_llama):
    # A budget of 16 tokens splits the longer prompts over steps (SplitFuse chunks).
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", token_budget=16, kv_cache_memory_gb=0.01,
                                    embedding_pooling=request.param))
    yield engine
    engine.shutdown()


def test_embeddings_match_transformers_pooled_hidden_state(engine, tiny_llama):
    """Each prompt (two split over several steps), batched with a generation, pools as HF's final
    hidden state does (cosine >= 0.999, unit norm); no token is generated; every KV block is
    free at the end; the generation is unchanged by its company."""
    gen = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = run(engine, {"g": (PROMPTS[0], gen)})["g"]
    requests = {f"e{i}": (p, SamplingParams(embed=True)) for i, p in enumerate(PROMPTS)}
    requests["g"] = (PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    final = run(engine, requests)
    assert final["g"].token_ids == alone.token_ids and final["g"].embedding is None
    pooling = engine.config.embedding_pooling
    for i, prompt in enumerate(PROMPTS):
        out = final[f"e{i}"]
        assert out.finish_reason == "stop" and out.token_ids == [] and out.prompt_token_ids == prompt
        assert out.embedding.dtype == np.float32 and out.embedding.shape == (engine.runner.args.hidden_size,)
        assert np.linalg.norm(out.embedding) == pytest.approx(1.0, abs=1e-5)
        assert float(out.embedding @ hf_pooled(tiny_llama, prompt, pooling)) >= 0.999
    assert engine.blocks.num_used_blocks == 0  # freed at once (cached blocks are free to take)
    assert engine.stats().num_running == 0


def test_a_prompt_split_into_chunks_pools_as_the_whole(engine, tiny_llama):
    """The same long prompt with a budget that splits it (16) and one that takes it whole."""
    prompt = PROMPTS[1]
    split = run(engine, {"s": (prompt, SamplingParams(embed=True))})["s"].embedding
    whole_engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", token_budget=512, kv_cache_memory_gb=0.01,
                                          embedding_pooling=engine.config.embedding_pooling,
                                          enable_prefix_caching=False))
    try:
        whole = run(whole_engine, {"w": (prompt, SamplingParams(embed=True))})["w"].embedding
    finally:
        whole_engine.shutdown()
    np.testing.assert_allclose(split, whole, atol=1e-5)


def test_prefix_cache_hits_serve_last_pooling_only(engine):
    """A repeated prompt: last pooling reuses the cached prefix (same vector); mean pooling
    computes every token again (no hit), so its vector is the same too."""
    prompt = PROMPTS[1]
    first = run(engine, {"a": (prompt, SamplingParams(embed=True))})["a"]
    again = run(engine, {"b": (prompt, SamplingParams(embed=True))})["b"]
    np.testing.assert_allclose(first.embedding, again.embedding, atol=1e-5)
    if engine.config.embedding_pooling == "last":
        assert again.num_cached_tokens > 0
    else:
        assert again.num_cached_tokens == 0


def test_embedding_bounds(engine):
    """Only the prompt must fit the context (max_tokens plays no part); an embedding with a
    guide is refused naming the field."""
    limit = engine.max_model_len
    engine.prepare_prompt([1] * limit, SamplingParams(embed=True))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.prepare_prompt([1] * (limit + 1), SamplingParams(embed=True))
    with pytest.raises(ValueError, match="embed"):
        SamplingParams(embed="yes")


def test_embedding_pooling_setting_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="embedding_pooling"):
        EngineConfig(tiny_llama, embedding_pooling="cls")


def test_a_mean_pooled_prompt_recomputed_after_preemption_starts_its_sum_again():
    """The Pooler on its own: a prompt's chunks add up to the mean of all its rows; when the
    prompt is computed again from its first token (preempted, recomputed), the rows of the first
    attempt no longer count."""
    from splitfuse.engine.pooling import Pooler
    from splitfuse.engine.scheduler import ScheduledChunk
    from splitfuse.engine.sequence import Sequence

    seq = Sequence("m", [1, 2, 3, 4], SamplingParams(embed=True), arrival=0, pooling="mean")
    pooler = Pooler()
    rows = torch.arange(16, dtype=torch.float32).view(4, 4)
    assert pooler.take([ScheduledChunk(seq, 2)], rows[:2] + 100) == []  # the first attempt's rows
    seq.num_computed_tokens = 0  # preempted: computed again from the start
    assert pooler.take([ScheduledChunk(seq, 2)], rows[:2]) == []
    seq.num_computed_tokens = 2
    [(done, vector)] = pooler.take([ScheduledChunk(seq, 2)], rows[2:])
    expected = torch.nn.functional.normalize(rows.mean(dim=0), dim=0).numpy()
    assert done is seq and np.allclose(vector, expected)


def test_speculation_proposes_nothing_for_an_embedding(tiny_llama):
    """A repetitive prompt whose last chunk is one token (budget 16, 17 tokens) would get n-gram
    proposals like a decode; an embedding takes none, so its vector is the prompt's own."""
    prompt = [5, 6, 7] * 5 + [5, 6]
    engine = LLMEngine(EngineConfig(tiny_llama, dtype="float32", token_budget=16, kv_cache_memory_gb=0.01,
                                    speculative_method="ngram", num_speculative_tokens=4))
    try:
        out = run(engine, {"e": (prompt, SamplingParams(embed=True))})["e"]
    finally:
        engine.shutdown()
    assert float(out.embedding @ hf_pooled(tiny_llama, prompt, "last")) >= 0.999
