"""The KV pool and max_model_len (ModelRunner._fit_max_model_len): the start-up log says what the
pool holds; a checkpoint context the pool cannot hold for one sequence is lowered to what it
holds, with a warning naming the setting to raise; an explicit max_model_len it cannot hold is
refused with the value needed; a request up to the lowered limit is served."""

from __future__ import annotations

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.engine.block_manager import longest_sequence


def test_the_checkpoint_context_is_lowered_to_what_the_pool_holds(tiny_llama, caplog):
    caplog.set_level("INFO", logger="splitfuse.engine.model_runner")
    fits = longest_sequence(64, 16, 0.01)  # 64 blocks of 16 tokens, the watermark kept free
    with LLM(tiny_llama, num_kv_blocks=64) as llm:
        assert llm.engine.max_model_len == fits < 4096  # the tiny checkpoint's 4,096 positions
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"max_model_len lowered from the checkpoint's 4096 to {fits}" in m and "num_kv_blocks to" in m
                   for m in messages), messages
        assert any(f"KV cache: 64 blocks of 16 tokens = 1024 tokens" in m for m in messages), messages
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=fits - 3, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == fits - 3
        with pytest.raises(ValueError, match=f"max_model_len={fits}"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=fits - 2))


@pytest.mark.parametrize("kw,needed", [({"num_kv_blocks": 64}, "num_kv_blocks to 126"),
                                       ({"kv_cache_memory_gb": 0.0005}, "kv_cache_memory_gb to")])
def test_an_explicit_max_model_len_the_pool_cannot_hold_is_refused(tiny_llama, kw, needed):
    assert longest_sequence(125, 16, 0.01) < 2000 <= longest_sequence(126, 16, 0.01)  # 126: the least that holds it
    with pytest.raises(ValueError, match=f"max_model_len=2000 does not fit the KV cache.*Raise {needed}"):
        LLM(tiny_llama, max_model_len=2000, **kw)


def test_a_pool_capped_by_max_num_seqs_still_holds_the_full_context(tiny_llama):
    # One sequence allowed: the pool is sized for one full-length sequence plus the watermark,
    # so the checkpoint's context is kept.
    with LLM(tiny_llama, max_num_seqs=1, kv_cache_memory_gb=1.0) as llm:
        assert llm.engine.max_model_len == 4096
        blocks = llm.engine.runner.num_kv_blocks
        assert longest_sequence(blocks, 16, 0.01) >= 4096 > longest_sequence(blocks - 1, 16, 0.01)
