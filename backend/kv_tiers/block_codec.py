"""A block's KV over all layers <-> bytes: a header (magic, version, the model's fingerprint
digest, payload length, CRC-32 of the payload), then each layer's K block and V block as the
attention backend lays them out (an int8 cache's scales are inside its block rows).

The runner calls `read_blocks` / `write_blocks` with its own cache tensors; the tiers only ever
see bytes."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

MAGIC = b"SFKV"
VERSION = 1
_HEADER = struct.Struct("<4sHH32sQI")  # magic, version, reserved, fingerprint, payload bytes, crc32
HEADER_BYTES = _HEADER.size


class CorruptBlock(ValueError):
    """A block's bytes fail their header, fingerprint, length or checksum."""


def encode(payload: memoryview | bytes, fingerprint: bytes) -> bytes:
    header = _HEADER.pack(MAGIC, VERSION, 0, fingerprint, len(payload), zlib.crc32(payload))
    return b"".join((header, payload))


def decode(blob: bytes | memoryview, fingerprint: bytes, verify: bool = True) -> memoryview:
    """The payload of `blob`; CorruptBlock when it is not a whole block of this fingerprint.
    `verify=False` skips the checksum (bytes that never left this process's memory)."""
    view = memoryview(blob)
    if len(view) < HEADER_BYTES:
        raise CorruptBlock(f"{len(view)} bytes: shorter than a header")
    magic, version, _, fp, length, crc = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a KV block of version {VERSION}")
    if fp != fingerprint:
        raise CorruptBlock("another model's block (fingerprint differs)")
    payload = view[HEADER_BYTES:]
    if len(payload) != length:
        raise CorruptBlock(f"payload of {len(payload)} bytes, header says {length}")
    if verify and zlib.crc32(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    return payload


def read_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                fingerprint: bytes) -> list[bytes]:
    """Each block's KV of every layer, encoded. One gather per layer and K/V into a host tensor
    [n, layers, 2, *block], then one copy per block into its bytes."""
    k0 = kv_caches[0][0]
    idx = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    host = torch.empty((len(block_ids), len(kv_caches), 2, *k0.shape[1:]), dtype=k0.dtype)
    for layer, (k, v) in enumerate(kv_caches):
        host[:, layer, 0] = k.index_select(0, idx)
        host[:, layer, 1] = v.index_select(0, idx)
    rows = host.view(len(block_ids), -1).view(torch.uint8).numpy()
    return [encode(row.data, fingerprint) for row in rows]


def write_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 payloads: list[memoryview]) -> None:
    """Copy decoded payloads (`decode`) into the blocks `block_ids` of every layer."""
    k0 = kv_caches[0][0]
    raw = np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads])
    host = torch.from_numpy(raw).view(k0.dtype).view(len(block_ids), len(kv_caches), 2, *k0.shape[1:])
    host = host.to(k0.device)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, idx, host[:, layer, 0])
        v.index_copy_(0, idx, host[:, layer, 1])


def block_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Encoded size of one block."""
    k0 = kv_caches[0][0]
    return HEADER_BYTES + 2 * len(kv_caches) * k0[0].numel() * k0.element_size()
