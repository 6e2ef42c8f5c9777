"""The disk tier: one file per block, named by the hex of its chain hash, in a folder of its
model's fingerprint under `kv_offload_dir`.

Shared by every process that sets the same folder (a server's replicas): a file is written under
a temporary name and renamed into place, so a reader sees a whole block or none; deletes tolerate
a file another process deleted first; a hit touches the file's mtime, the tier's LRU order.
The bound is kept per process from its own writes plus a scan of the folder when that estimate
passes the bound (the scan sees every process's files and deletes the oldest down to LOW_WATER of
the bound), so the folder may exceed the bound briefly by what others wrote since.
"""

from __future__ import annotations

import os
import time
import uuid

LOW_WATER = 0.9
"""A trim deletes down to this share of the bound, so scans stay rare under steady writes."""
STALE_TMP_S = 600.0
"""A temporary file this old was left by a process that died mid-write: deleted by a scan."""
TMP_PREFIX = ".tmp-"


class DiskTier:
    def __init__(self, folder: str, bound_bytes: int, fingerprint: bytes) -> None:
        self.dir = os.path.join(folder, fingerprint.hex()[:32])
        os.makedirs(self.dir, exist_ok=True)
        self.bound_bytes = bound_bytes
        self._last_ns = 0
        self.used_bytes = self._trim()  # what earlier runs and other processes left

    def path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex())

    def __contains__(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def get(self, key: bytes) -> bytes | None:
        """The file's bytes (unchecked: the caller decodes them), its mtime touched; None when
        absent (or deleted meanwhile by another process)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
            self._stamp(path)
        except FileNotFoundError:
            return None
        return blob

    def touch(self, key: bytes) -> None:
        try:
            self._stamp(self.path(key))
        except FileNotFoundError:
            pass

    def _stamp(self, path: str) -> None:
        """Set the file's mtime to now, strictly after this process's previous stamp: the kernel's
        clock ticks coarsely, and blocks used within one tick must keep their order."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        os.utime(path, ns=(self._last_ns, self._last_ns))

    def put(self, key: bytes, blob: bytes) -> tuple[bool, list[bytes]]:
        """Write the block unless a file holds it already (then touched). Atomic: a temporary
        file renamed into place. (whether it was written, the blocks a trim deleted)."""
        path = self.path(key)
        if os.path.exists(path):
            self.touch(key)
            return False, []
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            self._stamp(tmp)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise
        self.used_bytes += len(blob)
        deleted: list[bytes] = []
        if self.used_bytes > self.bound_bytes:
            self.used_bytes = self._trim(deleted)
        return True, deleted

    def drop(self, key: bytes) -> None:
        """Delete a block's file (a corrupt one); gone already is fine."""
        self._unlink(self.path(key))

    def _trim(self, deleted: list[bytes] | None = None) -> int:
        """Scan the folder, delete the least recently used blocks down to LOW_WATER of the bound
        when over it (and stale temporary files), appending their keys to `deleted`; the bytes
        left."""
        entries = []
        now = time.time()
        with os.scandir(self.dir) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        self._unlink(e.path)
                    continue
                if not _is_key_name(e.name):
                    continue  # not ours: left alone and not counted
                entries.append((st.st_mtime_ns, e.name, st.st_size))
        used = sum(size for _, _, size in entries)
        if used <= self.bound_bytes:
            return used
        target = int(self.bound_bytes * LOW_WATER)
        for _, name, size in sorted(entries):
            if used <= target:
                break
            self._unlink(os.path.join(self.dir, name))
            used -= size
            if deleted is not None:
                deleted.append(bytes.fromhex(name))
        return used

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another process deleted it first


def _is_key_name(name: str) -> bool:
    """A block file's name: the hex of a SHA-256 chain hash."""
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)
