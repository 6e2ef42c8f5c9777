"""The decoder layers in one C++ call (splitfuse.kernels.cpu.decoder) against the same layers run
one by one in Python: the same kernels with the same arguments, so every step's logits and the
KV caches must be bit-identical, for float32 and bfloat16, GQA, q/k/v biases (Qwen2), a sliding
window (Mistral), block sizes 4 and 16, prompt chunks with decodes in one step, steps whose
last layer keeps only the sampling rows (run in Python after the C++ call), and a GGUF file's
Q4_0 / Q4_1 / Q8_0 projections in both of their kernel's forms.

The engine takes the one call only where every projection runs the C++ linear kernel, which
`linear_backend=auto` picks on some CPUs only (`layers.linear.resolve_linear_backend`: AVX-512
builds); these tests ask for that kernel, so they cover the one call on AVX2 CPUs too."""

from __future__ import annotations

import random

import pytest
import torch
from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.layers.linear import resolve_linear_backend

pytestmark = pytest.mark.skipif(not cpu_decoder.available(), reason="C++ CPU kernels not built")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))] for _ in range(n)]


# The C++ linear kernel runs on every CPU the library builds for; `auto` takes it on some only.
CPU_LINEAR = {"linear_backend": "cpu"}


def _run(path: str, fused: bool, **kw) -> tuple[LLM, list[torch.Tensor], list[list[int]]]:
    llm = LLM(path, fused_decoder=fused, token_budget=48, num_kv_blocks=128, **CPU_LINEAR, **kw)
    runner = llm.engine.runner
    logits: list[torch.Tensor] = []
    collect = runner.collect

    def recording():
        out = collect()
        logits.append(out.clone())
        return out

    runner.collect = recording
    outs = llm.generate(_prompts(6, 0), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return llm, logits, [o.token_ids for o in outs]


def _cpu_int8() -> bool:
    from splitfuse.layers.int8_linear import cpu_int8_supported

    return cpu_int8_supported(torch.float32)


@pytest.mark.parametrize("arch,overrides,kw", [
    ("llama", {}, {}), ("qwen2", {}, {}), ("mistral", {"sliding_window": 24}, {}),
    pytest.param("llama", {}, {"quantization": "int8"}, id="llama-int8",
                 marks=pytest.mark.skipif(not _cpu_int8(), reason="the C++ int8 kernel needs AVX-512 VNNI")),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_one_call_matches_the_python_layers_bit_for_bit(tiny_model_factory, arch, overrides, kw, dtype, block_size):
    path = tiny_model_factory(arch, **overrides)
    fused, fused_logits, fused_tokens = _run(path, True, dtype=dtype, block_size=block_size, **kw)
    plain, plain_logits, plain_tokens = _run(path, False, dtype=dtype, block_size=block_size, **kw)
    assert fused.engine.runner.model.decoder_stack is not None
    assert plain.engine.runner.model.decoder_stack is None
    assert len(fused_logits) == len(plain_logits) > 10
    for step, (a, b) in enumerate(zip(fused_logits, plain_logits)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item()}"
    assert fused_tokens == plain_tokens
    for (fk, fv), (pk, pv) in zip(fused.engine.runner.kv_caches, plain.engine.runner.kv_caches):
        assert torch.equal(fk, pk) and torch.equal(fv, pv)
    assert fused.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("arch,kw,why", [
    ("mixtral", {}, "mixture-of-experts"),
    ("llama", {"linear_backend": "onednn"}, "projections not all"),
    ("llama", {"kv_cache_dtype": "bfloat16"}, "KV cache"),
    ("llama", {"attention_backend": "torch"}, "not the C++ CPU kernels"),
])
def test_models_it_cannot_run_keep_the_python_layers(tiny_model_factory, arch, kw, why, caplog):
    caplog.set_level("INFO", logger="splitfuse.engine.model_runner")
    llm = LLM(tiny_model_factory(arch), num_kv_blocks=64, **{**CPU_LINEAR, **kw})
    assert llm.engine.runner.model.decoder_stack is None
    assert any(why in r.getMessage() and "decoder layers in Python" in r.getMessage() for r in caplog.records)
    outs = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 3


def test_stack_rejects_inputs_it_does_not_take(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), num_kv_blocks=64, **CPU_LINEAR)
    stack = llm.engine.runner.model.decoder_stack
    assert stack is not None
    x = torch.zeros(3, stack.hidden)
    pos = torch.zeros(3, dtype=torch.int64)
    cos = sin = torch.zeros(8, stack.head_dim // 2)
    meta = (torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be"):
        stack.run(x.double(), 1, pos, cos, sin, *meta)
    with pytest.raises(ValueError, match="num_layers"):
        stack.run(x, stack.num_layers + 1, pos, cos, sin, *meta)
    with pytest.raises(ValueError, match="positions"):
        stack.run(x, 1, pos.int(), cos, sin, *meta)
    with pytest.raises(ValueError, match="outside the rotary tables"):
        stack.run(x, 1, torch.full((3,), 8, dtype=torch.int64), cos, sin, *meta)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_takes_the_one_call_where_it_picks_the_cpu_linear_kernel(tiny_model_factory, dtype):
    # The engine and this test ask the same function which linear kernel this CPU gets.
    chosen = resolve_linear_backend("auto", torch.device("cpu"), getattr(torch, dtype))
    llm = LLM(tiny_model_factory("llama"), num_kv_blocks=64, dtype=dtype)
    assert llm.engine.runner.linear_backend == chosen
    assert (llm.engine.runner.model.decoder_stack is not None) == (chosen == "cpu"), llm.engine.runner.decoder_layers


@pytest.mark.parametrize("quantization", ["gguf-exact", "gguf"])
@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_equal_the_python_layers(tiny_model_factory, tmp_path, monkeypatch, quant, quantization):
    """A tiny Llama written as a GGUF file of `quant` projections, served with the blocks widened
    to float32 (gguf-exact) or with int8 activations per 32-k group (gguf, where the build has
    that form): the same quant4 kernels with the same arguments, the same logits bit for bit."""
    pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import Q, write_gguf

    from splitfuse.kernels.cpu import quant4

    if quantization == "gguf" and not quant4.dot_products():
        pytest.skip("this build has no integer form of the GGUF kernel")
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    # hidden 64: rows of whole 32-element quantization blocks.
    model = str(write_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", quant=Q[quant]))
    fused, fused_logits, fused_tokens = _run(model, True, dtype="float32", quantization=quantization)
    plain, plain_logits, plain_tokens = _run(model, False, dtype="float32", quantization=quantization)
    stack = fused.engine.runner.model.decoder_stack
    assert stack is not None and stack.gguf, fused.engine.runner.decoder_layers
    assert plain.engine.runner.model.decoder_stack is None
    assert len(fused_logits) == len(plain_logits)
    for step, (a, b) in enumerate(zip(fused_logits, plain_logits)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item()}"
    assert fused_tokens == plain_tokens
