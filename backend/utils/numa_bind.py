"""Binding this process to one NUMA node: every thread's CPU affinity to the node's CPUs, and
the calling thread's memory policy to MPOL_BIND on the node (through libc's `syscall`: no libnuma,
no privilege needed). Threads started afterwards (the engine's, OpenMP's) inherit both, so this
runs before the engine is built: weights and KV cache are then allocated on the node."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from pathlib import Path

MPOL_BIND = 2
# The system calls' numbers per architecture (asm/unistd.h); elsewhere memory is left unbound.
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


def pin_threads(cpus) -> int:
    """Set the affinity of every thread of this process (those running now; later ones inherit
    it from their creator) to `cpus`; returns how many threads were pinned."""
    cpus = set(cpus)
    pinned = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except (ProcessLookupError, ValueError):  # the thread ended meanwhile
            continue
    return pinned


def bind_memory(node: int) -> str | None:
    """MPOL_BIND this thread's (and its future threads') memory to `node`; None when bound,
    else why not (the caller logs it and goes on unbound)."""
    number = SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return f"set_mempolicy's syscall number is not known on {platform.machine()}"
    words = node // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    libc = ctypes.CDLL(None, use_errno=True)
    # The kernel reads maxnode - 1 bits of the mask.
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_int(MPOL_BIND), mask, ctypes.c_ulong(words * _ULONG_BITS + 1))
    if rc != 0:
        err = ctypes.get_errno()
        return f"set_mempolicy(MPOL_BIND, node {node}) refused: {errno.errorcode.get(err, err)} {os.strerror(err)}"
    return None


def memory_policy() -> tuple[int, int] | None:
    """(mode, node mask) of this thread's memory policy (get_mempolicy), None where unknown."""
    number = SYS_GET_MEMPOLICY.get(platform.machine())
    if number is None:
        return None
    mode, mask = ctypes.c_int(0), (ctypes.c_ulong * 16)()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(number), ctypes.byref(mode), mask, ctypes.c_ulong(16 * _ULONG_BITS),
                      ctypes.c_void_p(0), ctypes.c_ulong(0))
    if rc != 0:
        return None
    return mode.value, sum(int(w) << (i * _ULONG_BITS) for i, w in enumerate(mask))
