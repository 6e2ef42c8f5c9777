"""GGUF files of the tests' demo checkpoints, laid out as llama.cpp's converter writes them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what its converter writes for Llama)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_experts(tensors: dict) -> dict:
    """Per-expert weights (`mlp.experts.J.gate_proj.weight` ...) stacked over J, as llama.cpp stores them."""
    import torch

    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, j, part = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            experts.setdefault((prefix, part), {})[j] = t
        else:
            out[name] = t
    for (prefix, part), by_j in experts.items():
        out[f"{prefix}.{part}"] = torch.stack([by_j[j] for j in sorted(by_j)])
    return out


def _expert_gguf_name(name: str) -> str:
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}." + {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.gate_proj": "ffn_gate_exps.weight",
                              "mlp.experts.up_proj": "ffn_up_exps.weight",
                              "mlp.experts.down_proj": "ffn_down_exps.weight"}[rest]


def _add_phi3_rope(w: gguf.GGUFWriter, cfg: dict, rope: dict) -> None:
    """What llama.cpp's converter writes for Phi-3's rope: the rotated dimensions, the sliding
    window (0: none), the original context, and for LongRoPE its attention factor and factors."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    original = cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _add_tokenizer(w: gguf.GGUFWriter, cfg: dict, tok: dict) -> None:
    """A tokenizer.json's byte-level BPE vocabulary and merges, as llama.cpp's converter writes them."""
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(cfg["eos_token_id"])


def write_gguf(checkpoint: str, out: Path, *, arch: str | None = None, quant: Q = Q.Q8_0, expert_count: int = 0,
               tensor_type: dict[str, Q] | None = None) -> Path:
    """A GGUF file of `checkpoint` (a demo checkpoint) as llama.cpp's converter lays it out."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    tok = json.loads((Path(checkpoint) / "tokenizer.json").read_text())
    arch = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if arch in ("qwen3", "qwen3moe", "gemma3") and cfg.get("head_dim"):  # llama.cpp writes their head size as key/value length
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (llama.cpp's freq_base)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        _add_phi3_rope(w, cfg, rope)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if expert_count:
        w.add_expert_count(expert_count)
    if arch == "qwen3moe":  # the experts' shape; llama.cpp's qwen3moe blocks are all sparse
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_tokenizer(w, cfg, tok)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
                 # Phi-3 stores these fused; llama.cpp keeps them so
                 "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
    if arch == "gemma3":  # llama.cpp's names for Gemma's four norms a layer
        per_layer |= {"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    for name, t in _stack_experts(load_file(str(Path(checkpoint) / "model.safetensors"))).items():
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            gname = _expert_gguf_name(name)
        elif name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{per_layer[rest]}"
        else:
            gname = names[name]
        data = t.float().numpy()
        if arch == "gemma3" and gname.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            data = data + np.float32(1.0)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            data = _permute_rotary(data, heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute_rotary(data, kv_heads)
        kind = (tensor_type or {}).get(gname, quant if data.ndim >= 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(gname, data)
        elif kind == Q.F16:
            w.add_tensor(gname, data.astype(np.float16))
        else:
            packed = gguf.quants.quantize(data, kind) if kind in gguf.quants._type_traits else data.astype(np.int8)
            w.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=kind)
    return _write(w, out)


def _write(w: "gguf.GGUFWriter", out: Path) -> Path:
    """Header, metadata and tensors of `w` written to its file `out`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _random_blocks(rows: int, cols: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """`rows` x `cols` weights of `kind` (Q4_0 or Q8_0) as random blocks with a small scale."""
    block = gguf.GGML_QUANT_SIZES[kind][1]
    data = rng.integers(0, 256, size=(rows, cols // 32, block), dtype=np.uint8)
    data[:, :, :2] = np.frombuffer(np.float16(2.0 ** -10).tobytes(), dtype=np.uint8)  # each block's scale d
    return data.reshape(rows, -1)


def write_random_gguf(checkpoint: str, out: Path, *, layers: int, hidden: int, intermediate: int, heads: int,
                      kv_heads: int, quant: Q = Q.Q8_0, seed: int = 0) -> Path:
    """A llama GGUF with the tokenizer of `checkpoint` (a demo checkpoint) and the given sizes, its
    matrices random `quant` blocks (quick to write at hundreds of MB; the values mean nothing) and
    its norms ones: a file big enough to measure loading on."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    tok = json.loads((Path(checkpoint) / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    w = gguf.GGUFWriter(out, arch="llama")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    _add_tokenizer(w, cfg, tok)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    matrices = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        matrices |= {f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                     f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                     f"blk.{i}.attn_output.weight": (hidden, hidden),
                     f"blk.{i}.ffn_gate.weight": (intermediate, hidden), f"blk.{i}.ffn_up.weight": (intermediate, hidden),
                     f"blk.{i}.ffn_down.weight": (hidden, intermediate)}
        for norm in ("attn_norm.weight", "ffn_norm.weight"):
            w.add_tensor(f"blk.{i}.{norm}", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for name, (rows, cols) in matrices.items():
        packed = _random_blocks(rows, cols, quant, rng)
        w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=quant)
    return _write(w, out)
