"""The host-RAM tier: encoded blocks in a dict bounded by bytes, least recently used first out.

Per engine process (replicas each have their own): the blocks are Python bytes in this
process's heap. A block leaving it is returned to the caller, which may move it down a tier."""

from __future__ import annotations

from collections import OrderedDict


class MemoryTier:
    def __init__(self, bound_bytes: int) -> None:
        self.bound_bytes = bound_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> bytes | None:
        blob = self._blocks.get(key)
        if blob is not None:
            self._blocks.move_to_end(key)
        return blob

    def touch(self, key: bytes) -> None:
        self._blocks.move_to_end(key)

    def put(self, key: bytes, blob: bytes) -> list[tuple[bytes, bytes]]:
        """Keep `blob` as the most recently used; the blocks pushed out past the bound, oldest
        first (a block larger than the whole bound is one of them)."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        self._blocks[key] = blob
        self.used_bytes += len(blob)
        out = []
        while self.used_bytes > self.bound_bytes:
            old, old_blob = self._blocks.popitem(last=False)
            self.used_bytes -= len(old_blob)
            out.append((old, old_blob))
        return out

    def keys(self) -> list[bytes]:
        """Least recently used first (for tests)."""
        return list(self._blocks)
