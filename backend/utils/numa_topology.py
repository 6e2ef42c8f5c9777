"""The machine's NUMA nodes and physical cores, read from sysfs, and the replica placement plan
built from them: one engine replica per node that has CPUs this process may use, each replica's
threads one per physical core of its node. The sysfs root is a parameter so that tests can
describe any machine."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SYSFS_ROOT = Path("/sys")


@dataclass(frozen=True)
class Node:
    node: int
    cpus: frozenset[int]
    """Online CPUs of the node (logical: SMT siblings included)."""


@dataclass(frozen=True)
class Placement:
    """Where one replica runs: its node, the CPUs its threads may use and how many threads."""

    node: int
    cpus: tuple[int, ...]
    threads: int
    """One per physical core among `cpus` (SMT siblings share one core's GEMM units)."""


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (sysfs's list format; empty -> empty)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def format_cpulist(cpus) -> str:
    """The inverse of parse_cpulist: {0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read_list(path: Path) -> set[int] | None:
    try:
        return parse_cpulist(path.read_text())
    except (OSError, ValueError):
        return None


def read_nodes(root: Path = SYSFS_ROOT) -> list[Node]:
    """The NUMA nodes with online CPUs (memory-only nodes left out); no node directory (a kernel
    without NUMA): one node 0 holding every online CPU."""
    online = _read_list(root / "devices/system/cpu/online")
    nodes: list[Node] = []
    for d in (root / "devices/system/node").glob("node*"):
        match = re.fullmatch(r"node(\d+)", d.name)
        cpus = _read_list(d / "cpulist") if match else None
        if cpus is None:
            continue
        if online is not None:
            cpus &= online
        if cpus:
            nodes.append(Node(int(match.group(1)), frozenset(cpus)))
    if not nodes and online:
        nodes.append(Node(0, frozenset(online)))
    return sorted(nodes, key=lambda n: n.node)


def physical_cores(cpus, root: Path = SYSFS_ROOT) -> list[int]:
    """One CPU per physical core among `cpus` (the lowest of its SMT siblings there)."""
    seen: set[int] = set()
    firsts: list[int] = []
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        topo = root / f"devices/system/cpu/cpu{cpu}/topology"
        siblings = _read_list(topo / "core_cpus_list") or _read_list(topo / "thread_siblings_list") or {cpu}
        seen.update(siblings | {cpu})
        firsts.append(cpu)
    return firsts


def plan_replicas(root: Path = SYSFS_ROOT, allowed: set[int] | None = None) -> list[Placement]:
    """One placement per NUMA node that has CPUs in `allowed` (this process's affinity mask by
    default, which a cgroup cpuset narrows), in node order. A single usable node gives one
    placement: the caller then keeps today's unpinned single replica."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    plan: list[Placement] = []
    for node in read_nodes(root):
        cpus = node.cpus & allowed
        if cpus:
            plan.append(Placement(node.node, tuple(sorted(cpus)), len(physical_cores(cpus, root))))
    return plan


def node_placement(node: int, root: Path = SYSFS_ROOT, allowed: set[int] | None = None) -> Placement:
    """The placement of the replica given `node` (ValueError when this process may use none of its CPUs)."""
    for p in plan_replicas(root, allowed):
        if p.node == node:
            return p
    raise ValueError(f"numa_nodes: NUMA node {node} has no CPU this process may use")
