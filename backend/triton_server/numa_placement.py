"""A replica's NUMA node (ServerConfig.numa_nodes, by instance index), applied in its stub before
the engine is built, and the start-up line that says where its threads run."""

from __future__ import annotations

import dataclasses
import logging
import math
import os


from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.utils.cpu_budget import cgroup_cpu_limit
from splitfuse.utils.numa_bind import bind_memory, memory_policy, pin_threads, MPOL_BIND
from splitfuse.utils.numa_topology import format_cpulist, node_placement, read_nodes

log = logging.getLogger("splitfuse.triton_server.numa")


def instance_index(instance: str) -> int:
    """Triton names a model's instances `<model>_<group>_<index>` (llm_0_1: the second of group 0)."""
    tail = instance.rsplit("_", 1)[-1]
    if not tail.isdigit():
        raise ValueError(f"cannot tell the instance index of {instance!r}")
    return int(tail)


def apply_numa(config: EngineConfig, server: ServerConfig, instance: str) -> tuple[EngineConfig, int | None]:
    """Pin this replica's threads to its node's CPUs and bind its memory there, when numa_nodes
    names a node for it; returns the config (num_threads one per physical core of the node unless
    set, and within the cgroup's CPU quota shared by the replicas) and the node (None: no placement)."""
    nodes = server.numa_node_list()
    if not nodes:
        return config, None
    index = instance_index(instance)
    if index >= len(nodes):
        raise ValueError(f"numa_nodes={server.numa_nodes!r} names {len(nodes)} node(s); instance {instance} "
                         f"is number {index + 1}")
    placement = node_placement(nodes[index])
    pin_threads(placement.cpus)
    refused = bind_memory(placement.node)
    if refused is not None:  # e.g. a seccomp profile without set_mempolicy: placed, but not bound
        log.warning("splitfuse: memory not bound to NUMA node %d (%s); threads are pinned", placement.node, refused)
    if not config.num_threads:
        threads = placement.threads
        quota = cgroup_cpu_limit()  # a container's CPU quota is shared by all the replicas
        if quota is not None:
            threads = min(threads, max(1, math.ceil(quota / len(nodes))))
        config = dataclasses.replace(config, num_threads=threads)
    return config, placement.node


def log_cpu_placement(node: int | None, threads: int) -> None:
    """One line: the engine's `threads`, the CPUs they may run on, their NUMA node(s), the memory
    policy (an engine process inherits this process's CPUs and policy)."""
    cpus = os.sched_getaffinity(0)
    nodes = read_nodes()
    on = sorted(n.node for n in nodes if n.cpus & cpus)
    policy = memory_policy()
    bound = policy is not None and policy[0] == MPOL_BIND
    memory = (f"memory bound to node(s) {format_cpulist(i for i in range(64) if policy[1] >> i & 1)}" if bound
              else "memory not bound")
    log.info("splitfuse: threads=%d on CPUs %s (%d); NUMA node %s of %d; %s%s", threads,
             format_cpulist(cpus), len(cpus), format_cpulist(on) or "?", len(nodes), memory,
             "" if node is not None else " (numa_nodes unset: not placed)")
