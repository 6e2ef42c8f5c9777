"""Load a local Hugging Face checkpoint (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from splitfuse.layers.linear import Linear
from splitfuse.models.gguf_checkpoint import GGUFSource, gguf_source
from splitfuse.models.args import ModelArgs
from splitfuse.models.llama import LlamaForCausalLM
from splitfuse.models.registry import causal_lm_class

# HF parameter name fragment -> (our fused parameter, index of the shard inside it)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
# Per-expert weights: Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down_proj (what transformers 5
# saves too). Stacked `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] are our
# parameters' layout and load as they are.
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|down_proj|up_proj)\.weight$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_weight(name: str) -> tuple[int, str, int] | None:
    """A per-expert checkpoint weight's (expert index, "gate" / "up" / "down", where its
    `.experts.` part starts in `name`); None for any other tensor."""
    match = _EXPERT.search(name)
    return None if match is None else (int(match[1]), _EXPERT_PART[match[2]], match.start())


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


# (checkpoint tensor name, tensor) -> the part this tensor-parallel rank keeps (parallel/sharding.py)
Shard = Callable[[str, torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def load_model(path: str | Path, args: ModelArgs, ops, dtype: torch.dtype, device: torch.device,
               shard: Shard | None = None, all_reduce: AllReduce | None = None) -> LlamaForCausalLM:
    """Build the model and read its weights. For a tensor-parallel rank, `args` carries the rank's
    local sizes, `shard` cuts each checkpoint tensor to the rank's part and `all_reduce` sums the
    row-parallel partial outputs across ranks."""
    with torch.device("meta"):
        model = causal_lm_class(args)(args, ops, all_reduce)
    model = model.to_empty(device=device).to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    # A model class may name checkpoint tensors its own way, or skip some (None): Gemma 3's
    # multimodal checkpoints hold the text model under a prefix, beside a vision tower.
    rename = getattr(model, "checkpoint_name", None)
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key if rename is None else rename(key)
                if name is None or "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    continue
                tensor = f.get_tensor(key)
                _load_one(params, name, tensor if shard is None else shard(name, tensor), args, loaded)
    missing = set(params) - loaded
    if args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")
    source = gguf_source(path) if shard is None else None
    if source is not None:
        _attach_gguf_blocks(model, source)
    return model.eval()


def _attach_gguf_blocks(model: LlamaForCausalLM, source: GGUFSource) -> None:
    """Give each projection and the LM head the means to read its weight's blocks from the GGUF
    file the checkpoint was converted from (read only when quantization="gguf" or "gguf-exact"
    prepares it). A tied head reads the embedding's blocks, and so does the embedding."""
    model.model.embed_tokens.gguf_blocks = lambda: source.blocks(["model.embed_tokens.weight"])
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if module is model.lm_head:
            head = "model.embed_tokens.weight" if model.args.tie_word_embeddings else "lm_head.weight"
            module.gguf_blocks = lambda names=[head]: source.blocks(names)
            continue
        fused = f".{name.rsplit('.', 1)[-1]}."
        parts = [p for p, (ours, _) in _FUSED.items() if ours == fused]  # a fused projection's, in order
        hf = [name.replace(fused[:-1], p[:-1]) + ".weight" for p in parts] or [f"{name}.weight"]
        # A file that stores the projection fused (Phi-3's attn_qkv, ffn_up) has it under our name.
        module.gguf_blocks = lambda names=hf, own=[f"{name}.weight"]: source.blocks(names) or source.blocks(own)


def _load_one(params: dict, name: str, tensor: torch.Tensor, args: ModelArgs, loaded: set[str]) -> None:
    hf_name = name
    # Mixtral checkpoints name the MoE block `block_sparse_moe`; ours (like HF's model) is `mlp`.
    name = name.replace(".block_sparse_moe.", ".mlp.")
    expert = expert_weight(name)
    if expert:
        # Per-expert gate, up, down go into the stacked expert weights.
        j, w, start = expert
        inter, n = args.expert_intermediate_size, args.num_experts
        if j >= n:
            raise ValueError(f"unexpected weight {hf_name!r} in checkpoint (num_experts={n})")
        prefix = name[:start] + ".experts."
        if w == "down":
            _load_part(params, prefix + "down_proj", (j,), tensor, j, n, hf_name, loaded)
        else:
            rows = slice(0, inter) if w == "gate" else slice(inter, 2 * inter)
            _load_part(params, prefix + "gate_up_proj", (j, rows), tensor, 2 * j + (w == "up"), 2 * n, hf_name,
                       loaded)
        return
    for hf_part, (ours, shard) in _FUSED.items():
        if hf_part in name:
            if ours == ".qkv_proj.":
                q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
                offsets = [0, q, q + kv, q + 2 * kv]
            else:
                offsets = [0, args.intermediate_size, 2 * args.intermediate_size]
            region = (slice(offsets[shard], offsets[shard + 1]),)
            _load_part(params, name.replace(hf_part, ours), region, tensor, shard, len(offsets) - 1, hf_name, loaded)
            return
    if name not in params:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    target = params[name]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
    with torch.no_grad():
        target.data.copy_(tensor)
    loaded.add(name)


def _load_part(params: dict, target_name: str, region: tuple, tensor: torch.Tensor, shard: int, num_shards: int,
               hf_name: str, loaded: set[str]) -> None:
    """Copy one checkpoint tensor into `region` of a fused/stacked parameter."""
    if target_name not in params:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    dest = params[target_name].data[region]
    if dest.shape != tensor.shape:
        raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
    # A fused parameter counts as loaded once every shard has been seen.
    loaded.add(f"{target_name}#{shard}")
    if all(f"{target_name}#{i}" in loaded for i in range(num_shards)):
        loaded.add(target_name)
