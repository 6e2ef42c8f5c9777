"""Which slice of each checkpoint tensor a tensor-parallel rank keeps (Megatron-style layout).

* Column-parallel (output rows split): q/k/v, gate/up, the experts' gate/up (w1/w3). Each rank
  computes its attention heads and its share of the MLP's intermediate features, with no
  communication; every rank holds a slice of every expert, so routing needs none either.
* Row-parallel (input columns split): o_proj and down_proj (and the experts' down, w2). Each
  rank's product is a partial sum; the model all-reduces it (one all-reduce after attention, one
  after the MLP per layer). Their biases stay on rank 0 only, so the sum adds them once.
* KV heads are split like the query heads; with fewer KV heads than ranks (Qwen2's single KV
  head) each rank keeps the one KV head its query heads read, so it is replicated.
* A checkpoint that stores q/k/v or gate/up fused (Phi-3) is cut as its parts: the rank's rows
  of q, of k and of v (of gate and of up), concatenated, never one block of the fused rows.
* Everything else (embeddings, norms, the LM head, MoE routers) is replicated: every rank then
  holds the full hidden state after each all-reduce, and only rank 0 computes logits.

Slicing happens per checkpoint tensor as it is read, before it reaches the fused parameters,
so the model is built with the rank's local sizes (`local_args`) and the loader stays unaware.
"""

from __future__ import annotations

import dataclasses

import torch

from splitfuse.models.args import ModelArgs
from splitfuse.models.weight_load import expert_weight



def check_divisible(args: ModelArgs, world_size: int) -> None:
    """Raise ValueError when `args` cannot be split over `world_size` ranks."""
    problems = []
    if args.num_heads % world_size:
        problems.append(f"num_attention_heads={args.num_heads}")
    if args.num_kv_heads % world_size and world_size % args.num_kv_heads:
        problems.append(f"num_key_value_heads={args.num_kv_heads} (nor does it divide it)")
    if args.intermediate_size % world_size:
        problems.append(f"intermediate_size={args.intermediate_size}")
    if args.moe_intermediate_size % world_size:
        problems.append(f"moe_intermediate_size={args.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={world_size} does not divide {', '.join(problems)}")


def local_args(args: ModelArgs, world_size: int) -> ModelArgs:
    """The shapes one rank builds: its heads, its KV heads, its share of the MLP."""
    check_divisible(args, world_size)
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // world_size,
        num_kv_heads=max(1, args.num_kv_heads // world_size),
        intermediate_size=args.intermediate_size // world_size,
        moe_intermediate_size=args.moe_intermediate_size // world_size,
    )


class Sharder:
    """Called by the loader on every checkpoint tensor: returns this rank's part of it."""

    def __init__(self, args: ModelArgs, rank: int, world_size: int) -> None:
        check_divisible(args, world_size)
        self.rank, self.world_size = rank, world_size
        d = args.head_dim
        self.q_size, self.kv_size = args.num_heads * d, args.num_kv_heads * d
        q_heads = args.num_heads // world_size
        self.q_rows = slice(rank * q_heads * d, (rank + 1) * q_heads * d)
        if args.num_kv_heads >= world_size:
            kv_heads = args.num_kv_heads // world_size
            self.kv_rows = slice(rank * kv_heads * d, (rank + 1) * kv_heads * d)
        else:  # replicated: the KV head of this rank's query heads
            kv_head = rank * args.num_kv_heads // world_size
            self.kv_rows = slice(kv_head * d, (kv_head + 1) * d)
        inter = args.intermediate_size
        self.intermediate = inter
        per = inter // world_size
        self.mlp_rows = slice(rank * per, (rank + 1) * per)
        self.expert_inter = args.expert_intermediate_size
        per = self.expert_inter // world_size
        self.expert_rows = slice(rank * per, (rank + 1) * per)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        part = self._part(name, tensor)
        # A copy, so the full tensor's memory goes when the loader drops it.
        return part if part is tensor else part.contiguous().clone()

    def _part(self, name: str, t: torch.Tensor) -> torch.Tensor:
        is_bias = name.endswith(".bias")
        if ".q_proj." in name:
            return t[self.q_rows]
        if ".k_proj." in name or ".v_proj." in name:
            return t[self.kv_rows]
        if ".o_proj." in name:
            return self._row_parallel(t, self.q_rows, is_bias)
        if name.endswith(".experts.gate_up_proj"):  # stacked [E, 2I, H]: gate rows, then up rows
            rows = self.expert_rows
            up = slice(self.expert_inter + rows.start, self.expert_inter + rows.stop)
            return torch.cat([t[:, rows], t[:, up]], dim=1)
        if name.endswith(".experts.down_proj"):  # stacked [E, H, I]
            return t[:, :, self.expert_rows]
        expert = expert_weight(name)
        if expert:
            return t[:, self.expert_rows] if expert[1] == "down" else t[self.expert_rows]
        if ".qkv_proj." in name:  # fused [q; k; v] rows
            k, v = self.q_size, self.q_size + self.kv_size
            return torch.cat([t[self.q_rows], t[k:][self.kv_rows], t[v:][self.kv_rows]])
        if ".gate_up_proj." in name:  # fused [gate; up] rows
            return torch.cat([t[self.mlp_rows], t[self.intermediate:][self.mlp_rows]])
        if ".gate_proj." in name or ".up_proj." in name:
            return t[self.mlp_rows]
        if ".down_proj." in name:
            return self._row_parallel(t, self.mlp_rows, is_bias)
        return t  # replicated

    def _row_parallel(self, t: torch.Tensor, cols: slice, is_bias: bool) -> torch.Tensor:
        if is_bias:  # added once, by rank 0, to the all-reduced sum
            return t if self.rank == 0 else torch.zeros_like(t)
        return t[:, cols]
