"""`--instances auto`: one llm replica per NUMA node this process may use, each told its node
through the numa_nodes parameter (its stub pins its threads and binds its memory there); a
machine with one node keeps one unpinned replica, as before."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitfuse.utils.numa_topology import SYSFS_ROOT, Placement, format_cpulist, plan_replicas

AUTO = "auto"


def instances_arg(value: str) -> int | str:
    """argparse type of --instances: a count >= 1, or "auto"."""
    if value == AUTO:
        return AUTO
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or {AUTO}, got {value!r}")
    return count


def resolve_instances(value: int | str, params: dict[str, str], root: Path = SYSFS_ROOT,
                      allowed: set[int] | None = None) -> tuple[int, dict[str, str], list[Placement]]:
    """The replica count and the parameters for --instances `value` (a count passes unchanged);
    with auto on several nodes, numa_nodes is set, unless the operator gave it."""
    if value != AUTO:
        return int(value), params, []
    given = params.get("numa_nodes", "").strip()
    if given:  # the operator's own placement: one replica per node named
        return len(given.split(",")), params, []
    plan = plan_replicas(root, allowed)
    if len(plan) < 2:
        return 1, params, plan
    return len(plan), {**params, "numa_nodes": ",".join(str(p.node) for p in plan)}, plan


def describe(plan: list[Placement]) -> str:
    if len(plan) < 2:
        return "--instances auto: one NUMA node: one replica, threads and memory not placed"
    nodes = "; ".join(f"node {p.node}: CPUs {format_cpulist(p.cpus)}, {p.threads} threads" for p in plan)
    return f"--instances auto: {len(plan)} replicas, one per NUMA node ({nodes})"
