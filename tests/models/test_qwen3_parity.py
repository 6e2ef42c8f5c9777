"""Qwen3 dense: greedy tokens identical to transformers' Qwen3ForCausalLM generate(do_sample=False),
fp32, for tiny random checkpoints whose head_dim (32) is not hidden / heads (16), with random
q_norm / k_norm weights (so the per-head norms count), tied and untied embeddings, qkv/o bias
on, and sliding-window layers from use_sliding_window / max_window_layers. Each run has prefix
caching and n-gram speculation on, and asserts both did work (cache hits, accepted proposals);
both CPU paths, several token budgets and block sizes. Also: the fused C++ decoder declines
the model with its reason (the per-layer path runs), tensor parallelism over 2 ranks, a GGUF
file written as llama.cpp writes Qwen3 (attn_q_norm / attn_k_norm, key_length) converts and
matches, and architectures we do not run are refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.models.args import ModelArgs
from splitfuse.tools.demo_model import SIZES
from random_checkpoint import save_random_checkpoint
from test_parity import _hf_reference, _max_tokens

HEAD_DIM = 32  # tiny size: hidden 64 / 4 heads = 16; Qwen3 takes head_dim from its config
CASES = {
    "untied": dict(),
    "tied-bias": dict(tie_word_embeddings=True, attention_bias=True),
    # Layer 1 of 2 attends over the last 8 positions only (prompts here run to 61 tokens).
    "sliding": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
}
SEGMENT_LENGTHS = [1, 3, 6, 11, 20]


def build_qwen3(out: Path, seed: int = 0, **overrides) -> str:
    """A random-weight Qwen3 checkpoint with the demo tokenizer (demo_model builds the others)."""
    import transformers

    shape = dict(SIZES["tiny"]) | dict(head_dim=HEAD_DIM, initializer_range=0.1, max_position_embeddings=4096)
    return save_random_checkpoint(out, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, shape | overrides,
                                  seed, _randomize_norms_and_biases)


def _randomize_norms_and_biases(model) -> None:
    for layer in model.model.layers:  # the norms start at ones: random weights make a dropped norm visible
        layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
        layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
            if proj.bias is not None:
                proj.bias.normal_(0.0, 0.1)


def _prompts(vocab: int) -> list[list[int]]:
    """Self-repeating prompts, so n-gram lookups find proposals."""
    rng = random.Random(3)
    out = []
    for n in SEGMENT_LENGTHS:
        segment = [rng.randrange(3, vocab) for _ in range(n)]
        out.append([1] + segment * 3 + segment[: n // 2])
    return out


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = build_qwen3(tmp_path_factory.mktemp(f"qwen3_{request.param}"), **CASES[request.param])
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    return request.param, path, prompts, _hf_reference(path, prompts)


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=_max_tokens(i), temperature=0.0) for i in range(n)]


@pytest.mark.parametrize("token_budget,block_size", [(7, 4), (64, 16)])
def test_qwen3_greedy_matches_hf_with_prefix_cache_and_ngram(case, cpu_path, token_budget, block_size):
    name, path, prompts, refs = case
    with LLM(path, dtype="float32", token_budget=token_budget, block_size=block_size, enable_prefix_caching=True,
             speculative_method="ngram", num_speculative_tokens=4, **cpu_path) as llm:
        engine = llm.engine
        first = llm.generate(prompts, _params(len(prompts)))
        again = llm.generate(prompts, _params(len(prompts)))  # the prompts' full blocks are cached now
        engine.check_invariants()
        assert engine.blocks.num_used_blocks == 0
        assert engine.speculation.num_accepted > 0, f"{name}: n-gram: {engine.speculation.num_proposed} proposed, none accepted"
        assert sum(o.num_cached_tokens for o in again) > 0, f"{name}: the second round never hit the cache"
        if cpu_path["attention_backend"] == "cpu" and cpu_decoder.available():
            assert engine.runner.decoder_layers == "Python (q/k norm is not in the fused decoder)"
    for i, ref in enumerate(refs):
        assert first[i].token_ids == ref, f"{name} budget={token_budget} block={block_size} prompt#{i}"
        assert again[i].token_ids == ref, f"{name} (prefix cache hit) prompt#{i}"


def test_config_mapping():
    base = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8, max_window_layers=2)
    args = ModelArgs.from_hf_config(base | dict(use_sliding_window=True))
    assert args.qk_norm and args.head_dim == 32 and not args.qkv_bias and not args.o_bias
    assert args.sliding_windows == [None, None, 8, 8]
    # transformers drops the window unless use_sliding_window is set, whatever layer_types says.
    off = ModelArgs.from_hf_config(base | dict(layer_types=["sliding_attention"] * 4))
    assert off.sliding_windows == [None] * 4
    assert ModelArgs.from_hf_config(base | dict(attention_bias=True)).o_bias
    assert not ModelArgs.from_hf_config(base | dict(model_type="qwen2")).qk_norm


def test_unsupported_architectures_are_refused_by_name():
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    for model_type in ("qwen2_moe", "gemma2"):
        with pytest.raises(ValueError, match=f"unsupported model_type '{model_type}'"):
            ModelArgs.from_hf_config(cfg | dict(model_type=model_type))


@pytest.mark.slow  # a two-rank engine (processes)
def test_qwen3_two_ranks_match_hf(tmp_path_factory):
    assert_two_ranks_match_hf(build_qwen3(tmp_path_factory.mktemp("qwen3_tp"), tie_word_embeddings=True))


def assert_two_ranks_match_hf(path: str) -> None:
    """Two ranks give transformers' tokens, split either way: tensor parallel (each with 2 of the 4
    query heads and 1 of the 2 KV heads) and pipeline parallel (each a stage of the layers)."""
    prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])
    refs = _hf_reference(path, prompts)
    with LLM(path, dtype="float32", tensor_parallel_size=2, num_threads=1, token_budget=12, block_size=4) as llm:
        assert llm.engine.runner.args.num_heads == 2 and llm.engine.runner.args.num_kv_heads == 1
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
        llm.engine.check_invariants()
    assert got == refs
    with LLM(path, dtype="float32", pipeline_parallel_size=2, num_threads=1, token_budget=12, block_size=4) as llm:
        assert llm.engine.runner.layers.first == 0 and not llm.engine.runner.layers.has_head
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
        llm.engine.check_invariants()
    assert got == refs, "pipeline_parallel_size=2"


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_gguf_converts_and_matches(tmp_path, monkeypatch, tie):
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import write_gguf

    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    path = build_qwen3(tmp_path / "hf", tie_word_embeddings=tie)
    prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])[:3]
    refs = _hf_reference(path, prompts)
    # Float32 tensors: the conversion is exact, so the tokens are the original checkpoint's.
    gguf_file = write_gguf(path, tmp_path / "tiny-qwen3.gguf", quant=gguf.GGMLQuantizationType.F32)
    with LLM(str(gguf_file), dtype="float32", quantization="none", token_budget=16, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
        converted = Path(llm.engine.config.model)
    cfg = json.loads((converted / "config.json").read_text())
    assert (cfg["model_type"], cfg["head_dim"], cfg["tie_word_embeddings"]) == ("qwen3", HEAD_DIM, tie)
    assert got == refs
