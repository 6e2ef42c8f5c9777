"""GGUF layer tensor names ("blk.N.<part>") and their Hugging Face names ("model.layers.N.<part>")."""

from __future__ import annotations


def layer_hf_name(name: str, parts: dict[str, str]) -> str | None:
    """"blk.N.<part>" -> "model.layers.N.<parts[part]>"; None when `name` is no layer tensor or its
    part is not in `parts`."""
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in parts:
            return f"model.layers.{layer}.{parts[rest]}"
    return None
