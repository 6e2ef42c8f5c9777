"""A GGUF file's tensors one at a time, under Hugging Face's names and in its layout.

`GGUFTensors` takes a file's tensor index (gguf_index.py: the header parsed, the tensor data
left unread) and gives each weight's name, its type and, when asked, its values:
- `read(t, dtype)`: dequantized alone (`gguf.quants.dequantize`; F32 / F16 / BF16 as stored)
  into `dtype`;
- `raw_rows(t)`: its bytes as uint8 rows (a quantized tensor's blocks).
Both copy the tensor's bytes out of the file with a positioned read rather than through a
memory map of it: touched map pages would count in the process's resident memory until
unmapped, and a whole 8B file read that way doubles the peak at start.

llama.cpp stores Llama / Mistral q and k projections with each head's rotary halves interleaved;
both put them back in Hugging Face's order (the one place that is done). Gemma 3's norms, stored
as 1 + w, come back as w (gguf_gemma3.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from splitfuse.models.gguf_gemma3 import gemma3_hf_name, is_shifted_norm
from splitfuse.models.gguf_moe import MOE_ARCHITECTURES, expert_hf_name
from splitfuse.models.gguf_names import layer_hf_name
from splitfuse.models.gguf_phi3 import phi3_gguf_name, phi3_hf_name

# llama.cpp's converter interleaves the rotary halves of q/k for these (not for qwen2, qwen3).
PERMUTED_QK = ("llama", "mistral")
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# Tensors that carry no weights of ours (llama.cpp's precomputed rotary factors; rope scaling comes
# from the metadata through the config, and Phi-3's LongRoPE factors through gguf_phi3.py).
IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_GGUF_LAYER = {hf: gg for gg, hf in LAYER_NAMES.items()}
_GGUF_TOP = {hf: gg for gg, hf in TOP_NAMES.items()}


class GGUFError(ValueError):
    """A GGUF file that cannot be served: unreadable, cut short, or of an unsupported kind."""


def hf_name(name: str, arch: str) -> str | None:
    """Our (Hugging Face's) name for a GGUF tensor of `arch`; None for one we do not know."""
    return ((gemma3_hf_name(name) if arch == "gemma3" else None)
            or (phi3_hf_name(name) if arch == "phi3" else None)
            or TOP_NAMES.get(name) or layer_hf_name(name, LAYER_NAMES)
            or (expert_hf_name(name) if arch in MOE_ARCHITECTURES else None))


def gguf_name(name: str) -> str | None:
    """The GGUF name of one of our weights (the inverse of hf_name for projections, the head and
    the embedding); None for any other."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        if rest in _GGUF_LAYER:
            return f"blk.{layer}.{_GGUF_LAYER[rest]}"
    return phi3_gguf_name(name)


def shape_of(t: Any) -> tuple[int, ...]:
    """A reader tensor's shape, outermost first (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def unpermute_rotary(w: torch.Tensor, heads: int, name: str, field: str) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (per head: pairs interleaved) into Hugging Face's (halves).
    `field` is the metadata key `heads` came from, named when the two disagree."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        raise GGUFError(f"tensor {name!r} has {rows} rows, which {field} = {heads} does not split into heads "
                        f"of an even number of rows: the file's metadata and tensors disagree")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_readable(t: Any) -> None:
    """Raise GGUFError when the gguf package cannot dequantize `t`'s type (tried on its
    first row only)."""
    if t.tensor_type.name not in _PLAIN:
        _dequantize(t, np.asarray(t.data[:1]))


def _dequantize(t: Any, data: np.ndarray) -> np.ndarray:
    """`data` (blocks of `t`'s type) as floats, by the gguf package; GGUFError where it cannot."""
    import gguf

    try:
        return gguf.quants.dequantize(data, t.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {t.name!r} has type {t.tensor_type.name}, which the gguf package cannot "
                        f"dequantize") from e


def _layout(t: Any) -> tuple[type, tuple[int, ...]]:
    """(numpy dtype, shape) of a tensor's stored data: F32 / F16 elements, else bytes by row."""
    import gguf

    dims = shape_of(t)
    if t.tensor_type.name in ("F32", "F16"):
        return (np.float32 if t.tensor_type.name == "F32" else np.float16), dims
    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    return np.uint8, (*dims[:-1], dims[-1] // block * size)


class GGUFTensors:
    """The tensors of one GGUF file: `tensors` as gguf_index.read_index or `gguf.GGUFReader`
    lists them (name, tensor_type, shape, data_offset)."""

    def __init__(self, tensors: list, path: Path, arch: str, heads: int, kv_heads: int) -> None:
        self.path, self.arch, self.heads, self.kv_heads = path, arch, heads, kv_heads
        self.by_name = {t.name: t for t in tensors}

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """(our name, reader tensor) of every weight, in file order; IGNORED tensors left out."""
        for t in self.by_name.values():
            if t.name not in IGNORED:
                yield hf_name(t.name, self.arch), t

    def of(self, name: str) -> Any | None:
        """The reader tensor of one of our weights (gguf_name's), or None."""
        return self.by_name.get(gguf_name(name) or "")

    def _bytes(self, t: Any) -> np.ndarray:
        """`t`'s data, copied out of the file (see the module's docstring), shaped as the reader's."""
        dtype, shape = _layout(t)
        count = int(np.prod(shape))
        data = np.fromfile(self.path, dtype=dtype, count=count, offset=t.data_offset)
        if data.size != count:
            raise GGUFError(f"tensor {t.name!r} is cut short in {self.path.name}")
        return data.reshape(shape)

    def _unpermute(self, t: Any, w: torch.Tensor) -> torch.Tensor:
        if self.arch in PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rotary(w, self.heads, t.name, f"{self.arch}.attention.head_count")
        if self.arch in PERMUTED_QK and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rotary(w, self.kv_heads, t.name, f"{self.arch}.attention.head_count_kv")
        return w

    def read(self, t: Any, dtype: torch.dtype) -> torch.Tensor:
        """`t` dequantized alone into `dtype`, in Hugging Face's layout."""
        kind = t.tensor_type.name
        data = self._bytes(t)
        if kind in _PLAIN:
            w = torch.from_numpy(data)
            w = w.view(torch.bfloat16) if kind == "BF16" else w  # stored as raw 16-bit words
        else:
            w = torch.from_numpy(_dequantize(t, data))
        w = self._unpermute(t, w.reshape(shape_of(t)))
        if self.arch == "gemma3" and is_shifted_norm(t.name):  # stored as 1 + w, subtracted in float32
            w = w.float() - 1
        return w.to(dtype).contiguous()

    def raw_rows(self, t: Any) -> torch.Tensor:
        """`t`'s bytes as uint8 rows (one a weight row: a quantized matrix's blocks), in Hugging
        Face's row order."""
        rows = torch.from_numpy(self._bytes(t)).view(torch.uint8).reshape(shape_of(t)[0], -1)
        return self._unpermute(t, rows)
