"""Gemma 3 text decoder (Gemma3ForCausalLM; the text model of Gemma3ForConditionalGeneration).

The Llama family's attention and fused projections (llama.py) with what Gemma 3 does beyond
them, computed as transformers 5.24's modeling_gemma3.py does:
- every RMSNorm scales by (1 + weight): the +1 is folded into the loaded weights once, before
  the first step (prepare_linears), in float32 (exact there: transformers adds it in float32);
- four norms a layer: input; post_attention, on attention's output before the residual add;
  pre_feedforward; post_feedforward, on the MLP's output before the residual add;
- per-head q/k norms (ModelArgs.qk_norm) and the softmax scale query_pre_attn_scalar ** -0.5;
- the MLP is gelu_tanh(gate) * up;
- the embedding rows are scaled by sqrt(hidden), the factor rounded to the model's dtype first;
- sliding-window layers rotate with their own rope (ModelArgs.sliding_rope). The runner's
  cos/sin tables are the global layers'; the model builds the sliding layers' itself, as long
  as the runner's and on their device, so the runner stays unaware of layer kinds.
The fused C++ decoder runs none of this: prepare_decoder_stack declines, the Python layers run.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from splitfuse.layers.embedding import Embedding
from splitfuse.layers.kernels import KernelSet
from splitfuse.layers.rotary import rope_cos_sin, rope_inverse_frequencies
from splitfuse.models.args import ModelArgs
from splitfuse.models.llama import MLP, Attention, Keep, LlamaForCausalLM, RMSNorm, _identity

# Multimodal checkpoints (Gemma3ForConditionalGeneration) hold the text model under these prefixes
# (transformers 5, then 4) beside the vision tower and projector, which the text model skips.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.", ""))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


class ScaledEmbedding(Embedding):
    """Token embeddings times sqrt(hidden), the factor a float32 rounded to the rows' dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim**0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = super().forward(ids)
        return h * torch.tensor(self.scale, dtype=torch.float32).to(h.dtype)


class SlidingRope:
    """The sliding-window layers' cos/sin tables, built on first use (the model is built on the
    meta device) as long as the runner's global tables and on their device; one for all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._tables
        if t is None or t[0].shape[0] != cos.shape[0] or t[0].device != cos.device:
            inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
            local_cos, local_sin = rope_cos_sin(inv_freq, cos.shape[0])
            t = self._tables = (local_cos.to(cos.device), local_sin.to(cos.device))
        return t


class GeluMLP(MLP):
    """MLP's projections without the fused SiLU: down(gelu_tanh(gate) * up)."""

    fuses_silu = False  # gate_up_proj returns the plain product's gate and up rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, ops: KernelSet, all_reduce: Callable,
                 sliding_rope: SlidingRope | None) -> None:
        super().__init__()
        self.all_reduce = all_reduce  # tensor parallelism: sums the row-parallel partial outputs
        self.self_attn = Attention(args, layer_idx, ops)  # its softmax scale: args.attention_scale
        self.mlp = GeluMLP(args, ops)
        size, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ops)
        self.post_attention_layernorm = RMSNorm(size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(size, eps, ops)
        self.sliding_rope = sliding_rope if self.self_attn.sliding_window is not None else None

    def forward(self, x, residual, positions, meta, k_cache, v_cache, cos, sin, keep: Keep | None = None):
        """(output, residual) as llama.DecoderLayer's: the next norm adds the two. With `keep`
        (the last layer): the kept rows only."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.sliding_rope is not None:
            cos, sin = self.sliding_rope.tables(cos)
        a = self.self_attn(h, positions, meta, k_cache, v_cache, cos, sin, keep)
        if keep is not None:
            if a is None:  # no row to keep (every rank of a tensor-parallel group alike)
                return h[:0], residual[:0]
            residual = residual.index_select(0, keep[0])
        a = self.post_attention_layernorm(self.all_reduce(a))  # summed over ranks before the norm
        h, residual = self.pre_feedforward_layernorm(a, residual)
        return self.post_feedforward_layernorm(self.all_reduce(self.mlp(h))), residual


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs, ops: KernelSet, all_reduce: Callable | None = None) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(args.vocab_size, args.hidden_size)
        sliding = SlidingRope(args.head_dim, *args.sliding_rope) if args.sliding_rope is not None else None
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, i, ops, all_reduce or _identity, sliding)
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def __init__(self, args: ModelArgs, ops: KernelSet, all_reduce: Callable | None = None) -> None:
        super().__init__(args, ops, all_reduce)
        self._norms_folded = False

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name for a checkpoint tensor; None for the vision tower's and projector's."""
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name

    def prepare_linears(self, backend: str, quantization: str = "none") -> None:
        """LlamaForCausalLM's, and Gemma's (1 + weight) folded into every norm (once)."""
        super().prepare_linears(backend, quantization)
        if not self._norms_folded:
            with torch.no_grad():
                for module in self.modules():
                    if isinstance(module, RMSNorm):
                        module.weight.copy_(1.0 + module.weight.float())
            self._norms_folded = True

    def prepare_decoder_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
        return "Gemma 3's layers (four norms, GELU-tanh MLP, q/k norm, two rope tables) are not in the fused decoder"
