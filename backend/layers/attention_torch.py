"""Attention in plain torch: gather each sequence's blocks into a reused workspace, then SDPA.

The fallback on any device, and what runs on a CPU without a C++ compiler. The cache is
head-major inside a block, [num_blocks, Hkv, block_size, D], so gathering (block, head) rows
yields K/V already in SDPA's [B, Hkv, L, D] layout. Measured on a 2-core CPU (32 decodes x
608 tokens, 4 KV heads, D 64): gathering into fresh tensors cost 6x more than into a reused
buffer (page faults), strided K/V ran SDPA 1.7x slower, and 3-D inputs send SDPA to its math
path at half the speed of its flash kernel; hence 4-D, contiguous, reused. Decodes run as one
batched group (in cache-sized sub-batches on CPU), each prompt chunk as its own SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitfuse.layers.attention import AttentionMetadata

# Decode K/V are gathered this many bytes at a time, small enough to still be in a server
# CPU's last-level cache when SDPA reads them (measured on a 32 MiB L3: 8 MiB sub-batches ran
# decode attention 1.6x faster than gathering the whole batch at once).
_DECODE_GATHER_BYTES = 8 << 20


@dataclass
class PrefillSpan:
    """One sequence with several new tokens."""

    row_start: int
    row_end: int
    seq_len: int
    num_blocks: int
    gather_rows: torch.Tensor  # int64 [Hkv * num_blocks]: rows of the cache viewed [-1, block_size, D]


@dataclass
class TorchPlan:
    """Computed once per step by `prepare`, shared by all layers: where each new token's K/V
    go, which (block, head) rows to gather, the decode group and the prompt chunks."""

    meta: AttentionMetadata
    write_rows: torch.Tensor  # int64 [T * Hkv], rows of the cache viewed [-1, D]
    decode_rows: torch.Tensor | None = None  # int64 [Bd]
    decode_gather_rows: torch.Tensor | None = None  # int64 [Bd * Hkv * Md], like PrefillSpan.gather_rows
    decode_num_blocks: int = 0
    decode_seq_lens: torch.Tensor | None = None  # int64 [Bd]
    prefills: list[PrefillSpan] = field(default_factory=list)
    masks: dict = field(default_factory=dict)


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None
        # A step prepares one or two plans: all its rows (the K/V writes, and attention in every
        # layer but the last) and, unless every row is one, its sample rows (the last layer's).
        self._plans: list[TorchPlan] = []

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype | None = None) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def prepare(self, meta: AttentionMetadata, query_lens: list[int], seq_lens: list[int], num_kv_heads: int) -> None:
        bs = meta.block_size
        device = meta.block_tables.device
        heads = torch.arange(num_kv_heads, dtype=torch.int64, device=device)
        slots = meta.slot_mapping
        # Row of token t, head h in the cache viewed [num_blocks * Hkv * block_size, D].
        rows = ((slots // bs * num_kv_heads)[:, None] + heads[None, :]) * bs + (slots % bs)[:, None]
        plan = TorchPlan(meta=meta, write_rows=rows.flatten())

        bt = meta.block_tables.to(torch.int64)
        decode_idx = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_idx:
            idx = torch.tensor(decode_idx, dtype=torch.int64, device=device)
            plan.decode_num_blocks = -(-max(seq_lens[i] for i in decode_idx) // bs)
            plan.decode_rows = meta.query_start_loc[:-1].to(torch.int64)[idx]
            plan.decode_seq_lens = meta.seq_lens.to(torch.int64)[idx]
            blocks = bt[idx, : plan.decode_num_blocks]  # [Bd, Md]
            plan.decode_gather_rows = (blocks[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
        qsl_list = meta.query_start_loc.tolist() if len(decode_idx) < len(query_lens) else None
        for i, n in enumerate(query_lens):
            if n > 1:
                num_blocks = -(-seq_lens[i] // bs)
                rows = (bt[i, :num_blocks][None, :] * num_kv_heads + heads[:, None]).flatten()  # [Hkv, nb]
                plan.prefills.append(PrefillSpan(qsl_list[i], qsl_list[i + 1], seq_lens[i], num_blocks, rows))
        self._plans = [*self._plans[-1:], plan]

    def _plan_for(self, meta: AttentionMetadata) -> TorchPlan:
        for plan in self._plans:
            if plan.meta is meta:
                return plan
        raise RuntimeError("TorchAttention.prepare was not called for this batch")

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        rows = self._plan_for(meta).write_rows
        head_dim = k.shape[-1]
        k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim))

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor):
        _, _, bs, head_dim = k_cache.shape
        need = rows.numel() * bs * head_dim
        buf = self._k_buf
        if buf is None or buf.numel() < need or buf.dtype != k_cache.dtype or buf.device != k_cache.device:
            # Grow with headroom so a slowly growing batch does not reallocate every step.
            size = need + need // 4
            self._k_buf = torch.empty(size, dtype=k_cache.dtype, device=k_cache.device)
            self._v_buf = torch.empty_like(self._k_buf)
        k = self._k_buf[:need].view(rows.numel(), bs, head_dim)
        v = self._v_buf[:need].view(rows.numel(), bs, head_dim)
        torch.index_select(k_cache.view(-1, bs, head_dim), 0, rows, out=k)
        torch.index_select(v_cache.view(-1, bs, head_dim), 0, rows, out=v)
        return k, v

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        plan = self._plan_for(meta)
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        if plan.decode_rows is not None:
            batch = plan.decode_rows.shape[0]
            length = plan.decode_num_blocks * bs
            rows_per_seq = num_kv_heads * plan.decode_num_blocks
            # A decode's query heads sharing a KV head become that head's "query rows" (no GQA expand).
            qd = q.index_select(0, plan.decode_rows).view(batch, num_kv_heads, group, head_dim)
            mask = self._decode_mask(plan, length, sliding_window)
            # On CPU, sub-batches whose gathered K/V stay in the last-level cache until SDPA
            # reads them; a GPU gets the whole batch in one call.
            seq_bytes = 2 * rows_per_seq * bs * head_dim * q.element_size()
            step = max(1, _DECODE_GATHER_BYTES // seq_bytes) if q.device.type == "cpu" else batch
            outs = []
            for s in range(0, batch, step):
                e = min(batch, s + step)
                k, v = self._gather(k_cache, v_cache, plan.decode_gather_rows[s * rows_per_seq : e * rows_per_seq])
                k = k.view(e - s, num_kv_heads, length, head_dim)
                v = v.view(e - s, num_kv_heads, length, head_dim)
                outs.append(F.scaled_dot_product_attention(qd[s:e], k, v, attn_mask=mask[s:e], scale=scale))
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            out.index_copy_(0, plan.decode_rows, o.reshape(batch, num_heads, head_dim))
        for span in plan.prefills:
            length = span.num_blocks * bs
            k, v = self._gather(k_cache, v_cache, span.gather_rows)
            k = k.view(1, num_kv_heads, length, head_dim)[:, :, : span.seq_len]
            v = v.view(1, num_kv_heads, length, head_dim)[:, :, : span.seq_len]
            qp = q[span.row_start : span.row_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            q_len = span.row_end - span.row_start
            if q_len == span.seq_len and sliding_window is None:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                mask = self._prefill_mask(plan, span, sliding_window, q.device)
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            out[span.row_start : span.row_end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode_mask(plan: TorchPlan, length: int, window: int | None) -> torch.Tensor:
        key = ("decode", window)
        if key not in plan.masks:
            pos = torch.arange(length, device=plan.decode_seq_lens.device)
            lens = plan.decode_seq_lens[:, None]
            mask = pos[None, :] < lens
            if window is not None:
                mask &= pos[None, :] > lens - 1 - window
            plan.masks[key] = mask[:, None, None, :]
        return plan.masks[key]

    @staticmethod
    def _prefill_mask(plan: TorchPlan, span: PrefillSpan, window: int | None, device) -> torch.Tensor:
        key = ("prefill", span.row_start, window)
        if key not in plan.masks:
            q_len = span.row_end - span.row_start
            q_pos = torch.arange(span.seq_len - q_len, span.seq_len, device=device)[:, None]
            k_pos = torch.arange(span.seq_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= q_pos - k_pos < window
            plan.masks[key] = mask
        return plan.masks[key]
