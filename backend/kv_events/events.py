"""The KV cache events, the log the block manager records them in, and their msgpack encoding.

The wire format is vLLM's (vllm/distributed/kv_events.py, docs/kv_events.md): a batch is the
array [ts, [event, ...], data_parallel_rank]; each event a tagged struct, by default the tagged
array vLLM sent up to v0.23 and every consumer reads (Dynamo's KV router, llm-d, SGLang's router):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

or ("map") the tagged map vLLM sends since its PR #42892: {"type": "BlockStored", "block_hashes": ...}.
Block hashes go out as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the
low 64 bits of the hash read as a big-endian unsigned integer (Dynamo decodes them as 64-bit ints).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

MEDIUM_KV_POOL = "GPU"
"""The `medium` of the engine's own KV pool: vLLM's name for the device tier, the tier a request
computes on, whatever the hardware (a CPU engine's pool too; routers weigh it as the first tier).
Tiers behind it are "CPU" (host memory) and "DISK"."""
ENCODINGS = ("array", "map")


def external_hash(block_hash: bytes) -> int:
    """A chain hash (SHA-256 digest) as the events carry it: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass
class BlockStored:
    """Full blocks became findable in the prefix cache, one chain: each block's parent is the one
    before it, the first one's is `parent_block_hash` (None: the sequence's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    """The blocks' tokens, block after block (block_size each)."""
    block_size: int
    lora_id: int | None = None
    """vLLM's deprecated adapter number; always None (adapters are named: lora_name)."""
    medium: str | None = MEDIUM_KV_POOL
    lora_name: str | None = None
    cache_salt: str | None = None
    """The request's cache_salt (in the map encoding only, as SGLang and Dynamo name it)."""

    TAG = "BlockStored"
    ARRAY_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name")


@dataclass
class BlockRemoved:
    """Blocks were dropped from the prefix cache (evicted: their room was needed)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_KV_POOL

    TAG = "BlockRemoved"
    ARRAY_FIELDS = ("block_hashes", "medium")


@dataclass
class AllBlocksCleared:
    """Every block of the cache is gone (an engine that starts announces it: its cache is empty)."""

    TAG = "AllBlocksCleared"
    ARRAY_FIELDS = ()


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    """The events of one engine step."""

    ts: float
    """time.time() when the step handed them over."""
    events: list[KvEvent]
    data_parallel_rank: int | None = None
    """The replica's index among the server's instances (its endpoint's port offset)."""


@dataclass
class KvEventLog:
    """What the block manager records as it caches and evicts blocks; `take` drains it."""

    medium: str = MEDIUM_KV_POOL
    events: list[KvEvent] = field(default_factory=list)

    def stored(self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
               lora_name: str | None, cache_salt: str | None, medium: str | None = None) -> None:
        """A chain of blocks stored in `medium` (default: the KV pool's; "CPU" / "DISK" for the
        tiers behind it)."""
        self.events.append(BlockStored([external_hash(h) for h in block_hashes],
                                       None if parent is None else external_hash(parent), list(token_ids),
                                       block_size, None, medium or self.medium, lora_name, cache_salt))

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        """One block dropped from `medium` (default: the KV pool's); drops in a row from one
        medium share one event."""
        medium = medium or self.medium
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_hash(block_hash))
        else:
            self.events.append(BlockRemoved([external_hash(block_hash)], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events


def event_value(event: KvEvent, encoding: str = "array") -> list | dict:
    """`event` as msgpack values: a tagged array (vLLM's field order) or a tagged map."""
    if encoding == "array":
        return [event.TAG, *(getattr(event, name) for name in event.ARRAY_FIELDS)]
    if encoding != "map":
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    value = {"type": event.TAG, **{name: getattr(event, name) for name in event.ARRAY_FIELDS}}
    if isinstance(event, BlockStored) and event.cache_salt is not None:
        value["cache_salt"] = event.cache_salt
    return value


def encode_batch(batch: EventBatch, encoding: str = "array") -> bytes:
    """The msgpack payload of one batch: [ts, [event, ...], data_parallel_rank]."""
    events = [event_value(e, encoding) for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "ENCODINGS", "EventBatch", "KvEvent", "KvEventLog",
           "MEDIUM_KV_POOL", "encode_batch", "event_value", "external_hash"]
