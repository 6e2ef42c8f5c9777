"""The model's shape and options (ModelArgs), read from a Hugging Face config.json.

Each architecture we run names its model_type here; anything else is refused at start with its
name, never run with a neighbour's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: list[int | None]  # per layer
    eos_token_ids: list[int]
    checkpoint_dtype: str | None
    num_experts: int = 0  # 0: dense MLP; else a sparse MoE MLP (Mixtral)
    num_experts_per_tok: int = 0
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and of k, before rotary

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: {', '.join(_MODEL_TYPES)} are supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (silu only)")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        # transformers 5 keeps rope settings in `rope_parameters`; older checkpoints use
        # top-level `rope_theta` and `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        windows = _sliding_windows(cfg, model_type, num_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_experts, top_k = 0, 0
        if model_type == "mixtral":
            num_experts, top_k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            o_bias=False if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=windows,
            eos_token_ids=eos_ids,
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            qk_norm=model_type == "qwen3",
        )


def _sliding_windows(cfg: dict, model_type: str, num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None  # as transformers' Qwen2/Qwen3 configs: the window only counts when switched on
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if model_type in ("mistral", "mixtral"):  # every layer; HF's default window is None
        return [window] * num_layers
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [None] * num_layers
