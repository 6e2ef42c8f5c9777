"""Fused elementwise C++ CPU kernels: RMSNorm (+ residual add), rotary, SwiGLU gate, per-row int8
quantization of activations and the int8 GEMM's dequantization (float32 or bfloat16).

Thin ctypes wrappers over `csrc/elementwise.cpp` in the shared CPU kernel library (`build.py`).
They compute what the torch references in `splitfuse.kernels.reference` compute (HF Llama
numerics): the residual sum x + residual and the rotary outputs are bit-identical to torch;
rms_norm differs by ~2 ulp (its sum of squares runs in another order than torch's mean);
silu_and_mul by ~2 ulp (a vectorised exp within ~1 ulp); quantize_rows and dequantize_rows are
bit-identical. In
bfloat16 the arithmetic is fp32, rounded to bf16 where torch's bf16 ops round (the residual sum
and the rotary outputs are bit-identical to torch's; rms_norm and silu_and_mul within 2 bf16
ulps, where an fp32 difference of a few ulps crosses a rounding boundary, rarely). Each function says which tensors it
writes; in-place and `out=` forms avoid allocations. Callers check `available()` first; the
functions raise ValueError on inputs they do not take (dtype, device, shape, stride) and never
fall back themselves.

CPU tensors, all of one call in the dtype of its first (the rotary tables stay float32). The calls release the GIL (ctypes) and run on the OpenMP pool shared
with torch (`torch.set_num_threads` applies) once a call has enough work
(`set_parallel_threshold`); smaller calls stay on the calling thread. Results do not depend on
the thread count (rows are independent).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import Entries, bind, vector_width

__all__ = ["apply_rotary", "available", "dequantize_rows", "get_parallel_threshold", "quantize_rows", "rms_norm",
           "set_parallel_threshold", "silu_and_mul", "vector_width"]

_F32 = torch.float32
_BF16 = torch.bfloat16
_I64 = torch.int64

# Arguments travel packed (struct.pack -> bytes -> const int64_t*) to the *_packed entry points:
# ctypes converts each argument of a call separately, which costs more than the kernels
# themselves at decode sizes; one bytes object costs a fraction. bytes are immutable and made
# per call, so concurrent calls from several threads are safe.
_RMS_ARGS = struct.Struct("=11qd")
_ROT_ARGS = struct.Struct("=22q")
_SILU_ARGS = struct.Struct("=6q")
_QUANT_ARGS = struct.Struct("=8q")
_DEQUANT_ARGS = struct.Struct("=8q")


@dataclass(frozen=True)
class _Kernels:
    lib: ctypes.CDLL
    f32: dict[str, ctypes._CFuncPtr]  # rms / rot / silu / quant / dequant for float32 tensors
    bf16: dict[str, ctypes._CFuncPtr]  # the same for bfloat16 tensors

    def fn(self, dtype: torch.dtype, key: str) -> ctypes._CFuncPtr:
        return (self.f32 if dtype is _F32 else self.bf16)[key]


_F32_NAMES = {"rms": "sf_ew_rms_norm_f32_packed", "rot": "sf_ew_rotary_f32_packed",
              "silu": "sf_ew_silu_and_mul_f32_packed", "quant": "sf_ew_quantize_rows_u8_packed",
              "dequant": "sf_ew_dequantize_rows_f32_packed"}
_BF16_NAMES = {"rms": "sf_ew_rms_norm_bf16_packed", "rot": "sf_ew_rotary_bf16_packed",
               "silu": "sf_ew_silu_and_mul_bf16_packed", "quant": "sf_ew_quantize_rows_u8_bf16_packed",
               "dequant": "sf_ew_dequantize_rows_bf16_packed"}


def _lookup(lib: ctypes.CDLL) -> _Kernels:
    f32, bf16 = ({key: bind(lib, name, ctypes.c_int64 if key == "rot" else None, ctypes.c_char_p)
                  for key, name in names.items()} for names in (_F32_NAMES, _BF16_NAMES))
    bind(lib, "sf_ew_set_parallel_threshold", None, ctypes.c_int64)
    bind(lib, "sf_ew_get_parallel_threshold", ctypes.c_int64)
    return _Kernels(lib, f32, bf16)


_entries = Entries("elementwise", _lookup)


def available() -> bool:
    """True when the kernel library is loaded and has these kernels (builds it on first call)."""
    return _entries.available()


def set_parallel_threshold(elements: int) -> None:
    """Calls with rows * row_length * op_cost >= `elements` split their rows (silu_and_mul: rows
    and column chunks) over the OpenMP pool; op_cost is 1 for rms_norm (row_length H) and rotary
    ((Hq+Hk)*D), 4 for silu_and_mul (row_length I). 0: always; a huge value: never.
    Process-wide; default 16384."""
    _entries.need().lib.sf_ew_set_parallel_threshold(int(elements))


def get_parallel_threshold() -> int:
    return int(_entries.need().lib.sf_ew_get_parallel_threshold())


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"{name}: {what}")


def _dtype(name: str, t: torch.Tensor) -> torch.dtype:
    """The call's dtype: its first tensor's, float32 or bfloat16."""
    if t.dtype not in (_F32, _BF16) or not t.is_cpu:
        raise _bad(name, f"tensors must be float32 or bfloat16 on the CPU, got {t.dtype} on {t.device}")
    return t.dtype


def _rows(name: str, label: str, t: torch.Tensor, shape: torch.Size | tuple[int, ...] | None,
          dtype: torch.dtype = _F32) -> tuple[int, int]:
    """(data_ptr, row stride) of `t` seen as [rows, last dim], without a copy. `t` must be a
    CPU tensor of `dtype` (and of `shape`, unless None) whose rows are evenly strided with a
    contiguous last dim."""
    if t.dtype is not dtype or not t.is_cpu:
        raise _bad(name, f"{label} must be a {str(dtype).removeprefix('torch.')} CPU tensor, got {t.dtype} on {t.device}")
    if shape is not None and t.shape != shape:
        raise _bad(name, f"{label} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    st = t.stride()
    if len(st) == 2:
        if st[1] != 1 and t.shape[1] > 1:
            raise _bad(name, f"{label} needs a contiguous last dimension (strides {st})")
        return t.data_ptr(), st[0]
    shape = t.shape
    if len(st) == 1:
        if st[0] != 1 and shape[0] > 1:
            raise _bad(name, f"{label} needs a contiguous last dimension (strides {st})")
        return t.data_ptr(), shape[0]
    try:
        v = t.view(-1, shape[-1])
    except RuntimeError:
        v = None
    if v is None or (v.stride(1) != 1 and shape[-1] > 1):
        raise _bad(name, f"{label} {tuple(shape)} (strides {st}) cannot be viewed as rows with a contiguous "
                   "last dimension")
    return v.data_ptr(), v.stride(0)


def _output(label: str, t: torch.Tensor | None, shape: torch.Size, inputs: list[tuple[torch.Tensor, tuple[int, int]]],
            dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, int]]:
    """An rms_norm output and its (pointer, row stride): a new tensor when None, an input's
    already checked rows when it is one of `inputs` (in place), else checked like an input."""
    if t is None:
        t = torch.empty(shape, dtype=dtype)
        return t, (t.data_ptr(), shape[-1])
    for tensor, rows in inputs:
        if t is tensor:
            return t, rows
    return t, _rows("rms_norm", label, t, shape, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm over the last dim of x [..., H] with weight [H] (all float32, or all
    bfloat16, CPU).

    Without `residual`: writes and returns `out` = weight * normed(x).
    With `residual` (shape of x): writes `residual_out` = x + residual, then
    `out` = weight * normed(x + residual), and returns `(out, residual_out)`.
    `out` / `residual_out` default to new contiguous tensors. In place is allowed: `out` may be
    `x` (or `residual`), `residual_out` may be `residual` (or `x`); the zero-allocation form is
    `rms_norm(x, w, eps, residual, out=x, residual_out=residual)` (x then holds the normed
    output, residual the new residual stream). `out` and `residual_out` must be different tensors;
    other (partial) overlaps between inputs and outputs are not checked and give undefined
    results. Rows may be strided (e.g. slices); the last dim must be contiguous.
    """
    kernels = _entries.need()
    dtype = _dtype("rms_norm", x)
    fn = kernels.fn(dtype, "rms")
    shape = x.shape
    if not shape or shape[-1] == 0:
        raise _bad("rms_norm", f"x must be [..., H] with H > 0, got {tuple(shape)}")
    h = shape[-1]
    px, sx = _rows("rms_norm", "x", x, None, dtype)
    rows = shape[0] if len(shape) == 2 else x.numel() // h
    if weight.dtype is not dtype or not weight.is_cpu or weight.shape != (h,) or weight.stride(0) != 1:
        raise _bad("rms_norm", f"weight must be a contiguous {str(dtype).removeprefix('torch.')} CPU tensor [{h}], "
                   f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    inputs = [(x, (px, sx))]
    if residual is not None:
        pr, sr = _rows("rms_norm", "residual", residual, shape, dtype)
        inputs.append((residual, (pr, sr)))
    out, (po, so) = _output("out", out, shape, inputs, dtype)
    if residual is None:
        if residual_out is not None:
            raise _bad("rms_norm", "residual_out given without residual")
        fn(_RMS_ARGS.pack(px, sx, 0, 0, weight.data_ptr(), po, so, 0, 0, rows, h, eps))
        return out
    given = residual_out is not None
    residual_out, (pro, sro) = _output("residual_out", residual_out, shape, inputs, dtype)
    if given and pro == po:
        raise _bad("rms_norm", "out and residual_out must be different tensors")
    fn(_RMS_ARGS.pack(px, sx, pr, sr, weight.data_ptr(), po, so, pro, sro, rows, h, eps))
    return out, residual_out


def _heads(name: str, label: str, t: torch.Tensor, tokens: int, heads: int | None, d: int,
           dtype: torch.dtype) -> tuple[int, int, int]:
    """(data_ptr, token stride, head stride) of a CPU [tokens, heads, d] tensor of `dtype`."""
    if t.dtype is not dtype or not t.is_cpu:
        raise _bad(name, f"{label} must be a {str(dtype).removeprefix('torch.')} CPU tensor, got {t.dtype} on {t.device}")
    shape = t.shape
    if len(shape) != 3 or shape[0] != tokens or shape[2] != d or (heads is not None and shape[1] != heads):
        want = f"[{tokens}, {'heads' if heads is None else heads}, {d}]"
        raise _bad(name, f"{label} must be {want}, got {tuple(shape)}")
    st = t.stride()
    if st[2] != 1:
        raise _bad(name, f"{label} needs a contiguous last (head_dim) dimension, strides {st}")
    return t.data_ptr(), st[0], st[1]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 *, inplace: bool = False, q_out: torch.Tensor | None = None,
                 k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF rotate-half rotary embedding of q [T, Hq, D] and k [T, Hk, D] at positions [T] (int64),
    with float32 cos/sin tables [max_pos, D/2] (q and k float32, or both bfloat16; CPU); returns
    the rotated (q, k).

    q and k may be strided views (any token and head strides, e.g. slices of a fused qkv
    projection output); only the last dim must be contiguous. Written tensors:
    `inplace=True`: q and k themselves (and returned). Otherwise `q_out` / `k_out` (default: new
    contiguous tensors; given ones may be strided the same way), which must not overlap q or k.
    A position outside [0, max_pos) raises ValueError before anything is written.
    """
    kernels = _entries.need()
    dtype = _dtype("apply_rotary", q)
    fn = kernels.fn(dtype, "rot")
    qs = q.shape
    if len(qs) != 3:
        raise _bad("apply_rotary", f"q must be [T, Hq, D], got {tuple(qs)}")
    tokens, hq, d = qs
    half = d >> 1
    if d & 1:
        raise _bad("apply_rotary", f"head_dim {d} must be even")
    pq, sqt, sqh = _heads("apply_rotary", "q", q, tokens, None, d, dtype)
    pk, skt, skh = _heads("apply_rotary", "k", k, tokens, None, d, dtype)
    hk = k.shape[1]
    cs, ss = cos.stride(), sin.stride()
    if (cos.dtype is not _F32 or sin.dtype is not _F32 or not cos.is_cpu or not sin.is_cpu or len(cs) != 2
            or cos.shape[1] != half or sin.shape != cos.shape or (cs[1] != 1 and half > 1)
            or (ss[1] != 1 and half > 1)):
        raise _bad("apply_rotary", f"cos/sin must be float32 CPU [max_pos, {half}] with a contiguous last dim, "
                   f"got {cos.dtype} {tuple(cos.shape)} / {sin.dtype} {tuple(sin.shape)}")
    if (positions.dtype is not _I64 or not positions.is_cpu or positions.shape != (tokens,)
            or (positions.stride(0) != 1 and tokens > 1)):
        raise _bad("apply_rotary", f"positions must be a contiguous int64 CPU tensor [{tokens}], got "
                   f"{positions.dtype} {tuple(positions.shape)}")
    if inplace:
        if q_out is not None or k_out is not None:
            raise _bad("apply_rotary", "q_out/k_out cannot be combined with inplace=True")
        q_out, k_out = q, k
        pqo, sqot, sqoh, pko, skot, skoh = pq, sqt, sqh, pk, skt, skh
    else:
        if q_out is None:
            q_out = torch.empty((tokens, hq, d), dtype=dtype)
            pqo, sqot, sqoh = q_out.data_ptr(), hq * d, d
        else:
            pqo, sqot, sqoh = _heads("apply_rotary", "q_out", q_out, tokens, hq, d, dtype)
        if k_out is None:
            k_out = torch.empty((tokens, hk, d), dtype=dtype)
            pko, skot, skoh = k_out.data_ptr(), hk * d, d
        else:
            pko, skot, skoh = _heads("apply_rotary", "k_out", k_out, tokens, hk, d, dtype)
    bad = fn(_ROT_ARGS.pack(pq, sqt, sqh, pk, skt, skh, pqo, sqot, sqoh, pko, skot, skoh, positions.data_ptr(),
                            cos.data_ptr(), cs[0], sin.data_ptr(), ss[0], cos.shape[0], tokens, hq, hk, d))
    if bad >= 0:
        raise _bad("apply_rotary", f"positions[{bad}] = {int(positions[bad])} is outside the "
                   f"cos/sin tables [0, {cos.shape[0]})")
    return q_out, k_out


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate of x [..., 2I] (float32 or bfloat16, CPU): writes and returns `out` [..., I] =
    silu(x[..., :I]) * x[..., I:] (default: a new contiguous tensor; a given one must not
    overlap x). Rows may be strided; the last dim must be contiguous."""
    kernels = _entries.need()
    dtype = _dtype("silu_and_mul", x)
    fn = kernels.fn(dtype, "silu")
    shape = x.shape
    if not shape or shape[-1] & 1 or shape[-1] == 0:
        raise _bad("silu_and_mul", f"x must be [..., 2I] with an even last dim > 0, got {tuple(shape)}")
    n = shape[-1] >> 1
    px, sx = _rows("silu_and_mul", "x", x, shape, dtype)
    rows = shape[0] if len(shape) == 2 else x.numel() // (2 * n)
    out_shape = shape[:-1] + (n,)
    if out is None:
        out = torch.empty(out_shape, dtype=dtype)
        po, so = out.data_ptr(), n
    else:
        po, so = _rows("silu_and_mul", "out", out, out_shape, dtype)
    fn(_SILU_ARGS.pack(px, sx, po, so, rows, n))
    return out


def quantize_rows(x: torch.Tensor, levels: int, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization of x [M, K] (float32 or bfloat16; rows may be strided,
    the last dim contiguous), stored as uint8 around `zero_point`: returns (q [M, K] uint8,
    scales [M, 1] float32) with scale = max(max|x_row|, 1e-12) / levels and
    q = round(x / scale) + zero_point, bit-identical to
    `splitfuse.kernels.reference.quantize_rows_reference`."""
    kernels = _entries.need()
    dtype = _dtype("quantize_rows", x)
    fn = kernels.fn(dtype, "quant")
    if x.dim() != 2:
        raise _bad("quantize_rows", f"x must be [M, K], got {tuple(x.shape)}")
    if not (0 < levels and 0 <= zero_point - levels and zero_point + levels <= 255):
        raise _bad("quantize_rows", f"levels {levels} around zero point {zero_point} do not fit in uint8")
    px, sx = _rows("quantize_rows", "x", x, None, dtype)
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.uint8)
    scales = torch.empty((rows, 1), dtype=_F32)
    fn(_QUANT_ARGS.pack(px, sx, q.data_ptr(), scales.data_ptr(), rows, k, levels, zero_point))
    return q, scales


def dequantize_rows(acc: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = _F32) -> torch.Tensor:
    """The int8 GEMM's epilogue: `(acc * scales + bias).to(dtype)` for float32 sums acc [M, N]
    (rows may be strided, the last dim contiguous), per-row float32 scales [M, 1] and an
    optional float32 bias [N], in one pass; bit-identical to
    `splitfuse.kernels.reference.dequantize_rows_reference`. float32 results overwrite `acc`
    and return it; bfloat16 ones go to a new contiguous tensor."""
    kernels = _entries.need()
    if dtype not in (_F32, _BF16):
        raise _bad("dequantize_rows", f"dtype must be float32 or bfloat16, got {dtype}")
    if acc.dim() != 2:
        raise _bad("dequantize_rows", f"acc must be [M, N], got {tuple(acc.shape)}")
    pa, sa = _rows("dequantize_rows", "acc", acc, None)
    rows, n = acc.shape
    if scales.dtype is not _F32 or not scales.is_cpu or scales.numel() != rows or not scales.is_contiguous():
        raise _bad("dequantize_rows", f"scales must be a contiguous float32 CPU tensor of {rows} values, got "
                   f"{scales.dtype} {tuple(scales.shape)} on {scales.device}")
    pb = 0
    if bias is not None:
        if bias.dtype is not _F32 or not bias.is_cpu or bias.shape != (n,) or not bias.is_contiguous():
            raise _bad("dequantize_rows", f"bias must be a contiguous float32 CPU tensor [{n}], got "
                       f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
        pb = bias.data_ptr()
    if dtype is _F32:
        out, po, so = acc, pa, sa
    else:
        out = torch.empty((rows, n), dtype=dtype)
        po, so = out.data_ptr(), n
    kernels.fn(dtype, "dequant")(_DEQUANT_ARGS.pack(pa, sa, scales.data_ptr(), pb, po, so, rows, n))
    return out
