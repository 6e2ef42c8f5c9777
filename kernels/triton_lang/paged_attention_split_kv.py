"""Split-KV ("flash-decoding") paged attention for decode-only batches.

A decode-only batch gives the single-pass kernel only B x Hkv programs, one per (sequence,
kv head), each walking the whole context. With few sequences and long contexts that leaves
most SMs idle. Here each (sequence, kv head) is split into `num_splits` key ranges handled by
separate programs (stage 1); each writes a normalised partial output plus its softmax max and
sum, and a small second kernel (stage 2) merges the splits exactly. The two stages are one
algorithm, so they share this file.

Heuristic (`choose_num_splits`): split only when B x Hkv programs fall short of ~2 waves on the
device (2 x SM count), so that the splits fill the GPU; never give a split fewer than
MIN_TOKENS_PER_SPLIT keys (the merge and the extra launch must pay off), and cap at MAX_SPLITS.
`paged_attention` applies it automatically to decode-only batches.
"""

from __future__ import annotations

import math

import torch

from ._common import (cdiv, check_attention_inputs, check_launch, dot_precision, next_pow2, num_sms, pick_num_warps, tl,
                      triton)

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      sliding_window: int | None = None) -> int:
    """How many key ranges to split each decode sequence into; 1 means "do not split"."""
    span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    programs = max(num_seqs * num_kv_heads, 1)
    splits = min(cdiv(2 * num_sms, programs), span // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return splits if splits >= 2 else 1


@triton.jit
def _split_kv_partial_kernel(
    part_out_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale_log2, sliding_window, split_len,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_mlb, stride_mlh, stride_mls,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)  # the sequence's one new token
    seq_len = tl.load(seq_lens_ptr + seq)
    # Keys [lo, seq_len) are visible to the token at seq_len - 1; split them evenly.
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # The last split runs to seq_len, so a max_seq_len that undershoots costs balance, not correctness.
    end = tl.where(split == tl.num_programs(2) - 1, seq_len, end)

    offs_m = tl.arange(0, BLOCK_M)  # rows = the GROUP query heads of this kv head (padded to >= 16)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_DIM
    head = kv_head * GROUP + offs_m
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for kv in range(start, end, BLOCK_N):  # empty for splits past the context: l stays 0
        k_pos = kv + offs_n
        k_ok = k_pos < end
        blk = tl.load(bt_row + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % PAGE_SIZE
        k = tl.load(k_cache_ptr + (blk * stride_kb + slot * stride_ks + kv_head * stride_kh)[None, :]
                    + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(k_ok[None, :], s, float("-inf"))  # all keys < end are causal and in-window

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (blk * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None]
                    + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    head_local = offs_m.to(tl.int64)
    part = part_out_ptr + seq * stride_pb + (kv_head * GROUP + head_local)[:, None] * stride_ph \
        + split * stride_ps + offs_d[None, :]
    tl.store(part, acc, mask=row_ok[:, None] & d_ok[None, :])
    ml = part_ml_ptr + seq * stride_mlb + (kv_head * GROUP + head_local) * stride_mlh + split * stride_mls
    tl.store(ml, m_i, mask=row_ok)
    tl.store(ml + 1, l_i, mask=row_ok)


@triton.jit
def _split_kv_merge_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, query_start_loc_ptr, num_splits,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_mlb, stride_mlh, stride_mls,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    ml = part_ml_ptr + seq * stride_mlb + head * stride_mlh + offs_s * stride_mls
    m = tl.load(ml, mask=s_ok, other=-1.0e30)
    l_s = tl.load(ml + 1, mask=s_ok, other=0.0)
    # Each split's output is normalised by its own sum; reweight by its share of the global sum.
    w = l_s * tl.exp2(m - tl.max(m, 0))
    o = tl.load(part_out_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention_split_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Decode-only paged attention (one new token per sequence, so T == B) with split KV.

    Same tensor conventions as `paged_attention`; `num_splits=None` uses `choose_num_splits`
    (at least 2 here, since the caller asked for splitting).
    """

    check_attention_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window)
    check_launch("paged_decode_attention_split_kv", q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    b = seq_lens.shape[0]
    if t != b:
        raise ValueError(f"split-KV decode needs one new token per sequence, got T={t} for B={b}")
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    if num_splits is None:
        num_splits = max(choose_num_splits(b, hkv, max_seq_len, num_sms(q.device), sliding_window), 2)
    group = hq // hkv
    block_m = max(next_pow2(group), 16)  # tl.dot needs >= 16 rows; extra rows are masked
    block_d = next_pow2(max(d, 16))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    block_n = max(next_pow2(block_n), 16)
    span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    split_len = cdiv(cdiv(max(span, 1), num_splits), block_n) * block_n  # whole tiles per split

    # fp32 partials: [B, Hq, S, D] outputs and [B, Hq, S, 2] (max in log2 units, sum).
    part_out = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    _split_kv_partial_kernel[(b, hkv, num_splits)](
        part_out, part_ml, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale * math.log2(math.e), sliding_window or 0, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, BLOCK_D=block_d, PAGE_SIZE=page_size,
        USE_WINDOW=sliding_window is not None, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=pick_num_warps(block_m, block_d, q.dtype),
    )
    _split_kv_merge_kernel[(b, hq)](
        out, part_out, part_ml, query_start_loc, num_splits,
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        HEAD_DIM=d, BLOCK_D=block_d, SPLITS_P=max(next_pow2(num_splits), 2),
        num_warps=4,
    )
    return out
