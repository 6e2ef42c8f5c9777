"""The model's shape and options (ModelArgs), read from a Hugging Face config.json.

Each architecture we run names its model_type here; anything else is refused at start with its
name, never run with a neighbour's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitfuse.models.gemma3_args import GEMMA3_MODEL_TYPES, gemma3_options, gemma3_text_config
from splitfuse.models.moe_args import moe_options
from splitfuse.models.rope_args import rope_options

_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", *GEMMA3_MODEL_TYPES)


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
    num_experts: int = 0  # 0: dense MLP; else a sparse MoE MLP (Mixtral, Qwen3-MoE: moe_args.py)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width; 0: intermediate_size (Mixtral)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model (Qwen3-MoE)
    routing_weights_in_model_dtype: bool = False  # Qwen3-MoE rounds them to the model's dtype, as HF
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and of k, before rotary
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar)
    # (rope_theta, rope_scaling) of the sliding-window layers where theirs is not the global layers' (Gemma 3)
    sliding_rope: tuple[float, dict | None] | None = None
    rotary_dim: int = 0  # rope turns each head's first rotary_dim features (Phi-4-mini: 3/4); 0: all

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's width: moe_intermediate_size (Qwen3-MoE), else the MLP's (Mixtral)."""
        return self.moe_intermediate_size or self.intermediate_size

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: {', '.join(_MODEL_TYPES)} are supported")
        if model_type in GEMMA3_MODEL_TYPES:  # its text model, its GELU-tanh MLP checked there (gemma3_args.py)
            cfg, model_type = gemma3_text_config(cfg), "gemma3_text"
        elif cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (silu only)")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        phi3 = model_type == "phi3"  # transformers' Phi-3 has no biases, whatever attention_bias says
        windows = _sliding_windows(cfg, model_type, num_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)) and not phi3,
            o_bias=False if model_type == "qwen2" else bool(cfg.get("attention_bias", False)) and not phi3,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and not phi3,
            sliding_windows=windows,
            eos_token_ids=eos_ids,
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            **moe_options(cfg, model_type, num_layers),
            **rope_options(cfg, model_type, head_dim),
            **(gemma3_options(cfg) if model_type == "gemma3_text" else {}),
        )


def _sliding_windows(cfg: dict, model_type: str, num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None  # as transformers' Qwen2/Qwen3 configs: the window only counts when switched on
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if model_type in ("mistral", "mixtral", "qwen3_moe", "phi3"):  # every layer; HF's default window is None
        return [window] * num_layers
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [None] * num_layers
