"""Requests shared evenly among the `llm` model's replicas (an instance group of count > 1).

Triton gives a request to whichever instance of the model is free to take one, and a decoupled
instance's execute() returns as soon as it has queued its request in the engine: every instance
is always free, nothing steers the requests, and under a closed loop one replica can end up
holding most of them while the other runs dry. Each replica therefore posts how many requests it
holds in a small file of the instances' shared board (`Control.model_dir`), and one that holds
more than the least loaded of its peers waits in execute() before taking more, so that Triton
hands the next requests to the others. The least loaded replica never waits, so requests never
stall in Triton's queue; a wait is capped (`ServerConfig.replica_balance_max_wait_ms`), and a
peer that stopped writing (a dead or frozen process) or takes no requests (a failed engine) is
left out.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

# A replica's slot: requests it holds (NOT_TAKING: none accepted, its engine failed) and the
# CLOCK_MONOTONIC time of the slot's last write in ns (the clock is the machine's, the same in
# every process).
_HELD = struct.Struct("<q")
_STAMP = struct.Struct("<q")
SLOT_BYTES = _HELD.size + _STAMP.size
NOT_TAKING = -1
STALE_NS = 2_000_000_000
"""A peer whose slot was not written for this long is left out (housekeeping rewrites it every
tick while the process lives)."""
RESCAN_S = 1.0
"""How often the folder is listed for peers that started since."""
POLL_S = 0.005
"""How often a waiting replica looks at the loads again."""


def _open_slot(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < SLOT_BYTES:
            os.ftruncate(fd, SLOT_BYTES)
        return mmap.mmap(fd, SLOT_BYTES)
    finally:
        os.close(fd)


class ReplicaBalance:
    """One replica's side: posts its load, and waits its turn when it holds more than a peer."""

    def __init__(self, folder: Path, instance: str, max_wait_s: float) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.instance = instance
        self.max_wait_s = max_wait_s
        # The same file across restarts of this instance (peers keep their mapping of it).
        self._own = _open_slot(folder / instance)
        self._peers: dict[str, mmap.mmap] = {}
        self._scanned = float("-inf")
        self.post(0)

    def post(self, held: int) -> None:
        """This replica now holds `held` requests (NOT_TAKING: it accepts none)."""
        _HELD.pack_into(self._own, 0, held)
        self.touch()

    def touch(self) -> None:
        """Still alive: the slot stays fresh for the peers."""
        _STAMP.pack_into(self._own, _HELD.size, time.monotonic_ns())

    def least_peer_load(self) -> int | None:
        """The fewest requests any live, accepting peer holds; None when there is no such peer."""
        if time.monotonic() - self._scanned > RESCAN_S:
            self._rescan()
        now = time.monotonic_ns()
        least = None
        for slot in self._peers.values():
            held = _HELD.unpack_from(slot, 0)[0]
            stamp = _STAMP.unpack_from(slot, _HELD.size)[0]
            if held < 0 or now - stamp > STALE_NS:
                continue
            least = held if least is None else min(least, held)
        return least

    def wait_turn(self, held: Callable[[], int]) -> float:
        """Wait while this replica holds more requests (`held()`) than its least loaded peer, at
        most max_wait_s; returns the seconds waited (0.0 when it did not wait)."""
        if self.max_wait_s <= 0 or not self._above_a_peer(held):
            return 0.0
        start = time.monotonic()
        deadline = start + self.max_wait_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(POLL_S, left))
            if not self._above_a_peer(held):
                break
        return time.monotonic() - start

    def _above_a_peer(self, held: Callable[[], int]) -> bool:
        least = self.least_peer_load()
        return least is not None and held() > least

    def close(self) -> None:
        self.post(NOT_TAKING)
        for slot in self._peers.values():
            slot.close()
        self._peers.clear()

    def _rescan(self) -> None:
        self._scanned = time.monotonic()
        try:
            names = [n for n in os.listdir(self.folder) if n != self.instance and not n.startswith(".")]
        except FileNotFoundError:
            return
        for name in names:
            if name not in self._peers:
                try:
                    self._peers[name] = _open_slot(self.folder / name)
                except (OSError, ValueError):
                    continue  # not (yet) a slot
