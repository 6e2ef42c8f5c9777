"""The set of kernels a model runs with: torch everywhere, or Triton-lang kernels.

Chosen once at start-up from the resolved attention backend; the model layers call
through it and never branch on the device themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from splitfuse.layers.attention import make_backend
from splitfuse.layers.norm import rms_norm_torch
from splitfuse.layers.rotary import apply_rotary_torch

log = logging.getLogger(__name__)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class KernelSet:
    attention_backend: str
    attention: object
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable

    @classmethod
    def create(cls, attention_backend: str) -> "KernelSet":
        attention = make_backend(attention_backend)
        if attention_backend == "torch":
            return cls(attention_backend, attention, rms_norm_torch, apply_rotary_torch, silu_and_mul_torch)
        # The Triton-lang backends also take the fused elementwise kernels.
        from splitfuse.kernels import apply_rotary, rms_norm, silu_and_mul

        return cls(attention_backend, attention, rms_norm, apply_rotary, silu_and_mul)
