"""The mixture-of-experts options of a Hugging Face config (Mixtral, Qwen3-MoE), as ModelArgs fields.

Mixtral: every layer sparse, experts as wide as `intermediate_size`, top-k weights renormalised.
Qwen3-MoE: experts `moe_intermediate_size` wide; the layers in `mlp_only_layers`, and those that
`decoder_sparse_step` skips, run a dense MLP `intermediate_size` wide; the top-k weights are
renormalised only with `norm_topk_prob`. Qwen2-MoE's shared expert is not implemented, so
`qwen2_moe` stays refused (args._MODEL_TYPES).
"""

from __future__ import annotations

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


def moe_options(cfg: dict, model_type: str, num_layers: int) -> dict:
    """num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob and dense_mlp_layers
    for ModelArgs; the dense defaults for a model without experts."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts` (its attribute map).
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"])
    if num_experts <= 0:
        raise ValueError(f"{model_type}: num_experts = {num_experts}: a mixture of experts needs at least one")
    if model_type == "mixtral":
        return dict(num_experts=num_experts, num_experts_per_tok=top_k)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"{model_type}: decoder_sparse_step = {step} is not supported (it must be >= 1)")
    only = [int(i) for i in cfg.get("mlp_only_layers") or []]
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_mlp_layers=dense,
                routing_weights_in_model_dtype=True)
