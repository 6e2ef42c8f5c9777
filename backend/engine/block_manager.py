"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables, and the
prefix cache that lets requests starting with the same tokens share computed blocks.

The manager only counts and hands out block ids; the KV tensors themselves live in the
model runner (one preallocated pool per layer, indexed by these ids).

Prefix caching (automatic, as vLLM's): a FULL block whose KV is computed is identified by a
hash chained over (its parent block's hash, its token ids), so equal hashes mean equal whole
prefixes. A map from hash to block lets a new sequence take the longest chain of such blocks
its own tokens produce (the block's reference count + 1) instead of computing them again.
Only full, computed blocks are shared and nobody writes into them again, so no copy-on-write
is needed. A freed block that carries a hash stays findable ("cached-free") until a new
block is needed and no block without a hash is free: then the least recently freed one is
evicted and its hash forgotten.

Tiers below the pool (kv_tiers/, `record_evictions`): an evicted block's (hash, id) is kept
until the engine drains it, before the step's forward pass can overwrite the block, so its KV can
be copied down first; `tier_candidates` names the blocks past the pool's hits a tier may restore.

Every block is in exactly one state: free (no hash), cached-free (hash, no owner) or owned
(reference count = number of sequences whose block table holds it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence as Tokens

import numpy as np

from splitfuse.engine.sequence import Sequence
from splitfuse.kv_events.events import KvEventLog

ROOT_HASH = b""
"""Parent hash of a sequence's first block (without a cache salt)."""


def root_hash(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """Parent hash of a sequence's first block: a salt starts a chain of its own, so requests
    share cached blocks only with requests of the same salt; so does a LoRA adapter (its KV
    differs from the base's and other adapters' for the same tokens)."""
    if cache_salt is None and lora_name is None:
        return ROOT_HASH
    # Adapter names hold no NUL, and the two prefixes differ: no salt can pose as an adapter.
    key = b"" if lora_name is None else b"lora_name\0" + lora_name.encode("utf-8") + b"\0"
    if cache_salt is not None:
        key += b"cache_salt\0" + cache_salt.encode("utf-8")
    return hashlib.sha256(key).digest()


def seq_root_hash(seq: Sequence) -> bytes:
    root = root_hash(seq.params.cache_salt, seq.params.lora_name)
    if seq.rope_offset:  # its keys were rotated with another rope set (LongRoPE's long factors)
        root = hashlib.sha256(root + b"rope_offset\0" + str(seq.rope_offset).encode()).digest()
    return root


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(parent: bytes, block_token_ids: Tokens[int]) -> bytes:
    """Hash of a full block given its parent's hash: equal hashes mean equal prefixes.

    SHA-256 rather than Python's hash(): a collision would silently hand one request another
    request's KV, and int-tuple hashes are easy to collide on purpose."""
    tokens = np.asarray(block_token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(parent + tokens).digest()


def watermark_blocks(num_blocks: int, watermark: float) -> int:
    """Blocks kept free when admitting new prompts, so running decodes can still grow."""
    return int(watermark * num_blocks)


def longest_sequence(num_blocks: int, block_size: int, watermark: float) -> int:
    """Tokens of the longest sequence a pool can admit on its own (all but the watermark)."""
    return (num_blocks - watermark_blocks(num_blocks, watermark)) * block_size


def pool_blocks_for(num_blocks: int, watermark: float) -> int:
    """The fewest blocks a pool needs for `num_blocks` of them to be admittable beside its
    watermark."""
    total = num_blocks
    while total - watermark_blocks(total, watermark) < num_blocks:
        total += 1
    return total


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = True, record_evictions: bool = False,
                 kv_events: KvEventLog | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks(num_blocks, watermark)
        self._free: deque[int] = deque(range(num_blocks))  # free blocks without a hash
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[bytes | None] = [None] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self.kv_events = kv_events
        """Where blocks cached and evicted are recorded, when KV events are published (kv_events/)."""
        self.record_evictions = record_evictions
        self._evicted: list[tuple[bytes, int]] = []  # (hash, block) evicted since the last drain

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: free ones and cached-free ones (evicted on demand)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ---- prefix cache ---------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of `seq`'s first `num_blocks` blocks (all full), memoized on the sequence:
        its tokens only ever grow, so a full block's hash never changes."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if i else seq_root_hash(seq)
            hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _max_cached_blocks(self, seq: Sequence) -> int:
        """Most leading blocks of `seq` a cache may give it: full ones, leaving at least its last
        token to compute (that step samples the next token); 0 where none may be skipped."""
        # A mean-pooled embedding needs every token's hidden state: nothing of it may be skipped.
        if not self.enable_prefix_caching or seq.block_table or seq.pooling == "mean":
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s longest computed prefix (see `_max_cached_blocks`).
        Does not take them."""
        hits: list[int] = []
        for i in range(self._max_cached_blocks(seq)):
            block = self._block_of_hash.get(self.block_hashes(seq, i + 1)[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def tier_candidates(self, seq: Sequence, num_hits: int) -> list[bytes]:
        """Hashes of `seq`'s blocks after its `num_hits` pool hits that a lower tier may restore
        (the same rule as pool hits: full blocks, its last token left to compute)."""
        max_blocks = self._max_cached_blocks(seq)
        return self.block_hashes(seq, max_blocks)[num_hits:max_blocks] if max_blocks > num_hits else []

    def drain_evicted(self) -> list[tuple[bytes, int]]:
        """(hash, block) of each cached block evicted since the last drain (`record_evictions`):
        their KV is intact until the next forward pass writes into the blocks."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def cache_computed_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Make the blocks that became full and computed since `num_computed_before` findable.

        A block whose tokens another block already holds (two requests computed the same
        prefix at once) stays private and returns to the plain free list when freed."""
        if not self.enable_prefix_caching:
            return
        first = num_computed_before // self.block_size
        last = seq.num_computed_tokens // self.block_size
        if last <= first:
            return
        hashes = self.block_hashes(seq, last)
        stored: list[int] = []
        for i in range(first, last):
            block = seq.block_table[i]
            if self._hash_of_block[block] is None and hashes[i] not in self._block_of_hash:
                self._hash_of_block[block] = hashes[i]
                self._block_of_hash[hashes[i]] = block
                stored.append(i)
        if self.kv_events is not None and stored:
            self._record_stored(seq, hashes, stored)

    def _record_stored(self, seq: Sequence, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored event per run of consecutive blocks of `seq` made findable."""
        bs = self.block_size
        start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            a, b = stored[start], stored[k - 1] + 1
            self.kv_events.stored(hashes[a:b], hashes[a - 1] if a else None, seq.token_ids[a * bs : b * bs], bs,
                                  seq.params.lora_name, seq.params.cache_salt)
            start = k

    # ---- allocation -----------------------------------------------------------------------------
    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold KV for its first `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_admit(self, seq: Sequence, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Admission check for a new (or recomputed) sequence that would take the `cached`
        blocks from `lookup`, keeping the watermark free."""
        cached = self.lookup(seq) if cached is None else cached
        # Cached-free blocks it takes stop being available to anyone else.
        taken_from_free = sum(1 for b in cached if b in self._cached_free)
        missing = self.blocks_missing(seq, num_tokens) - len(cached)
        return self.num_free_blocks - taken_from_free - missing >= self.watermark_blocks

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a running sequence can get room for `num_tokens` tokens (no watermark)."""
        return self.blocks_missing(seq, num_tokens) <= self.num_free_blocks

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        """Start `seq`'s (empty) block table with the cached blocks from `lookup`."""
        assert not seq.block_table, "cached blocks start a block table"
        for block in cached:
            if self._ref_counts[block] == 0:
                del self._cached_free[block]
            self._ref_counts[block] += 1
            seq.block_table.append(block)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to hold `num_tokens` tokens. Caller checked room."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, have {self.num_free_blocks}")
        for _ in range(missing):
            block = self._free.popleft() if self._free else self._evict()
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def _evict(self) -> int:
        block, _ = self._cached_free.popitem(last=False)
        h = self._hash_of_block[block]
        del self._block_of_hash[h]
        if self.kv_events is not None:
            self.kv_events.removed(h)
        self._hash_of_block[block] = None
        if self.record_evictions:
            self._evicted.append((h, block))
        return block

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of `seq`'s table past what `num_tokens` tokens need (slots
        reserved for proposed tokens that were rejected). They were never full and computed,
        so none carries a hash."""
        keep = blocks_needed(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] == 0 and self._hash_of_block[block] is None, "trimmed a shared block"
            self._free.append(block)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (at finish, abort or preemption)."""
        # Freed in reverse: a sequence's last blocks are the least likely to be shared, so they
        # are evicted (or handed out) first.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._hash_of_block[block] is None:
                    self._free.append(block)
                else:
                    self._cached_free[block] = None
        seq.block_table.clear()

    # ---- checks -----------------------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block free, cached-free or owned, never two; ref counts match owners; the
        hash map and the blocks' hashes agree (an evicted block's hash is gone); a hashed
        block in a table holds exactly the tokens its hash says. For tests."""
        owners = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                owners[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cached_free = set(self._cached_free)
        assert not free & cached_free, "a block is both free and cached-free"
        for block in range(self.num_blocks):
            h = self._hash_of_block[block]
            if block in free:
                assert h is None, f"free block {block} still carries a hash"
            if block in free or block in cached_free:
                assert owners[block] == 0, f"free block {block} is owned by a sequence"
                assert self._ref_counts[block] == 0, f"free block {block} has references"
            else:
                assert owners[block] == self._ref_counts[block] > 0, (
                    f"block {block}: {owners[block]} owners, ref count {self._ref_counts[block]}"
                )
            if block in cached_free:
                assert h is not None, f"cached-free block {block} has no hash"
            if h is not None:
                assert self._block_of_hash.get(h) == block, f"block {block}'s hash maps elsewhere"
        assert len(self._block_of_hash) == sum(h is not None for h in self._hash_of_block), (
            "the hash map holds a hash no block carries (an evicted block's hash?)"
        )
        if not self.enable_prefix_caching:
            assert not self._block_of_hash, "blocks hashed with prefix caching off"
        bs = self.block_size
        for seq in live:
            parent = seq_root_hash(seq)
            for i, block in enumerate(seq.block_table):
                if (i + 1) * bs > seq.num_tokens:
                    break
                expected = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
                h = self._hash_of_block[block]
                assert h is None or h == expected, f"{seq.request_id}: block {block} holds other tokens"
                if h is not None:
                    assert (i + 1) * bs <= seq.num_computed_tokens, f"{seq.request_id}: hashed block {block} not computed"
                parent = expected
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
