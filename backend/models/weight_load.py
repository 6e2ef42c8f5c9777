"""One checkpoint tensor into its parameter: fused projections (q/k/v, gate/up) and stacked
experts take each part into their region, a tensor-parallel rank's part already cut."""

from __future__ import annotations

import re

import torch

from splitfuse.models.args import ModelArgs

# HF parameter name fragment -> (our fused parameter, index of the shard inside it)
FUSED = {
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


def load_one(params: dict, name: str, tensor: torch.Tensor, args: ModelArgs, loaded: set[str]) -> None:
    """Copy the checkpoint tensor `name` into its place among `params` (ours, by name), adding
    the parameter's name to `loaded` once all of it has been."""
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
            load_part(params, prefix + "down_proj", (j,), tensor, j, n, hf_name, loaded)
        else:
            rows = slice(0, inter) if w == "gate" else slice(inter, 2 * inter)
            load_part(params, prefix + "gate_up_proj", (j, rows), tensor, 2 * j + (w == "up"), 2 * n, hf_name,
                       loaded)
        return
    for hf_part, (ours, shard) in FUSED.items():
        if hf_part in name:
            if ours == ".qkv_proj.":
                q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
                offsets = [0, q, q + kv, q + 2 * kv]
            else:
                offsets = [0, args.intermediate_size, 2 * args.intermediate_size]
            region = (slice(offsets[shard], offsets[shard + 1]),)
            load_part(params, name.replace(hf_part, ours), region, tensor, shard, len(offsets) - 1, hf_name, loaded)
            return
    if name not in params:
        raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
    target = params[name]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
    with torch.no_grad():
        target.data.copy_(tensor)
    loaded.add(name)


def check_loaded(params: dict, loaded: set[str], args: ModelArgs, path: object) -> None:
    """Raise ValueError naming the parameters no checkpoint tensor filled."""
    missing = set(params) - loaded
    if args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(missing)[:8]}")


def load_part(params: dict, target_name: str, region: tuple, tensor: torch.Tensor, shard: int, num_shards: int,
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
