"""The tiers together: memory first, then disk. A block pushed out of the memory tier goes down
to the disk tier (when there is one); a block found on disk is checked (fingerprint, length,
checksum) and a bad one deleted and counted, its request then recomputing from there.

`_stored` and `_removed` are the one place where a block enters or leaves a tier of this process
(KV events with medium CPU / DISK are recorded there). Blocks another process deletes from a
shared disk folder are not seen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitfuse.kv_tiers.block_codec import CorruptBlock, decode
from splitfuse.kv_tiers.disk_tier import DiskTier
from splitfuse.kv_tiers.memory_tier import MemoryTier

MEDIUM_MEMORY = "CPU"
MEDIUM_DISK = "DISK"

TierListener = Callable[[str, str, bytes], None]
"""(what: "stored" or "removed", medium: MEDIUM_MEMORY or MEDIUM_DISK, the block's chain hash)."""


@dataclass
class Fetched:
    """What `fetch` found of one block."""

    payload: memoryview | None
    """The block's KV bytes (block_codec.write_blocks takes them); None: not restorable."""
    medium: str | None = None
    """Where it was found: MEDIUM_MEMORY or MEDIUM_DISK; None when absent."""
    corrupt: bool = False
    """It was on disk but failed its checks (deleted now)."""


class TieredStore:
    def __init__(self, fingerprint: bytes, memory: MemoryTier | None, disk: DiskTier | None,
                 listener: TierListener | None = None) -> None:
        if memory is None and disk is None:
            raise ValueError("a tiered store needs a memory or a disk tier")
        self.fingerprint = fingerprint
        self.memory, self.disk = memory, disk
        self.listener = listener

    def __contains__(self, key: bytes) -> bool:
        return (self.memory is not None and key in self.memory) or (self.disk is not None and key in self.disk)

    def prefix_length(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, a tier holds (a chain's restorable prefix)."""
        for i, key in enumerate(keys):
            if key not in self:
                return i
        return len(keys)

    def refresh(self, key: bytes) -> bool:
        """Whether the top tier (memory, else disk) holds `key` already, then marked recently
        used: a block the pool evicts again needs no copy then."""
        if self.memory is not None:
            if key not in self.memory:
                return False
            self.memory.touch(key)
            return True
        if key not in self.disk:
            return False
        self.disk.touch(key)
        return True

    def put(self, key: bytes, blob: bytes) -> None:
        """Keep an encoded block: in memory (what that pushes out goes to disk), else on disk."""
        if self.memory is None:
            self._put_disk(key, blob)
            return
        new = key not in self.memory
        pushed = self.memory.put(key, blob)
        if new:
            self._stored(MEDIUM_MEMORY, key)
        for old, old_blob in pushed:
            self._removed(MEDIUM_MEMORY, old)
            if self.disk is not None:
                self._put_disk(old, old_blob)

    def fetch(self, key: bytes) -> Fetched:
        if self.memory is not None:
            blob = self.memory.get(key)
            if blob is not None:  # our own bytes, never out of this process: no checksum pass
                return Fetched(decode(blob, self.fingerprint, verify=False), MEDIUM_MEMORY)
        if self.disk is None:
            return Fetched(None)
        blob = self.disk.get(key)
        if blob is None:
            return Fetched(None)
        try:
            return Fetched(decode(blob, self.fingerprint), MEDIUM_DISK)
        except CorruptBlock:
            self.disk.drop(key)
            self._removed(MEDIUM_DISK, key)
            return Fetched(None, MEDIUM_DISK, corrupt=True)

    def used_bytes(self) -> tuple[int, int]:
        """(memory tier bytes, disk tier bytes as this process estimates them)."""
        return (self.memory.used_bytes if self.memory is not None else 0,
                self.disk.used_bytes if self.disk is not None else 0)

    def _put_disk(self, key: bytes, blob: bytes) -> None:
        written, deleted = self.disk.put(key, blob)
        if written:
            self._stored(MEDIUM_DISK, key)
        for old in deleted:
            self._removed(MEDIUM_DISK, old)

    def _stored(self, medium: str, key: bytes) -> None:
        if self.listener is not None:
            self.listener("stored", medium, key)

    def _removed(self, medium: str, key: bytes) -> None:
        if self.listener is not None:
            self.listener("removed", medium, key)
