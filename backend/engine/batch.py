"""A step's flat tensors, built from the scheduler's decision with vectorized numpy ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from splitfuse.layers.attention import AttentionMetadata
from splitfuse.lora.batching import LoraRows
from splitfuse.engine.scheduler import ScheduledChunk
from splitfuse.engine.stage_sampling import StageSampling


@dataclass
class SampleRows:
    """The sample rows as a ragged batch of their own: they are the last rows of the sampling
    chunks, over the same contexts (the sampling sequences only)."""

    attn: AttentionMetadata
    query_lens: list[int]
    seq_lens: list[int]


@dataclass
class RaggedBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]: rows of the rope tables (the position + its sequence's rope_offset)
    sample_rows: torch.Tensor  # int64 [S]: rows whose final hidden state is read: a next token's (1 + proposals per
    # sampling chunk) or an embedding's (the last prompt row, or every row of a mean-pooled chunk)
    attn: AttentionMetadata
    query_lens: list[int]
    seq_lens: list[int]
    # The last layer runs its attention output, o_proj and MLP for the sample rows only (every
    # row still writes its K/V there): no other row's hidden state is read after it. None when
    # every row is a sample row (a step of decodes), so such a step runs as it is.
    last_layer: SampleRows | None
    # Which rows each LoRA adapter owns (each sequence's SamplingParams.lora_name); None when no
    # sequence of the step has one.
    lora: LoraRows | None = None
    # Of the rows read, those of embedding chunks (pooled, in chunk order) and the others (their
    # logits); both None when the step has no embedding chunk (every row read gives logits).
    pool_rows: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None
    # With pipeline parallelism: what the last stage needs to sample this batch's sampling rows.
    sampling: StageSampling | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], block_size: int, device: torch.device,
              sampling: StageSampling | None = None) -> "RaggedBatch":
        num_seqs = len(chunks)
        query_lens = np.fromiter((c.num_tokens + c.num_draft_tokens for c in chunks), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((c.seq.num_computed_tokens for c in chunks), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        query_start_loc = _start_loc(query_lens)
        total = int(query_start_loc[-1])

        token_ids: list[int] = []
        for c in chunks:
            s = c.seq.num_computed_tokens
            token_ids.extend(c.seq.token_ids[s : s + c.num_tokens])
            if c.num_draft_tokens:
                token_ids.extend(c.seq.draft_token_ids[: c.num_draft_tokens])

        # Position of each token: its sequence's start offset plus its index in the chunk.
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], query_lens)

        max_blocks = max(len(c.seq.block_table) for c in chunks)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, c in enumerate(chunks):
            block_tables[i, : len(c.seq.block_table)] = c.seq.block_table
        slot_mapping = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
        slot_mapping += positions % block_size

        # A sampling chunk's last row, and before it one row per proposed token: row i gives the
        # token after the chunk's first i proposals, to verify proposal i + 1 against.
        kept = np.fromiter((rows_read(c) for c in chunks), dtype=np.int64, count=num_seqs)
        samples = kept > 0  # the chunks with rows read
        num_rows = kept[samples]
        ends = query_start_loc[1:][samples]
        sample_rows = np.repeat(ends - num_rows, num_rows) + _ranges(num_rows)

        offsets = np.fromiter((c.seq.rope_offset for c in chunks), dtype=np.int64, count=num_seqs)
        if offsets.any():  # only the rotary tables read the positions
            positions = positions + np.repeat(offsets, query_lens)

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)
        attn = AttentionMetadata(
            slot_mapping=tensor(slot_mapping),
            query_start_loc=tensor(query_start_loc.astype(np.int32)),
            seq_lens=tensor(seq_lens.astype(np.int32)),
            block_tables=tensor(block_tables),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
        )
        last_layer = None
        if len(sample_rows) < total:
            sample_seq_lens = seq_lens[samples]
            last_layer = SampleRows(
                attn=AttentionMetadata(
                    slot_mapping=tensor(slot_mapping[sample_rows]),
                    query_start_loc=tensor(_start_loc(num_rows).astype(np.int32)),
                    seq_lens=tensor(sample_seq_lens.astype(np.int32)),
                    block_tables=tensor(block_tables[samples]),
                    max_query_len=int(num_rows.max(initial=0)),
                    max_seq_len=int(sample_seq_lens.max(initial=0)),
                    block_size=block_size,
                ),
                query_lens=num_rows.tolist(),
                seq_lens=sample_seq_lens.tolist(),
            )
        lora = LoraRows.build([c.seq.params.lora_name for c in chunks], query_lens,
                              sample_rows if last_layer is not None else None)
        pool_rows, logit_rows = _pooled_rows(chunks, samples, num_rows, tensor)
        return cls(
            input_ids=tensor(np.asarray(token_ids, dtype=np.int64)),
            positions=tensor(positions),
            sample_rows=tensor(sample_rows),
            attn=attn,
            query_lens=query_lens.tolist(),
            seq_lens=seq_lens.tolist(),
            last_layer=last_layer,
            lora=lora,
            pool_rows=pool_rows, logit_rows=logit_rows, sampling=sampling,
        )


def rows_read(chunk: ScheduledChunk) -> int:
    """Rows of `chunk` whose final hidden state the step reads (its last ones)."""
    if chunk.seq.pooling == "mean":
        return chunk.num_tokens
    return 1 + chunk.num_draft_tokens if chunk.samples else 0


def _pooled_rows(chunks: list[ScheduledChunk], reads: np.ndarray, num_rows: np.ndarray,
                 tensor: Callable[[np.ndarray], torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Of the rows read (`num_rows` of each chunk in `reads`), those of embedding chunks and the
    others; (None, None) when no chunk is an embedding's."""
    pooled = np.fromiter((c.seq.pooling is not None for c in chunks), dtype=bool, count=len(chunks))[reads]
    if not pooled.any():
        return None, None
    pooled = np.repeat(pooled, num_rows)
    return tensor(np.flatnonzero(pooled)), tensor(np.flatnonzero(~pooled))


def _start_loc(lengths: np.ndarray) -> np.ndarray:
    """[0, l0, l0 + l1, ...]: where each run of `lengths` starts, and the total last."""
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each n in `lengths`, concatenated."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
