"""Phi-3 / Phi-4-mini: greedy tokens identical to transformers' Phi3ForCausalLM
generate(do_sample=False), fp32, for tiny random checkpoints (fused qkv_proj / gate_up_proj as
Phi-3 stores them): Phi-4-mini's shape (rope on 3/4 of each head, LongRoPE, tied embeddings),
Phi-3-128k's (full rotary, LongRoPE) and Phi-3-mini-4k's (default rope, a sliding window).

LongRoPE: each batch mixes prompts below the switch (short factors; prompt + output stay within
original_max_position_embeddings, where transformers never re-ropes) and prompts past it (long
factors from the first token, as transformers runs them), and a short prompt that is a prefix of
a long one (so a prefix cache that ignored the rope set would hand it the long set's keys). A
short prompt whose output crosses the switch keeps the short factors (transformers recomputes
the whole cache with the long ones there: not matchable without re-roping the cache): checked
against transformers with long_factor = short_factor. Each run has prefix caching and n-gram
speculation on and asserts both did work; both CPU paths, two token budgets and block sizes;
tensor parallelism over 2 ranks (fused checkpoint tensors cut per part); a phi3 GGUF file as
llama.cpp writes it converts and matches; options we do not run are refused by name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from splitfuse import LLM, SamplingParams
from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.models.args import ModelArgs
from splitfuse.tools.demo_model import SIZES
from random_checkpoint import save_random_checkpoint
from test_parity import _hf_reference

ORIGINAL = 32  # original_max_position_embeddings: the LongRoPE switch
MAX_POSITIONS = 128


def _factors(n: int, seed: int, low: float, high: float) -> list[float]:
    rng = random.Random(seed)
    return [round(rng.uniform(low, high), 3) for _ in range(n)]


def _longrope(rotary_dim: int) -> dict:
    return {"rope_type": "longrope", "short_factor": _factors(rotary_dim // 2, 1, 1.0, 1.5),
            "long_factor": _factors(rotary_dim // 2, 2, 1.5, 6.0)}


CASES = {
    # Phi-4-mini: partial rotary 0.75 (head 16 -> 12 rotated), LongRoPE, tied embeddings.
    "phi4-mini": dict(partial_rotary_factor=0.75, rope_scaling=_longrope(12), tie_word_embeddings=True),
    # Phi-3-128k: LongRoPE over the whole head (the fused C++ decoder runs it).
    "phi3-128k": dict(rope_scaling=_longrope(16)),
    # Phi-3-mini-4k: default rope; every layer attends over the last 8 positions.
    "phi3-4k": dict(sliding_window=8),
}


def build_phi3(out: Path, seed: int = 0, **overrides) -> str:
    """A random-weight Phi-3 checkpoint with the demo tokenizer."""
    import transformers

    shape = dict(SIZES["tiny"]) | dict(initializer_range=0.1, max_position_embeddings=MAX_POSITIONS,
                                       original_max_position_embeddings=ORIGINAL)
    return save_random_checkpoint(out, transformers.Phi3Config, transformers.Phi3ForCausalLM, shape | overrides, seed)


def _prompts(vocab: int) -> list[list[int]]:
    """Self-repeating prompts (n-gram lookups find proposals): some below the switch, some past it,
    and one below it that is the start of one past it."""
    rng = random.Random(3)
    out = []
    for n in (1, 3, 6, 11, 17):
        segment = [rng.randrange(3, vocab) for _ in range(n)]
        out.append([1] + segment * 3 + segment[: n // 2])  # 4, 11, 22, 37, 60 tokens
    out.append(out[3][:20])
    return out


def _max_tokens_for(prompts: list[list[int]]):
    """Outputs of prompts below the switch end before it: transformers' last forward pass there
    (prompt + output - 1 tokens) must not pass original_max_position_embeddings."""
    def max_tokens(i: int) -> int:
        n = 6 + (i * 7) % 20
        return n if len(prompts[i]) > ORIGINAL else min(n, ORIGINAL + 1 - len(prompts[i]))
    return max_tokens


def _params(prompts: list[list[int]]) -> list[SamplingParams]:
    max_tokens = _max_tokens_for(prompts)
    return [SamplingParams(max_tokens=max_tokens(i), temperature=0.0) for i in range(len(prompts))]


def _vocab(path: str) -> int:
    return json.loads(Path(path, "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = build_phi3(tmp_path_factory.mktemp(f"phi3_{request.param}"), **CASES[request.param])
    prompts = _prompts(_vocab(path))
    return request.param, path, prompts, _hf_reference(path, prompts, _max_tokens_for(prompts))


# Each CPU path with one budget and block size: small chunks and blocks through the C++ kernels,
# large ones through torch (the pairing keeps the file's run time down).
@pytest.mark.parametrize("cpu_path,token_budget,block_size", [("fast", 7, 4), ("fallback", 64, 16)],
                         indirect=["cpu_path"])
def test_phi3_greedy_matches_hf_with_prefix_cache_and_ngram(case, cpu_path, token_budget, block_size):
    name, path, prompts, refs = case
    with LLM(path, dtype="float32", token_budget=token_budget, block_size=block_size, enable_prefix_caching=True,
             speculative_method="ngram", num_speculative_tokens=4, **cpu_path) as llm:
        engine = llm.engine
        first = llm.generate(prompts, _params(prompts))
        again = llm.generate(prompts, _params(prompts))  # the prompts' full blocks are cached now
        engine.check_invariants()
        assert engine.blocks.num_used_blocks == 0
        assert engine.speculation.num_accepted > 0, f"{name}: n-gram: none of {engine.speculation.num_proposed} accepted"
        assert sum(o.num_cached_tokens for o in again) > 0, f"{name}: the second round never hit the cache"
        if cpu_path["attention_backend"] == "cpu" and cpu_decoder.available():
            partial = "Python (partial rotary (rope on part of each head) is not in the fused decoder)"
            assert engine.runner.decoder_layers == (partial if name == "phi4-mini" else "one C++ call")
    for i, ref in enumerate(refs):
        assert first[i].token_ids == ref, f"{name} budget={token_budget} block={block_size} prompt#{i}"
        assert again[i].token_ids == ref, f"{name} (prefix cache hit) prompt#{i}"


def test_longrope_output_past_the_switch_keeps_the_short_factors(tmp_path):
    """A prompt below the switch whose output runs past it: the sequence keeps its short
    factors, i.e. transformers' tokens for the same weights with long_factor = short_factor."""
    path = build_phi3(tmp_path / "hf", **CASES["phi4-mini"])
    short_only = tmp_path / "short_only"
    shutil.copytree(path, short_only)
    cfg = json.loads((short_only / "config.json").read_text())
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["short_factor"]
    (short_only / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(_vocab(path))[1:3]  # 11 and 22 tokens, 20 new tokens each: past 32
    refs = _hf_reference(str(short_only), prompts, lambda i: 20)
    crossing = _hf_reference(path, prompts, lambda i: 20)  # transformers re-ropes at the switch
    assert refs != crossing, "the long factors never mattered: the test would prove nothing"
    with LLM(path, dtype="float32", token_budget=16, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=20, temperature=0.0)] * 2)]
    assert got == refs


