"""Plain quantizers for GGUF's Q4_K and Q6_K blocks (the `gguf` package dequantizes them but has
no quantizer): one pass of min/max scaling per sub-block, not llama.cpp's search, for the test
GGUF files that need real-valued K-quant tensors. `quantize(data, kind)` takes what
`gguf.quants.quantize` takes and falls through to it for every other type."""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256
_gguf_quantize = gguf.quants.quantize


def _fp16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape[:-1], 2)


def q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) as Q4_K rows [N, K / 256 * 144] uint8."""
    n = w.shape[0]
    b = w.reshape(n, -1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(b.min(-1), 0), b.max(-1)
    scale, mins = (hi - lo) / 15, -lo  # per sub-block: w ~ scale q - mins
    d = np.maximum(scale.max(-1, keepdims=True), 1e-12) / 63
    dmin = np.maximum(mins.max(-1, keepdims=True), 1e-12) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / dmin), 0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.rint((b + offset) / step), 0, 15).astype(np.uint8)  # [N, R, 8, 32]
    packed = np.empty((n, b.shape[1], 12), dtype=np.uint8)  # the 6-bit pairs' byte layout
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, -1, 128)  # sub-blocks 2j, 2j + 1 per 32 bytes
    out = np.concatenate([_fp16(d), _fp16(dmin), packed, qs], axis=-1)
    return out.reshape(n, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) as Q6_K rows [N, K / 256 * 210] uint8."""
    n = w.shape[0]
    b = w.reshape(n, -1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31  # per 16: q in -32..31
    d = np.maximum(np.abs(scale).max(-1, keepdims=True), 1e-12) / 127
    d = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d), 1, 127).astype(np.int8)
    q = (np.clip(np.rint(b / (d * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, -1, 2, 128)
    low, high = q & 15, q >> 4  # per half of 128: weights i and 64 + i share a byte of ql
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(n, -1, 128)
    h = high.reshape(n, -1, 2, 4, 32)  # weight 32 s + i: bits 2 s of qh byte i
    qh = (h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)).reshape(n, -1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)], axis=-1)
    return out.reshape(n, -1)


def quantize(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    if kind == gguf.GGMLQuantizationType.Q4_K:
        return q4_k(data.reshape(-1, data.shape[-1])).reshape(*data.shape[:-1], -1)
    if kind == gguf.GGMLQuantizationType.Q6_K:
        return q6_k(data.reshape(-1, data.shape[-1])).reshape(*data.shape[:-1], -1)
    return _gguf_quantize(data, kind)
