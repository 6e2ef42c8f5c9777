"""Engine greedy parity with HF through the Triton-lang kernels.

On CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py), which is slow,
so the workload is small. On CUDA the same engine runs natively in fp32 and bf16.
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from splitfuse import LLM, SamplingParams

pytest.importorskip("triton")

PROMPT_LENGTHS = [1, 9, 23, 40]
MAX_TOKENS = 8


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 400) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


def _reference(path, prompts, dtype=torch.float32, device="cpu"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                           max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in prompts
        ]


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_triton_backend_matches_hf_on_cpu_interpreter(tiny_model_factory, arch):
    if torch.cuda.is_available():
        pytest.skip("covered natively by the CUDA test")
    path = tiny_model_factory(arch)
    prompts = _prompts()
    llm = LLM(path, dtype="float32", attention_backend="triton", token_budget=24, block_size=4)
    assert llm.engine.runner.attention_backend == "triton"
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == _reference(path, prompts)
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.interpreter
@pytest.mark.slow
def test_triton_backend_with_prefix_cache_hits_matches_hf(tiny_model_factory):
    """A second wave of requests reuses the first wave's blocks: its chunks start at a
    context offset into cached KV that the Triton kernel reads in place."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA test covers the kernels natively")
    path = tiny_model_factory("llama")
    first = _prompts()[2]  # 23 tokens
    second = [first + [5, 6, 7], list(first)]  # shares 5 blocks of 4; the same prompt again
    llm = LLM(path, dtype="float32", attention_backend="triton", token_budget=24, block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([first], params)
    outs = llm.generate(second, params)
    assert [o.num_cached_tokens for o in outs] == [20, 20]
    assert [o.token_ids for o in outs] == _reference(path, second)
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_cuda_engine_matches_hf(tiny_model_factory, arch, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tiny_model_factory(arch)
    prompts = _prompts()
    llm = LLM(path, dtype="float32", attention_backend=backend, device="cuda", token_budget=24, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == _reference(path, prompts, device="cuda")
