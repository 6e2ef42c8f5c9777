"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and per-sequence block tables.

The manager only counts and hands out block ids; the KV tensors themselves live in the
model runner (one preallocated pool per layer, indexed by these ids). Reference counts let
a later prefix cache share a block between sequences.
"""

from __future__ import annotations

from collections import deque

from splitfuse.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks kept free when admitting new prompts, so running decodes can still grow.
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold KV for its first `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Admission check for a new (or recomputed) sequence, keeping the watermark free."""
        return self.num_free_blocks - self.blocks_missing(seq, num_tokens) >= self.watermark_blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a running sequence can get room for `num_tokens` tokens (no watermark)."""
        return self.blocks_missing(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to hold `num_tokens` tokens. Caller checked room."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {missing}, have {len(self._free)}")
        for _ in range(missing):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (at finish, abort or preemption)."""
        # Freed in reverse so the most recently used blocks are handed out last.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table.clear()

    def check_invariants(self, live: list[Sequence]) -> None:
        """used + free == total; no block owned twice; ref counts match owners. For tests."""
        owners = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            if block in free:
                assert owners[block] == 0, f"free block {block} is owned by a sequence"
                assert self._ref_counts[block] == 0, f"free block {block} has references"
            else:
                assert owners[block] == self._ref_counts[block] > 0, (
                    f"block {block}: {owners[block]} owners, ref count {self._ref_counts[block]}"
                )
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
