"""Linear layers on CPUs over weights packed once into column blocks (`csrc/linear.cpp`).

`pack_weight(w)` rearranges a [N, K] float32 or bfloat16 weight (plain torch, once at load) and
`linear(x, packed)` computes `x @ w^T (+ bias)` from it with float32 sums, in x's dtype: what
`splitfuse.kernels.reference.linear_reference` computes, up to the order of the sums (every
output is one sequential sum over k; bf16 products are summed in pairs, as vdpbf16ps does).

`pack_weight(w, gated=True)` takes SwiGLU's fused gate_up weight [2I, K] (gate rows, then up
rows); `linear` then returns silu(x @ gate^T) * (x @ up^T) [M, I], computed from the registers
holding the sums, with the numerics of the projection followed by `silu_and_mul` (each sum
rounded to x's dtype first): the [M, 2I] projection output is never written.

The packed layout, NB = `block_width()` columns per block (64 with AVX-512, 32 with AVX2):
  float32: [ceil(N / NB), K, NB]
  bfloat16: [ceil(N / NB), ceil(K / 2), NB, 2]  (pairs of consecutive k per column)
  int8:    [ceil(N / NB), ceil(K / 4), NB, 4]  (quads of consecutive k per column, vpdpbusd's
            operand order), with per-column weight sums, weight scales and bias in float32
Padding columns and the padding k of an odd K are zero. A gated weight's blocks hold NB / 2 gate
columns followed by the same NB / 2 up columns. The rearrangement is cheap and made by torch, so
the weight never needs a second, plain copy once packed.

`pack_int8_weight` / `linear_int8` (`has_int8()`: builds with AVX-512 VNNI, or AVX2, where the
products go through vpmaddubsw + vpmaddwd, or AVX-VNNI's 256-bit vpdpbusd when the compiler
targets it; `int8_products()` says which): symmetric int8 weights in [-127, 127] with
per-output-channel scales against uint8 activations (all 256 values) quantized per row around a
zero point (`elementwise.quantize_rows`); the int32 sums are exact on every path (the AVX2 one
multiplies |x - 128| by w * sign(x - 128), whose pair sums fit vpmaddubsw's int16), are
corrected for the zero point, scaled
(float(sum) * weight scale, then times the row scale, plus bias) and narrowed to the output
dtype in the same pass: what oneDNN's int8 GEMM followed by `elementwise.dequantize_rows`
computes. Gated weights work as above.

The call releases the GIL (ctypes) and runs on the OpenMP pool shared with torch. Results do
not depend on the thread count. Callers check `available()` first; functions raise ValueError
on inputs they do not take.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import Entries, bind

__all__ = ["PackedInt8Weight", "PackedWeight", "available", "block_width", "has_int8", "int8_products", "linear",
           "linear_int8", "native_bf16", "pack_int8_weight", "pack_weight"]

_DTYPES = (torch.float32, torch.bfloat16)
_ARGS = struct.Struct("=9q")  # csrc/linear.cpp: sf_lin_linear_*_packed
_I8_ARGS = struct.Struct("=13q")  # sf_lin_linear_i8_*_packed


@dataclass(frozen=True)
class _Kernels:
    lib: ctypes.CDLL
    fns: dict[tuple[torch.dtype, bool], ctypes._CFuncPtr]  # (dtype, gated)
    addend: ctypes._CFuncPtr  # any float form with a dense addend (csrc: sf_lin_linear_addend_packed)
    i8_fns: dict[tuple[torch.dtype, bool], ctypes._CFuncPtr]  # (output dtype, gated); empty without an int8 path


def _forms(lib: ctypes.CDLL, prefix: str) -> dict[tuple[torch.dtype, bool], ctypes._CFuncPtr]:
    """The (dtype, gated) entry points sf_lin_linear_{prefix}[silu_mul_]{f32,bf16}_packed."""
    return {(dtype, gated): bind(lib, f"sf_lin_linear_{prefix}{'silu_mul_' if gated else ''}{suffix}_packed",
                                 None, ctypes.c_char_p)
            for dtype, suffix in zip(_DTYPES, ("f32", "bf16")) for gated in (False, True)}


def _lookup(lib: ctypes.CDLL) -> _Kernels:
    for name in ("sf_lin_block_width", "sf_lin_native_bf16", "sf_lin_has_int8", "sf_lin_int8_products"):
        bind(lib, name, ctypes.c_int)
    addend = bind(lib, "sf_lin_linear_addend_packed", None, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                  ctypes.c_void_p, ctypes.c_int64)
    i8_fns = _forms(lib, "i8_")
    return _Kernels(lib, _forms(lib, ""), addend, i8_fns if lib.sf_lin_has_int8() else {})


_entries = Entries("linear", _lookup)


def available() -> bool:
    """True when the kernel library is loaded and has these kernels (builds it on first call)."""
    return _entries.available()


def block_width() -> int:
    """Output columns per packed block: four vectors of the library's width."""
    return int(_entries.need().lib.sf_lin_block_width())


