"""Attention over the paged KV cache for a ragged batch, behind one interface.

A step's batch mixes prompt chunks (many new tokens) and decodes (one new token). The
new tokens' K/V are first written into the cache by slot; attention then reads every key
of the sequence from the cache through its block table. The last layer attends for the sample
rows only (the rows that give next tokens), through metadata of their own (RaggedBatch.last_layer).

Every backend has the same four methods:
    cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)  its KV layout (one shape for K and V)
    prepare(meta, query_lens, seq_lens, num_kv_heads)             before the layers, for each metadata of
                                                                  the step: all rows (and the sample rows)
    write_kv(k, v, k_cache, v_cache, meta)                        the new tokens' K/V into the cache
    attend(q, k_cache, v_cache, meta, scale, sliding_window)      -> [T, Hq, D]
Backends: `cpu` (C++ kernels compiled on the machine, attention_cpu.py), `torch` (gather + SDPA,
attention_torch.py; the fallback anywhere), `triton` and `flash_attn` (GPU, attention_triton.py).
`resolve_backend` picks one for `auto`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """The step's batch as every backend sees it (built by RaggedBatch, read-only after)."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B], context length including this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_query_len: int
    max_seq_len: int
    block_size: int


def cpu_attention_problem(dtype: torch.dtype) -> str | None:
    """Why the C++ CPU attention cannot run here, or None when it can."""
    from splitfuse.kernels.cpu import paged_attention as cpu_attention
    from splitfuse.kernels.cpu.build import unavailable_reason

    if not cpu_attention.available():
        return unavailable_reason()
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 and bfloat16, got {dtype}"
    return None


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """Pick the attention backend for `auto`, and refuse combinations that cannot run."""
    triton_ok = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        if device.type == "cuda":
            if importlib.util.find_spec("flash_attn") is not None:
                from splitfuse.kernels.flash_attn import flash_attn_supported

                ok, reason = flash_attn_supported(dtype, block_size, device)
                if ok:
                    return "flash_attn"
                log.info("flash-attn not used: %s", reason)
            if triton_ok:
                return "triton"
            return "torch"
        problem = cpu_attention_problem(dtype)
        if problem is None:
            return "cpu"
        log.warning("splitfuse: C++ CPU attention not used (%s); using the torch path", problem)
        return "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' needs device cpu, got {device}")
        problem = cpu_attention_problem(dtype)
        if problem is not None:
            raise ValueError(f"attention_backend='cpu' cannot run here: {problem}")
    if requested in ("triton", "flash_attn") and not triton_ok:
        raise ValueError(f"attention_backend={requested!r} needs the `triton` package")
    if requested == "flash_attn":
        from splitfuse.kernels.flash_attn import flash_attn_supported

        ok, reason = flash_attn_supported(dtype, block_size, device)
        if not ok:
            raise ValueError(f"attention_backend='flash_attn' cannot run here: {reason}")
    return requested


def resolve_kv_cache_dtype(requested: str, dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """The KV cache's dtype: the model's for `auto`; bfloat16 (under float32 queries) and int8
    (codes and scales, under float32 or bfloat16 queries) only where the attention reads them:
    the C++ CPU kernels."""
    if requested == "auto" or getattr(torch, requested) == dtype:
        return dtype
    if requested == "int8" and attention_backend != "cpu":
        raise ValueError(f"kv_cache_dtype='int8' needs the C++ CPU attention (attention_backend cpu, on a CPU), "
                         f"not {attention_backend!r}: only its kernels read and write int8 K/V with scales")
    if attention_backend != "cpu":
        raise ValueError(f"kv_cache_dtype={requested!r} under a {str(dtype).removeprefix('torch.')} model needs "
                         f"the C++ CPU attention (attention_backend cpu), not {attention_backend!r}")
    return getattr(torch, requested)


def make_backend(name: str):
    if name == "torch":
        from splitfuse.layers.attention_torch import TorchAttention

        return TorchAttention()
    if name == "cpu":
        from splitfuse.layers.attention_cpu import CpuAttention

        return CpuAttention()
    from splitfuse.layers.attention_triton import FlashAttnAttention, TritonAttention

    return {"triton": TritonAttention, "flash_attn": FlashAttnAttention}[name]()
