"""The set of kernels a model runs with: torch everywhere, or Triton-lang kernels.

Chosen once at start-up from the resolved attention backend; the model layers call
through it and never branch on the device themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable


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

    @classmethod
    def create(cls, attention_backend: str) -> "KernelSet":
        attention = make_backend(attention_backend)
        if attention_backend == "torch":
            return cls(attention_backend, attention, rms_norm_reference, apply_rotary_reference, silu_and_mul_reference)
        # The Triton-lang backends also take the fused elementwise kernels.
        from splitfuse.kernels import apply_rotary, rms_norm, silu_and_mul

        return cls(attention_backend, attention, rms_norm, apply_rotary, silu_and_mul)
