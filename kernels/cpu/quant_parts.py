"""A projection whose stacked parts are stored in different GGUF block types (Q4_K_M files keep
attn_v at Q6_K in some layers while attn_q / attn_k are Q4_K): each part packed as its own
`quant4.PackedQuantWeight`, over its own range of output columns, and multiplied into that
range of one output (each column block of the kernels belongs to one part; no weight is widened
or requantized to a common type).

`join` / `split` carry the parts through the loader's single (kind, rows) pair: the kind reads
"Q4_K:576+Q6_K:192" (each part's type and row count, in order) and the rows are the parts'
uint8 rows zero-padded to the widest part's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant4

__all__ = ["PackedQuantParts", "is_joined", "join", "linear", "pack", "split"]


def is_joined(kind: str) -> bool:
    return "+" in kind


def join(parts: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """One (kind, rows) pair for parts [(kind, uint8 rows [n_i, bytes_i]), ...] of differing kinds."""
    width = max(rows.shape[1] for _, rows in parts)
    padded = [torch.nn.functional.pad(rows, (0, width - rows.shape[1])) for _, rows in parts]
    return "+".join(f"{kind}:{rows.shape[0]}" for kind, rows in parts), torch.cat(padded)


def split(kind: str, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The parts `join` made (each part's rows cut back to its kind's bytes for K = `in_features`)."""
    specs = [(k, int(n)) for k, n in (s.split(":") for s in kind.split("+"))]
    if sum(n for _, n in specs) != rows.shape[0]:
        raise ValueError(f"joined GGUF parts {kind!r} do not add up to {rows.shape[0]} rows")
    k = min(rows.shape[1] // quant4.BLOCK_BYTES[k] * quant4.BLOCK_K[k] for k, _ in specs)  # the narrowest's K
    out, row = [], 0
    for part_kind, n in specs:
        out.append((part_kind, rows[row:row + n, :k // quant4.BLOCK_K[part_kind] * quant4.BLOCK_BYTES[part_kind]]))
        row += n
    return out


@dataclass(frozen=True)
class PackedQuantParts:
    """Parts packed each in its own kind; part i gives output columns [starts[i], starts[i] + its
    out_features). Never gated (a gated weight of mixed kinds runs its product, then SwiGLU)."""

    parts: tuple[quant4.PackedQuantWeight, ...]
    starts: tuple[int, ...]
    out_features: int
    in_features: int
    gated: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def kind(self) -> str:
        return "+".join(p.kind for p in self.parts)


def pack(kind: str, rows: torch.Tensor, bias: torch.Tensor | None, forms: dict[str, str]) -> PackedQuantParts:
    """The joined parts `kind` / `rows` packed, part by part, in `forms[part kind]`."""
    parts, starts, n0 = [], [], 0
    for part_kind, part_rows in split(kind, rows):
        n = part_rows.shape[0]
        b = None if bias is None else bias[n0:n0 + n].contiguous()
        parts.append(quant4.pack_quantized(part_kind, part_rows.contiguous(), b, form=forms[part_kind]))
        starts.append(n0)
        n0 += n
    in_features = {p.in_features for p in parts}
    if len(in_features) != 1:
        raise ValueError(f"joined GGUF parts {kind!r} of different input sizes {sorted(in_features)}")
    return PackedQuantParts(tuple(parts), tuple(starts), n0, in_features.pop())


def linear(x: torch.Tensor, weight: PackedQuantParts, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 times every part, each into its columns of `out` [M, out_features]."""
    if out is None:
        out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    for part, start in zip(weight.parts, weight.starts):
        quant4.linear(x, part, out=out[:, start:start + part.out_features])
    return out
