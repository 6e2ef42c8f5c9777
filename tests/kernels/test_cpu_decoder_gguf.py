"""GGUF blocks inside the one-call C++ decoder (splitfuse.kernels.cpu.decoder): a tiny Llama written
as a GGUF file of Q4_0, Q4_1 or Q8_0 projections and served with quantization gguf-exact (the blocks
widened to float32) or gguf (int8 activations per 32-k group, where the build has that form)
gives, step by step, the same logits bit for bit with the decoder layers in one call as in Python
(the same quant4 kernels with the same arguments), and the one call is taken."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

from gguf_files import Q, write_gguf  # noqa: E402

from splitfuse import LLM, SamplingParams  # noqa: E402
from splitfuse.kernels.cpu import decoder as cpu_decoder  # noqa: E402
from splitfuse.kernels.cpu import quant4  # noqa: E402

pytestmark = pytest.mark.skipif(not (cpu_decoder.available() and quant4.available()),
                                reason="C++ CPU kernels not built")


def _logits(model: str, quantization: str, fused: bool) -> tuple[list[torch.Tensor], list[list[int]], LLM]:
    llm = LLM(model, dtype="float32", quantization=quantization, fused_decoder=fused, enable_prefix_caching=False,
              token_budget=40)
    runner = llm.engine.runner
    logits: list[torch.Tensor] = []
    execute = runner.execute

    def recording(batch):
        out = execute(batch)
        logits.append(out.clone())
        return out

    runner.execute = recording
    prompts = [[1, 5, 9, 200, 17, 33], [1] + list(range(40, 90)), [7] * 3]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return logits, [o.token_ids for o in outs], llm


@pytest.mark.parametrize("quantization", ["gguf-exact", "gguf"])
@pytest.mark.parametrize("quant", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_one_call_equals_the_python_layers(tiny_model_factory, tmp_path, monkeypatch, quant, quantization):
    if quantization == "gguf" and not quant4.dot_products():
        pytest.skip("this build has no integer form of the GGUF kernel")
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    # hidden 64: rows of whole 32-element quantization blocks.
    model = str(write_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", quant=quant))
    fused_logits, fused_tokens, fused = _logits(model, quantization, True)
    plain_logits, plain_tokens, plain = _logits(model, quantization, False)
    stack = fused.engine.runner.model.decoder_stack
    assert stack is not None and stack.gguf, fused.engine.runner.decoder_layers
    assert plain.engine.runner.model.decoder_stack is None
    assert len(fused_logits) == len(plain_logits)
    for step, (a, b) in enumerate(zip(fused_logits, plain_logits)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item()}"
    assert fused_tokens == plain_tokens
