"""Which model class runs an architecture (ModelArgs.architecture)."""

from __future__ import annotations

from torch import nn

from splitfuse.models.args import ModelArgs
from splitfuse.models.gemma3 import Gemma3ForCausalLM
from splitfuse.models.llama import LlamaForCausalLM

# model_type -> the causal-LM class built for it; every class takes (args, ops, all_reduce) and
# offers LlamaForCausalLM's interface (forward, compute_logits, prepare_linears, ...).
_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def causal_lm_class(args: ModelArgs) -> type[nn.Module]:
    try:
        return _CLASSES[args.architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {args.architecture!r}") from None
