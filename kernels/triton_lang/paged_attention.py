"""Paged attention over a ragged batch that mixes prompt chunks and decodes, in one launch.

Layout (the engine's conventions):
  q                [T, Hq, D]    new tokens of all sequences, sequence b at rows
                                 query_start_loc[b] : query_start_loc[b + 1]
  k_cache, v_cache [num_blocks, block_size, Hkv, D]
  block_tables     [B, max_blocks_per_seq] int32, seq_lens [B] int32 (context incl. new tokens)
New token i of sequence b is at position seq_lens[b] - q_len_b + i and sees keys 0..its position
(and, with `sliding_window`, only keys with pos_q - pos_k < sliding_window).

Kernel design (FlashAttention-2 style, online softmax in fp32):
* One program = one kv head x one "q block" of BLOCK_Q consecutive new tokens of ONE sequence.
  All GROUP = Hq / Hkv query heads that share the kv head are packed into the rows of the
  tile (row = token * GROUP_P + head), so each K/V tile is loaded once per group (GQA/MQA).
* The flat grid covers every sequence's q blocks: sequence b's blocks start at
  query_start_loc[b] // BLOCK_Q + b, so a program finds its sequence by binary search over
  query_start_loc. The grid size T // BLOCK_Q + B is an upper bound known on the host without
  reading any device tensor (no sync); surplus programs exit at once.
* K/V tiles of BLOCK_N key positions are gathered through the block table per key, so any page
  size works with any BLOCK_N (pages smaller or larger than a tile).

Decode-only batches with long contexts and few (sequence, kv head) pairs are handed to the
split-KV kernel in `paged_attention_split_kv.py`; see `choose_num_splits` for the heuristic.

Supported: head_dim any size up to 256 (padded to a power of two inside the kernel; 64 and 128
are the main targets), any block_size (16/32/64 in the engine, 4/8 in tests), Hq a multiple of
Hkv, fp32/fp16/bf16 (bf16 only on CUDA: the interpreter has none; fp32 on CUDA uses 3xTF32 dots,
about fp32 accuracy), sliding window. `max_query_len` / `max_seq_len` only steer tiling and the
split-KV choice; results do not depend on them being tight (they are upper bounds).
"""

from __future__ import annotations

import math

import torch

from ._common import (check_attention_inputs, check_launch, dot_precision, next_pow2, num_sms, pick_num_warps, tl,
                      triton)
from .paged_attention_split_kv import choose_num_splits, paged_decode_attention_split_kv


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, num_seqs, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which sequence owns q block `pid`: the last b with query_start_loc[b] // BLOCK_Q + b <= pid.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid + 1, lo)
        hi = tl.where(first <= pid, hi, mid)
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # surplus program of the upper-bound grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step's new ones

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q_block * BLOCK_Q + offs_m // GROUP_P
    head_in_group = offs_m % GROUP_P
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    d_ok = offs_d < HEAD_DIM
    q_pos = ctx_len + tok
    head = kv_head * GROUP + head_in_group
    row = (q_start + tok).to(tl.int64)

    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys this block needs: causal up to its last token; the window trims the front.
    last_tok = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    kv_end = ctx_len + last_tok + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx_len + q_block * BLOCK_Q - sliding_window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N

    # Finite start for the running max: a fully masked tile then gives exp2(-inf) = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + offs_n
        k_ok = k_pos < kv_end
        blk = tl.load(bt_row + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % PAGE_SIZE
        k_off = blk * stride_kb + slot * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2

        ok = row_ok[:, None] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            ok = ok & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        s = tl.where(ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = blk * stride_vb + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # only padding rows have l == 0; they are not stored
    acc = acc / l_i[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens `q` over their paged KV context; returns [T, Hq, D].

    `num_splits`: None picks automatically (split-KV only for decode-only batches, see
    `choose_num_splits`); 1 always uses the single-pass kernel; > 1 forces split-KV (the batch
    must then be decode-only). `block_m` / `block_n` override the tile sizes (tuning and tests).
    """
    check_attention_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window)
    check_launch("paged_attention", q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    t, hq, d = q.shape
    num_blocks, page_size, hkv, _ = k_cache.shape
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out

    decode_only = max_query_len == 1 and t == b  # every q_len >= 1, so t == b means all are 1
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv, max_seq_len, num_sms(q.device), sliding_window) if decode_only else 1
    if num_splits > 1:
        if not decode_only:
            raise ValueError("split-KV attention needs a decode-only batch (one new token per sequence)")
        return paged_decode_attention_split_kv(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                               scale, max_seq_len, sliding_window, out, num_splits=num_splits,
                                               block_n=block_n)

    group = hq // hkv
    group_p = next_pow2(group)
    if block_m is None:
        # Prompt chunks fill 64-row tiles; decodes only fill GROUP rows, so keep those small.
        block_m = 64 if max_query_len * group_p >= 64 else 16
    block_m = max(next_pow2(block_m), group_p, 16)  # tl.dot needs >= 16 rows
    block_q = block_m // group_p
    block_d = next_pow2(max(d, 16))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    block_n = max(next_pow2(block_n), 16)

    grid = (t // block_q + b, hkv)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale * math.log2(math.e), b, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=d, BLOCK_D=block_d, PAGE_SIZE=page_size, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=pick_num_warps(block_m, block_d, q.dtype),
    )
    return out
