"""Rotary embedding over the first `rotary_dim` features of each head only (Phi-4-mini: 3/4 of
them); the rest pass through unrotated, as transformers' Phi-3 does. Works with any KernelSet's
apply_rotary: the rotated part goes in as its own contiguous tensor, whose tables are
[positions, rotary_dim / 2]."""

from __future__ import annotations

from typing import Callable

import torch


def apply_partial_rotary(apply_rotary: Callable, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_rot, k_rot = apply_rotary(q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous(), positions,
                                cos, sin)
    return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)
