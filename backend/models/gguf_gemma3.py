"""What a Gemma 3 GGUF (general.architecture = gemma3) needs beyond the Llama layout
(gguf_checkpoint.py), as llama.cpp's converter writes it and transformers' GGUF loader reads it:

- names: Gemma's four norms a layer are `attn_norm` (input), `post_attention_norm`,
  `ffn_norm` (pre-feedforward: not Llama's post-attention norm) and `post_ffw_norm`;
- every norm weight (the q/k norms too) is stored as 1 + w: the converted checkpoint holds w,
  as Hugging Face's Gemma 3 does (transformers subtracts the 1 the same way, in float32);
- q/k rows are in Hugging Face's order (llama.cpp permutes Llama's only);
- the global layers' linear rope scaling (`gemma3.rope.scaling.*`, Gemma 3 4B and up), which
  transformers 5.24's GGUF reader drops, is put back into the config; another kind is refused.
"""

from __future__ import annotations

from typing import Any, Callable

from splitfuse.models.gguf_names import layer_hf_name

_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def gemma3_hf_name(name: str) -> str | None:
    """The Hugging Face name of a gemma3 layer norm whose GGUF name means another thing in the
    Llama layout; None for every other tensor (the Llama names apply)."""
    return layer_hf_name(name, _NORMS)


def is_shifted_norm(name: str) -> bool:
    """Whether a gemma3 GGUF tensor is a norm stored as 1 + w."""
    return name.endswith("norm.weight")


def configure_gemma3(field: Callable[[str], Any], config, file_name: str) -> None:
    """Put the file's rope scaling of the global layers into `config` (a Gemma3TextConfig)."""
    kind = field("gemma3.rope.scaling.type")
    if kind in (None, "none"):
        return
    if kind != "linear":
        raise ValueError(f"{file_name}: gemma3.rope.scaling.type = {kind!r} is not supported (linear only)")
    factor = float(field("gemma3.rope.scaling.factor"))
    config.rope_parameters["full_attention"].update(rope_type="linear", factor=factor)
