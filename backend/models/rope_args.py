"""The rotary options of a Hugging Face config, as ModelArgs fields (rope_theta, rope_scaling,
rotary_dim), normalised the way transformers reads them.

transformers 5 keeps them in `rope_parameters`; older checkpoints use top-level `rope_theta`,
`rope_scaling` and (Phi-3, Phi-4-mini) `partial_rotary_factor` and
`original_max_position_embeddings`. Rope types we do not run are refused here by name.
"""

from __future__ import annotations

from splitfuse.layers.rotary import rope_type

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# Types that scale against the context the model was pretrained on.
_NEED_ORIGINAL = ("llama3", "yarn", "longrope")


def rope_options(cfg: dict, model_type: str, head_dim: int) -> dict:
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or (rope if rope_type(rope) != "default" else {})) or None
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim != head_dim and model_type != "phi3":
        raise ValueError(f"partial_rotary_factor={partial} is not supported for {model_type} (phi3 only)")
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(f"partial_rotary_factor={partial} gives an odd or empty rotary dimension {rotary_dim}")
    if scaling is not None:
        kind = rope_type(scaling)
        if model_type == "phi3" and kind in ("su", "yarn"):
            kind = "longrope"  # as transformers' Phi3Config: older Phi-3 checkpoints name LongRoPE so
        if model_type == "phi3" and kind not in ("default", "longrope"):
            raise ValueError(f"rope type {kind!r} is not supported for phi3 (default, longrope are)")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)} are)")
        scaling = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind}
        if kind in _NEED_ORIGINAL:
            # Phi-3 keeps the original context at the top level; transformers prefers it there.
            original = cfg.get("original_max_position_embeddings") if model_type == "phi3" else None
            scaling["original_max_position_embeddings"] = int(
                original or scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096))
        if kind == "default":
            scaling = None
    return dict(rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim)
