import pytest

from splitfuse.block_manager import BlockManager, blocks_needed
from splitfuse.sequence import SamplingParams, Sequence


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
