"""Qwen3-MoE: greedy tokens identical to transformers' Qwen3MoeForCausalLM generate(do_sample=False),
fp32, for tiny random checkpoints with 8 experts, top-2 routing, experts narrower than the dense
MLP (moe_intermediate_size 48 against intermediate_size 128), random q/k norms, and router and
expert weights large enough that routing and the renormalisation change the greedy tokens (the
parity runs fail with norm_topk_prob ignored either way). Cases: top-k weights as the softmax
gives them with a dense layer among the sparse ones (mlp_only_layers), and renormalised with
every layer sparse and tied embeddings, each with its own token budget and block size; the
two-rank and GGUF tests reuse their checkpoints. Each run has prefix caching and n-gram
speculation on and asserts both worked; both CPU paths. Also: the config's MoE options map onto
ModelArgs, the fused C++ decoder declines with its reason, tensor parallelism over 2 ranks, a
GGUF written as llama.cpp writes qwen3moe converts and matches, its metadata maps onto the config
(shared experts and sigmoid gating refused by name), and Qwen2-MoE (a shared expert) and other
mixture-of-experts GGUFs are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitfuse import LLM
from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.models.args import ModelArgs
from splitfuse.models.gguf_checkpoint import GGUFError, convert
from splitfuse.tools.demo_model import SIZES
from random_checkpoint import save_random_checkpoint
from test_parity import _hf_reference
from test_qwen3_parity import HEAD_DIM, _params, _prompts

MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
# name -> (config overrides, (token_budget, block_size))
CASES = {
    # seed 3: a model whose continuations repeat its prompts enough for n-gram proposals to land
    "raw-topk-dense-layer": (dict(seed=3, norm_topk_prob=False, mlp_only_layers=[1]), (7, 4)),
    "norm-topk-tied": (dict(norm_topk_prob=True, tie_word_embeddings=True), (64, 16)),
}


def build_qwen3_moe(out: Path, seed: int = 0, **overrides) -> str:
    """A random-weight Qwen3-MoE checkpoint with the demo tokenizer, saved by transformers."""
    import transformers

    shape = dict(SIZES["tiny"]) | MOE_SHAPE | dict(head_dim=HEAD_DIM, initializer_range=0.1,
                                                   max_position_embeddings=4096)
    return save_random_checkpoint(out, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                                  shape | overrides, seed, _randomize_norms_and_experts)


def _randomize_norms_and_experts(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
        layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
        if hasattr(layer.mlp, "experts"):  # clear top-2 picks; experts that outweigh the residual
            layer.mlp.gate.weight.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.2)
            layer.mlp.experts.down_proj.normal_(0.0, 0.2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(case name) -> (name, checkpoint, prompts, transformers' greedy tokens), built once."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            path = build_qwen3_moe(tmp_path_factory.mktemp(f"qwen3moe_{name}"), **CASES[name][0])
            prompts = _prompts(json.loads(Path(path, "config.json").read_text())["vocab_size"])
            cache[name] = name, path, prompts, _hf_reference(path, prompts)
        return cache[name]

    return get


@pytest.fixture(params=list(CASES))
def case(request, checkpoints):
    return checkpoints(request.param)


def test_qwen3_moe_greedy_matches_hf_with_prefix_cache_and_ngram(case, cpu_path):
    name, path, prompts, refs = case
    token_budget, block_size = CASES[name][1]
    with LLM(path, dtype="float32", token_budget=token_budget, block_size=block_size, enable_prefix_caching=True,
             speculative_method="ngram", num_speculative_tokens=4, **cpu_path) as llm:
        engine = llm.engine
        layers = engine.runner.model.model.layers
        kinds = [type(layer.mlp).__name__ for layer in layers]
        first = llm.generate(prompts, _params(len(prompts)))
        again = llm.generate(prompts, _params(len(prompts)))
        engine.check_invariants()
        assert engine.blocks.num_used_blocks == 0
        assert engine.speculation.num_accepted > 0, f"{name}: n-gram: none accepted"
        assert sum(o.num_cached_tokens for o in again) > 0, f"{name}: the second round never hit the cache"
        if cpu_path["attention_backend"] == "cpu" and cpu_decoder.available():
            assert engine.runner.decoder_layers == "Python (a mixture-of-experts MLP)"
    dense = CASES[name][0].get("mlp_only_layers", [])
    assert kinds == ["MLP" if i in dense else "SparseMoeBlock" for i in range(len(kinds))]
    for i, ref in enumerate(refs):
        assert first[i].token_ids == ref, f"{name} budget={token_budget} block={block_size} prompt#{i}"
        assert again[i].token_ids == ref, f"{name} (prefix cache hit) prompt#{i}"


def test_config_mapping():
    base = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=48, sliding_window=8)
    args = ModelArgs.from_hf_config(base)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (8, 2, 48)
    assert args.qk_norm and not args.norm_topk_prob and args.dense_mlp_layers == ()
    assert args.sliding_windows == [None] * 4  # the window counts only with use_sliding_window
    assert ModelArgs.from_hf_config(base | dict(use_sliding_window=True)).sliding_windows == [8] * 4
    # transformers 5 saves num_experts as num_local_experts.
    saved = {k: v for k, v in base.items() if k != "num_experts"} | dict(num_local_experts=6, norm_topk_prob=True)
    assert (ModelArgs.from_hf_config(saved).num_experts, ModelArgs.from_hf_config(saved).norm_topk_prob) == (6, True)
    # A layer is sparse when (i + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers.
    assert ModelArgs.from_hf_config(base | dict(decoder_sparse_step=2)).dense_mlp_layers == (0, 2)
    both = ModelArgs.from_hf_config(base | dict(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert both.dense_mlp_layers == (0, 2, 3)
    with pytest.raises(ValueError, match="decoder_sparse_step = 0 is not supported"):
        ModelArgs.from_hf_config(base | dict(decoder_sparse_step=0))
    with pytest.raises(ValueError, match="unsupported model_type 'qwen2_moe'"):  # its shared expert is not run
        ModelArgs.from_hf_config(base | dict(model_type="qwen2_moe"))


@pytest.mark.slow  # a two-rank engine (processes)
def test_qwen3_moe_two_ranks_match_hf(checkpoints):
    _, path, prompts, refs = checkpoints("raw-topk-dense-layer")  # experts and a dense MLP, each split
    with LLM(path, dtype="float32", tensor_parallel_size=2, num_threads=1, token_budget=12, block_size=4) as llm:
        args = llm.engine.runner.args
        assert (args.moe_intermediate_size, args.intermediate_size) == (24, 64)  # each rank's half
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
        llm.engine.check_invariants()
    assert got == refs


def test_qwen3_moe_gguf_converts_and_matches(checkpoints, tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import write_gguf

    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    # llama.cpp's qwen3moe has no dense layers and renormalises the top-k weights.
    _, path, prompts, refs = checkpoints("norm-topk-tied")
    prompts, refs = prompts[:3], refs[:3]
    gguf_file = write_gguf(path, tmp_path / "tiny-qwen3moe.gguf", arch="qwen3moe", quant=gguf.GGMLQuantizationType.F32)
    with LLM(str(gguf_file), dtype="float32", quantization="none", token_budget=16, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
        converted = Path(llm.engine.config.model)
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["head_dim"] == HEAD_DIM and cfg["norm_topk_prob"]
    assert cfg["tie_word_embeddings"]
    assert cfg["moe_intermediate_size"] == MOE_SHAPE["moe_intermediate_size"] and cfg["mlp_only_layers"] == []
    assert got == refs


def test_other_moe_ggufs_are_refused_by_name(tiny_llama, tmp_path):
    from gguf_files import write_gguf

    with pytest.raises(GGUFError, match="a mixture-of-experts llama GGUF is not supported"):
        convert(write_gguf(tiny_llama, tmp_path / "llama-moe.gguf", expert_count=4), tmp_path / "out")
    with pytest.raises(GGUFError, match="architecture 'qwen2moe' is not supported"):
        convert(write_gguf(tiny_llama, tmp_path / "qwen2moe.gguf", arch="qwen2moe"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_qwen3moe_gguf_metadata():
    from types import SimpleNamespace

    from splitfuse.models.gguf_moe import GGUFMoeError, configure_moe

    meta = {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 48}
    config = SimpleNamespace(norm_topk_prob=True)
    configure_moe(meta.get, "qwen3moe", config, "f.gguf", 3, {0, 2})
    assert (config.moe_intermediate_size, config.norm_topk_prob, config.mlp_only_layers) == (48, True, [1])
    configure_moe((meta | {"qwen3moe.expert_weights_norm": False}).get, "qwen3moe", config, "f.gguf", 3, {0, 1, 2})
    assert not config.norm_topk_prob and config.mlp_only_layers == []
    refused = [({"qwen3moe.expert_shared_count": 1}, "expert_shared_count = 1 (shared experts) is not supported"),
               ({"qwen3moe.expert_gating_func": 2}, "expert_gating_func = 2 is not supported (softmax only)"),
               ({"qwen3moe.expert_feed_forward_length": None}, "expert_feed_forward_length (the experts' width) is"),
               ({"qwen3moe.expert_count": None}, "needs qwen3moe.expert_count and qwen3moe.expert_used_count")]
    for change, message in refused:
        with pytest.raises(GGUFMoeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            configure_moe((meta | change).get, "qwen3moe", SimpleNamespace(), "f.gguf", 3, {0, 1, 2})
