"""Load a local Hugging Face checkpoint (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from splitfuse.models.llama import LlamaForCausalLM, ModelArgs

# HF parameter name fragment -> (our fused parameter, index of the shard inside it)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def read_hf_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: `model` must be a local HF checkpoint directory")
    return json.loads(config_file.read_text())


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_model(path: str | Path, args: ModelArgs, ops, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(args, ops)
    model = model.to_empty(device=device).to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    continue
                _load_one(params, name, f.get_tensor(name), args, loaded)
    missing = set(params) - loaded
    if args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")
    return model.eval()


def _load_one(params: dict, name: str, tensor: torch.Tensor, args: ModelArgs, loaded: set[str]) -> None:
    for hf_part, (ours, shard) in _FUSED.items():
        if hf_part in name:
            target_name = name.replace(hf_part, ours)
            target = params[target_name]
            if ours == ".qkv_proj.":
                q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
                offsets = [0, q, q + kv, q + 2 * kv]
            else:
                offsets = [0, args.intermediate_size, 2 * args.intermediate_size]
            with torch.no_grad():
                target.data[offsets[shard] : offsets[shard + 1]].copy_(tensor)
            # A fused parameter counts as loaded once every shard has been seen.
            loaded.add(f"{target_name}#{shard}")
            shards = 3 if ours == ".qkv_proj." else 2
            if all(f"{target_name}#{i}" in loaded for i in range(shards)):
                loaded.add(target_name)
            return
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    target = params[name]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
    with torch.no_grad():
        target.data.copy_(tensor)
    loaded.add(name)
