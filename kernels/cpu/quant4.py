"""Linear layers over GGUF's quantized blocks, kept packed and widened in registers (`csrc/quant4.cpp`).

A GGUF tensor of type Q4_0, Q4_1 or Q8_0 is, per output row, a run of blocks of 32 weights along
k (llama.cpp's formats):

    Q4_0: fp16 d, 16 bytes of 4-bit q (weight i in the low nibble of byte i, weight 16 + i in
          its high nibble)                                   w = d * (q - 8)     18 bytes
    Q4_1: fp16 d, fp16 m, the same 16 bytes                  w = d * q + m       20 bytes
    Q8_0: fp16 d, 32 int8 q                                  w = d * q           34 bytes

`pack_quantized(kind, rows)` takes those bytes as a uint8 matrix [N, K / 32 * block bytes] (a
GGUF tensor's data, rows possibly reordered or concatenated: every row is independent) and
rearranges them once into the kernel's column blocks (the layout is described in
csrc/quant4.cpp; linear.py's block width and gated column order); `linear(x, packed)` computes
`x @ W^T (+ bias)` for float32 x with float32 sums. The weights are widened exactly as the `gguf`
package dequantizes them and multiplied in linear.py's order, so the output equals
`linear.linear(x, pack_weight(dequantize(rows)))` bit for bit, and the weight stays at about the
file's size in memory (Q4_1: 5 bits a weight; Q8_0: 8.5).

`dequantize(kind, rows)` is the torch reference: float32 [N, K]. `quantize(kind, weight)` makes
those rows from a float weight (round to nearest, one scale per block: the `gguf` package's
quantizer, llama.cpp's reference rounding), for checkpoints quantized at load.

`form="dot"` (`dot_products()`: builds with AVX-512 VNNI, or AVX2) packs for the kernel's integer
form instead, llama.cpp's arithmetic: each call quantizes x per row and 32-k group to int8
(scale max|x| / 127, round to nearest) and multiplies the blocks' integers exactly (vpdpbusd, or
vpmaddubsw + vpmaddwd), each group's sum scaled once (Q4_1's minimum times the group's float sum
of x). A quarter of the float form's multiply instructions; outputs differ from the dequantized
model's by the activations' rounding. `dot_reference` computes it in torch.

The call releases the GIL (ctypes) and runs on the OpenMP pool shared with torch. Callers check
`available()` first; functions raise ValueError on inputs they do not take.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import Entries, bind
from .linear import _column_order, _input, _output, _per_column

__all__ = ["BLOCK_BYTES", "FORMS", "KINDS", "PackedQuantWeight", "available", "dequantize", "dot_products",
           "dot_reference", "linear", "lookup_rows", "can_lookup", "pack_quantized", "quantize"]

QK = 32  # weights per GGUF block
KINDS = ("Q4_0", "Q4_1", "Q8_0")  # csrc/quant4.cpp's Kind, in order
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
FORMS = ("float", "dot")
_ARGS = struct.Struct("=9q")  # csrc/quant4.cpp: sf_q4_linear_*


@dataclass(frozen=True)
class _Kernels:
    lib: ctypes.CDLL
    fns: dict[tuple[str, str, bool], ctypes._CFuncPtr]  # (form, kind, gated); no "dot" ones without that form
    dot: int  # csrc: sf_q4_dot_products


def _lookup(lib: ctypes.CDLL) -> _Kernels:
    bind(lib, "sf_q4_block_width", ctypes.c_int)
    bind(lib, "sf_q4_record_bytes", ctypes.c_int64, ctypes.c_int)
    dot = int(bind(lib, "sf_q4_dot_products", ctypes.c_int)())
    forms = (("float", "linear"), ("dot", "dot")) if dot else (("float", "linear"),)
    fns = {(form, kind, gated): bind(lib, f"sf_q4_{stem}_{'silu_mul_' if gated else ''}{kind.lower()}",
                                     None, ctypes.c_char_p)
           for form, stem in forms for kind in KINDS for gated in (False, True)}
    return _Kernels(lib, fns, dot)


_entries = Entries("quant4", _lookup)


def available() -> bool:
    """True when the kernel library is loaded and has these kernels (builds it on first call)."""
    return _entries.available()


_DOT_PRODUCTS = {0: "none", 1: "avx512_vnni", 2: "avx2_maddubs"}


def dot_products() -> str:
    """What the integer form multiplies with: avx512_vnni (vpdpbusd), avx2_maddubs (vpmaddubsw +
    vpmaddwd), or none (that form is absent: builds without AVX-512 VNNI or AVX2)."""
    kernels = _entries.get()
    return "none" if kernels is None else _DOT_PRODUCTS[kernels.dot]


def _fields(kind: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(d [N, G] fp16, m [N, G] fp16 or None, q [N, K]: uint8 0..15 for Q4, int8 for Q8_0)."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"unsupported block type {kind!r} (supported: {', '.join(KINDS)})")
    bb = BLOCK_BYTES[kind]
    if rows.dtype is not torch.uint8 or rows.dim() != 2 or rows.shape[1] % bb or not rows.is_cpu:
        raise ValueError(f"{kind} rows must be a uint8 CPU matrix of whole {bb}-byte blocks, got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    n = rows.shape[0]
    blocks = rows.contiguous().view(n, -1, bb)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    if kind == "Q8_0":
        return d, None, blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1) if kind == "Q4_1" else None
    qs = blocks[..., 4 if m is not None else 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # weight i low nibble, 16 + i high
    return d, m, q.reshape(n, -1)


def dequantize(kind: str, rows: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] in float32, as the `gguf` package computes them."""
    d, m, q = _fields(kind, rows)
    n = q.shape[0]
    d = d.float().unsqueeze(-1)
    qf = q.view(n, -1, QK).float()
    if kind == "Q4_0":
        w = d * (qf - 8)
    elif kind == "Q4_1":
        w = d * qf + m.float().unsqueeze(-1)
    else:
        w = qf * d
    return w.reshape(n, -1)


