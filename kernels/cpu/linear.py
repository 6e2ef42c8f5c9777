"""Linear layers on CPUs over weights packed once into column blocks (`csrc/linear.cpp`).

`pack_weight(w)` rearranges a [N, K] float32 or bfloat16 weight (plain torch, once at load) and
`linear(x, packed)` computes `x @ w^T (+ bias)` from it with float32 sums, in x's dtype: what
`splitfuse.kernels.reference.linear_reference` computes, up to the order of the sums (every
output is one sequential sum over k; bf16 products are summed in pairs, as vdpbf16ps does).

The packed layout, NB = `block_width()` columns per block (64 with AVX-512, 32 with AVX2):
  float32: [ceil(N / NB), K, NB]
  bfloat16: [ceil(N / NB), ceil(K / 2), NB, 2]  (pairs of consecutive k per column)
Padding columns and the padding k of an odd K are zero. The rearrangement is cheap and made by
torch, so the weight never needs a second, plain copy once packed.

The call releases the GIL (ctypes) and runs on the OpenMP pool shared with torch. Results do
not depend on the thread count. Callers check `available()` first; functions raise ValueError
on inputs they do not take.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import library

__all__ = ["PackedWeight", "available", "block_width", "linear", "native_bf16", "pack_weight"]

_DTYPES = (torch.float32, torch.bfloat16)
_ARGS = struct.Struct("=9q")  # csrc/linear.cpp: sf_lin_linear_*_packed

_fns: dict[torch.dtype, ctypes._CFuncPtr] = {}
_lib: ctypes.CDLL | None = None
_bound = False


def _bind() -> bool:
    global _lib, _bound
    if _bound:
        return _lib is not None
    lib = library()
    if lib is not None:
        try:
            fns = {torch.float32: lib.sf_lin_linear_f32_packed, torch.bfloat16: lib.sf_lin_linear_bf16_packed}
            for f in (lib.sf_lin_block_width, lib.sf_lin_native_bf16):
                f.argtypes, f.restype = [], ctypes.c_int
        except AttributeError:  # a library built without linear.cpp
            lib = None
    if lib is not None:
        for f in fns.values():
            f.argtypes, f.restype = [ctypes.c_char_p], None
        _fns.update(fns)
    _lib = lib
    _bound = True
    return lib is not None


def available() -> bool:
    """True when the kernel library is loaded and has these kernels (builds it on first call)."""
    return _bind()


def _need() -> None:
    if not _bind():
        raise RuntimeError("splitfuse C++ CPU linear kernels are unavailable; check available() first")


def block_width() -> int:
    """Output columns per packed block: four vectors of the library's width."""
    _need()
    return int(_lib.sf_lin_block_width())


def native_bf16() -> bool:
    """Whether bf16 products run as AVX-512 BF16 dot products (else widened to float32)."""
    _need()
    return bool(_lib.sf_lin_native_bf16())


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight in the kernel's blocked layout, with its bias as float32 padded to the
    blocks (or None)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """`weight` [N, K] (float32 or bfloat16, CPU) rearranged into column blocks; `bias` [N] is
    kept as float32 (the kernel adds it to the float32 sums)."""
    _need()
    if weight.dtype not in _DTYPES or not weight.is_cpu or weight.dim() != 2:
        raise ValueError(f"pack_weight: weight must be a float32 or bfloat16 CPU matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    nb = block_width()
    blocks = -(-n // nb)
    w = weight.detach()
    if weight.dtype is torch.bfloat16:
        kp = k + (k & 1)
        padded = torch.zeros(blocks * nb, kp, dtype=w.dtype)
        padded[:n, :k] = w
        data = padded.view(blocks, nb, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    else:
        padded = torch.zeros(blocks * nb, k, dtype=w.dtype)
        padded[:n] = w
        data = padded.view(blocks, nb, k).permute(0, 2, 1).contiguous()
    b = None
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"pack_weight: bias must be [{n}], got {tuple(bias.shape)}")
        b = torch.zeros(blocks * nb, dtype=torch.float32)
        b[:n] = bias.detach().float()
    return PackedWeight(data, n, k, b)


def linear(x: torch.Tensor, weight: PackedWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (the weight's dtype, CPU; rows may be strided, the last dim contiguous) times the
    packed weight: writes and returns `out` [M, N] (default: a new contiguous tensor; a given one
    may have strided rows and must not overlap x)."""
    fn = _fns.get(x.dtype) if _bound else None
    if fn is None:
        _need()
        fn = _fns.get(x.dtype)
    if fn is None or x.dtype is not weight.dtype or not x.is_cpu or x.dim() != 2:
        raise ValueError(f"linear: x must be a {weight.dtype} CPU matrix, got {x.dtype} {tuple(x.shape)} on {x.device}")
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"linear: x has {k} columns, the weight {weight.in_features}")
    sx = x.stride(0)
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"linear: x needs a contiguous last dimension (strides {x.stride()})")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
        so = n
    else:
        if out.dtype is not x.dtype or not out.is_cpu or out.shape != (m, n) or (out.stride(1) != 1 and n > 1):
            raise ValueError(f"linear: out must be a {x.dtype} CPU [{m}, {n}] with a contiguous last dimension, "
                             f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
        so = out.stride(0)
    bias = weight.bias
    fn(_ARGS.pack(x.data_ptr(), sx, weight.data.data_ptr(), n, k, 0 if bias is None else bias.data_ptr(),
                  out.data_ptr(), so, m))
    return out
