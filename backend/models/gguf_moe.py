"""Mixture-of-experts GGUF files (llama.cpp's `qwen3moe`) for gguf_checkpoint's conversion.

llama.cpp stores each layer's experts stacked: `ffn_gate_exps` / `ffn_up_exps` [E, I, H] and
`ffn_down_exps` [E, H, I] (dimensions listed outermost first), the router as `ffn_gate_inp`
[E, H]. They become our stacked `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows)
and `mlp.experts.down_proj`, and `mlp.gate.weight`. The expert width comes from
`{arch}.expert_feed_forward_length`, which transformers' GGUF config reader leaves out. Shared
experts (Qwen2-MoE) and sigmoid gating are refused by name; Mixtral-style `llama` MoE files
are refused by the caller.
"""

from __future__ import annotations

import torch

from splitfuse.models.gguf_names import layer_hf_name

MOE_ARCHITECTURES = ("qwen3moe",)
# GGUF tensor name (after "blk.N.") -> ours (after "model.layers.N."); gate and up are joined
# by merge_experts.
EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


class GGUFMoeError(ValueError):
    """A mixture-of-experts option this engine does not run (gguf_checkpoint re-raises it as GGUFError)."""


def configure_moe(field, arch: str, config, file_name: str, num_layers: int, sparse_layers: set[int]) -> None:
    """Set the config's expert options from the file's metadata. `field(key)` reads a metadata
    value (None when absent); `sparse_layers`: the blocks that hold expert tensors."""
    if not field(f"{arch}.expert_count") or not field(f"{arch}.expert_used_count"):
        raise GGUFMoeError(f"{file_name}: a {arch} GGUF needs {arch}.expert_count and {arch}.expert_used_count")
    shared = field(f"{arch}.expert_shared_count")
    if shared:
        raise GGUFMoeError(f"{file_name}: {arch}.expert_shared_count = {shared} (shared experts) is not supported")
    gating = field(f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise GGUFMoeError(f"{file_name}: {arch}.expert_gating_func = {gating} is not supported (softmax only)")
    width = field(f"{arch}.expert_feed_forward_length")
    if width is None:
        raise GGUFMoeError(f"{file_name}: {arch}.expert_feed_forward_length (the experts' width) is missing")
    config.moe_intermediate_size = int(width)
    norm = field(f"{arch}.expert_weights_norm")
    if norm is not None:  # llama.cpp renormalises qwen3moe's top-k weights unless told otherwise
        config.norm_topk_prob = bool(norm)
    config.decoder_sparse_step = 1
    config.mlp_only_layers = [i for i in range(num_layers) if i not in sparse_layers]


def merge_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Join each layer's stacked gate and up experts into `mlp.experts.gate_up_proj`, in place."""
    for gate_name in [n for n in tensors if n.endswith(".mlp.experts.gate_proj")]:
        prefix = gate_name.removesuffix("gate_proj")
        up = tensors.pop(prefix + "up_proj", None)
        if up is None:
            raise GGUFMoeError(f"{gate_name} has no matching up experts (ffn_up_exps)")
        tensors[prefix + "gate_up_proj"] = torch.cat([tensors.pop(gate_name), up], dim=1).contiguous()


def expert_hf_name(name: str) -> str | None:
    """Our name for a GGUF expert or router tensor ("blk.N.ffn_*_exps.weight"), else None."""
    return layer_hf_name(name, EXPERT_NAMES)
