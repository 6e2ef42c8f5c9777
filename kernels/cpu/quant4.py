"""Linear layers over GGUF's quantized blocks, kept packed and widened in registers (`csrc/quant4.cpp`).

The block types (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 of 32 weights along k; the K-quants Q4_K, Q5_K,
Q6_K of 256) and how the `gguf` package dequantizes them are in `gguf_blocks.py`; the packed
layout in `gguf_layout.py` and csrc/gguf_blocks.h (docs/gguf_blocks.md).

`pack_quantized(kind, rows)` takes a tensor's bytes as a uint8 matrix [N, K / block k * block bytes] (a
GGUF tensor's data, rows possibly reordered or concatenated: every row is independent) and
rearranges them once into the kernel's column blocks (linear.py's block width and gated
column order); `linear(x, packed)` computes
`x @ W^T (+ bias)` for float32 x with float32 sums. The weights are widened exactly as the `gguf`
package dequantizes them and multiplied in linear.py's order, so the output equals
`linear.linear(x, pack_weight(dequantize(rows)))` bit for bit, and the weight stays at about the
file's size in memory (Q4_1: 5 bits a weight; Q8_0: 8.5; Q4_K 4.62 against the file's 4.5: its
6-bit sub-block scales a byte each).

`dequantize(kind, rows)` is the torch reference: float32 [N, K]. `quantize(kind, weight)` makes
those rows from a float weight (round to nearest, one scale per block: the `gguf` package's
quantizer, llama.cpp's reference rounding), for checkpoints quantized at load.

`form="dot"` (`dot_products()`: builds with AVX-512 VNNI, or AVX2) packs for the kernel's integer
form instead, llama.cpp's arithmetic: each call quantizes x per row and 32-k group to int8
(scale max|x| / 127, round to nearest) and multiplies the blocks' integers exactly (vpdpbusd, or
vpmaddubsw + vpmaddwd), each group's sum scaled once (Q6_K: each 16 k's; Q4_1's and Q5_1's
minimum, and the K-quants' dmin m, times the group's float sum of x). A quarter of the float
form's multiply instructions; outputs differ from the dequantized model's by the activations'
rounding. `dot_reference` computes it in torch.

The call releases the GIL (ctypes) and runs on the OpenMP pool shared with torch. Callers check
`available()` first; functions raise ValueError on inputs they do not take.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import Entries, bind
from .gguf_blocks import (BLOCK_BYTES, BLOCK_K, KINDS, OFFSET, QK, Fields, check_rows, dequantize, group_scales, parse,
                          weights)
from .gguf_layout import by_column, records, unpack
from .linear import _column_order, _input, _output, _per_column

__all__ = ["BLOCK_BYTES", "BLOCK_K", "FORMS", "KINDS", "QUANTIZE_KINDS", "PackedQuantWeight", "available",
           "can_lookup", "dequantize", "dot_kinds", "dot_products", "dot_reference", "linear", "lookup_rows",
           "pack_quantized", "quantize"]

FORMS = ("float", "dot")
QUANTIZE_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # what `quantize` makes
_ARGS = struct.Struct("=9q")  # csrc/quant4.cpp: sf_q4_linear_*


@dataclass(frozen=True)
class _Kernels:
    lib: ctypes.CDLL
    fns: dict[tuple[str, str, bool], ctypes._CFuncPtr]  # (form, kind, gated); no "dot" ones without that form
    dot: int  # csrc: sf_q4_dot_products
    dot_kinds: tuple[str, ...]  # the kinds with the integer form in this build


def _lookup(lib: ctypes.CDLL) -> _Kernels:
    bind(lib, "sf_q4_block_width", ctypes.c_int)
    bind(lib, "sf_q4_record_bytes", ctypes.c_int64, ctypes.c_int)
    dot = int(bind(lib, "sf_q4_dot_products", ctypes.c_int)())
    mask = int(bind(lib, "sf_q4_dot_kinds", ctypes.c_int)())
    dot_kinds = tuple(kind for i, kind in enumerate(KINDS) if mask >> i & 1) if dot else ()
    fns = {("float", kind, gated): bind(lib, f"sf_q4_linear_{'silu_mul_' if gated else ''}{kind.lower()}",
                                        None, ctypes.c_char_p)
           for kind in KINDS for gated in (False, True)}
    fns.update({("dot", kind, gated): bind(lib, f"sf_q4_dot_{'silu_mul_' if gated else ''}{kind.lower()}",
                                           None, ctypes.c_char_p)
                for kind in dot_kinds for gated in (False, True)})
    return _Kernels(lib, fns, dot, dot_kinds)


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


def dot_kinds() -> tuple[str, ...]:
    """The block types the integer form takes in this build (empty where it is absent)."""
    kernels = _entries.get()
    return () if kernels is None else kernels.dot_kinds


def quantize(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] (K a multiple of 32) as `kind` blocks: the uint8 rows
    [N, K / 32 * block bytes] that `pack_quantized` and `dequantize` take."""
    from gguf import GGMLQuantizationType, quants

    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"unsupported block type {kind!r} (supported: {', '.join(QUANTIZE_KINDS)})")
    if weight.dim() != 2 or weight.shape[1] % QK:
        raise ValueError(f"quantize: a [N, K] weight with K a multiple of {QK}, got {tuple(weight.shape)}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return torch.from_numpy(quants.quantize(w, GGMLQuantizationType[kind]))


def lookup_rows(weight: "PackedQuantWeight", ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an ungated packed weight (either form, any kind), as float32 [len(ids), K]
    with the values `dequantize` gives them: the packed copy of a tied LM head serves the
    embedding's lookups, so the table is held once. Reads each row's bytes where the packing put
    them (`can_lookup` says which weights this takes)."""
    if not can_lookup(weight):
        raise ValueError(f"lookup_rows: an ungated weight, got a gated {weight.kind} one")
    ids = ids.reshape(-1).long()
    if weight.form == "float" or weight.kind != "Q8_0":
        nb = _entries.need().lib.sf_q4_block_width()
        like = parse(weight.kind, torch.zeros(1, BLOCK_BYTES[weight.kind], dtype=torch.uint8))
        return weights(unpack(weight.kind, weight.data, nb, ids, like, dot=weight.form == "dot"))
    nb = weight.data.shape[-1] // (2 + QK)  # a Q8_0 record: NB fp16 scales, then QK x NB int8
    blocks, groups = weight.data.shape[:2]
    block, lane = ids // nb, ids % nb
    d = weight.data[..., :2 * nb].view(torch.float16)[block, :, lane].float()  # [T, G]
    # per quad of k, NB lanes of 4 bytes (offset binary)
    q = weight.data[..., 2 * nb:].view(blocks, groups, QK // 4, nb, 4)[block, :, :, lane].to(torch.int16) - 128
    return (q.reshape(ids.numel(), groups, QK).float() * d.unsqueeze(-1)).reshape(ids.numel(), -1)


def can_lookup(weight: "PackedQuantWeight") -> bool:
    return not weight.gated


def dot_reference(x: torch.Tensor, kind: str, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The integer form's result in torch (float64 sums): x [M, K] quantized per row and 32-k
    group as the kernel quantizes it, times the blocks' integers, each group scaled."""
    f = parse(kind, rows)
    a, b = group_scales(f)  # float32, as the kernel forms them
    n, g = f.q.shape[0], f.q.shape[1] // QK
    xf = x.float().reshape(x.shape[0], -1, QK)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: torch computes scalar / tensor through a reciprocal (not correctly rounded)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).double()  # float32 products rounded half to even, as the kernel does
    scale = (amax / 127.0).double()
    halves = 2 if kind == "Q6_K" else 1  # Q6_K: a scale per 16 k
    qg = f.q.view(n, g, halves, QK // halves).double() - OFFSET.get(kind, 0)
    sums = torch.einsum("mghk,nghk->mngh", xq.view(x.shape[0], g, halves, -1), qg)  # exact integers
    out = (sums * a.double().view(1, n, g, halves) * scale.view(x.shape[0], 1, g, 1)).sum(-1)
    if b is not None:  # + m sum x (Q4_1, Q5_1), - dmin mn sum x (Q4_K, Q5_K)
        sign = 1.0 if kind in ("Q4_1", "Q5_1") else -1.0
        out = out + sign * b.double().unsqueeze(0) * xf.sum(-1).double().unsqueeze(1)
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


# Weights parsed and laid out at a time: the packing's temporaries (a few bytes a weight) stay near
# 64 MB whatever the tensor's size (a 128k-row LM head is 0.4-0.5 GB of blocks).
CHUNK_WEIGHTS = 1 << 23


def pack_quantized(kind: str, rows: torch.Tensor, bias: torch.Tensor | None = None, *,
                   gated: bool = False, form: str = "float", chunk_weights: int = CHUNK_WEIGHTS) -> PackedQuantWeight:
    """GGUF `kind` blocks `rows` [N, K / 32 * block bytes] rearranged for the kernel's `form`
    ("float" or "dot"); `bias` [N] kept as float32. `gated`: SwiGLU's gate_up weight (N = 2I,
    gate rows first). The output is allocated once and filled a few column blocks at a time (about
    `chunk_weights` weights; at least one block): only those blocks' rows are read from `rows`."""
    kernels = _entries.need()
    lib = kernels.lib
    if form not in FORMS:
        raise ValueError(f"pack_quantized: form must be one of {FORMS}, got {form!r}")
    if form == "dot" and not kernels.dot:
        raise RuntimeError("the integer form of the GGUF block kernel needs a build with AVX-512 VNNI or AVX2")
    if form == "dot" and kind not in kernels.dot_kinds:
        raise ValueError(f"pack_quantized: the integer form takes {', '.join(kernels.dot_kinds)}, got {kind}")
    check_rows(kind, rows)
    n, k = rows.shape[0], rows.shape[1] // BLOCK_BYTES[kind] * BLOCK_K[kind]
    if gated and n & 1:
        raise ValueError(f"pack_quantized: a gated weight needs an even number of rows (gate, up), got {n}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"pack_quantized: bias must be [{n}], got {tuple(bias.shape)}")
    nb = int(lib.sf_q4_block_width())
    order = _column_order(n, nb, gated)
    blocks = order.numel() // nb
    data = torch.empty(blocks, k // BLOCK_K[kind], lib.sf_q4_record_bytes(KINDS.index(kind)), dtype=torch.uint8)
    step = max(1, chunk_weights // max(1, nb * k))  # column blocks a chunk
    for b0 in range(0, blocks, step):
        part = order[b0 * nb:(b0 + step) * nb]
        valid = part >= 0
        local = torch.full_like(part, -1)  # the chunk's columns, numbered in its own rows
        local[valid] = torch.arange(int(valid.sum()))
        f = parse(kind, rows[part[valid]])
        if form == "float" or kind not in ("Q4_0", "Q4_1", "Q8_0"):
            chunk = records(f, local, nb, dot=form == "dot")
        else:
            chunk = _dot_records(f, local, nb)
        if chunk.shape[1:] != data.shape[1:]:
            raise AssertionError("quant4.cpp's record size differs from this packing")
        data[b0:b0 + chunk.shape[0]] = chunk
    return PackedQuantWeight(kind, data, n // 2 if gated else n, k, _per_column(bias, order), gated, form)


def _dot_records(f: Fields, order: torch.Tensor, nb: int) -> torch.Tensor:
    """The integer form's records [blocks, groups, bytes] of a 32-k block kind."""
    kind, (n, k), vw = f.kind, f.q.shape, nb // 4
    blocks, groups = order.numel() // nb, k // QK
    # [blocks, groups, NB] scales, then the quants as [blocks, groups, QK, NB] (k-major).
    scales = [by_column(s, order).view(blocks, nb, groups).transpose(1, 2).contiguous().view(torch.uint8)
              for s in (f.d, f.m) if s is not None]
    qb = by_column(f.q, order).view(blocks, nb, groups, QK).permute(0, 2, 3, 1)
    # [blocks, groups, quad, 4 k, NV, VW] -> per quad and vector, byte 4 i + e
    quads = qb.reshape(blocks, groups, QK // 4, 4, 4, vw).permute(0, 1, 2, 4, 5, 3)
    if kind == "Q8_0":  # offset binary: w + 128 as a byte
        quants = (quads.to(torch.int16) + 128).to(torch.uint8).reshape(blocks, groups, QK * nb)
    else:  # vectors 2c and 2c + 1 as one chunk's low and high nibbles
        pairs = quads.reshape(blocks, groups, QK // 4, 2, 2, 4 * vw)
        quants = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(blocks, groups, QK * nb // 2)
    return torch.cat([*(s.reshape(blocks, groups, -1) for s in scales), quants], dim=-1).contiguous()


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
