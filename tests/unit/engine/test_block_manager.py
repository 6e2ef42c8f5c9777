import pytest

from splitfuse.engine.block_manager import BlockManager, blocks_needed
from splitfuse.engine.sequence import SamplingParams, Sequence


def seq(n: int, name: str = "s") -> Sequence:
    return Sequence(name, list(range(n)), SamplingParams(), arrival=0)


def test_grow_allocates_only_missing_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(9)
    bm.grow(a, 9)
    assert len(a.block_table) == blocks_needed(9, 4) == 3
    bm.grow(a, 12)  # still fits in 3 blocks
    assert len(a.block_table) == 3
    bm.grow(a, 13)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 6
    b = seq(5, "b")
    bm.grow(b, 5)
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.check_invariants([a, b])
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_admission_keeps_watermark_but_growth_may_use_it():
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.1)
    assert bm.watermark_blocks == 10
    a = seq(90)
    assert bm.can_admit(a, 90)
    assert not bm.can_admit(a, 91)
    bm.grow(a, 90)
    assert bm.can_grow(a, 100) and not bm.can_grow(a, 101)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(a, 101)
    bm.check_invariants([a])


def test_invariant_check_catches_double_ownership():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq(4, "a"), seq(2, "b")
    bm.grow(a, 4)
    b.block_table.append(a.block_table[0])  # corrupt: a block owned twice
    with pytest.raises(AssertionError):
        bm.check_invariants([a, b])


# ---- prefix caching ------------------------------------------------------------------------


def computed(bm: BlockManager, s: Sequence, num_tokens: int) -> Sequence:
    """Admit `s` after its cached prefix and pretend its first `num_tokens` tokens ran."""
    cached = bm.lookup(s)
    bm.take_cached(s, cached)
    bm.grow(s, s.num_tokens)
    s.num_computed_tokens = len(cached) * bm.block_size
    before = s.num_computed_tokens
    s.num_computed_tokens = num_tokens
    bm.cache_computed_blocks(s, before)
    return s


def tokens_seq(tokens: list[int], name: str, cache_salt: str | None = None) -> Sequence:
    return Sequence(name, tokens, SamplingParams(cache_salt=cache_salt), arrival=0)


def test_lookup_finds_the_longest_cached_chain_and_leaves_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = computed(bm, tokens_seq(list(range(10)), "a"), 10)  # blocks 0-1 full and computed, 2 partial
    assert bm.lookup(tokens_seq(list(range(10)) + [99], "b")) == a.block_table[:2]
    # Same first block, different second: the chain stops at the first difference.
    assert bm.lookup(tokens_seq([0, 1, 2, 3, 4, 5, 6, 99, 8, 9], "c")) == a.block_table[:1]
    # Same second block but a different first: the chained hash does not match.
    assert bm.lookup(tokens_seq([99, 1, 2, 3, 4, 5, 6, 7, 8], "d")) == []
    # A prompt exactly two blocks long keeps its last block to compute (it must sample).
    assert bm.lookup(tokens_seq(list(range(8)), "e")) == a.block_table[:1]
    assert bm.lookup(tokens_seq(list(range(9)), "f")) == a.block_table[:2]
    bm.check_invariants([a])


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(10))
    plain = computed(bm, tokens_seq(tokens, "plain"), 10)
    salted = computed(bm, tokens_seq(tokens, "salted", cache_salt="tenant-a"), 10)
    assert bm.lookup(tokens_seq(tokens + [1], "x")) == plain.block_table[:2]
    assert bm.lookup(tokens_seq(tokens + [1], "y", cache_salt="tenant-a")) == salted.block_table[:2]
    assert not set(salted.block_table[:2]) & set(plain.block_table[:2])  # computed apart, not shared
    assert bm.lookup(tokens_seq(tokens + [1], "z", cache_salt="tenant-b")) == []
    bm.check_invariants([plain, salted])


def test_only_full_computed_blocks_are_shared():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = computed(bm, tokens_seq(list(range(12)), "a"), 6)  # a chunk of 6: one full computed block
    assert bm.lookup(tokens_seq(list(range(12)), "b")) == a.block_table[:1]
    a.num_computed_tokens = 12  # the next chunk ran
    bm.cache_computed_blocks(a, 6)
    assert bm.lookup(tokens_seq(list(range(13)), "b")) == a.block_table[:3]
    bm.check_invariants([a])


