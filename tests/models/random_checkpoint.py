"""A tiny random-weight Hugging Face checkpoint of any architecture transformers builds, with the
demo tokenizer: the parity suites' builders name the config and model classes, the shape, and
what they change in the random weights (norms that start at ones hide a dropped norm)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from splitfuse.tools.demo_model import build_tokenizer


def save_random_checkpoint(out: Path, config_class: type, model_class: type, shape: dict[str, Any], seed: int,
                           init: Callable[[torch.nn.Module], None] | None = None) -> str:
    """Save model_class(config_class(**shape)), its vocabulary the tokenizer's, seeded weights
    then `init(model)` (under no_grad), and the tokenizer in `out`; returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, shape["vocab_size"], seed)
    config = config_class(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
                          **(shape | {"vocab_size": len(tok)}))
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if init is not None:
        with torch.no_grad():
            init(model)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)
