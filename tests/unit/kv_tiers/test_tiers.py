"""The tiers below the KV pool on their own: the codec's round trip and checks, the memory
tier's bound and LRU order, the disk tier's bound, LRU order, sharing and corruption handling,
and the store moving blocks down from memory to disk."""

import os

import pytest
import torch

from splitfuse.kv_tiers import block_codec
from splitfuse.kv_tiers.block_codec import CorruptBlock, decode, encode
from splitfuse.kv_tiers.disk_tier import DiskTier
from splitfuse.kv_tiers.fingerprint import KVFingerprint, model_files_identity
from splitfuse.kv_tiers.memory_tier import MemoryTier
from splitfuse.kv_tiers.tiered_store import MEDIUM_DISK, MEDIUM_MEMORY, TieredStore

FP = bytes(range(32))
OTHER_FP = bytes(32)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def blob(i: int, size: int = 100) -> bytes:
    return encode(bytes([i % 256]) * size, FP)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (2, 4, 8)), (torch.bfloat16, (4, 2, 8)),
                                         (torch.int8, (2, 4 * (8 + 4)))])
def test_codec_round_trip_moves_whole_blocks_of_every_layer(dtype, shape):
    """Blocks read from one pool and written at other ids of another are equal in every layer,
    K and V, for each backend's layout and cache dtype; the others are untouched."""
    def pool(fill):
        if dtype is torch.int8:
            return torch.randint(-128, 127, (6, *shape), dtype=dtype) if fill else torch.zeros((6, *shape), dtype=dtype)
        return torch.randn((6, *shape)).to(dtype) if fill else torch.zeros((6, *shape), dtype=dtype)

    src = [(pool(True), pool(True)) for _ in range(3)]
    dst = [(pool(False), pool(False)) for _ in range(3)]
    blobs = block_codec.read_blocks(src, [4, 1], FP)
    assert all(len(b) == block_codec.block_bytes(src) for b in blobs)
    block_codec.write_blocks(dst, [0, 5], [decode(b, FP) for b in blobs])
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[0], sk[4]) and torch.equal(dv[0], sv[4])
        assert torch.equal(dk[5], sk[1]) and torch.equal(dv[5], sv[1])
        assert not dk[1:5].any() and not dv[1:5].any()


def test_codec_refuses_other_models_truncation_and_flipped_bytes():
    b = encode(b"x" * 64, FP)
    assert bytes(decode(b, FP)) == b"x" * 64
    with pytest.raises(CorruptBlock, match="fingerprint"):
        decode(b, OTHER_FP)
    with pytest.raises(CorruptBlock, match="payload"):
        decode(b[:-1], FP)
    with pytest.raises(CorruptBlock, match="header"):
        decode(b[:10], FP)
    flipped = bytearray(b)
    flipped[-5] ^= 0xFF
    with pytest.raises(CorruptBlock, match="checksum"):
        decode(bytes(flipped), FP)