def test_shared_blocks_are_reference_counted_and_freed_blocks_stay_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, tokens_seq(list(range(9)), "a"), 9)
    b = computed(bm, tokens_seq(list(range(8)) + [50, 51, 52], "b"), 11)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_used_blocks == 4
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.num_used_blocks == 3  # the two shared blocks are still b's
    bm.check_invariants([b])
    bm.free(b)
    # Every block is free again, the hashed ones still findable.
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 2
    again = tokens_seq(list(range(8)) + [50, 51, 52, 53], "again")
    assert len(bm.lookup(again)) == 2
    bm.check_invariants([])


def test_cached_blocks_are_evicted_lru_only_when_no_uncached_block_is_free():
    bm = BlockManager(num_blocks=6, block_size=2)
    old = computed(bm, tokens_seq([1, 2, 3, 4, 5], "old"), 5)  # 2 hashed blocks + 1 partial
    bm.free(old)
    new = computed(bm, tokens_seq([7, 8, 9, 10, 11], "new"), 5)
    bm.free(new)
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 6
    # Two uncached free blocks are used before any cached one is evicted.
    filler = tokens_seq([0, 0, 0, 0], "filler")
    bm.grow(filler, 4)
    assert len(bm.lookup(tokens_seq([1, 2, 3, 4, 5], "x"))) == 2
    assert len(bm.lookup(tokens_seq([7, 8, 9, 10, 11], "y"))) == 2
    # Two more: the least recently freed ("old"'s, its last block first) go, their hashes too.
    bm.grow(filler, 8)
    assert bm.lookup(tokens_seq([1, 2, 3, 4, 5], "x")) == []
    assert len(bm.lookup(tokens_seq([7, 8, 9, 10, 11], "y"))) == 2
    bm.check_invariants([filler])
    # A hit on a cached-free block takes it out of the free pool: the only free blocks are
    # the two it hits, so the third block it needs is missing.
    user = tokens_seq([7, 8, 9, 10, 11], "user")
    hit = bm.lookup(user)
    assert len(hit) == 2 and bm.num_free_blocks == 2 and not bm.can_admit(user, 5, hit)
    bm.free(filler)
    assert bm.can_admit(user, 5, hit)
    bm.take_cached(user, hit)
    bm.grow(user, 5)
    user.num_computed_tokens = 4  # the scheduler starts it after the hits
    assert bm.num_free_blocks == 3 and bm.num_cached_free_blocks == 0
    bm.check_invariants([user])


def test_admission_counts_cached_free_hits_as_taken():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = computed(bm, tokens_seq([1, 2, 3, 4, 5], "a"), 5)
    bm.free(a)  # 2 cached-free blocks + 2 free
    b = tokens_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # 5 blocks; hits 2, needs 3 more of 2 left
    hit = bm.lookup(b)
    assert len(hit) == 2 and not bm.can_admit(b, 9, hit)
    c = tokens_seq([1, 2, 3, 4, 5, 6, 7], "c")  # 4 blocks: hits 2, needs 2 more
    assert bm.can_admit(c, 7, bm.lookup(c))


def test_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = computed(bm, tokens_seq([1, 2, 3, 4, 5], "a"), 5)
    assert bm.lookup(tokens_seq([1, 2, 3, 4, 5], "b")) == []
    bm.free(a)
    assert bm.num_cached_free_blocks == 0
    bm.check_invariants([])


def test_invariant_check_catches_a_stale_hash_and_a_block_both_free_and_cached():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = computed(bm, tokens_seq([1, 2, 3, 4, 5], "a"), 5)
    bm.free(a)
    bm.check_invariants([])
    block = next(iter(bm._cached_free))
    bm._hash_of_block[block] = None  # corrupt: evicted without forgetting its hash
    with pytest.raises(AssertionError):
        bm.check_invariants([])
    bm = BlockManager(num_blocks=6, block_size=2)
    a = computed(bm, tokens_seq([1, 2, 3, 4, 5], "a"), 5)
    bm.free(a)
    bm._free.append(next(iter(bm._cached_free)))  # corrupt: in two free lists
    with pytest.raises(AssertionError):
        bm.check_invariants([])
