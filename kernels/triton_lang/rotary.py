"""Rotary position embedding (HF Llama "rotate half" convention), applied IN PLACE to q and k.

out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin),  rotate_half(x) = cat(-x2, x1),
i.e. for each head, with x1 = x[:D/2], x2 = x[D/2:]:  out1 = x1*c - x2*s,  out2 = x2*c + x1*s.
cos/sin [max_pos, D/2] are gathered at `positions` (built by the engine, any float dtype).
Rounding mirrors HF in x.dtype (tables cast to x.dtype, each product rounded, then the sum),
so fp16/bf16 results match HF's unfused ops. Any even head_dim; fp32/fp16/bf16.
"""

from __future__ import annotations

import torch

from ._common import check_launch, next_pow2, tl, triton


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, c, s, half_ok, offs_half,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & half_ok[None, :]
    p1 = base_ptr + heads[:, None] * stride_h + offs_half[None, :]
    dtype = base_ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    # Round the tables and each product to x's dtype, as HF's unfused ops do.
    c = c.to(dtype).to(tl.float32)[None, :]
    s = s.to(dtype).to(tl.float32)[None, :]
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    tl.store(p1, o1.to(dtype), mask=mask)
    tl.store(p1 + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_ok = offs_half < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_half, mask=half_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + offs_half, mask=half_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, c, s, half_ok, offs_half, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_k_heads, c, s, half_ok, offs_half, HALF, BLOCK_HK)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] IN PLACE at `positions` [T]; returns (q, k)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D]")
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or cos.shape[-1] * 2 != d or sin.shape != cos.shape or positions.shape != (t,):
        raise ValueError(f"apply_rotary: cos/sin must be [max_pos, {d // 2}] and positions [{t}]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("apply_rotary: q, k, cos and sin need a contiguous last dimension")
    if not positions.is_contiguous():
        raise ValueError("apply_rotary: positions must be contiguous")
    check_launch("apply_rotary", q, k, positions, cos, sin)
    if t > 0:
        half = d // 2
        block_hq, block_hk = next_pow2(hq), next_pow2(hk)
        _rotary_kernel[(t,)](
            q, k, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), hq, hk,
            HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
            num_warps=4 if block_hq * half <= 4096 else 8,
        )
    return q, k
