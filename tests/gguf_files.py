"""GGUF files of the tests' demo checkpoints, laid out as llama.cpp's converter writes them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (what its converter writes for Llama)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
    if arch == "qwen3" and cfg.get("head_dim"):  # llama.cpp writes Qwen3's head size as key/value length
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if expert_count:
        w.add_expert_count(expert_count)
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
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in load_file(str(Path(checkpoint) / "model.safetensors")).items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{per_layer[rest]}"
        else:
            gname = names[name]
        data = t.float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            data = _permute_rotary(data, heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute_rotary(data, kv_heads)
        kind = (tensor_type or {}).get(gname, quant if data.ndim == 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(gname, data)
        elif kind == Q.F16:
            w.add_tensor(gname, data.astype(np.float16))
        else:
            packed = gguf.quants.quantize(data, kind) if kind in gguf.quants._type_traits else data.astype(np.int8)
            w.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
