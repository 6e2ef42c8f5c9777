"""What a Phi-3 / Phi-4-mini GGUF (general.architecture = phi3) needs beyond the Llama layout
(gguf_checkpoint.py), as llama.cpp's converter writes it:

- q/k/v fused in `attn_qkv` and gate/up fused in `ffn_up` ([2 * intermediate, hidden], gate
  rows first), in Hugging Face's row order: they become Phi-3's own `qkv_proj` / `gate_up_proj`;
- `phi3.rope.dimension_count` (rope on part of each head: Phi-4-mini), the sliding window
  (`phi3.attention.sliding_window`, 0 for none) and, for LongRoPE, the original context
  (`phi3.rope.scaling.original_context_length`), the attention factor
  (`phi3.rope.scaling.attn_factor`) and the factors themselves as the global F32 tensors
  `rope_factors_short.weight` / `rope_factors_long.weight`. transformers 5.24's GGUF reader
  drops all of these; they are put back into the config here.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from splitfuse.models.gguf_names import layer_hf_name

_FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def phi3_hf_name(name: str) -> str | None:
    """The Hugging Face name of a phi3 fused tensor; None for every other (Llama names apply)."""
    return layer_hf_name(name, _FUSED)


def phi3_gguf_name(hf_name: str) -> str | None:
    """The GGUF name of a Phi-3 fused weight (for its quantized blocks); None for any other."""
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        for gguf_name, hf in _FUSED.items():
            if rest == hf:
                return f"blk.{layer}.{gguf_name}"
    return None


def configure_phi3(field: Callable[[str], Any], factors: dict[str, np.ndarray], config, file_name: str) -> None:
    """Put the file's rotary dimension, sliding window and LongRoPE settings into `config` (a
    Phi3Config); `factors` maps ROPE_FACTOR_TENSORS present in the file to their values."""
    head_dim = config.hidden_size // config.num_attention_heads
    rope = dict(config.rope_parameters or {})
    rotary = field("phi3.rope.dimension_count")
    if rotary is not None:
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    window = field("phi3.attention.sliding_window")
    config.sliding_window = int(window) if window else None
    original = field("phi3.rope.scaling.original_context_length")
    config.original_max_position_embeddings = int(original or config.max_position_embeddings)
    if len(factors) == 1:
        raise ValueError(f"{file_name}: only one of {', '.join(ROPE_FACTOR_TENSORS)}: LongRoPE needs both")
    if factors:
        short, long = (factors[n].astype(np.float64).tolist() for n in ROPE_FACTOR_TENSORS)
        rope.update(rope_type="longrope", short_factor=short, long_factor=long,
                    original_max_position_embeddings=config.original_max_position_embeddings)
        attn_factor = field("phi3.rope.scaling.attn_factor")
        if attn_factor is not None and not math.isclose(float(attn_factor), _derived_attention_factor(config),
                                                        rel_tol=1e-6):
            rope["attention_factor"] = float(attn_factor)  # else derived as transformers does, unrounded
    config.rope_parameters = rope


def _derived_attention_factor(config) -> float:
    """LongRoPE's attention factor from the context ratio (what llama.cpp's converter writes,
    rounded to float32)."""
    scale = config.max_position_embeddings / config.original_max_position_embeddings
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings))