def test_longrope_prefix_cache_keeps_the_two_rope_sets_apart(tmp_path):
    """A prompt below the switch that starts like a cached prompt past it must not take that
    prompt's blocks (their keys hold the long factors' rotation); its own repeat does hit."""
    path = build_phi3(tmp_path / "hf", **CASES["phi3-128k"])
    long = _prompts(_vocab(path))[3]
    short = long[:20]
    ref = _hf_reference(path, [short], lambda i: 8)[0]
    params = [SamplingParams(max_tokens=8, temperature=0.0)]
    with LLM(path, dtype="float32", token_budget=64, block_size=4, enable_prefix_caching=True) as llm:
        llm.generate([long], params)
        first = llm.generate([short], params)[0]
        again = llm.generate([short], params)[0]
    assert first.num_cached_tokens == 0, "a prompt below the switch took blocks rotated with the long factors"
    assert again.num_cached_tokens > 0
    assert first.token_ids == again.token_ids == ref


def test_config_mapping():
    base = dict(model_type="phi3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                original_max_position_embeddings=32, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1)
    plain = ModelArgs.from_hf_config(base | dict(sliding_window=8, attention_bias=True))
    assert plain.sliding_windows == [8, 8] and plain.rotary_dim == 16 and plain.rope_scaling is None
    assert not (plain.qkv_bias or plain.o_bias or plain.mlp_bias)  # transformers' Phi-3 has none
    # Phi-3's older checkpoints: top-level partial_rotary_factor, rope_scaling of type "su".
    old = ModelArgs.from_hf_config(base | dict(partial_rotary_factor=0.75, rope_scaling=dict(
        type="su", short_factor=[1.0] * 6, long_factor=[2.0] * 6)))
    assert old.rotary_dim == 12 and old.rope_scaling["rope_type"] == "longrope"
    assert old.rope_scaling["original_max_position_embeddings"] == 32


def test_options_we_do_not_run_are_refused_by_name():
    base = dict(model_type="phi3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4)
    with pytest.raises(ValueError, match="rope type 'linear' is not supported for phi3"):
        ModelArgs.from_hf_config(base | dict(rope_scaling=dict(type="linear", factor=2.0)))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        ModelArgs.from_hf_config(base | dict(hidden_act="gelu"))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for llama"):
        ModelArgs.from_hf_config(base | dict(model_type="llama", partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="rope type 'su_v2' is not supported"):
        ModelArgs.from_hf_config(base | dict(model_type="llama", rope_scaling=dict(rope_type="su_v2")))


@pytest.mark.slow  # a two-rank engine (processes)
def test_phi3_two_ranks_match_hf(tmp_path_factory):
    path = build_phi3(tmp_path_factory.mktemp("phi3_tp"), **CASES["phi4-mini"])
    prompts = _prompts(_vocab(path))
    refs = _hf_reference(path, prompts, _max_tokens_for(prompts))
    with LLM(path, dtype="float32", tensor_parallel_size=2, num_threads=1, token_budget=12, block_size=4) as llm:
        assert llm.engine.runner.args.num_heads == 2 and llm.engine.runner.args.num_kv_heads == 1
        got = [o.token_ids for o in llm.generate(prompts, _params(prompts))]
        llm.engine.check_invariants()
    assert got == refs
    with LLM(path, dtype="float32", pipeline_parallel_size=2, num_threads=1, token_budget=12, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _params(prompts))]
        llm.engine.check_invariants()
    assert got == refs, "pipeline_parallel_size=2"


@pytest.mark.parametrize("name", ["phi4-mini", "phi3-4k"])
def test_phi3_gguf_converts_and_matches(tmp_path, monkeypatch, name):
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import write_gguf

    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    path = build_phi3(tmp_path / "hf", **CASES[name])
    prompts = [_prompts(_vocab(path))[i] for i in (2, 3)]  # below and past the LongRoPE switch
    refs = _hf_reference(path, prompts, _max_tokens_for(prompts))
    # Float32 tensors: the conversion is exact, so the tokens are the original checkpoint's.
    gguf_file = write_gguf(path, tmp_path / f"tiny-{name}.gguf", quant=gguf.GGMLQuantizationType.F32)
    with LLM(str(gguf_file), dtype="float32", token_budget=16, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, _params(prompts))]
        converted = Path(llm.engine.config.model)
    cfg = json.loads((converted / "config.json").read_text())
    original = json.loads(Path(path, "config.json").read_text())
    assert cfg["model_type"] == "phi3" and cfg["sliding_window"] == original["sliding_window"]
    ours, theirs = cfg["rope_parameters"], original["rope_parameters"]
    assert (ours["rope_type"], ours["partial_rotary_factor"]) == (theirs["rope_type"], theirs["partial_rotary_factor"])
    for key in ("short_factor", "long_factor"):  # float32 in the file, as transformers uses them
        assert (key in ours) == (key in theirs)
        if key in ours:
            assert torch.equal(torch.tensor(ours[key], dtype=torch.float32), torch.tensor(theirs[key])), key
    assert got == refs


def test_phi3_q8_gguf_multiplies_the_fused_blocks_packed(tmp_path, monkeypatch):
    """quantization=gguf-exact reads attn_qkv and ffn_up's Q8_0 blocks under our fused names and
    gives the dequantized model's tokens."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")
    from gguf_files import write_gguf
    from splitfuse.kernels.cpu import quant4
    from splitfuse.layers.q4_linear import CpuQ4Linear

    if not quant4.available():
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setenv("SPLITFUSE_GGUF_CACHE", str(tmp_path / "cache"))
    path = build_phi3(tmp_path / "hf", **CASES["phi3-128k"])
    prompts = [_prompts(_vocab(path))[i] for i in (2, 3)]
    gguf_file = write_gguf(path, tmp_path / "tiny-phi3-q8.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    got = {}
    for quantization in ("none", "gguf-exact"):
        with LLM(str(gguf_file), dtype="float32", token_budget=16, block_size=4, quantization=quantization) as llm:
            layer = llm.engine.runner.model.model.layers[0]
            packed = [isinstance(m.kernel, CpuQ4Linear) for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
            assert packed == [quantization != "none"] * 2
            got[quantization] = [o.token_ids for o in llm.generate(prompts, _params(prompts))]
    assert got["gguf-exact"] == got["none"]
