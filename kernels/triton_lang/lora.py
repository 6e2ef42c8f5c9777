"""Batched multi-LoRA: each row of a ragged batch gets its own adapter's `(x @ A) @ B * scale`.

Two launches, the shrink/expand split of Punica's SGMV (written afresh here):

* shrink: xa[t] = x[t] @ A[slot[t]]  (fp32 [T, R]; split over `in` with atomic adds when few rows
  would leave the GPU idle: then the fp32 sums' order, so their last bits, may vary run to run);
* expand: out[t] += (xa[t] @ B[slot[t]]) * scale[slot[t]]  (accumulated in fp32, rounded once).

Rows are grouped by slot on the device (a stable argsort plus per-slot counts and starts), so every
program multiplies a tile of rows of ONE slot with tensor-core dots; nothing is read back to the
host (no sync, capturable in a CUDA graph). The grid is sized for the worst case (every row in
one slot): programs past their slot's rows return at once.

Layout (matching backend/lora/stacks.py through `slot_views`): x [T, in]; slot_ids [T] integer,
negative = no adapter (such rows get nothing); A [S, in, R]; B [S, R, out]; scales [S] or None
(None: already folded into B, as the engine does). Any strides. A slot whose adapter has a smaller
rank is zero-padded to R (as the stacks are). fp32 / fp16 / bf16.

Numerics: 16-bit operands are widened to fp32 and multiplied with TF32 dots, which is exact for
them (fp16 and bf16 fit TF32's 10-bit mantissa) and also runs under the CPU interpreter, which
has no bf16 dot. fp32 operands use 3xTF32 (about fp32 accuracy). xa stays fp32 between the two
launches; the expand dot rounds it to TF32 (16-bit inputs) - finer than the dtype rounding of a
torch `(x @ A) @ B` in fp16/bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import cdiv, check_launch, dot_precision, next_pow2, tl, triton


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, xa_ptr, order_ptr, seg_start_ptr, seg_len_ptr,
    n_in, rank, k_per_split,
    stride_xt, stride_xk, stride_as, stride_ak, stride_ar, stride_xat,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1) % SPLIT_K
    pid_r = tl.program_id(1) // SPLIT_K
    slot = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + slot)
    if pid_m * BLOCK_M >= seg_len:  # worst-case grid: this slot has fewer rows (or none)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    # this slot's rows, in batch order: gathered, so the batch never needs to be sorted in memory
    rows = tl.load(order_ptr + tl.load(seg_start_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = pid_k * k_per_split  # a multiple of BLOCK_K; the last split may run past n_in (masked)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < n_in
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                    mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=PRECISION)
    ptrs = xa_ptr + rows[:, None] * stride_xat + offs_r[None, :]
    mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:  # partial sums over `in` from several programs into a zeroed buffer
        tl.atomic_add(ptrs, acc, mask=mask)


@triton.jit
def _lora_expand_kernel(
    xa_ptr, b_ptr, out_ptr, scale_ptr, order_ptr, seg_start_ptr, seg_len_ptr,
    n_out, rank,
    stride_xat, stride_bs, stride_br, stride_bn, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + slot)
    if pid_m * BLOCK_M >= seg_len:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = tl.load(order_ptr + tl.load(seg_start_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        xa = tl.load(xa_ptr + rows[:, None] * stride_xat + offs_r[None, :],
                     mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_base + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(xa, b.to(tl.float32), acc, input_precision=PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + slot).to(tl.float32)
    # each row belongs to one slot, so exactly one program touches each output element: no race
    ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoraPlan:
    """Tile sizes and the shrink's split over `in` for one call (a function of shapes only)."""

    block_m: int
    block_k: int
    block_r: int
    block_n: int
    split_k: int
    k_per_split: int
    num_warps: int


