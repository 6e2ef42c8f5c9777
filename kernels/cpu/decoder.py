"""The decoder layers of a dense Llama-family model in one C++ call (`csrc/decoder.cpp`).

`DecoderStack` holds, per layer, the packed projections (qkv, o, the gated gate_up and down:
`linear.PackedWeight` in the model's dtype, `linear.PackedInt8Weight` whose input rows are
quantized first, as `layers.int8_linear.CpuInt8Linear` does, or a float32 model's GGUF blocks,
`quant4.PackedQuantWeight`, or `quant_parts.PackedQuantParts` for parts in different block
types), the two norms' weights, the layer's K/V caches (the paged-attention kernel's layout)
and its attention window; `run` computes layers 0..n-1 over a ragged batch with the kernels
the Python layers call one by one (`elementwise.rms_norm`, `apply_rotary`, `linear.linear`,
`quantize_rows` + `linear.linear_int8` or `quant4.linear`, `paged_attention.write_kv_cache`,
`paged_attention.paged_attention`), with the same arguments: results are bit-identical. It
returns the hidden states and the residual stream, as the Python layers leave them. What it
saves is the Python between the kernels.

Float32 or bfloat16 models whose KV cache has the model's dtype or is int8 (`kv_int8`: the
write kernel quantizes), projections in that dtype or
int8 (or GGUF blocks in float32). A gate_up projection may be ungated (its product, then
`silu_and_mul`: an int8 or GGUF one with LoRA adapters on gate/up, whose deltas go in between
the two; a gated one takes them into its sums before SwiGLU). `set_lora` gives the stack the resident LoRA adapters'
stacked weights (`splitfuse.lora.stacks`, packed for the C++ linear kernel); `run` with
`lora_row_slot` then adds each row's own adapter's deltas to every adapted projection, the sums
`splitfuse.lora.batching.add_stacked` computes, in steps of any size: the rows' products with A
first, then each row's through its own slot's rows of B as the base product stores its outputs
(csrc/decoder.cpp, csrc/lora_simd.h).

The call releases the GIL (ctypes) and runs on the calling thread's OpenMP pool. Callers
check `available()` first.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from .build import Entries, bind
from .linear import PackedInt8Weight, PackedWeight
from .kv_int8 import SCALE_BYTES
from .paged_attention import K_TRANSPOSED, cache_shape, kv_kind, window_arg
from .quant4 import KINDS as GGUF_KINDS
from .quant4 import PackedQuantWeight
from .quant_parts import PackedQuantParts

__all__ = ["DecoderLayerWeights", "DecoderStack", "LoraWeights", "available"]

_LAYER_FIELDS, _SHAPE_FIELDS, _CALL_FIELDS = 26, 15, 30  # csrc/decoder.cpp: Layer, Shape, Call
_LORA_FIELDS, _LP_FIELDS, _LQ_FIELDS = 84, 21, 6  # LORA_FIELDS, LP_FIELDS, LQ_FIELDS
_LP_MAX_PARTS = 3
_CALL = struct.Struct(f"={_CALL_FIELDS}q")
_ERRORS = {-100: "a position is outside the rotary tables", -101: "bad layer count or token count",
           -102: "a LoRA row slot outside the stacks"}


def _lookup(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    layout = bind(lib, "sf_dec_layout", ctypes.c_int, ctypes.c_int)
    if [layout(i) for i in range(6)] != [_LAYER_FIELDS, _SHAPE_FIELDS, _CALL_FIELDS, _LORA_FIELDS,
                                         _LP_FIELDS, _LQ_FIELDS]:
        raise AttributeError("decoder.cpp's argument layout differs from this wrapper's")
    return bind(lib, "sf_dec_forward", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)


_entries = Entries("decoder", _lookup)


def available() -> bool:
    """True when the kernel library is loaded and has this entry point (builds it on first call)."""
    return _entries.available()


Packed = PackedWeight | PackedInt8Weight | PackedQuantWeight | PackedQuantParts


@dataclass(frozen=True)
class DecoderLayerWeights:
    qkv: Packed
    o: Packed
    gate_up: Packed  # gated (SwiGLU), or the plain [2I] product (LoRA on gate/up)
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
        cache_dtype = first.k_cache.dtype if first.k_cache.dtype is torch.int8 else dtype
        block_size = block_elems // (head_dim + SCALE_BYTES if cache_dtype is torch.int8 else head_dim)
        for i, w in enumerate(layers):
            gated = w.gate_up.gated
            shapes = [(w.qkv, qkv_n, hidden, False), (w.o, hidden, num_heads * head_dim, False),
                      (w.gate_up, inter if gated else 2 * inter, hidden, gated), (w.down, hidden, inter, False)]
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
                if (cache.dtype is not cache_dtype or cache.shape != cache_shape(num_blocks, block_size, num_kv_heads,
                                                                                 head_dim, cache_dtype)
                        or not cache.is_contiguous()):
                    raise ValueError(f"DecoderStack: layer {i} caches must be contiguous {cache_dtype} "
                                     f"{cache_shape(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)}")
        self.dtype, self.hidden, self.intermediate = dtype, hidden, inter
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_layers = len(layers)
        self._layers = layers  # keeps every tensor the table points into alive
        self._int8 = any(isinstance(p, PackedInt8Weight) for w in layers for p in (w.qkv, w.o, w.gate_up, w.down))
        self.gguf = any(isinstance(p, (PackedQuantWeight, PackedQuantParts))
                        for w in layers for p in (w.qkv, w.o, w.gate_up, w.down))
        rows = []
        self._parts_tables: list[torch.Tensor] = []  # GGUF parts' tables the layer table points to
        for w in layers:
            rows.append([*(v for p in (w.qkv, w.o, w.gate_up, w.down) for v in _projection(p, self._parts_tables)),
                         w.input_norm.data_ptr(), w.post_norm.data_ptr(), w.k_cache.data_ptr(), w.v_cache.data_ptr(),
                         window_arg(w.sliding_window), int(w.gate_up.gated)])
        self._ungated = not all(w.gate_up.gated for w in layers)
        self._lora: torch.Tensor | None = None
        self._lora_keep: list = []
        self._lora_cols = self._lora_slots = 0
        self._table = torch.tensor(rows, dtype=torch.int64)
        self._shape = torch.tensor([len(layers), hidden, num_heads, num_kv_heads, head_dim, inter,
                                    block_size, num_blocks, int(dtype is torch.bfloat16), K_TRANSPOSED,
                                    _as_double_slot(eps), _as_double_slot(scale), int8_levels, int8_zero_point,
                                    kv_kind(cache_dtype)],
                                   dtype=torch.int64)

    def set_lora(self, projections: list[list[LoraWeights | None]] | None) -> None:
        """Per layer, per projection (qkv, o, gate_up, down): the LoRA stacks' weights, or None
        where no adapter applies; None: no LoRA. Call again whenever the stacks are repacked
        (the table holds their addresses)."""
        if projections is None:
            self._lora, self._lora_keep = None, []
            return
        if len(projections) != self.num_layers or any(len(p) != 4 for p in projections):
            raise ValueError(f"DecoderStack.set_lora: 4 projections for each of {self.num_layers} layers")
        table = torch.zeros(self.num_layers, _LORA_FIELDS, dtype=torch.int64)
        keep, cols, num_slots = [], 0, None
        for layer, row in enumerate(projections):
            for j, lw in enumerate(row):
                if lw is None:
                    continue
                if (lw.a.dtype is not self.dtype or lw.col_slot.dtype is not torch.int64
                        or lw.col_slot.shape != (lw.a.out_features,) or len(lw.parts) > _LP_MAX_PARTS):
                    raise ValueError(f"DecoderStack.set_lora: layer {layer} projection {j}: {self.dtype} weights, "
                                     f"int64 column slots [{lw.a.out_features}], at most {_LP_MAX_PARTS} parts")
                slots = [lw.a.data.data_ptr(), lw.a.out_features, len(lw.parts)]
                for b, col, out in lw.parts:
                    if b.dtype is not self.dtype or b.gated or b.bias is not None:
                        raise ValueError("DecoderStack.set_lora: a part's B must be a plain packed weight")
                    # Row t of slot s reads columns [col + s R, col + (s + 1) R) of XA and those rows
                    # of B: the stacks' layout (part-major, slot-minor), checked here.
                    width = b.in_features
                    col_slot = lw.col_slot[col:col + width]
                    rank = int((col_slot == col_slot[0]).sum()) if width else 0
                    if (not rank or width % rank or (num_slots is not None and width // rank != num_slots)
                            or not torch.equal(col_slot, torch.arange(width) // rank)):
                        raise ValueError(f"DecoderStack.set_lora: layer {layer} projection {j}: a part's columns "
                                         "are not every slot's equal run, slot-major")
                    num_slots = width // rank
                    slots += [b.data.data_ptr(), col, width, rank, out, b.out_features]
                base = j * _LP_FIELDS
                table[layer, base:base + len(slots)] = torch.tensor(slots, dtype=torch.int64)
                keep.append(lw)
                cols = max(cols, lw.a.out_features)
        self._lora, self._lora_keep, self._lora_cols = table, keep, cols
        self._lora_slots = num_slots or 0

    def run(self, x: torch.Tensor, num_layers: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, lora_row_slot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers 0..num_layers-1 over x [T, hidden] (the embedding output, overwritten: it becomes
        the residual stream); returns (hidden states [T, hidden], residual stream = x). Positions
        int64 [T]; cos/sin float32 [max_pos, head_dim / 2]; the attention metadata as the
        paged-attention kernel takes it (int64 slot mapping, int32 query_start_loc, seq_lens and
        block tables). `lora_row_slot` (int64 [T]): each row's slot in the LoRA stacks given to
        set_lora (-1: the base), to add the rows' adapters' deltas; rows of one adapter need not be
        adjacent."""
        fn = _entries.need()
        lora = 0
        if lora_row_slot is not None:
            if self._lora is None:
                raise ValueError("DecoderStack.run: lora_row_slot without set_lora")
            if lora_row_slot.dtype is not torch.int64 or lora_row_slot.shape != (x.shape[0],) or (
                    not lora_row_slot.is_contiguous()):
                raise ValueError(f"DecoderStack.run: lora_row_slot must be a contiguous int64 [{x.shape[0]}]")
            lora = self._lora.data_ptr()
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
        xa = torch.empty(t if lora else 0, self._lora_cols, dtype=self.dtype)
        gu = torch.empty(t if self._ungated else 0, 2 * self.intermediate, dtype=self.dtype)
        call = _CALL.pack(
            t, num_layers, x.data_ptr(), y.data_ptr(), positions.data_ptr(), cos.data_ptr(), cos.stride(0),
             sin.data_ptr(), sin.stride(0), cos.shape[0], slot_mapping.data_ptr(), query_start_loc.data_ptr(),
             seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], b,
             torch.get_num_threads(), qkv.data_ptr(), att.data_ptr(), attc.data_ptr(), ao.data_ptr(),
             act.data_ptr(), xq.data_ptr(), xs.data_ptr(), lora, 0 if lora == 0 else lora_row_slot.data_ptr(),
             xa.data_ptr(), self._lora_slots, gu.data_ptr())
        rc = fn(self._shape.data_ptr(), self._table.data_ptr(), call)
        if rc:
            raise ValueError(f"DecoderStack.run: {_ERRORS.get(rc) or f'attention kernel error {rc}'}")
        return y, x