def quantize(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] (K a multiple of 32) as `kind` blocks: the uint8 rows
    [N, K / 32 * block bytes] that `pack_quantized` and `dequantize` take."""
    from gguf import GGMLQuantizationType, quants

    if kind not in BLOCK_BYTES:
        raise ValueError(f"unsupported block type {kind!r} (supported: {', '.join(KINDS)})")
    if weight.dim() != 2 or weight.shape[1] % QK:
        raise ValueError(f"quantize: a [N, K] weight with K a multiple of {QK}, got {tuple(weight.shape)}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return torch.from_numpy(quants.quantize(w, GGMLQuantizationType[kind]))


def lookup_rows(weight: "PackedQuantWeight", ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an ungated Q8_0 packed weight (either form), as float32 [len(ids), K] with the
    values `dequantize` gives them: the packed copy of a tied LM head serves the embedding's
    lookups, so the table is held once. Reads each row's bytes where the packing put them
    (`can_lookup` says which weights this takes)."""
    if not can_lookup(weight):
        raise ValueError(f"lookup_rows: an ungated Q8_0 weight, got {weight.kind} (gated {weight.gated})")
    nb = weight.data.shape[-1] // (2 + QK)  # a Q8_0 record: NB fp16 scales, then QK x NB int8
    blocks, groups = weight.data.shape[:2]
    ids = ids.reshape(-1).long()
    block, lane = ids // nb, ids % nb
    d = weight.data[..., :2 * nb].view(torch.float16)[block, :, lane].float()  # [T, G]
    quants = weight.data[..., 2 * nb:]
    if weight.form == "dot":  # per quad of k, NB lanes of 4 bytes (offset binary)
        q = quants.view(blocks, groups, QK // 4, nb, 4)[block, :, :, lane].to(torch.int16) - 128
    else:  # per k, NB int8
        q = quants.view(torch.int8).view(blocks, groups, QK, nb)[block, :, :, lane]
    return (q.reshape(ids.numel(), groups, QK).float() * d.unsqueeze(-1)).reshape(ids.numel(), -1)


def can_lookup(weight: "PackedQuantWeight") -> bool:
    return weight.kind == "Q8_0" and not weight.gated


def dot_reference(x: torch.Tensor, kind: str, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The integer form's result in torch (float64 sums): x [M, K] quantized per row and 32-k
    group as the kernel quantizes it, times the blocks' integers, each group scaled."""
    d, m, q = _fields(kind, rows)
    n, k = q.shape
    xf = x.float().reshape(x.shape[0], -1, QK)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: torch computes scalar / tensor through a reciprocal (not correctly rounded)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).double()  # float32 products rounded half to even, as the kernel does
    scale = (amax / 127.0).double()
    qg = q.view(n, -1, QK).double() - (8 if kind == "Q4_0" else 0)
    sums = torch.einsum("mgk,ngk->mng", xq, qg)  # exact integers
    out = (sums * d.double().unsqueeze(0) * scale.squeeze(-1).unsqueeze(1))
    if kind == "Q4_1":
        out = out + m.double().unsqueeze(0) * xf.sum(-1).double().unsqueeze(1)
    out = out.sum(-1)
    return (out if bias is None else out + bias.double()).float()


@dataclass(frozen=True)
class PackedQuantWeight:
    """Quantized blocks in the kernel's layout, with the bias as float32 in the packed column
    order (or None). `out_features` counts the product's columns: N, or I for a gated [2I, K]."""

    kind: str
    data: torch.Tensor  # uint8 [column blocks, K / 32, record bytes]
    out_features: int
    in_features: int
    bias: torch.Tensor | None
    gated: bool = False
    form: str = "float"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what the kernel takes and returns


def _by_column(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Per-row values `t` [N, ...] in the packed column order, zero in padding columns."""
    valid = order >= 0
    out = torch.zeros(order.numel(), *t.shape[1:], dtype=t.dtype)
    out[valid] = t[order[valid]]
    return out


def pack_quantized(kind: str, rows: torch.Tensor, bias: torch.Tensor | None = None, *,
                   gated: bool = False, form: str = "float") -> PackedQuantWeight:
    """GGUF `kind` blocks `rows` [N, K / 32 * block bytes] rearranged for the kernel's `form`
    ("float" or "dot"); `bias` [N] kept as float32. `gated`: SwiGLU's gate_up weight (N = 2I,
    gate rows first)."""
    kernels = _entries.need()
    lib = kernels.lib
    if form not in FORMS:
        raise ValueError(f"pack_quantized: form must be one of {FORMS}, got {form!r}")
    if form == "dot" and not kernels.dot:
        raise RuntimeError("the integer form of the GGUF block kernel needs a build with AVX-512 VNNI or AVX2")
    d, m, q = _fields(kind, rows)
    n, k = q.shape
    if gated and n & 1:
        raise ValueError(f"pack_quantized: a gated weight needs an even number of rows (gate, up), got {n}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"pack_quantized: bias must be [{n}], got {tuple(bias.shape)}")
    nb = int(lib.sf_q4_block_width())
    vw = nb // 4
    order = _column_order(n, nb, gated)
    blocks, groups = order.numel() // nb, k // QK
    # [blocks, groups, NB] scales, then the quants as [blocks, groups, QK, NB] (k-major).
    scales = [_by_column(s, order).view(blocks, nb, groups).transpose(1, 2).contiguous().view(torch.uint8)
              for s in (d, m) if s is not None]
    qb = _by_column(q, order).view(blocks, nb, groups, QK).permute(0, 2, 3, 1)
    if form == "dot":  # [blocks, groups, quad, 4 k, NV, VW] -> per quad and vector, byte 4 i + e
        quads = qb.reshape(blocks, groups, QK // 4, 4, 4, vw).permute(0, 1, 2, 4, 5, 3)
        if kind == "Q8_0":  # offset binary: w + 128 as a byte
            quants = (quads.to(torch.int16) + 128).to(torch.uint8).reshape(blocks, groups, QK * nb)
        else:  # vectors 2c and 2c + 1 as one chunk's low and high nibbles
            pairs = quads.reshape(blocks, groups, QK // 4, 2, 2, 4 * vw)
            quants = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(blocks, groups, QK * nb // 2)
    elif kind == "Q8_0":
        quants = qb.contiguous().view(torch.uint8).reshape(blocks, groups, QK * nb)
    else:  # chunk c of VW bytes: columns 2c*VW + i (low nibble) and (2c+1)*VW + i (high)
        pairs = qb.reshape(blocks, groups, QK, 2, 2, vw)
        quants = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(blocks, groups, QK * nb // 2)
    data = torch.cat([*(s.reshape(blocks, groups, -1) for s in scales), quants], dim=-1).contiguous()
    if data.shape[-1] != lib.sf_q4_record_bytes(KINDS.index(kind)):
        raise AssertionError("quant4.cpp's record size differs from this packing")
    return PackedQuantWeight(kind, data, n // 2 if gated else n, k, _per_column(bias, order), gated, form)


def linear(x: torch.Tensor, weight: PackedQuantWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 (CPU; rows may be strided, the last dim contiguous) times the packed
    weight: writes and returns `out` [M, out_features] (default a new tensor; a given one may
    have strided rows and must not overlap x)."""
    fn = _entries.need().fns[(weight.form, weight.kind, weight.gated)]
    m = _input("linear", x, torch.float32, weight.in_features)
    n, k = weight.out_features, weight.in_features
    out, so = _output("linear", out, m, n, torch.float32)
    bias = weight.bias
    fn(_ARGS.pack(x.data_ptr(), x.stride(0), weight.data.data_ptr(), n, k, 0 if bias is None else bias.data_ptr(),
                  out.data_ptr(), so, m))
    return out
