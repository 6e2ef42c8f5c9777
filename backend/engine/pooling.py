"""Embeddings: an embedding request's final hidden states (after the final norm, before the LM
head) pooled into one L2-normalised vector, as the step that computes its last prompt chunk ends."""

from __future__ import annotations

import numpy as np
import torch

from splitfuse.engine.batch import rows_read
from splitfuse.engine.scheduler import ScheduledChunk
from splitfuse.engine.sequence import Sequence


class Pooler:
    """Pools the embedding chunks of each step; holds the running sums of mean-pooled prompts
    that span several chunks (SplitFuse splits a long prompt over steps)."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    def take(self, chunks: list[ScheduledChunk], hidden: torch.Tensor | None) -> list[tuple[Sequence, np.ndarray]]:
        """Pool a step's embedding chunks (`hidden`: their rows read, in chunk order; call before
        the scheduler advances past them); the sequences whose prompt is complete, with their
        vectors."""
        done = []
        offset = 0
        for chunk in chunks:
            seq = chunk.seq
            if seq.pooling is None:
                continue
            n = rows_read(chunk)
            if n == 0:  # a last-pooled prompt's earlier chunk: nothing read
                continue
            rows = hidden[offset : offset + n]
            offset += n
            if seq.pooling == "mean":
                vector = self._mean(chunk, rows)
            else:
                vector = rows[-1] if chunk.samples else None
            if vector is not None:
                done.append((seq, normalized(vector)))
        return done

    def _mean(self, chunk: ScheduledChunk, rows: torch.Tensor) -> torch.Tensor | None:
        """The prompt's mean row once its last chunk is in; until then its running sum grows. A
        prompt recomputed after preemption starts again from its first token (a mean-pooled
        prompt never starts from the prefix cache), so its sum does too."""
        seq = chunk.seq
        total, count = (0.0, 0) if seq.num_computed_tokens == 0 else self._sums[seq.request_id]
        total, count = rows.sum(dim=0) + total, count + rows.shape[0]
        if not chunk.samples:
            self._sums[seq.request_id] = (total, count)
            return None
        self._sums.pop(seq.request_id, None)
        return total / count

    def forget(self, request_id: str) -> None:
        """Drop a request's running sum (it ended early: aborted or failed)."""
        self._sums.pop(request_id, None)


def normalized(vector: torch.Tensor) -> np.ndarray:
    """`vector` scaled to unit L2 norm, as float32 numpy (what crosses the process boundary)."""
    vector = vector.float()
    return torch.nn.functional.normalize(vector, dim=0).cpu().numpy()
