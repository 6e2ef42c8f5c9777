"""A step's batch cut into micro-batches of whole sequences, for pipeline parallelism: the first
stage runs micro-batch m + 1 while the next stage runs m, so with P stages and P micro-batches
the stages work at once instead of in turn (each step still fills and drains the pipeline).

The cut keeps the chunks' order (contiguous groups), so the micro-batches' sampling rows,
concatenated, are the step's sampling rows in the order the sampler expects. Sequences never
repeat across micro-batches (one chunk per sequence per step), so none waits on another's token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.scheduler import ScheduledChunk
from splitfuse.engine.stage_sampling import StageSampling


@dataclass
class MicroBatches:
    parts: list[RaggedBatch]

    @property
    def num_tokens(self) -> int:
        return sum(part.num_tokens for part in self.parts)

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], block_size: int, device: torch.device, count: int,
              sampling: Callable[[list[ScheduledChunk]], StageSampling]) -> "MicroBatches":
        """`sampling(group)`: what the last stage needs to sample a group of chunks' rows."""
        return cls([RaggedBatch.build(group, block_size, device, sampling=sampling(group))
                    for group in split_chunks(chunks, count)])


def split_chunks(chunks: list[ScheduledChunk], count: int) -> list[list[ScheduledChunk]]:
    """`chunks` in min(count, len(chunks)) contiguous non-empty groups of about equal token counts."""
    sizes = [c.num_tokens + c.num_draft_tokens for c in chunks]
    total = sum(sizes)
    groups: list[list[ScheduledChunk]] = [[]]
    done = 0
    for i, (chunk, size) in enumerate(zip(chunks, sizes)):
        # A new group once the tokens so far reach the groups so far's share, or when the chunks
        # left are just enough to give each group still to come one (more groups: more overlap).
        if groups[-1] and len(groups) < count and (done >= total * len(groups) / count
                                                   or len(chunks) - i <= count - len(groups)):
            groups.append([])
        groups[-1].append(chunk)
        done += size
    return groups
