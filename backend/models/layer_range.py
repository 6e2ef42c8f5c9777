"""The part of a model one pipeline stage holds: a contiguous range of its decoder layers, the
embedding on the first stage, the final norm and LM head on the last.

The model is built whole on the meta device (no memory) and then cut to its range (`cut`), so
that each architecture's layers keep their global index (sliding windows, dense MoE layers are
per index) while only the stage's own layers are ever materialised; checkpoint tensors are
renamed to the local layer index or skipped (`checkpoint_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerRange:
    first: int
    end: int
    num_layers: int
    tie_word_embeddings: bool = False

    @property
    def has_embedding(self) -> bool:
        return self.first == 0

    @property
    def has_head(self) -> bool:
        """The final norm and the LM head (logits) are this stage's."""
        return self.end == self.num_layers

    @property
    def keeps_embedding_table(self) -> bool:
        # A tied LM head multiplies the embedding's table: the last stage keeps it too.
        return self.has_embedding or (self.has_head and self.tie_word_embeddings)

    def checkpoint_name(self, name: str) -> str | None:
        """`name` with its layer index made local, or None for a tensor this stage does not hold."""
        match = _LAYER.match(name)
        if match is not None:
            i = int(match[1])
            if not self.first <= i < self.end:
                return None
            return f"model.layers.{i - self.first}." + name[match.end():]
        if name.startswith("model.embed_tokens."):
            return name if self.keeps_embedding_table else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.has_head else None
        return name

    def global_name(self, name: str) -> str:
        """The checkpoint's name of this stage's parameter `name` (its layer index made global)."""
        match = _LAYER.match(name)
        if match is None:
            return name
        return f"model.layers.{int(match[1]) + self.first}." + name[match.end():]

    def cut(self, model: nn.Module) -> None:
        """Drop from `model` (a LlamaForCausalLM still on the meta device) what this stage does not hold."""
        model.model.layers = nn.ModuleList(list(model.model.layers)[self.first:self.end])
        if not self.keeps_embedding_table:
            model.model.embed_tokens = None
        if not self.has_head:
            model.model.norm = None
            model.lm_head = None


def split_layers(num_layers: int, stages: int, tie_word_embeddings: bool = False) -> list[LayerRange]:
    """`num_layers` over `stages` contiguous ranges differing by at most one layer, the first
    stages the smaller (the first also runs the scheduler, the last the LM head)."""
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's {num_layers} layers "
                         "(each stage holds at least one)")
    bounds = [num_layers * s // stages for s in range(stages + 1)]
    return [LayerRange(bounds[s], bounds[s + 1], num_layers, tie_word_embeddings) for s in range(stages)]
