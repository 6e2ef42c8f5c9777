"""Write this step's new K/V rows into the paged cache, in place.

k, v            [T, Hkv, D]   (views of a fused QKV output are fine: only the last dim must be contiguous)
k_cache/v_cache [num_blocks, block_size, Hkv, D]
slot_mapping    [T] int64 = block_id * block_size + offset; -1 marks a padding token to skip.
Values are cast to the cache dtype. Any head_dim/block_size; fp32/fp16/bf16.
"""

from __future__ import annotations

import torch

from ._common import cdiv, check_launch, next_pow2, tl, triton


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]

    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter k/v rows into the caches at `slot_mapping` (skipping -1), in place."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    t, hkv, d = k.shape
    if k_cache.shape[2:] != (hkv, d) or slot_mapping.shape != (t,):
        raise ValueError(f"k {tuple(k.shape)} / slot_mapping {tuple(slot_mapping.shape)} "
                         f"do not fit cache {tuple(k_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a contiguous last (head_dim) dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    check_launch("write_kv_cache", k, v, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    block_d = next_pow2(d)
    block_h = min(next_pow2(hkv), max(1, 4096 // block_d))  # ~4K elements per program
    _write_kv_cache_kernel[(t, cdiv(hkv, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1],
        num_warps=4,
    )
