"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing over SiLU-gated expert MLPs.

Plain torch, for a ragged batch of T tokens: each expert that received any tokens runs
one fused gate/up matmul and one down matmul on just those rows, so the work is
T * top_k expert-MLP rows instead of T * num_experts.
"""

from __future__ import annotations

import torch
from torch import nn

from splitfuse.layers.kernels import KernelSet
from splitfuse.layers.linear import Linear, LinearKernel, make_linear_kernel, release_if_packed, swiglu


class Experts(nn.Module):
    """All experts' weights stacked, laid out as HF's fused `experts.gate_up_proj` /
    `experts.down_proj` (gate rows first, then up rows) so those load as they are."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up: list[LinearKernel] = []
        self.down: list[LinearKernel] = []

    def prepare(self, backend: str, quantization: str = "none") -> None:
        """One linear kernel per expert and projection. Packed kernels hold their own copy,
        so the stacked weights' storage is released then, as `Linear.prepare` does."""
        self.gate_up = [make_linear_kernel(w, None, backend, quantization, swiglu=True) for w in self.gate_up_proj]
        self.down = [make_linear_kernel(w, None, backend, quantization) for w in self.down_proj]
        release_if_packed(self.gate_up[0], self.gate_up_proj, self.down_proj)

    def kernels(self) -> tuple[list[LinearKernel], list[LinearKernel]]:
        if not self.gate_up:  # not prepared (a block built on its own): plain torch
            self.prepare("torch")
        return self.gate_up, self.down


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 ops: KernelSet, norm_topk_prob: bool = True, weights_in_model_dtype: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob  # False (Qwen3-MoE's default): the softmax's own values
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.ops = ops

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their fp32 weights [T, k] (renormalised when norm_topk_prob)."""
        # Softmax in fp32 as HF does, so bf16 routing picks the same experts.
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:  # HF's Qwen3-MoE scales by weights rounded to the model's dtype
            weights = weights.to(x.dtype).float()
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        # Group the T*k (token, slot) assignments by expert: after a stable sort each
        # expert's assignments are one contiguous slice, in token order.
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // self.top_k
        slot_weights = weights.flatten()[order, None]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync
        out = torch.zeros_like(x)
        gate_up, down = self.experts.kernels()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue  # no tokens for this expert: skip its weights entirely
            rows = tokens[start:start + n]
            h = swiglu(gate_up[e], x.index_select(0, rows), self.ops.silu_and_mul)
            h = down[e](h) * slot_weights[start:start + n]  # fp32 scale, as HF
            out.index_add_(0, rows, h.to(out.dtype))
            start += n
        return out
