"""The set of kernels a model runs with: torch references, C++ CPU kernels, or Triton-lang kernels.

Chosen once at start-up from the resolved attention backend and the dtype (the C++
elementwise kernels take float32 and bfloat16); the model layers call through it and never
branch on the device themselves.

Contract of `rms_norm(x, weight, eps, residual)`: with a residual it returns
(normed(x + residual), x + residual) and may overwrite both inputs (the model never reads
them again), so the C++ kernel works in place; `apply_rotary` may rotate q and k in place
(views of the fused qkv output, read by nothing else) and return them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from splitfuse.kernels.cpu import elementwise
from splitfuse.kernels.reference import apply_rotary_reference, rms_norm_reference, silu_and_mul_reference
from splitfuse.layers.attention import make_backend

log = logging.getLogger(__name__)


@dataclass
class KernelSet:
    attention_backend: str
    attention: object
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable

    @property
    def native_cpu(self) -> bool:
        """Whether attention and the elementwise ops are the C++ CPU kernels."""
        return self.attention_backend == "cpu" and self.rms_norm is _cpu_rms_norm

    @property
    def triton_lang(self) -> bool:
        """Whether the Triton-lang kernels run (attention backends triton / flash_attn)."""
        return self.attention_backend not in ("torch", "cpu")

    @classmethod
    def create(cls, attention_backend: str, dtype: torch.dtype = torch.float32) -> "KernelSet":
        attention = make_backend(attention_backend)
        if attention_backend == "cpu" and dtype in (torch.float32, torch.bfloat16) and elementwise.available():
            return cls(attention_backend, attention, _cpu_rms_norm, _cpu_apply_rotary, elementwise.silu_and_mul)
        if attention_backend in ("torch", "cpu"):  # cpu: float16, or the elementwise kernels failed to bind
            return cls(attention_backend, attention, rms_norm_reference, apply_rotary_reference, silu_and_mul_reference)
        # The Triton-lang backends also take the fused elementwise kernels.
        from splitfuse.kernels import apply_rotary, rms_norm, silu_and_mul

        return cls(attention_backend, attention, rms_norm, apply_rotary, silu_and_mul)


def _cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is None:  # the first layer: x is also the residual stream, keep it
        return elementwise.rms_norm(x, weight, eps)
    return elementwise.rms_norm(x, weight, eps, residual, out=x, residual_out=residual)


def _cpu_apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return elementwise.apply_rotary(q, k, positions, cos, sin, inplace=True)
