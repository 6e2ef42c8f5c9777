"""kv_cache_dtype: a bfloat16 or int8 KV cache (the C++ CPU attention reads them)."""

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


def test_int8_is_refused_off_the_cpu_kernels(tiny_llama):
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, "cpu") is torch.int8
    for backend in ("torch", "triton", "flash_attn"):
        with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs the C\\+\\+ CPU attention"):
            resolve_kv_cache_dtype("int8", torch.float32, backend)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(tiny_llama, dtype="float32", kv_cache_dtype="int8", attention_backend="torch")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_used_blocks == 0
    return [o.token_ids for o in outs]


@pytest.mark.skipif(CPU_ATTENTION_WHY is not None, reason=f"C++ CPU attention unavailable: {CPU_ATTENTION_WHY}")
def test_int8_cache_blocks_and_greedy_agreement(tiny_model_factory):
    """head_dim 64: an int8 block takes 64 + 4 bytes per token, head and K or V against bf16's 128,
    so the same memory holds 128 / 68 = 1.88x the blocks. Greedy tokens of the fused C++ decoder
    and of the Python layers over the int8 cache are the same kernels' (identical); against float32
    they agree on most prompts, and a prompt run again over its prefix-cached blocks repeats its tokens (tiny random weights: close top logits flip; measured 24 prompts,
    first token 100%, first 8 tokens 88%; bounded loosely)."""
    path = tiny_model_factory("llama", hidden_size=256)
    common = dict(dtype="float32", attention_backend="cpu", kv_cache_memory_gb=0.01, token_budget=64)
    bf16 = LLM(path, kv_cache_dtype="bfloat16", **common).engine.runner
    int8 = LLM(path, kv_cache_dtype="int8", **common)
    runner = int8.engine.runner
    assert runner.kv_caches[0][0].dtype is torch.int8 and runner.decoder_layers == "one C++ call"
    assert runner.kv_bytes_per_block() * 128 == bf16.kv_bytes_per_block() * 68
    assert abs(runner.num_kv_blocks / bf16.num_kv_blocks - 128 / 68) < 0.01
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(2, 80, (24,), generator=gen)]
    got = _greedy(int8, prompts)
    # Again: the prompts' full blocks now come from the prefix cache, codes and scales together.
    hits = int8.engine.blocks.num_cached_free_blocks
    assert hits > 0 and _greedy(int8, prompts[:8]) == got[:8]
    assert got == _greedy(LLM(path, kv_cache_dtype="int8", fused_decoder=False, **common), prompts)
    ref = _greedy(LLM(path, **common), prompts)
    first = sum(g[0] == r[0] for g, r in zip(got, ref)) / len(prompts)
    first8 = sum(g == r for g, r in zip(got, ref)) / len(prompts)
    print(f"\nint8 KV cache vs float32 greedy agreement: first token {first:.0%}, first 8 tokens {first8:.0%}")
    assert first >= 0.8 and first8 >= 0.4
