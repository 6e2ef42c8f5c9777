"""Gemma 3 text: greedy tokens identical to transformers' Gemma3ForCausalLM generate(do_sample=False),
fp32, for tiny random checkpoints with sliding-window (window 8) and global layers, their own rope
bases (the global one with linear scaling), a softmax scale from query_pre_attn_scalar (not
head_dim), random weights in all six norms a layer (so a dropped +1, norm or scale shows), head_dim
not hidden / heads. Prompts run to 61 tokens, past the window. Each run has prefix caching and
n-gram speculation on and asserts both did work; both CPU paths, two token budgets and block sizes.
Also: a config in the older form (rope_theta, rope_local_base_freq, sliding_window_pattern, no
layer_types) and a multimodal (gemma3 + text_config) checkpoint's text model; the fused C++
decoder declines with its reason; two tensor-parallel ranks; a GGUF written as llama.cpp writes
gemma3 (its norm names, norms stored as 1 + w) converts and matches, and its Q8_0 blocks under
quantization=gguf-exact give the float32 tokens; options we do not run are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitfuse import LLM
from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.models.args import ModelArgs
from splitfuse.tools.demo_model import SIZES
from random_checkpoint import save_random_checkpoint
from test_parity import _hf_reference
from test_qwen3_parity import _params, _prompts, assert_two_ranks_match_hf

HEAD_DIM = 32  # hidden 64 / 4 heads = 16
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
# transformers 5's form: layer_types, per-layer-type rope_parameters.
TIED = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters=ROPE)
DECLINED = "Python (Gemma 3's layers (four norms, GELU-tanh MLP, q/k norm, two rope tables) are not in the fused decoder)"


def build_gemma3(out: Path, seed: int = 0, legacy: bool = False, **overrides) -> str:
    """A random-weight Gemma 3 text checkpoint with the demo tokenizer."""
    import transformers

    shape = dict(SIZES["tiny"]) | dict(num_hidden_layers=3, head_dim=HEAD_DIM, initializer_range=0.1,
                                       max_position_embeddings=4096, sliding_window=8, query_pre_attn_scalar=24)
    save_random_checkpoint(out, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, shape | overrides,
                           seed, _randomize_norms)
    if legacy:
        cfg = json.loads((out / "config.json").read_text())
        for key in ("layer_types", "rope_parameters"):
            cfg.pop(key)
        cfg |= dict(sliding_window_pattern=2, rope_theta=50_000.0, rope_local_base_freq=100.0,
                    rope_scaling={"rope_type": "linear", "factor": 2.0})
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _randomize_norms(model) -> None:
    for name, p in model.named_parameters():  # Gemma's norms start at zero (a scale of 1): random ones count
        if "norm" in name:
            p.normal_(0.0, 0.5)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = build_gemma3(tmp_path_factory.mktemp("gemma3_tied"), **TIED)
    prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])
    return path, prompts, _hf_reference(path, prompts)


@pytest.mark.parametrize("token_budget,block_size", [(7, 4), (64, 16)])
def test_gemma3_greedy_matches_hf_with_prefix_cache_and_ngram(tied, cpu_path, token_budget, block_size):
    path, prompts, refs = tied
    with LLM(path, dtype="float32", token_budget=token_budget, block_size=block_size, enable_prefix_caching=True,
             speculative_method="ngram", num_speculative_tokens=4, **cpu_path) as llm:
        engine = llm.engine
        assert engine.runner.args.sliding_windows == [8, None, 8]
        first = llm.generate(prompts, _params(len(prompts)))
        again = llm.generate(prompts, _params(len(prompts)))  # the prompts' full blocks are cached now
        engine.check_invariants()
        assert engine.blocks.num_used_blocks == 0
        assert engine.speculation.num_accepted > 0, f"n-gram: {engine.speculation.num_proposed} proposed, none accepted"
        assert sum(o.num_cached_tokens for o in again) > 0, "the second round never hit the cache"
        if cpu_path["attention_backend"] == "cpu" and cpu_decoder.available():
            assert engine.runner.decoder_layers == DECLINED
    for i, ref in enumerate(refs):
        assert first[i].token_ids == ref, f"budget={token_budget} block={block_size} prompt#{i}"
        assert again[i].token_ids == ref, f"(prefix cache hit) prompt#{i}"


def test_legacy_config_untied_matches_hf(tmp_path):
    """Older config.json keys (rewritten after saving): rope_theta + rope_scaling, rope_local_base_freq,
    sliding_window_pattern=2 (layer 1 global), no layer_types; an untied head."""
    path = build_gemma3(tmp_path, tie_word_embeddings=False, legacy=True)
    prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])
    refs = _hf_reference(path, prompts)
    with LLM(path, dtype="float32", token_budget=64, block_size=16) as llm:
        assert llm.engine.runner.args.sliding_windows == [8, None, 8]
        assert llm.engine.runner.args.sliding_rope == (100.0, None)
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
    assert got == refs


def test_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A gemma3 config (text_config inside) whose weights carry transformers 5's
    `model.language_model.` prefix beside vision tensors: the text model loads and matches."""
    from safetensors.torch import load_file, save_file

    path = Path(build_gemma3(tmp_path / "text", **TIED))
    prompts = _prompts(json.loads((path / "config.json").read_text())["vocab_size"])[:2]
    refs = _hf_reference(str(path), prompts)
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["model.vision_tower.patch_embedding.weight"] = torch.zeros(4, 4)  # skipped, never shape-checked
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                                                      text_config=text, eos_token_id=text["eos_token_id"])))
    with LLM(str(path), dtype="float32", token_budget=16, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
    assert got == refs


def test_config_mapping():
    base = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8)
    args = ModelArgs.from_hf_config(base)  # Gemma3TextConfig's defaults: every 6th layer global, rope 1e6 / 1e4
    assert args.sliding_windows == [8] * 5 + [None] and args.qk_norm and args.tie_word_embeddings
    assert (args.rope_theta, args.rope_scaling, args.sliding_rope) == (1e6, None, (1e4, None))
    assert args.attention_scale == 256**-0.5
    new = ModelArgs.from_hf_config(base | dict(rope_parameters=ROPE, query_pre_attn_scalar=24,
                                               layer_types=["full_attention", "sliding_attention"] * 3))
    assert new.rope_theta == 50_000.0 and new.rope_scaling["factor"] == 2.0 and new.sliding_rope == (100.0, None)
    assert new.sliding_windows == [None, 8] * 3 and new.attention_scale == 24**-0.5
    outer = ModelArgs.from_hf_config(dict(model_type="gemma3", text_config=base, eos_token_id=[1, 106]))
    assert outer.architecture == "gemma3_text" and outer.eos_token_ids == [1, 106]


