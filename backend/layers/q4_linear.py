"""Projections over GGUF's quantized blocks: a GGUF file's own (`EngineConfig.quantization="gguf"`
or `"gguf-exact"`), or any float checkpoint's weights quantized into them at load (`"q4_0"`,
`"q4_1"`, `"q8_0"`).

The loader gives each projection of a checkpoint converted from a GGUF file the means to read
its blocks from that file (`Linear.gguf_blocks`, models/gguf_checkpoint.py: a fused qkv or
gate_up projection stacks its parts' rows). Under a load quantization `block_source` makes the
blocks from the loaded weight instead (round to nearest, one fp16 scale, and for Q4_1 a minimum,
per 32 weights along k: llama.cpp's reference quantizer); the LM head and the embedding then take
Q8_0 blocks (they pick the tokens; llama.cpp's 4-bit files keep their output tensor at 6 bits or
more too). Where every part is stored in a type the kernel takes (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K), `CpuQ4Linear` packs them for the C++ kernel (`splitfuse.kernels.cpu.quant4`;
parts of different types each in its own, `quant_parts`) and the float weight is released: the
weights stay at about the blocks' size in memory (Q4_0 4.5 bits a weight, Q4_K 4.62, Q6_K 6.56,
Q8_0 8.5, against 32; docs/gguf_blocks.md) and are widened in registers as each call reads them.
Two forms of the kernel:

* `gguf` and the load quantizations: llama.cpp's arithmetic where the build has integer dot
  products (AVX-512 VNNI, or AVX2's vpmaddubsw): the activations quantized per row and 32-k
  group to int8 in each call, multiplied exactly against the blocks' integers, each group's sum
  scaled (a quarter of the float form's multiply instructions). Outputs differ from the
  dequantized float32 model's by the activations' rounding: greedy agreement is reported
  (perf/results/2026-11-27-q4/), not equality. Builds with neither run the float form.
* `gguf-exact`: the blocks widened to float32 in registers exactly as the `gguf` package
  dequantizes them and summed in the float32 kernel's order: a projection's output equals the
  float32 model's (the same file dequantized) bit for bit. Faster than float32 where the weight's
  bytes bound the product (decodes of a few rows); about float32's speed at 16 rows and more.

Other projections (other block types, no source file, an input size not a multiple of 32) keep
the float kernel, with a log line. Float32 activations only. A gated (gate_up) projection of
mixed types runs its product, then SwiGLU (its kernel is not `gated`).
"""

from __future__ import annotations

from typing import Callable

import torch

from splitfuse.config import BLOCK_QUANTIZATIONS, GGUF_QUANTIZATIONS, LOAD_QUANTIZATIONS
from splitfuse.kernels.cpu import quant4, quant_parts

__all__ = ["BLOCK_QUANTIZATIONS", "GGUF_QUANTIZATIONS", "HEAD_QUANTIZATION", "LOAD_QUANTIZATIONS", "BlockSource",
           "CpuQ4Linear", "block_source", "q4_supported"]

HEAD_QUANTIZATION = "q8_0"  # the LM head's and the embedding's under a load quantization
# Reads a projection's blocks: (block type, uint8 rows) or None (not packable).
BlockSource = Callable[[], "tuple[str, torch.Tensor] | None"]


def block_source(quantization: str, weight: torch.Tensor, file_blocks: BlockSource | None) -> BlockSource | None:
    """Where `weight`'s blocks come from under `quantization`: the GGUF file's (`file_blocks`, set by
    the loader), the weight quantized now (a load quantization; None when its input size is not a
    multiple of 32), or nowhere (the float kernels)."""
    if quantization in LOAD_QUANTIZATIONS:
        if weight.dim() != 2 or weight.shape[1] % quant4.QK:
            return None
        kind = quantization.upper()  # q4_0 -> GGUF's Q4_0
        return lambda: (kind, quant4.quantize(kind, weight))
    return file_blocks if quantization in GGUF_QUANTIZATIONS else None


def q4_supported(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the packed GGUF kernel runs here for activations of `dtype` (and why not)."""
    if device.type != "cpu":
        return False, f"the GGUF block kernel is for CPUs (device {device.type})"
    if dtype is not torch.float32:
        return False, f"the GGUF block kernel takes float32 activations (dtype {dtype})"
    if not quant4.available():
        return False, "the C++ CPU kernels are not built"
    return True, ""


class CpuQ4Linear:
    """GGUF blocks packed once; calling it computes `x @ W^T + b` (float32), or for a gated
    (SwiGLU gate_up) weight silu(gate) * up. `exact`: the float form (see the module's docstring)."""

    def __init__(self, kind: str, rows: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
                 exact: bool = False) -> None:
        dot = () if exact else quant4.dot_kinds()  # the integer form where the build has it for the kind
        bias = None if bias is None else bias.detach().float()
        self.packed: quant4.PackedQuantWeight | quant_parts.PackedQuantParts
        if quant_parts.is_joined(kind):  # parts of different kinds: ungated (see quant_parts)
            forms = {k: "dot" if k in dot else "float" for k in quant4.KINDS}
            self.packed = quant_parts.pack(kind, rows, bias, forms)
            self._linear = quant_parts.linear
        else:
            self.packed = quant4.pack_quantized(kind, rows, bias, gated=gated, form="dot" if kind in dot else "float")
            self._linear = quant4.linear
        self.in_features = self.packed.in_features
        self.out_features = self.packed.out_features

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Memory of the weight by kind: the packed blocks (scales included) and a float32 bias."""
        out: dict[str, int] = {}
        parts = self.packed.parts if isinstance(self.packed, quant_parts.PackedQuantParts) else (self.packed,)
        for p in parts:
            out[p.kind.lower()] = out.get(p.kind.lower(), 0) + p.data.numel()
            if p.bias is not None:
                out["float32"] = out.get("float32", 0) + 4 * p.bias.numel()
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self._linear(x, self.packed)
        out = self._linear(x.reshape(-1, self.in_features), self.packed)
        return out.view(*x.shape[:-1], self.out_features)
