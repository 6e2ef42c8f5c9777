"""kv_cache_dtype: a bfloat16 KV cache under a float32 model (the C++ CPU attention reads it)."""

from __future__ import annotations

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.layers.attention import cpu_attention_problem, resolve_kv_cache_dtype

CPU_ATTENTION_WHY = cpu_attention_problem(torch.float32)


def test_resolution_and_refusal():
    assert resolve_kv_cache_dtype("auto", torch.float32, "torch") is torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "torch") is torch.bfloat16  # already the model's
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16'.*attention_backend cpu"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, "torch")


def test_engine_refuses_bf16_cache_on_the_torch_path(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_llama, dtype="float32", kv_cache_dtype="bfloat16", attention_backend="torch")


@pytest.mark.skipif(CPU_ATTENTION_WHY is not None, reason=f"C++ CPU attention unavailable: {CPU_ATTENTION_WHY}")
def test_bf16_cache_holds_twice_the_blocks_and_frees_them(tiny_llama):
    """Same memory, half the bytes per block: twice the blocks; requests run and give back every
    block, with prompts longer than a block and more than one 16-key tile."""
    fp32 = LLM(tiny_llama, dtype="float32", attention_backend="cpu", kv_cache_memory_gb=0.01)
    bf16 = LLM(tiny_llama, dtype="float32", attention_backend="cpu", kv_cache_memory_gb=0.01, kv_cache_dtype="bfloat16")
    runner = bf16.engine.runner
    assert runner.kv_cache_dtype is torch.bfloat16 and runner.kv_caches[0][0].dtype is torch.bfloat16
    assert 2 * runner.kv_bytes_per_block() == fp32.engine.runner.kv_bytes_per_block()
    assert runner.num_kv_blocks in (2 * fp32.engine.runner.num_kv_blocks, 2 * fp32.engine.runner.num_kv_blocks + 1)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 70)]
    outs = bf16.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    bf16.engine.check_invariants()
    assert bf16.engine.blocks.num_used_blocks == 0
