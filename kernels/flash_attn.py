"""Optional flash-attn backend with `paged_attention`'s signature (CUDA only; not testable on CPU).

Wraps flash-attn 2's `flash_attn_varlen_func(..., block_table=...)`, which reads K/V straight
from the paged cache [num_blocks, page_size, Hkv, D]. Conventions line up with the engine's:
flash-attn aligns the causal mask bottom-right when seqlen_q < seqlen_k (new token i of a
sequence sits at position seq_len - q_len + i), and its window (left, right) keeps keys in
[pos_q - left, pos_q + right], so our `pos_q - pos_k < sliding_window` is left = window - 1.

Requirements, checked by `flash_attn_supported`: flash_attn importable, a CUDA device of compute
capability >= 8.0, fp16/bf16, page size a multiple of 256 (flash-attn 2's paged-KV rule), head_dim
<= 256 and a multiple of 8. The engine's default 16-token blocks therefore use the Triton kernel.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def _load_flash_attn() -> tuple[Callable | None, str]:
    """Import flash-attn on first use (optional dependency; a broken CUDA build raises non-ImportErrors)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return flash_attn_varlen_func, ""


def flash_attn_supported(dtype: torch.dtype, block_size: int, device: torch.device | str,
                         head_dim: int | None = None) -> tuple[bool, str]:
    """(ok, reason): whether `flash_attn_paged_attention` can serve this cache layout."""
    fn, error = _load_flash_attn()
    if fn is None:
        return False, f"flash_attn is not importable ({error})"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"flash-attn needs a CUDA device, got {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"flash-attn 2 needs sm80+, device is sm{major}{minor}"
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"flash-attn needs fp16/bf16, got {dtype}"
    if block_size % 256 != 0:
        return False, f"flash-attn paged KV needs a page size that is a multiple of 256, got {block_size}"
    if head_dim is not None and (head_dim > 256 or head_dim % 8 != 0):
        return False, f"flash-attn needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    return True, "ok"


def flash_attn_paged_attention(
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
) -> torch.Tensor:
    """Same contract as `paged_attention`, computed by flash-attn's paged varlen kernel."""
    ok, reason = flash_attn_supported(q.dtype, k_cache.shape[1], q.device, q.shape[-1])
    if not ok:
        raise RuntimeError(f"flash_attn_paged_attention: {reason}")
    # flash-attn takes K lengths as cumulative offsets, like query_start_loc.
    cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(seq_lens, dim=0, dtype=torch.int32, out=cu_seqlens_k[1:])
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    flash_attn_varlen_func = _load_flash_attn()[0]
    res = flash_attn_varlen_func(
        q, k_cache, v_cache,
        query_start_loc.to(torch.int32), cu_seqlens_k, max_query_len, max_seq_len,
        softmax_scale=scale, causal=True, window_size=window,
        block_table=block_tables.to(torch.int32),
    )
    if out is not None:
        out.copy_(res)
        return out
    return res


# The name the engine's attention layer imports.
paged_attention_flash = flash_attn_paged_attention
