"""Attention through the C++ CPU kernels (splitfuse.kernels.cpu.paged_attention).

One kernel call per layer covers the whole ragged batch, reading K/V blocks in place through
the block tables (no gather, no padding to the longest sequence); one more writes the new
tokens' K/V. The layout is the kernel's own (`cache_shape`: K transposed inside a block).
Nothing to plan per step: the kernel splits its work itself. A bfloat16 model keeps a bfloat16
cache, and so may a float32 model (`kv_cache_dtype`): the new tokens' K/V are rounded to the
cache's dtype as they are written. An int8 cache (either model dtype) holds codes and a scale
per token and kv head inside each block's tile (`splitfuse.kernels.cpu.kv_int8`); the write
kernel quantizes the model's K/V itself. Queries enter the kernel in the model's dtype (float32, or
bfloat16: prompt chunks of a bf16 model then multiply in bf16 where the CPU has AVX-512 BF16);
the kernel's float32 output leaves in the model's dtype.
"""

from __future__ import annotations

import torch

from splitfuse.kernels.cpu import paged_attention as kernels
from splitfuse.layers.attention import AttentionMetadata


class CpuAttention:
    name = "cpu"

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype | None = None) -> tuple[int, ...]:
        return kernels.cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype or torch.float32)

    def prepare(self, meta: AttentionMetadata, query_lens: list[int], seq_lens: list[int], num_kv_heads: int) -> None:
        pass

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        if k.dtype != k_cache.dtype and k_cache.dtype is not torch.int8:  # (int8: quantized by the kernel)
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        out = kernels.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                      meta.block_tables, scale, sliding_window)
        return out.to(q.dtype)
