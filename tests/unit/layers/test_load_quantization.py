"""quantization="q4_0" / "q4_1" / "q8_0": a float checkpoint's projections quantized at load into
GGUF's blocks, the LM head and the embedding into Q8_0 blocks.

The sharpest check available without a second implementation: the engine quantizing at load
must compute exactly what quantization="gguf" computes over a GGUF file that holds the same
blocks (written from the same float checkpoint by the `gguf` package's quantizer, with the
embedding and the output in Q8_0): both then run the same block kernel over the same bytes, so
every step's logits are equal bit for bit. A projection quantized with the wrong kind, rows
stacked in another order, or a head or embedding left float, fails it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import quant4

pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
if not quant4.available():
    pytest.skip("the C++ CPU kernels are not built", allow_module_level=True)

PROMPTS = [[1, 5, 9, 200, 17], [3] * 40, list(range(30, 90))]


def _run(model: str, quantization: str) -> tuple[list[torch.Tensor], list[list[int]], dict[str, int], LLM]:
    with LLM(model, quantization=quantization, enable_prefix_caching=False) as llm:
        runner = llm.engine.runner
        logits: list[torch.Tensor] = []
        collect = runner.collect
        runner.collect = lambda: logits.append(collect().clone()) or logits[-1]
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        return logits, [o.token_ids for o in out], runner.model.weight_memory(), runner


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("tied", [False, True])
def test_equals_the_gguf_file_of_the_same_blocks(tiny_model_factory, tmp_path, monkeypatch, kind, tied):
    from gguf_files import Q, write_gguf

    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    base = tiny_model_factory("llama", tie_word_embeddings=tied)
    gguf_model = str(write_gguf(base, tmp_path / "tiny.gguf", quant=Q[kind],
                                tensor_type={"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0}))
    at_load = _run(base, kind.lower())
    from_file = _run(gguf_model, "gguf")
    assert at_load[3].dtype is torch.float32
    assert len(at_load[0]) == len(from_file[0])
    assert all(torch.equal(a, b) for a, b in zip(at_load[0], from_file[0]))
    assert at_load[1] == from_file[1]
    memory = at_load[2]
    assert memory[kind.lower()] > 0 and memory["q8_0"] > 0
    model = at_load[3].model
    embedding = model.model.embed_tokens
    assert embedding.weight.numel() == 0
    if tied:  # the table held once: the head's packed Q8_0 blocks serve the lookups too
        assert embedding.blocks is None and embedding.head_blocks is model.lm_head.kernel.packed
    else:
        assert embedding.blocks is not None and embedding.blocks[0] == "Q8_0" and embedding.head_blocks is None
    # Only the norms stay float32 (two per layer and the final one, 64 floats each).
    assert memory["float32"] == 4 * 64 * (2 * 2 + 1), memory


def test_a_projection_that_cannot_be_blocked_keeps_the_float_kernel(tiny_model_factory, caplog):
    """An input size that is not a multiple of 32 (hidden 48 here) cannot be cut into blocks:
    those projections keep the float kernel, saying why, and the model still answers as float32."""
    base = tiny_model_factory("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    with caplog.at_level(logging.WARNING):
        _, tokens, memory, _ = _run(base, "q4_0")
    _, float_tokens, _, _ = _run(base, "none")
    assert "not a multiple of 32" in caplog.text
    assert "q4_0" in memory  # down_proj (input 128) is blocked
    assert len(tokens) == len(float_tokens) and all(len(t) == 8 for t in tokens)


def test_auto_dtype_is_float32_for_a_bfloat16_checkpoint(tiny_model_factory):
    base = tiny_model_factory("llama", dtype="bfloat16")
    _, tokens, memory, runner = _run(base, "q4_1")
    assert runner.dtype is torch.float32 and memory.get("q4_1", 0) > 0
    assert all(len(t) == 8 for t in tokens)


def test_mixtral_experts_are_blocked_too(tiny_model_factory):
    """Every expert's gate_up and down are quantized like a dense MLP's (the router stays float)."""
    from splitfuse.layers.linear import CpuQ4Linear
    from splitfuse.layers.moe import SparseMoeBlock

    base = tiny_model_factory("mixtral")
    _, tokens, memory, runner = _run(base, "q4_0")
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        gate_up, down = block.experts.kernels()
        assert all(isinstance(k, CpuQ4Linear) for k in gate_up + down)
        assert not isinstance(block.gate.kernel, CpuQ4Linear)
    assert memory["q4_0"] > 0 and all(len(t) == 8 for t in tokens)
