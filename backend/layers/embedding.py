"""Token embeddings: nn.Embedding's parameter, and under quantization gguf / gguf-exact the GGUF
file's own blocks instead of the float32 table (under q8_0, the table quantized into Q8_0 blocks).

A checkpoint converted from a GGUF file holds the embedding dequantized to float32 (SmolLM2's
Q8_0 table: 113 MB against the file's 30 MB). With the file at hand, `prepare` keeps its blocks
and each step widens only the looked-up rows, as the `gguf` package dequantizes them (the same
values as the float32 table, so the same outputs), the way llama.cpp reads its embedding rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from splitfuse.kernels.cpu import quant4
from splitfuse.layers.q4_linear import BlockSource, block_source


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        # Set by the loader for a checkpoint converted from a GGUF file: reads the table's blocks.
        self.gguf_blocks: BlockSource | None = None
        self.blocks: tuple[str, torch.Tensor] | None = None  # (kind, uint8 rows [V, block bytes])
        self.head_blocks: quant4.PackedQuantWeight | None = None  # a tied LM head's, looked up in place

    def prepare(self, quantization: str, head_blocks: "quant4.PackedQuantWeight | None" = None) -> bool:
        """Under a GGUF quantization (float32 model, the C++ kernels built, as for the
        projections), keep the file's blocks of the table (when it stores them in a kind `quant4`
        reads), or under q8_0 the table quantized, in place of the float table's rows; returns
        whether it did. `head_blocks`: a tied LM head's packed blocks of this same table, looked
        up in place (`quant4.lookup_rows` reads either form of any kind), so that no second copy
        is read or quantized. The caller frees the float weight (a tied LM head may still need it)."""
        file_blocks, self.gguf_blocks = self.gguf_blocks, None  # holds the GGUF file open
        if head_blocks is not None and quant4.can_lookup(head_blocks):
            self.head_blocks = head_blocks
            return True
        source = block_source(quantization, self.weight, file_blocks)
        if source is None or self.weight.dtype is not torch.float32 or not quant4.available():
            return False  # without the C++ kernels every weight stays float
        found = source()
        if found is None or found[0] not in quant4.KINDS or found[1].shape[0] != self.weight.shape[0]:
            if self.weight.is_meta:
                raise ValueError(f"the embedding was left unread for its GGUF blocks, which it cannot look up "
                                 f"({'none' if found is None else found[0]})")
            return False
        self.blocks = found
        return True

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Memory this module holds beyond its parameters (the head's packed blocks count there)."""
        if self.blocks is None:
            return {}
        kind, rows = self.blocks
        return {kind.lower(): rows.numel()}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head_blocks is not None:
            return quant4.lookup_rows(self.head_blocks, ids).view(*ids.shape, -1)
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        kind, rows = self.blocks
        flat = ids.reshape(-1)
        return quant4.dequantize(kind, rows.index_select(0, flat)).view(*ids.shape, -1)
