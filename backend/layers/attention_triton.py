"""GPU attention backends: Triton-lang kernels, and flash-attn's paged varlen kernel."""

from __future__ import annotations

from splitfuse.layers.attention import AttentionMetadata


class TritonAttention:
    """Triton-lang kernels: one launch for the whole ragged batch."""

    name = "triton"

    def __init__(self) -> None:
        from splitfuse.kernels import paged_attention, write_kv_cache

        self._attention = paged_attention
        self._write = write_kv_cache

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype | None = None) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, meta: AttentionMetadata, query_lens: list[int], seq_lens: list[int], num_kv_heads: int) -> None:
        pass

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._write(k, v.contiguous(), k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        return self._attention(
            q.contiguous(), k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            meta.max_query_len, meta.max_seq_len, sliding_window=sliding_window,
        )


class FlashAttnAttention(TritonAttention):
    """flash-attn's paged varlen kernel for attention; the KV write stays a Triton kernel."""

    name = "flash_attn"

    def __init__(self) -> None:
        super().__init__()
        from splitfuse.kernels.flash_attn import paged_attention_flash

        self._attention = paged_attention_flash
