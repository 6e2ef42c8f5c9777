"""KV events' records and encoding, decoded with plain msgpack into vLLM's field order; the block
manager's log of them; the endpoint checks and the endpoint of each replica."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from splitfuse.config import EngineConfig
from splitfuse.engine.block_manager import ROOT_HASH, BlockManager, chain_hash, root_hash
from splitfuse.engine.sequence import SamplingParams, Sequence
from splitfuse.kv_events.endpoint import check_endpoint, replica_endpoint
from splitfuse.kv_events.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEventLog,
                                        encode_batch, external_hash)

DIGEST = hashlib.sha256(b"block").digest()


def test_external_hash_is_vllms_int_conversion():
    # vLLM (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default): int.from_bytes(h, "big") & (2**64 - 1)
    assert external_hash(DIGEST) == int.from_bytes(DIGEST, "big") & ((1 << 64) - 1)
    assert 0 <= external_hash(DIGEST) < 1 << 64


def _batch() -> EventBatch:
    stored = BlockStored([11, 12], 10, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", "sql", "tenant")
    return EventBatch(1234.5, [stored, BlockRemoved([10, 2**64 - 1], "GPU"), AllBlocksCleared()], 3)


def test_array_encoding_is_vllms_tagged_arrays_in_field_order():
    ts, events, rank = msgpack.unpackb(encode_batch(_batch(), "array"), raw=False)
    assert (ts, rank) == (1234.5, 3)
    assert events == [
        # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
        ["BlockStored", [11, 12], 10, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", "sql"],
        ["BlockRemoved", [10, 2**64 - 1], "GPU"],  # hashes up to 2**64 - 1: msgpack uint64
        ["AllBlocksCleared"],
    ]


def test_map_encoding_names_the_fields_and_the_salt():
    _, events, _ = msgpack.unpackb(encode_batch(_batch(), "map"), raw=False)
    assert events[0] == {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10,
                         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "lora_id": None, "medium": "GPU",
                         "lora_name": "sql", "cache_salt": "tenant"}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [10, 2**64 - 1], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
    with pytest.raises(ValueError, match="encoding"):
        encode_batch(_batch(), "json")


def test_log_joins_evictions_in_a_row():
    log = KvEventLog()
    log.removed(b"\1" * 32)
    log.removed(b"\2" * 32)
    log.stored([b"\3" * 32], None, [1, 2], 2, None, None)
    log.removed(b"\4" * 32)
    events = log.take()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored, BlockRemoved]
    assert events[0].block_hashes == [external_hash(b"\1" * 32), external_hash(b"\2" * 32)]
    assert log.take() == []
    # A tier behind the pool (host memory) records in the same log under its own medium.
    log.removed(b"\1" * 32)
    log.removed(b"\2" * 32, medium="CPU")
    log.stored([b"\3" * 32], None, [1, 2], 2, None, None, medium="DISK")
    assert [(type(e).__name__, e.medium) for e in log.take()] == [
        ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU"), ("BlockStored", "DISK")]


def _computed(bm: BlockManager, name: str, tokens: list[int], params: SamplingParams | None = None) -> Sequence:
    """A sequence whose tokens all got KV (blocks allocated and cached as the scheduler does)."""
    seq = Sequence(name, tokens, params or SamplingParams(), arrival=0)
    cached = bm.lookup(seq)
    bm.take_cached(seq, cached)
    seq.num_computed_tokens = before = len(cached) * bm.block_size
    bm.grow(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_computed_blocks(seq, before)
    return seq


def test_block_manager_records_chains_and_evictions():
    bm = BlockManager(num_blocks=6, block_size=2, watermark=0.0, kv_events=KvEventLog())
    a = _computed(bm, "a", [1, 2, 3, 4, 5])  # two full blocks, a partial third
    h1 = chain_hash(ROOT_HASH, [1, 2])
    h2 = chain_hash(h1, [3, 4])
    [stored] = bm.kv_events.take()
    assert stored == BlockStored([external_hash(h1), external_hash(h2)], None, [1, 2, 3, 4], 2)
    # A prompt sharing the first block takes it from the cache: only its own blocks are stored,
    # their chain hung on the shared block.
    b = _computed(bm, "b", [1, 2, 9, 9, 7])
    [stored] = bm.kv_events.take()
    assert stored.parent_block_hash == external_hash(h1)
    assert stored.block_hashes == [external_hash(chain_hash(h1, [9, 9]))] and stored.token_ids == [9, 9]
    bm.free(a)
    bm.free(b)
    # Room for a new 6-block sequence evicts every cached block.
    _computed(bm, "c", list(range(20, 32)))
    events = bm.kv_events.take()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted([external_hash(h1), external_hash(h2), stored.block_hashes[0]])
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == 6


def test_salted_and_adapter_blocks_carry_their_names():
    bm = BlockManager(num_blocks=4, block_size=2, kv_events=KvEventLog())
    _computed(bm, "s", [1, 2, 3], SamplingParams(cache_salt="t1", lora_name="sql"))
    [stored] = bm.kv_events.take()
    assert (stored.lora_name, stored.cache_salt, stored.parent_block_hash) == ("sql", "t1", None)
    assert stored.block_hashes == [external_hash(chain_hash(root_hash("t1", "sql"), [1, 2]))]


def test_endpoint_checks():
    for ok in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", "ipc:///tmp/kv", "inproc://kv", ""):
        check_endpoint(ok, allow_remote=False)
    for remote in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://eth0:5557"):
        with pytest.raises(ValueError, match="kv_events_allow_remote"):
            check_endpoint(remote, allow_remote=False)
        check_endpoint(remote, allow_remote=True)
    for bad in ("http://127.0.0.1:5557", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://:5557", "ipc://"):
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            check_endpoint(bad, allow_remote=True)
    with pytest.raises(ValueError, match="kv_events_allow_remote"):
        EngineConfig(model="m", kv_events_endpoint="tcp://*:5557")
    with pytest.raises(ValueError, match="kv_events_encoding"):
        EngineConfig(model="m", kv_events_encoding="json")


def test_each_replica_binds_its_own_endpoint():
    assert replica_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert replica_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert replica_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert replica_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"
    with pytest.raises(ValueError, match="port 65536"):
        EngineConfig(model="m", kv_events_endpoint="tcp://127.0.0.1:65535", kv_events_replica=1)
