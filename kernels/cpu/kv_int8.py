"""The int8 KV cache's format (csrc/kv_int8.h), in torch: the reference quantization and layout
conversions for tests and tools. The kernels (`paged_attention.write_kv_cache` quantizes,
`paged_attention.paged_attention` reads) never call these.

Each (block, kv head) tile holds block_size * head_dim int8 codes in the float tiles' layout (K
transposed [head_dim, block_size], V row-major [block_size, head_dim]) and then block_size
float32 scales, one per token: value = code * scale, scale = max |x| / 127 over the token's
head_dim values, code = round-half-even(x / scale), 0 for an all-zero row. Why per token and not
per block: docs/architecture.md, "int8 KV cache".
"""

from __future__ import annotations

import torch

__all__ = ["SCALE_BYTES", "bytes_per_token", "dequantize", "from_reference_layout", "quantize",
           "to_reference_layout"]

SCALE_BYTES = 4  # one float32 scale per token and kv head, for K and for V


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Cache bytes one token takes over all layers: K and V codes plus their scales."""
    return 2 * num_layers * num_kv_heads * (head_dim + SCALE_BYTES)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (float32 or bfloat16) -> (int8 codes [..., D], float32 scales [...]), rounded as
    the kernel's write rounds them (float32 division, then half to even)."""
    x = x.float()
    scale = x.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale[..., None] > 0, (x / safe[..., None]).round(), torch.zeros_like(x))
    return codes.clamp(-127, 127).to(torch.int8), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales[..., None]


def from_reference_layout(k_ref: torch.Tensor, v_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float caches in the reference layout [num_blocks, block_size, Hkv, D] quantized into the
    kernel's int8 caches [num_blocks, Hkv, block_size * (D + 4)] (K transposed)."""
    return _pack(*quantize(k_ref), transpose=True), _pack(*quantize(v_ref), transpose=False)


def _pack(codes: torch.Tensor, scales: torch.Tensor, transpose: bool) -> torch.Tensor:
    nb, bs, hkv, d = codes.shape
    tiles = codes.permute(0, 2, 3, 1) if transpose else codes.permute(0, 2, 1, 3)  # [nb, hkv, ., .]
    scale_bytes = scales.permute(0, 2, 1).contiguous().view(torch.int8)  # [nb, hkv, bs * 4]
    return torch.cat([tiles.reshape(nb, hkv, bs * d), scale_bytes], dim=2).contiguous()


def to_reference_layout(k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 caches -> their values (code * scale) as float32 in the reference layout
    [num_blocks, block_size, Hkv, D]."""
    return _unpack(k_cache, block_size, transpose=True), _unpack(v_cache, block_size, transpose=False)


def _unpack(cache: torch.Tensor, block_size: int, transpose: bool) -> torch.Tensor:
    nb, hkv, n = cache.shape
    d = n // block_size - SCALE_BYTES
    codes = cache[:, :, :block_size * d]
    scales = cache[:, :, block_size * d:].contiguous().view(torch.float32)  # [nb, hkv, bs]
    if transpose:
        codes = codes.reshape(nb, hkv, d, block_size).permute(0, 3, 1, 2)
    else:
        codes = codes.reshape(nb, hkv, block_size, d).permute(0, 2, 1, 3)
    return dequantize(codes, scales.permute(0, 2, 1)).contiguous()
