"""How much memory this process may use, and the KV pool `kv_cache_memory_gb=auto` takes of it.

The bound is the memory limit of the process's cgroup (`memory.max`, cgroup v2, the smallest of
its ancestors'; `memory.limit_in_bytes`, v1) when it has one, else the host's `MemAvailable`: a
container limited to 24 GiB on a 512 GiB host must size its cache by its 24 GiB, or the kernel's
OOM killer ends the replica the first time the pool fills.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitfuse.utils.cpu_budget import CGROUP_ROOT, PROC_CGROUP, cgroup_v2_chain, own_cgroup

MEMINFO = Path("/proc/meminfo")
# What `auto` leaves out of the memory after the weights: activations, the step's workspace,
# torch, the tokenizer, Triton's server and the /dev/shm tensors all live in the other 30%.
AUTO_KV_SHARE = 0.7
# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages); anything above this is none.
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class MemoryBound:
    bytes: int
    source: str  # where it was read, for the log line: "cgroup v2 memory.max", "MemAvailable", ...


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _NO_LIMIT else None


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> MemoryBound | None:
    """The cgroup's memory limit, or None when it has none. In cgroup v2 every ancestor's
    `memory.max` bounds the process too: the smallest applies."""
    v2, v1 = own_cgroup(root, proc_cgroup, "memory")
    if v2 is not None:
        limits = [v for d in cgroup_v2_chain(v2, root) if (v := _read_int(d / "memory.max")) is not None]
        if limits:
            return MemoryBound(min(limits), "cgroup v2 memory.max")
    if v1 is not None and (value := _read_int(v1 / "memory.limit_in_bytes")) is not None:
        return MemoryBound(value, "cgroup v1 memory.limit_in_bytes")
    return None


def mem_available(meminfo: Path = MEMINFO) -> MemoryBound:
    """The host's MemAvailable (what can be allocated without swapping)."""
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            return MemoryBound(int(rest.split()[0]) * 1024, "MemAvailable")
    raise OSError(f"{meminfo} has no MemAvailable line")


def memory_bound(root: Path | None = None, proc_cgroup: Path | None = None,
                 meminfo: Path | None = None) -> MemoryBound:
    """The memory this process may use: its cgroup's limit, else the host's MemAvailable (the
    module's paths unless given, read at the call)."""
    return (cgroup_memory_limit(root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP)
            or mem_available(meminfo or MEMINFO))


def auto_kv_cache_bytes(bound: int, weight_bytes: int, replicas: int, share: float = AUTO_KV_SHARE) -> int:
    """One replica's KV pool under `kv_cache_memory_gb=auto`: `share` of what the bound leaves
    after every replica's weights, divided among the replicas. Raises ValueError when nothing is
    left, naming the figures."""
    left = bound - replicas * weight_bytes
    kv = int(share * left) // replicas
    if kv <= 0:
        raise ValueError(f"kv_cache_memory_gb=auto: the memory limit ({bound / (1 << 30):.2f} GiB) does not hold "
                         f"{replicas} replica(s) of {weight_bytes / (1 << 30):.2f} GiB of weights; raise the limit, "
                         f"lower kv_cache_replicas (--instances) or quantize the weights")
    return kv
