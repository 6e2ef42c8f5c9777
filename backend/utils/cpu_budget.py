"""How many CPUs this process may use: the cores of its affinity mask, bounded by the CPU quota
of its cgroup (`cpu.max`, cgroup v2; `cpu.cfs_quota_us` / `cpu.cfs_period_us`, v1). A container
limited to 4 CPUs on a 64-core host sees all 64 cores in its mask but gets 4 cores' time: 64
OpenMP threads there would contend for it. A fractional quota rounds up (2.5 CPUs -> 3)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def own_cgroup(root: Path, proc_cgroup: Path, controller: str = "cpu") -> tuple[Path | None, Path | None]:
    """(the v2 directory, the v1 `controller` directory) of this process's cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            v2 = root / rel
        elif controller in controllers.split(","):
            v1 = root / controllers / rel
    return v2, v1


def cgroup_v2_chain(directory: Path, root: Path) -> list[Path]:
    """A v2 cgroup directory and its ancestors up to `root`: each one's limits bound the process."""
    chain = [directory]
    while chain[-1] != root and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota as a number of CPUs, or None when there is none. In cgroup v2 every
    ancestor's `cpu.max` bounds the process too: the smallest applies."""
    v2, v1 = own_cgroup(root, proc_cgroup)
    limits: list[float] = []
    for d in cgroup_v2_chain(v2, root) if v2 is not None else []:
        try:
            quota, period = (d / "cpu.max").read_text().split()
            if quota != "max":
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
    if not limits and v1 is not None:
        try:
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            period = int((v1 / "cpu.cfs_period_us").read_text())
            if quota > 0 and period > 0:
                limits.append(quota / period)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None


def available_cpus() -> int:
    """The CPUs this process may use (at least 1)."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(limit)) if limit is not None else cores)
