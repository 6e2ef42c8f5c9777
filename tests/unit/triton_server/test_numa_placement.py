"""Placing a replica on its NUMA node (numa_placement.py, numa_bind.py) with the real syscalls on
this machine's own node: the memory policy becomes MPOL_BIND on the node, every thread's affinity
the node's CPUs, num_threads one per physical core; and the numa_nodes parameter's checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

import pytest

from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.triton_server.numa_placement import apply_numa, instance_index
from splitfuse.utils.cpu_budget import cgroup_cpu_limit
from splitfuse.utils.numa_bind import MPOL_BIND, bind_memory, memory_policy, pin_threads
from splitfuse.utils.numa_topology import physical_cores, read_nodes


def _in_thread(fn):
    """Run fn on a thread of its own: a memory policy is per thread, the test's own stays as it was."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_bind_memory_sets_mpol_bind_on_the_node():
    node = read_nodes()[0].node

    def bind():
        before = memory_policy()
        return before, bind_memory(node), memory_policy()

    before, refused, after = _in_thread(bind)
    if refused is not None and "EPERM" in refused:
        pytest.skip(f"this sandbox refuses set_mempolicy: {refused}")
    assert before is not None and before[0] != MPOL_BIND
    assert refused is None and after == (MPOL_BIND, 1 << node)
    assert memory_policy()[0] != MPOL_BIND  # this thread untouched


def test_apply_numa_places_the_replica_of_its_index():
    node = read_nodes()[0]
    server = ServerConfig(numa_nodes=f"{node.node},{node.node}")
    saved = os.sched_getaffinity(0)
    try:
        config, placed = _in_thread(lambda: apply_numa(EngineConfig(model="/m"), server, "pfx_llm_0_1"))
        allowed = node.cpus & saved
        threads = len(physical_cores(allowed))
        quota = cgroup_cpu_limit()  # two replicas share a container's CPU quota
        assert placed == node.node and config.num_threads == (
            threads if quota is None else min(threads, max(1, math.ceil(quota / 2))))
        assert os.sched_getaffinity(0) == allowed
    finally:  # the pinning is process-wide: on a multi-node machine the rest of the run gets its CPUs back
        pin_threads(saved)
    # A num_threads given stays; no numa_nodes: nothing placed.
    kept, _ = _in_thread(lambda: apply_numa(EngineConfig(model="/m", num_threads=1), server, "llm_0_0"))
    assert kept.num_threads == 1
    assert apply_numa(EngineConfig(model="/m"), ServerConfig(), "llm_0_0") == (EngineConfig(model="/m"), None)
    with pytest.raises(ValueError, match="names 2 node"):
        apply_numa(EngineConfig(model="/m"), server, "llm_0_2")


def test_pin_threads_pins_every_running_thread():
    """In a child process: threads that exist before the call are moved too, not only the caller."""
    cpu = min(os.sched_getaffinity(0))
    code = ("import os, threading\n"
            "from splitfuse.utils.numa_bind import pin_threads\n"
            "go = threading.Event(); seen = []\n"
            "t = threading.Thread(target=lambda: (go.wait(), seen.append(os.sched_getaffinity(0)))); t.start()\n"
            f"assert pin_threads({{{cpu}}}) >= 2\n"
            "go.set(); t.join(); print(sorted(seen[0]), sorted(os.sched_getaffinity(0)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [f"[{cpu}]", f"[{cpu}]"]


def test_numa_nodes_parameter_checks():
    assert ServerConfig(numa_nodes="0, 1").numa_node_list() == [0, 1]
    assert ServerConfig().numa_node_list() == []
    for bad in ("0,x", "-1", "0,,1"):
        with pytest.raises(ValueError, match="numa_nodes must be node numbers"):
            ServerConfig(numa_nodes=bad)
    assert instance_index("llm_0_3") == 3
    with pytest.raises(ValueError, match="instance index"):
        instance_index("llm")
