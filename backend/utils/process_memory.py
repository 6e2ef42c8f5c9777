"""This process's resident memory, now and at its peak, from /proc/self/status.

The peak is VmHWM, the high-water mark of the current program image. `getrusage`'s ru_maxrss is
not used: Linux keeps it across fork and execve, so a process started by a large parent (a test
worker, a server) reports the parent's size as its own peak.
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int:
    """A "kB" field of /proc/self/status in bytes; 0 where /proc is absent (not Linux)."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def resident_bytes() -> int:
    """Resident memory now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int:
    """The most resident memory this program image has held (VmHWM)."""
    return _status_bytes("VmHWM")