@dataclass(frozen=True)
class LoraWeights:
    """One projection's LoRA stacks for `DecoderStack.set_lora`: A_all packed ([C, in]), each
    column's slot (int64 [C]) and per output part (B packed [out width, its columns], its first
    column in A_all's output, its first output column in the projection)."""

    a: PackedWeight
    col_slot: torch.Tensor
    parts: list[tuple[PackedWeight, int, int]]


def _projection(p: Packed, tables: list[torch.Tensor]) -> list[int]:
    """A projection's slots in the layer table (decoder.cpp: Projection); a GGUF parts table is
    appended to `tables` (kept alive by the caller)."""
    if isinstance(p, PackedQuantParts):
        table = torch.tensor([len(p.parts), *(v for q, start in zip(p.parts, p.starts)
                                              for v in (q.data.data_ptr(), 0 if q.bias is None else q.bias.data_ptr(),
                                                        GGUF_KINDS.index(q.kind), int(q.form == "dot"), start,
                                                        q.out_features))], dtype=torch.int64)
        tables.append(table)
        return [3, table.data_ptr(), 0, 0, 0]
    bias = 0 if p.bias is None else p.bias.data_ptr()
    if isinstance(p, PackedInt8Weight):
        return [1, p.data.data_ptr(), bias, p.column_sums.data_ptr(), p.scales.data_ptr()]
    if isinstance(p, PackedQuantWeight):
        return [2, p.data.data_ptr(), bias, GGUF_KINDS.index(p.kind), int(p.form == "dot")]
    return [0, p.data.data_ptr(), bias, 0, 0]
