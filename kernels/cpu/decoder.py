"""The decoder layers of a dense Llama-family model in one C++ call (`csrc/decoder.cpp`).

`DecoderStack` holds, per layer, the packed projections (qkv, o, the gated gate_up and down:
`linear.PackedWeight` in the model's dtype, or `linear.PackedInt8Weight` whose input rows are
quantized first, as `layers.int8_linear.CpuInt8Linear` does), the two norms' weights, the
layer's K/V caches (the paged-attention kernel's layout) and its attention window; `run`
computes layers 0..n-1 over a ragged batch with the kernels the Python layers call one by one
(`elementwise.rms_norm`, `apply_rotary`, `linear.linear` or `quantize_rows` +
`linear.linear_int8`, `paged_attention.write_kv_cache`, `paged_attention.paged_attention`),
with the same arguments: results are bit-identical. It returns the hidden states and the
residual stream, as the Python layers leave them. What it saves is the Python between the
kernels.

Float32 or bfloat16 models whose KV cache has the model's dtype, projections in that dtype or
int8. The call releases the GIL (ctypes) and runs on the calling thread's OpenMP pool. Callers
check `available()` first.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import Entries
from .linear import PackedInt8Weight, PackedWeight
from .paged_attention import K_TRANSPOSED, window_arg

__all__ = ["DecoderLayerWeights", "DecoderStack", "available"]

_LAYER_FIELDS, _SHAPE_FIELDS, _CALL_FIELDS = 25, 14, 25  # csrc/decoder.cpp: Layer, Shape, Call
_CALL = struct.Struct(f"={_CALL_FIELDS}q")
_ERRORS = {-100: "a position is outside the rotary tables", -101: "bad layer count or token count"}


def _lookup(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    lib.sf_dec_layout.argtypes, lib.sf_dec_layout.restype = [ctypes.c_int], ctypes.c_int
    if [lib.sf_dec_layout(i) for i in range(3)] != [_LAYER_FIELDS, _SHAPE_FIELDS, _CALL_FIELDS]:
        raise AttributeError("decoder.cpp's argument layout differs from this wrapper's")
    fn = lib.sf_dec_forward
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int
    return fn


_entries = Entries("decoder", _lookup)


def available() -> bool:
    """True when the kernel library is loaded and has this entry point (builds it on first call)."""
    return _entries.available()


Packed = PackedWeight | PackedInt8Weight


@dataclass(frozen=True)
class DecoderLayerWeights:
    qkv: Packed
    o: Packed
    gate_up: Packed  # gated (SwiGLU)
    down: Packed
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    sliding_window: int | None


def _as_double_slot(x: float) -> int:
    return struct.unpack("=q", struct.pack("=d", x))[0]


class DecoderStack:
    """The layers' weights and caches as the C++ call reads them; checked once, here."""

    def __init__(self, layers: list[DecoderLayerWeights], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, scale: float, int8_levels: int = 127, int8_zero_point: int = 128) -> None:
        """`int8_levels` / `int8_zero_point`: how int8 projections quantize their input rows
        (`elementwise.quantize_rows`)."""
        _entries.need()
        first = layers[0]
        dtype = first.input_norm.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"DecoderStack: a float32 or bfloat16 model, got {dtype}")
        hidden, inter = first.qkv.in_features, first.down.in_features
        qkv_n = (num_heads + 2 * num_kv_heads) * head_dim
        num_blocks, _, block_elems = first.k_cache.shape
        for i, w in enumerate(layers):
            shapes = [(w.qkv, qkv_n, hidden, False), (w.o, hidden, num_heads * head_dim, False),
                      (w.gate_up, inter, hidden, True), (w.down, hidden, inter, False)]
            for p, n, k, gated in shapes:
                kind = "int8" if isinstance(p, PackedInt8Weight) else p.dtype
                if ((kind != "int8" and kind is not dtype) or p.out_features != n or p.in_features != k
                        or p.gated != gated):
                    raise ValueError(f"DecoderStack: layer {i} has a projection {p.out_features}x{p.in_features} "
                                     f"{kind} (gated {p.gated}), expected {n}x{k} {dtype} or int8 (gated {gated})")
            for norm in (w.input_norm, w.post_norm):
                if norm.dtype is not dtype or norm.shape != (hidden,) or not norm.is_contiguous():
                    raise ValueError(f"DecoderStack: layer {i} norm weights must be contiguous {dtype} [{hidden}]")
            for cache in (w.k_cache, w.v_cache):
                if (cache.dtype is not dtype or cache.shape != (num_blocks, num_kv_heads, block_elems)
                        or not cache.is_contiguous()):
                    raise ValueError(f"DecoderStack: layer {i} caches must be contiguous {dtype} "
                                     f"[{num_blocks}, {num_kv_heads}, block_size * {head_dim}]")
        self.dtype, self.hidden, self.intermediate = dtype, hidden, inter
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_layers = len(layers)
        self._layers = layers  # keeps every tensor the table points into alive
        self._int8 = any(isinstance(p, PackedInt8Weight) for w in layers for p in (w.qkv, w.o, w.gate_up, w.down))
        rows = []
        for w in layers:
            rows.append([*_projection(w.qkv), *_projection(w.o), *_projection(w.gate_up), *_projection(w.down),
                         w.input_norm.data_ptr(), w.post_norm.data_ptr(), w.k_cache.data_ptr(), w.v_cache.data_ptr(),
                         window_arg(w.sliding_window)])
        self._table = torch.tensor(rows, dtype=torch.int64)
        self._shape = torch.tensor([len(layers), hidden, num_heads, num_kv_heads, head_dim, inter,
                                    block_elems // head_dim, num_blocks, int(dtype is torch.bfloat16), K_TRANSPOSED,
                                    _as_double_slot(eps), _as_double_slot(scale), int8_levels, int8_zero_point],
                                   dtype=torch.int64)

    def run(self, x: torch.Tensor, num_layers: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers 0..num_layers-1 over x [T, hidden] (the embedding output, overwritten: it becomes
        the residual stream); returns (hidden states [T, hidden], residual stream = x). Positions
        int64 [T]; cos/sin float32 [max_pos, head_dim / 2]; the attention metadata as the
        paged-attention kernel takes it (int64 slot mapping, int32 query_start_loc, seq_lens and
        block tables)."""
        fn = _entries.need()
        t = x.shape[0]
        if (x.dtype is not self.dtype or x.shape != (t, self.hidden) or not x.is_contiguous()
                or not 0 <= num_layers <= self.num_layers):
            raise ValueError(f"DecoderStack.run: x must be a contiguous {self.dtype} [T, {self.hidden}] and "
                             f"0 <= num_layers <= {self.num_layers}, got {x.dtype} {tuple(x.shape)}, {num_layers}")
        for name, tensor, dtype, shape in (("positions", positions, torch.int64, (t,)),
                                           ("slot_mapping", slot_mapping, torch.int64, (t,)),
                                           ("seq_lens", seq_lens, torch.int32, None),
                                           ("query_start_loc", query_start_loc, torch.int32, None)):
            if tensor.dtype is not dtype or not tensor.is_contiguous() or (shape is not None and tensor.shape != shape):
                raise ValueError(f"DecoderStack.run: {name} must be a contiguous {dtype} tensor"
                                 + (f" [{t}]" if shape else ""))
        b = seq_lens.shape[0]
        if (query_start_loc.shape != (b + 1,) or block_tables.dtype is not torch.int32 or block_tables.dim() != 2
                or block_tables.shape[0] != b or block_tables.stride(1) != 1):
            raise ValueError("DecoderStack.run: query_start_loc [B+1], seq_lens [B], block_tables int32 [B, W]")
        if (cos.dtype is not torch.float32 or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride(1) != 1
                or cos.shape[1] != self.head_dim // 2):
            raise ValueError(f"DecoderStack.run: cos/sin must be float32 [max_pos, {self.head_dim // 2}]")
        y = torch.empty_like(x)
        qd = self.num_heads * self.head_dim
        qkv = torch.empty(t, qd + 2 * self.num_kv_heads * self.head_dim, dtype=self.dtype)
        att = torch.empty(t, qd, dtype=torch.float32)
        attc = torch.empty(t, qd, dtype=self.dtype) if self.dtype is torch.bfloat16 else att
        ao = torch.empty_like(x)
        act = torch.empty(t, self.intermediate, dtype=self.dtype)
        # int8 projections: their quantized input rows (the widest input is one of these K).
        xq = torch.empty(t, max(self.hidden, qd, self.intermediate) if self._int8 else 0, dtype=torch.uint8)
        xs = torch.empty(t if self._int8 else 0, dtype=torch.float32)
        call = _CALL.pack(
            t, num_layers, x.data_ptr(), y.data_ptr(), positions.data_ptr(), cos.data_ptr(), cos.stride(0),
             sin.data_ptr(), sin.stride(0), cos.shape[0], slot_mapping.data_ptr(), query_start_loc.data_ptr(),
             seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], b,
             torch.get_num_threads(), qkv.data_ptr(), att.data_ptr(), attc.data_ptr(), ao.data_ptr(),
             act.data_ptr(), xq.data_ptr(), xs.data_ptr())
        rc = fn(self._shape.data_ptr(), self._table.data_ptr(), call)
        if rc:
            raise ValueError(f"DecoderStack.run: {_ERRORS.get(rc) or f'attention kernel error {rc}'}")
        return y, x


def _projection(p: Packed) -> list[int]:
    """A projection's slots in the layer table (decoder.cpp: Projection)."""
    bias = 0 if p.bias is None else p.bias.data_ptr()
    if isinstance(p, PackedInt8Weight):
        return [1, p.data.data_ptr(), bias, p.column_sums.data_ptr(), p.scales.data_ptr()]
    return [0, p.data.data_ptr(), bias, 0, 0]