@pytest.mark.parametrize("option,value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                          ("hidden_activation", "silu"), ("use_bidirectional_attention", True),
                                          ("sliding_window", None)])
def test_options_we_do_not_run_are_refused_by_name(option, value):
    cfg = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8)
    with pytest.raises(ValueError, match=option):
        ModelArgs.from_hf_config(cfg | {option: value})


def test_sliding_layers_rope_type_we_do_not_build_is_refused():
    cfg = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
               rope_parameters=dict(ROPE, sliding_attention={"rope_type": "yarn", "factor": 2.0, "rope_theta": 100.0}))
    with pytest.raises(ValueError, match="rope type 'yarn' on the sliding_attention layers"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.slow  # a two-rank engine (processes)
def test_gemma3_two_ranks_match_hf(tmp_path_factory):
    assert_two_ranks_match_hf(build_gemma3(tmp_path_factory.mktemp("gemma3_tp"), **TIED))


def test_gemma3_gguf_converts_and_matches(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import write_gguf

    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    # What a gemma3 GGUF's metadata implies (transformers reads it so, as llama.cpp does): every 6th
    # layer global, rope bases 1e6 / 1e4, query_pre_attn_scalar 256.
    path = build_gemma3(tmp_path / "hf", num_hidden_layers=6, query_pre_attn_scalar=256)
    prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])[:3]
    refs = _hf_reference(path, prompts)
    # Float32 tensors: the conversion is exact, so the tokens are the original checkpoint's.
    gguf_file = write_gguf(path, tmp_path / "tiny-gemma3.gguf", arch="gemma3", quant=gguf.GGMLQuantizationType.F32)
    with LLM(str(gguf_file), dtype="float32", token_budget=16, block_size=4) as llm:
        assert llm.engine.runner.args.sliding_windows == [8] * 5 + [None]
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
        converted = Path(llm.engine.config.model)
    cfg = json.loads((converted / "config.json").read_text())
    assert (cfg["model_type"], cfg["head_dim"], cfg["tie_word_embeddings"]) == ("gemma3_text", HEAD_DIM, True)
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert got == refs


def test_gemma3_gguf_blocks_give_float32_tokens(tmp_path, monkeypatch):
    """A Q8_0 file under quantization=gguf-exact (projections, tied head and scaled embedding on the
    file's blocks) gives the tokens of the same file dequantized to float32."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import write_gguf
    from splitfuse.kernels.cpu import quant4

    if not quant4.available():
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    path = build_gemma3(tmp_path / "hf", **TIED)
    prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])[:3]
    gguf_file = write_gguf(path, tmp_path / "tiny-gemma3-q8.gguf", arch="gemma3", quant=gguf.GGMLQuantizationType.Q8_0)
    got = {}
    for quantization in ("none", "gguf-exact"):
        with LLM(str(gguf_file), dtype="float32", quantization=quantization, token_budget=16, block_size=4) as llm:
            got[quantization] = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
            weights = llm.engine.runner.model.weight_memory()
    assert "q8_0" in weights, weights
    assert got["gguf-exact"] == got["none"]
