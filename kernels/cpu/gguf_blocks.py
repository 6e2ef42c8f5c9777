"""GGUF's block formats read into their integer fields, and the weights as the `gguf` package
dequantizes them (the torch reference of the packed kernels, `quant4.py`).

Per output row, a GGUF tensor is a run of blocks along k (llama.cpp's formats):

    Q4_0  32 k, 18 bytes: fp16 d, 16 bytes of 4-bit q             w = d (q - 8)
    Q4_1  32 k, 20 bytes: fp16 d, fp16 m, the same 16 bytes         w = fl(d q) + m
    Q8_0  32 k, 34 bytes: fp16 d, 32 int8 q                         w = d q
    Q5_0  32 k, 22 bytes: fp16 d, 4 bytes of 5th bits, 16 bytes     w = d (q - 16)
    Q5_1  32 k, 24 bytes: fp16 d, fp16 m, 4 + 16 bytes              w = fl(d q) + m
    Q4_K  256 k, 144 bytes: fp16 d, dmin, 12 bytes of 6-bit sub-block (32 k) scales sc and
          minimums mn, 128 bytes of 4-bit q                         w = fl(fl(d sc) q) - fl(dmin mn)
    Q5_K  256 k, 176 bytes: as Q4_K with 32 bytes of 5th bits       the same
    Q6_K  256 k, 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 sub-block
          (16 k) scales, fp16 d                                     w = fl(d sc) (q - 32)

(fl: float32 rounding, where numpy rounds). `parse` reads a kind's uint8 rows into `Fields`,
`weights` forms the float32 weights from them, `dequantize` is the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK_BYTES", "BLOCK_K", "FP16_FIELDS", "Fields", "HIGH_BITS", "KINDS", "OFFSET", "QK", "check_rows",
           "dequantize", "group_scales", "parse", "weights"]

QK = 32  # k per group (the kernels' unit)
KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # csrc/gguf_blocks.h's Kind, in order
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_K = {kind: 256 if kind.endswith("_K") else QK for kind in KINDS}
HIGH_BITS = {"Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}  # bits of q above the low nibble
OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # subtracted from q
# Byte offsets of each block's fp16 fields (d; m or dmin)
FP16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class Fields:
    """A kind's rows [N, blocks of BLOCK_K] as integers: q [N, K] (uint8; int8 for Q8_0), d [N, R]
    fp16, m [N, R] fp16 (Q4_1, Q5_1: the minimum; K-quants: dmin) or None, and the K-quants'
    sub-block scales sc and minimums mn [N, R, S] (uint8; Q6_K's sc int8, no mn) or None."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., P, L]: each byte's low nibbles (L weights), then its high ones, per P."""
    return torch.stack([qs & 15, qs >> 4], dim=-2)


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [..., L] split into 8 / width fields of `width` bits: [..., 8 / width, L], low first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).view(-1, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [..., 12] as 8 six-bit scales and 8 minimums."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def check_rows(kind: str, rows: torch.Tensor) -> None:
    """Raise ValueError unless `rows` is a uint8 CPU matrix of whole `kind` blocks."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"unsupported block type {kind!r} (supported: {', '.join(KINDS)})")
    bb = BLOCK_BYTES[kind]
    if rows.dtype is not torch.uint8 or rows.dim() != 2 or rows.shape[1] % bb or not rows.is_cpu:
        raise ValueError(f"{kind} rows must be a uint8 CPU matrix of whole {bb}-byte blocks, got {rows.dtype} "
                         f"{tuple(rows.shape)}")


def parse(kind: str, rows: torch.Tensor) -> Fields:
    """`rows` [N, K / BLOCK_K * BLOCK_BYTES] uint8 (CPU) read into `kind`'s fields."""
    check_rows(kind, rows)
    bb = BLOCK_BYTES[kind]
    n = rows.shape[0]
    b = rows.contiguous().view(n, -1, bb)
    if kind == "Q8_0":
        return Fields(kind, b[..., 2:].contiguous().view(torch.int8).reshape(n, -1), _f16(b[..., :2]))
    if kind in ("Q4_0", "Q4_1"):
        m = _f16(b[..., 2:4]) if kind == "Q4_1" else None
        return Fields(kind, _nibbles(b[..., 4 if m is not None else 2:]).reshape(n, -1), _f16(b[..., :2]), m)
    if kind in ("Q5_0", "Q5_1"):
        o = 4 if kind == "Q5_1" else 2
        high = _bits(b[..., o:o + 4], 1).transpose(-1, -2)  # bit i of the little-endian word: weight i
        q = _nibbles(b[..., o + 4:]).reshape(n, -1, QK) | (high.reshape(n, -1, QK) << 4)
        return Fields(kind, q.reshape(n, -1), _f16(b[..., :2]), _f16(b[..., 2:4]) if o == 4 else None)
    if kind == "Q6_K":
        low = _nibbles(b[..., :128].reshape(n, -1, 2, 64))  # [N, R, half, nibble, 64]
        high = _bits(b[..., 128:192].reshape(n, -1, 2, 32), 2)  # [N, R, half, 4, 32]
        q = low.reshape(n, -1, 256) | (high.reshape(n, -1, 256) << 4)
        return Fields(kind, q.reshape(n, -1), _f16(b[..., 208:210]), sc=b[..., 192:208].contiguous().view(torch.int8))
    sc, mn = _k_scales(b[..., 4:16])  # Q4_K, Q5_K
    low = _nibbles(b[..., -128:].reshape(n, -1, 4, 32))  # [N, R, 64 k, nibble, 32]
    q = low.reshape(n, -1, 8, 32)
    if kind == "Q5_K":
        q = q | (_bits(b[..., 16:48], 1) << 4)  # bit s of byte i: sub-block s, weight i
    return Fields(kind, q.reshape(n, -1), _f16(b[..., :2]), _f16(b[..., 2:4]), sc, mn)


def group_scales(f: Fields) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per 32-k group the float32 a and b that its weights are formed from (a [N, G], Q6_K's
    [N, G, 2] per 16 k; b [N, G] or None): w = a (q - OFFSET), fl(a q) + b (Q4_1, Q5_1) or
    fl(a q) - b (Q4_K, Q5_K)."""
    n, g = f.q.shape[0], f.q.shape[1] // QK
    d = f.d.float().unsqueeze(-1)
    if f.sc is None:
        return d.reshape(n, g), None if f.m is None else f.m.float().reshape(n, g)
    a = (d * f.sc.float()).reshape(n, g, -1)  # Q6_K: two 16-k scales per group
    if f.kind == "Q6_K":
        return a, None
    return a.reshape(n, g), (f.m.float().unsqueeze(-1) * f.mn.float()).reshape(n, g)


def weights(f: Fields) -> torch.Tensor:
    """The float32 weights [N, K], rounded as the `gguf` package rounds them."""
    n = f.q.shape[0]
    a, b = group_scales(f)
    if f.kind == "Q6_K":
        q = f.q.view(n, -1, 2, 16).float() - 32
        return (a.unsqueeze(-1) * q).reshape(n, -1)
    q = f.q.view(n, -1, QK).float()
    a = a.unsqueeze(-1)
    if f.kind == "Q8_0":
        w = q * a
    elif b is None:
        w = a * (q - OFFSET[f.kind])
    elif f.kind in ("Q4_1", "Q5_1"):
        w = a * q + b.unsqueeze(-1)
    else:
        w = a * q - b.unsqueeze(-1)
    return w.reshape(n, -1)


def dequantize(kind: str, rows: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] in float32, as the `gguf` package computes them."""
    return weights(parse(kind, rows))
