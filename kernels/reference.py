"""Plain-torch references of every kernel, on any device, with or without triton.

Each Triton-lang kernel (`triton_lang/`) and each C++ CPU kernel (`cpu/`) is tested against
the function of the same name here; the engine's `torch` path runs these functions directly.
Conventions (the engine's): q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] (token-major);
sequence b owns rows query_start_loc[b]:query_start_loc[b+1]; seq_lens[b] counts its context
including this step's tokens; slot = block * block_size + offset (slots < 0 are skipped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence at a time: gather K/V through the block table, masked softmax in fp32.
    New token i of a q_len-token chunk sits at position seq_len - q_len + i and sees keys up to
    it (with `sliding_window` W, only keys less than W positions back)."""
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        blocks = block_tables[b, :-(-seq_len // page_size)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:seq_len].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, hkv, d)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def write_kv_cache_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """Scatter each new token's K/V [T, Hkv, D] into its cache slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page_size = k_cache.shape[1]
    blk, off = slots // page_size, slots % page_size
    k_cache[blk, off] = k[keep].to(k_cache.dtype)
    v_cache[blk, off] = v[keep].to(v_cache.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm: h = x.float(); h * rsqrt(mean(h^2) + eps), cast back, times weight.
    With `residual`: (normed(x + residual), x + residual), the add rounded to x's dtype."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    return normed if residual is None else (normed, x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's rotate-half rotary embedding: q [T, Hq, D], k [T, Hkv, D], tables
    [max_positions, D/2]; x * cos + rotate_half(x) * sin in x's dtype; returns new tensors."""
    c = cos[positions].to(q.dtype)
    s = sin[positions].to(q.dtype)
    c = torch.cat((c, c), dim=-1).unsqueeze(1)
    s = torch.cat((s, s), dim=-1).unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :I]) * x[..., I:] for x [..., 2I]."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] . weight [N, K]^T (+ bias [N]) with float32 products and sums, in x's dtype."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def quantize_rows_reference(x: torch.Tensor, levels: int, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization of x [M, K] stored as uint8 around `zero_point`:
    (q [M, K] uint8, scales [M, 1] float32), scale = max(max|x_row|, 1e-12) / levels,
    q = round(x / scale) + zero_point (round half to even)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12).div_(levels)
    q = torch.round(xf / scale).add_(zero_point).to(torch.uint8)
    return q, scale


def int8_linear_reference(xq: torch.Tensor, xscales: torch.Tensor, zero_point: int, wq: torch.Tensor,
                          wscales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """uint8 activations xq [M, K] around `zero_point` with row scales [M, 1], times int8 weights
    wq [N, K] with channel scales [N]: exact integer sums, float32(sum) * weight scale, then
    `dequantize_rows_reference` (times the row scale, plus bias, in `dtype`)."""
    sums = (xq.long() - zero_point) @ wq.long().t()
    return dequantize_rows_reference(sums.float() * wscales, xscales.view(-1, 1), bias, dtype)


def dequantize_rows_reference(acc: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An int8 GEMM's float32 sums acc [M, N] back to values: times the per-row activation scales
    [M, 1], plus the bias [N], in float32, then in `dtype`. Overwrites acc."""
    acc.mul_(scales)
    if bias is not None:
        acc.add_(bias)
    return acc.to(dtype)


def lora_delta_reference(x: torch.Tensor, slot_ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         scales: torch.Tensor | None = None, out: torch.Tensor | None = None,
                         segments: object = None) -> torch.Tensor:
    """Batched multi-LoRA: row t gets `(x[t] @ a[s]) @ b[s] * scales[s]`, s = slot_ids[t]; rows with
    s < 0 get nothing. x [T, in]; a [S, in, R]; b [S, R, out]; scales [S] or None (folded into b).
    float32 products and sums. With `out` [T, out]: added to it in place (one rounding) and
    returned; else a new [T, out] tensor in x's dtype. `segments` (the kernel's precomputed row
    grouping) is ignored here."""
    ids = slot_ids.long()
    delta = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float32, device=x.device)
    for s in torch.unique(ids[ids >= 0]).tolist():
        rows = (ids == s).nonzero().squeeze(1)
        d = (x[rows].float() @ a[s].float()) @ b[s].float()
        delta[rows] = d if scales is None else d * scales[s].float()
    if out is None:
        return delta.to(x.dtype)
    return out.add_(delta)