def test_fingerprint_tells_models_and_numerics_apart(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    ident = model_files_identity(str(tmp_path))
    base = dict(architecture="LlamaForCausalLM", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16,
                kv_dtype="float32", block_shape=(2, 256), numerics="float32 none torch", weights=ident)
    assert KVFingerprint(**base).digest() == KVFingerprint(**base).digest()
    for field, value in [("block_size", 8), ("kv_dtype", "bfloat16"), ("numerics", "float32 int8 cpu")]:
        assert KVFingerprint(**{**base, field: value}).digest() != KVFingerprint(**base).digest()
    (tmp_path / "model.safetensors").write_bytes(b"b" * 11)  # another checkpoint of the same shape
    assert model_files_identity(str(tmp_path)) != ident


def test_memory_tier_is_bounded_by_bytes_and_drops_the_least_recently_used():
    tier = MemoryTier(bound_bytes=3 * len(blob(0)))
    for i in range(3):
        assert tier.put(key(i), blob(i)) == []
    assert tier.get(key(0)) == blob(0)  # 0 becomes the most recently used
    pushed = tier.put(key(3), blob(3))
    assert pushed == [(key(1), blob(1))]
    assert tier.keys() == [key(2), key(0), key(3)] and tier.used_bytes == 3 * len(blob(0))
    assert tier.put(key(2), blob(2)) == []  # already held: refreshed, not added twice
    assert tier.keys() == [key(0), key(3), key(2)]
    assert [k for k, _ in tier.put(key(9), encode(b"z" * 1000, FP))] == [key(0), key(3), key(2), key(9)]
    assert len(tier) == 0 and tier.used_bytes == 0  # larger than the whole bound: not kept


def test_disk_tier_bound_lru_and_atomic_files(tmp_path):
    size = len(blob(0))
    tier = DiskTier(str(tmp_path), bound_bytes=4 * size, fingerprint=FP)
    for i in range(4):
        assert tier.put(key(i), blob(i)) == (True, [])
    assert tier.put(key(1), blob(1)) == (False, [])  # there already: touched, 1 most recent
    assert tier.get(key(0)) == blob(0)  # a hit touches: 0 most recent
    written, deleted = tier.put(key(4), blob(4))  # past the bound: down to 90% of it, oldest first
    assert written and deleted == [key(2), key(3)]  # 5 blocks down to 3.6: the two least recent
    assert all(key(i) in tier for i in (0, 1, 4)) and tier.used_bytes == 3 * size
    names = os.listdir(tier.dir)
    assert sorted(names) == sorted(key(i).hex() for i in (0, 1, 4))  # no temporary file left
    assert os.path.dirname(tier.dir) == str(tmp_path)  # a folder of the fingerprint's own
    # Another process sharing the folder sees the same blocks and their usage.
    other = DiskTier(str(tmp_path), bound_bytes=4 * size, fingerprint=FP)
    assert other.used_bytes == 3 * size and other.get(key(4)) == blob(4)
    other.drop(key(4))
    tier.drop(key(4))  # deleted by the other first: no error
    assert tier.get(key(4)) is None
    assert DiskTier(str(tmp_path), 4 * size, OTHER_FP).get(key(0)) is None  # another model's folder


def test_disk_tier_scan_removes_stale_temporary_files_and_ignores_strangers(tmp_path):
    tier = DiskTier(str(tmp_path), bound_bytes=1000, fingerprint=FP)
    stale = os.path.join(tier.dir, ".tmp-1-dead")
    open(stale, "wb").write(b"half")
    os.utime(stale, (0, 0))
    open(os.path.join(tier.dir, "README"), "w").write("not a block")
    assert DiskTier(str(tmp_path), bound_bytes=1000, fingerprint=FP).used_bytes == 0
    assert not os.path.exists(stale) and os.path.exists(os.path.join(tier.dir, "README"))


def test_store_moves_blocks_down_and_reports_every_change(tmp_path):
    events = []
    size = len(blob(0))
    store = TieredStore(FP, MemoryTier(2 * size), DiskTier(str(tmp_path), 10 * size, FP),
                        listener=lambda what, medium, k: events.append((what, medium, k)))
    for i in range(3):
        store.put(key(i), blob(i))
    assert key(0) in store.disk and key(0) not in store.memory  # pushed out of memory, down to disk
    assert events == [("stored", MEDIUM_MEMORY, key(0)), ("stored", MEDIUM_MEMORY, key(1)),
                      ("stored", MEDIUM_MEMORY, key(2)), ("removed", MEDIUM_MEMORY, key(0)),
                      ("stored", MEDIUM_DISK, key(0))]
    assert store.prefix_length([key(0), key(1), key(2), key(7), key(1)]) == 3
    assert store.fetch(key(2)).medium == MEDIUM_MEMORY
    hit = store.fetch(key(0))
    assert hit.medium == MEDIUM_DISK and bytes(hit.payload) == bytes([0]) * 100
    assert store.fetch(key(7)).payload is None
    assert store.used_bytes() == (2 * size, size)


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_model"])
def test_a_damaged_disk_block_is_deleted_and_counted(tmp_path, damage):
    events = []
    store = TieredStore(FP, None, DiskTier(str(tmp_path), 1 << 20, FP), lambda *e: events.append(e))
    store.put(key(1), blob(1))
    path = store.disk.path(key(1))
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[-3] ^= 0x55
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(encode(b"\x01" * 100, OTHER_FP))
    open(path, "wb").write(bytes(data))
    got = store.fetch(key(1))
    assert got.payload is None and got.corrupt and got.medium == MEDIUM_DISK
    assert not os.path.exists(path) and events[-1] == ("removed", MEDIUM_DISK, key(1))
    assert store.fetch(key(1)).payload is None and not store.fetch(key(1)).corrupt  # gone, not counted twice