def plan_lora(num_rows: int, n_in: int, rank: int) -> LoraPlan:
    """Tiles for T rows: dots need every tile side >= 16; fp32 tiles (widened operands) are kept
    at 64 x 64 so that two pipeline stages fit shared memory with room to spare."""
    block_m = min(64, max(16, next_pow2(num_rows)))
    block_r = min(64, max(16, next_pow2(rank)))
    block_k = 64
    k_blocks = cdiv(n_in, block_k)
    # Few rows (decode) give few programs with work: split `in` so that ~16 per slot run at once.
    want = max(1, 16 // cdiv(num_rows, block_m))
    per_split = cdiv(k_blocks, min(k_blocks, want))
    return LoraPlan(block_m=block_m, block_k=block_k, block_r=block_r, block_n=64,
                    split_k=cdiv(k_blocks, per_split), k_per_split=per_split * block_k,
                    # 64 x 64 fp32 tiles need 255 registers with 4 warps on sm80 (ptxas -v), 144 with 8
                    num_warps=8 if block_m * block_r >= 64 * 64 else 4)


@dataclass(frozen=True)
class LoraSegments:
    """The batch's rows grouped by slot, on the device: rows in slot order (no-adapter rows first,
    never visited), each slot's start in that order and its row count."""

    order: torch.Tensor  # int64 [T]
    starts: torch.Tensor  # int64 [S]
    counts: torch.Tensor  # int64 [S]


def lora_segments(slot_ids: torch.Tensor, num_slots: int) -> LoraSegments:
    """Group rows by slot without a host sync. One step's projections share one grouping: compute
    it once per step and pass it to every `lora_delta` call of the step."""
    ids = slot_ids.long().clamp(min=-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids + 1, torch.ones_like(ids))  # an id >= num_slots fails here, not silently
    starts = torch.cumsum(counts, 0) - counts
    return LoraSegments(order=order, starts=starts[1:], counts=counts[1:])


def lora_delta(x: torch.Tensor, slot_ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scales: torch.Tensor | None = None, out: torch.Tensor | None = None,
               segments: LoraSegments | None = None) -> torch.Tensor:
    """Each row's adapter delta `(x[t] @ a[s]) @ b[s] * scales[s]`, s = slot_ids[t] (rows with
    s < 0: none). x [T, in]; slot_ids [T] in [-1, S); a [S, in, R]; b [S, R, out]; scales [S]
    or None (folded into b). With `out` [T, out] the deltas are added to it in place (fp32 sum,
    rounded once) and `out` is returned; else a new [T, out] tensor in x's dtype (zero rows for
    rows without an adapter). `segments`: `lora_segments(slot_ids, S)` computed once for several
    calls (else computed here)."""
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"lora_delta: x [T, in], a [S, in, R], b [S, R, out] expected, got {tuple(x.shape)}, "
                         f"{tuple(a.shape)}, {tuple(b.shape)}")
    t, n_in = x.shape
    num_slots, rank, n_out = b.shape
    if a.shape != (num_slots, n_in, rank):
        raise ValueError(f"lora_delta: a must be [S={num_slots}, in={n_in}, R={rank}], got {tuple(a.shape)}")
    if slot_ids.shape != (t,) or slot_ids.dtype.is_floating_point:
        raise ValueError(f"lora_delta: slot_ids must be integers [T={t}], got {tuple(slot_ids.shape)}")
    if scales is not None and scales.shape != (num_slots,):
        raise ValueError(f"lora_delta: scales must be [S={num_slots}], got {tuple(scales.shape)}")
    if out is None:
        out = torch.zeros((t, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (t, n_out):
        raise ValueError(f"lora_delta: out must be [T={t}, out={n_out}], got {tuple(out.shape)}")
    check_launch("lora_delta", x, slot_ids, a, b, out, *([scales] if scales is not None else []))
    if segments is None:
        segments = lora_segments(slot_ids, num_slots)
    elif segments.order.shape != (t,) or segments.counts.shape != (num_slots,):
        raise ValueError(f"lora_delta: segments are for {segments.order.shape[0]} rows and "
                         f"{segments.counts.shape[0]} slots, not {t} and {num_slots}")
    if t == 0 or n_in == 0 or n_out == 0 or rank == 0 or num_slots == 0:
        return out  # nothing to add (and no tile plan for an empty `in`)
    plan = plan_lora(t, n_in, rank)
    order, seg_start, seg_len = segments.order, segments.starts, segments.counts
    # fp32 between the launches; zeroed only when split programs add into it
    xa = (torch.zeros if plan.split_k > 1 else torch.empty)((t, rank), dtype=torch.float32, device=x.device)
    precision = dot_precision(x.dtype)
    m_blocks = cdiv(t, plan.block_m)
    _lora_shrink_kernel[(m_blocks, plan.split_k * cdiv(rank, plan.block_r), num_slots)](
        x, a, xa, order, seg_start, seg_len, n_in, rank, plan.k_per_split,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), xa.stride(0),
        BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, BLOCK_R=plan.block_r, SPLIT_K=plan.split_k,
        PRECISION=precision, num_warps=plan.num_warps, num_stages=2)
    _lora_expand_kernel[(m_blocks, cdiv(n_out, plan.block_n), num_slots)](
        xa, b, out, b if scales is None else scales, order, seg_start, seg_len, n_out, rank,
        xa.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_R=plan.block_r, HAS_SCALE=scales is not None,
        PRECISION=precision, num_warps=plan.num_warps, num_stages=2)
    return out


def slot_views(a_cols: torch.Tensor, b_rows: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One part of a `StackedProjection` (backend/lora/stacks.py) as `lora_delta`'s a and b,
    without copies: `a_cols` = stacked.a[:, part.col_start:part.col_end] [in, S*R] (slot-minor
    runs of R columns) -> [S, in, R]; `b_rows` = part.b [S*R, out] -> [S, R, out]."""
    n_in, cols = a_cols.shape
    if cols % num_slots or b_rows.shape[0] != cols:
        raise ValueError(f"slot_views: {cols} columns of A / {b_rows.shape[0]} rows of B for {num_slots} slots")
    rank = cols // num_slots
    return a_cols.unflatten(1, (num_slots, rank)).permute(1, 0, 2), b_rows.unflatten(0, (num_slots, rank))


__all__ = ["lora_delta", "lora_segments", "plan_lora", "slot_views", "LoraPlan", "LoraSegments"]