def has_int8() -> bool:
    """Whether the int8 kernel runs here (a build with AVX-512 VNNI or AVX2)."""
    kernels = _entries.get()
    return kernels is not None and bool(kernels.i8_fns)


_INT8_PRODUCTS = {0: "none", 1: "avx512_vnni", 2: "avx_vnni", 3: "avx2_maddubs"}


def int8_products() -> str:
    """The instructions the int8 kernel multiplies with: avx512_vnni (vpdpbusd, 512-bit),
    avx_vnni (vpdpbusd, 256-bit), avx2_maddubs (vpmaddubsw + vpmaddwd), or none."""
    kernels = _entries.get()
    return "none" if kernels is None else _INT8_PRODUCTS[int(kernels.lib.sf_lin_int8_products())]


def native_bf16() -> bool:
    """Whether bf16 products run as AVX-512 BF16 dot products (else widened to float32)."""
    return bool(_entries.need().lib.sf_lin_native_bf16())


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernel's blocked layout, with its bias as float32 in the same column order,
    padded to the blocks (or None). `out_features` counts the product's columns: N, or I for a
    gated weight [2I, K]."""

    data: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None
    gated: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def _column_order(n: int, nb: int, gated: bool) -> torch.Tensor:
    """For each packed column, the weight row it holds (-1: padding)."""
    if not gated:
        blocks = -(-n // nb)
        order = torch.full((blocks * nb,), -1, dtype=torch.long)
        order[:n] = torch.arange(n)
        return order
    inter, half = n // 2, nb // 2
    blocks = -(-inter // half)
    cols = torch.arange(blocks * half).view(blocks, half)
    gate = torch.where(cols < inter, cols, -1)
    up = torch.where(cols < inter, cols + inter, -1)
    return torch.cat([gate, up], dim=1).reshape(-1)


def _check_rows(name: str, n: int, gated: bool, **per_row: torch.Tensor | None) -> None:
    if gated and n & 1:
        raise ValueError(f"{name}: a gated weight needs an even number of rows (gate, up), got {n}")
    for label, t in per_row.items():
        if t is not None and t.shape != (n,):
            raise ValueError(f"{name}: {label} must be [{n}], got {tuple(t.shape)}")


def _blocks(weight: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight in column blocks, the packed column order of `_column_order`): k grouped by
    4 bytes (bf16 pairs, int8 quads, single floats), K padded to whole groups with zeros:
    [blocks, ceil(K / G), NB, G], the last dim dropped for float32."""
    nb = block_width()
    n, k = weight.shape
    order = _column_order(n, nb, gated)
    valid = order >= 0
    group = 4 // weight.element_size()
    kg = -(-k // group)
    rows = torch.zeros(order.numel(), kg * group, dtype=weight.dtype)
    rows[valid, :k] = weight.detach()[order[valid]]
    data = rows.view(order.numel() // nb, nb, kg, group).permute(0, 2, 1, 3).contiguous()
    return (data.squeeze(3) if group == 1 else data), order


def _per_column(values: torch.Tensor | None, order: torch.Tensor) -> torch.Tensor | None:
    """Per-row `values` as float32 in the packed column order (0 in padding columns)."""
    if values is None:
        return None
    valid = order >= 0
    out = torch.zeros(order.numel(), dtype=torch.float32)
    out[valid] = values.detach().float()[order[valid]]
    return out


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False) -> PackedWeight:
    """`weight` [N, K] (float32 or bfloat16, CPU) rearranged into column blocks; `bias` [N] is
    kept as float32 (the kernel adds it to the float32 sums). `gated`: SwiGLU's gate_up weight
    (N = 2I, gate rows first)."""
    _entries.need()
    if weight.dtype not in _DTYPES or not weight.is_cpu or weight.dim() != 2:
        raise ValueError(f"pack_weight: weight must be a float32 or bfloat16 CPU matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    _check_rows("pack_weight", n, gated, bias=bias)
    data, order = _blocks(weight, gated)
    return PackedWeight(data, n // 2 if gated else n, k, _per_column(bias, order), gated)


def _input(name: str, x: torch.Tensor, dtype: torch.dtype, in_features: int) -> int:
    """x's row count, once x is checked: a `dtype` CPU matrix [M, in_features], last dim contiguous."""
    if x.dtype is not dtype or not x.is_cpu or x.dim() != 2:
        raise ValueError(f"{name}: x must be a {dtype} CPU matrix, got {x.dtype} {tuple(x.shape)} on {x.device}")
    m, k = x.shape
    if k != in_features:
        raise ValueError(f"{name}: x has {k} columns, the weight {in_features}")
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"{name}: x needs a contiguous last dimension (strides {x.stride()})")
    return m


def _output(name: str, out: torch.Tensor | None, m: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """`out` [m, n] of `dtype` and its row stride: a new contiguous tensor, or the given one checked."""
    if out is None:
        return torch.empty(m, n, dtype=dtype), n
    if out.dtype is not dtype or not out.is_cpu or out.shape != (m, n) or (out.stride(1) != 1 and n > 1):
        raise ValueError(f"{name}: out must be a {dtype} CPU [{m}, {n}] with a contiguous last dimension, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return out, out.stride(0)


def linear(x: torch.Tensor, weight: PackedWeight, *, out: torch.Tensor | None = None,
           addend: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (the weight's dtype, CPU; rows may be strided, the last dim contiguous) times the
    packed weight: writes and returns `out` [M, out_features] (default: a new contiguous tensor;
    a given one may have strided rows and must not overlap x). `addend` (x's dtype, [M, the
    unfused output's columns]: a gated weight's gate columns then its up columns; last dim
    contiguous) is added to the sums before they are stored, as `x @ W^T + b + addend` in x's
    dtype would round it, and for a gated weight before SwiGLU."""
    kernels = _entries.need()
    m = _input("linear", x, weight.dtype, weight.in_features)
    fn = kernels.fns[(x.dtype, weight.gated)]  # x.dtype is weight.dtype: float32 or bfloat16 (pack_weight)
    n, k = weight.out_features, weight.in_features
    out, so = _output("linear", out, m, n, x.dtype)
    bias = weight.bias
    args = _ARGS.pack(x.data_ptr(), x.stride(0), weight.data.data_ptr(), n, k, 0 if bias is None else bias.data_ptr(),
                      out.data_ptr(), so, m)
    if addend is None:
        fn(args)
        return out
    width = 2 * n if weight.gated else n
    if (addend.dtype is not x.dtype or addend.dim() != 2 or addend.shape != (m, width)
            or (addend.stride(1) != 1 and width > 1)):
        raise ValueError(f"linear: addend must be a {x.dtype} [{m}, {width}] with a contiguous last dimension, got "
                         f"{addend.dtype} {tuple(addend.shape)}")
    kernels.addend(args, int(x.dtype is torch.bfloat16), int(weight.gated), addend.data_ptr(), addend.stride(0))
    return out


@dataclass(frozen=True)
class PackedInt8Weight:
    """An int8 weight in the kernel's blocked layout with, in the packed column order, each
    column's weight sum (int32, for the activations' zero point), weight scale and bias (float32,
    or None). `out_features` as for PackedWeight."""

    data: torch.Tensor
    column_sums: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    gated: bool = False


def pack_int8_weight(weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                     gated: bool = False) -> PackedInt8Weight:
    """int8 `weight` [N, K] with float32 per-row `scales` [N] (w ~ weight * scale) and optional
    `bias` [N] rearranged into column blocks of quads of k. `gated` as for pack_weight."""
    if not has_int8():
        raise RuntimeError("the int8 linear kernel is unavailable here (needs a build with AVX-512 VNNI or AVX2)")
    if weight.dtype is not torch.int8 or not weight.is_cpu or weight.dim() != 2:
        raise ValueError(f"pack_int8_weight: weight must be an int8 CPU matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if weight.numel() and int(weight.min()) < -127:
        # The AVX2 path negates weights (vpsignb), which wraps at -128; symmetric quantization
        # (int8_linear.quantize_weight_per_channel) never produces it.
        raise ValueError("pack_int8_weight: weights must lie in [-127, 127] (symmetric int8), got -128")
    n, k = weight.shape
    _check_rows("pack_int8_weight", n, gated, scales=scales, bias=bias)
    data, order = _blocks(weight, gated)
    column_sums = data.sum(dim=(1, 3), dtype=torch.int32).reshape(-1)  # padding k and columns are 0
    return PackedInt8Weight(data, column_sums, _per_column(scales, order), _per_column(bias, order),
                            n // 2 if gated else n, k, gated)


def linear_int8(xq: torch.Tensor, xscales: torch.Tensor, zero_point: int, weight: PackedInt8Weight,
                dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 activations xq [M, K] (row stride free, last dim contiguous) around `zero_point`,
    with float32 row scales xscales ([M] or [M, 1], contiguous), times the packed int8 weight:
    writes and returns `out` [M, out_features] in `dtype` (float32 or bfloat16)."""
    kernels = _entries.get()
    fn = None if kernels is None else kernels.i8_fns.get((dtype, weight.gated))
    if fn is None:
        if not has_int8():
            raise RuntimeError("the int8 linear kernel is unavailable here (needs a build with AVX-512 VNNI or AVX2)")
        raise ValueError(f"linear_int8: output dtype must be float32 or bfloat16, got {dtype}")
    if xq.dtype is not torch.uint8 or not xq.is_cpu or xq.dim() != 2 or xq.shape[1] != weight.in_features:
        raise ValueError(f"linear_int8: xq must be a uint8 CPU matrix [M, {weight.in_features}], got {xq.dtype} "
                         f"{tuple(xq.shape)}")
    m, k = xq.shape
    if xq.stride(1) != 1 and k > 1:
        raise ValueError(f"linear_int8: xq needs a contiguous last dimension (strides {xq.stride()})")
    if xscales.dtype is not torch.float32 or xscales.numel() != m or not xscales.is_contiguous():
        raise ValueError(f"linear_int8: xscales must be {m} contiguous float32 values, got {xscales.dtype} "
                         f"{tuple(xscales.shape)}")
    n = weight.out_features
    out, so = _output("linear_int8", out, m, n, dtype)
    bias = weight.bias
    fn(_I8_ARGS.pack(xq.data_ptr(), xq.stride(0), xscales.data_ptr(), zero_point, weight.data.data_ptr(),
                     weight.column_sums.data_ptr(), weight.scales.data_ptr(), 0 if bias is None else bias.data_ptr(),
                     n, k, out.data_ptr(), so, m))
    return out
