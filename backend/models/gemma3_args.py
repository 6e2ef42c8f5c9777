"""Gemma 3's config (model_type gemma3_text, or gemma3 with a text_config) as ModelArgs fields.

Read as transformers 5.24's Gemma3TextConfig reads it: layers are sliding-window ("local") or
global by `layer_types`, else by `sliding_window_pattern` (every n-th layer global, default 6);
each kind has its own rope: `rope_parameters` {"full_attention": ..., "sliding_attention": ...}
(transformers 5), or the older top-level `rope_theta` + `rope_scaling` (global layers) and
`rope_local_base_freq` (sliding layers, default 10000). Options the engine does not run are
refused by name.
"""

from __future__ import annotations

from splitfuse.layers.rotary import rope_type

GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
_ACTIVATIONS = ("gelu_pytorch_tanh",)  # transformers' GELUTanh: torch's gelu(approximate="tanh")
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig's defaults
_SLIDING_ROPE_TYPES = ("default", "linear")


def gemma3_text_config(cfg: dict) -> dict:
    """The text model's config: a gemma3 (multimodal) config's `text_config` with what the outer
    config holds for the text model, and the rope settings flattened for ModelArgs: the global
    layers' in `rope_parameters`, the sliding layers' in `sliding_rope_parameters`."""
    if cfg.get("model_type") == "gemma3":
        outer, cfg = cfg, dict(cfg.get("text_config") or {})
        for key in ("eos_token_id", "tie_word_embeddings", "dtype", "torch_dtype"):
            if key in outer and key not in cfg:
                cfg[key] = outer[key]
    cfg = dict(cfg, model_type="gemma3_text")
    _refuse_unsupported(cfg)
    num_layers = cfg.get("num_hidden_layers", 26)
    if not cfg.get("layer_types"):
        # transformers 4.5x saved the pattern as `_sliding_window_pattern`
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(num_layers)]
    for key, default in (("sliding_window", 4096), ("head_dim", 256), ("tie_word_embeddings", True),
                         ("max_position_embeddings", 131_072)):  # Gemma3TextConfig's defaults
        cfg.setdefault(key, default)
    if cfg["sliding_window"] is None:  # its layers would still take the local rope: not what we run
        raise ValueError("gemma3: sliding_window = None is not supported (Gemma 3's local layers need a window)")
    full, sliding = _rope_parameters(cfg)
    cfg["rope_parameters"], cfg["sliding_rope_parameters"] = full, sliding
    cfg.pop("rope_scaling", None)
    cfg.pop("rope_theta", None)
    return cfg


def _rope_parameters(cfg: dict) -> tuple[dict, dict]:
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full = dict(rope.get("full_attention") or {"rope_type": "default"})
        sliding = dict(rope.get("sliding_attention") or {"rope_type": "default"})
    else:
        full = dict(rope or cfg.get("rope_scaling") or {"rope_type": "default"})
        sliding = {"rope_type": "default"}
    full.setdefault("rope_theta", cfg.get("rope_theta", _GLOBAL_THETA))
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))
    # The global layers take the runner's tables (every rope type it runs); the sliding layers'
    # own table (gemma3.SlidingRope) is built from inverse frequencies alone.
    kind = rope_type(sliding)
    if kind not in _SLIDING_ROPE_TYPES:
        raise ValueError(f"gemma3: rope type {kind!r} on the sliding_attention layers is not supported "
                         f"({', '.join(_SLIDING_ROPE_TYPES)} are)")
    return full, sliding


def _refuse_unsupported(cfg: dict) -> None:
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"gemma3: unsupported hidden_activation {activation!r} ({', '.join(_ACTIVATIONS)} only)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"gemma3: {key} = {cfg[key]} is not supported (only None, as Gemma 3 ships)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention is not supported (causal attention only)")
    layer_types = cfg.get("layer_types") or []
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"gemma3: layer_types {unknown} are not supported (sliding_attention, full_attention)")


def gemma3_options(cfg: dict) -> dict:
    """ModelArgs fields of a config gemma3_text_config returned."""
    sliding = cfg["sliding_rope_parameters"]
    theta = float(sliding["rope_theta"])
    scaling = sliding if rope_type(sliding) != "default" else None
    return dict(attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                sliding_rope=(theta, scaling))
