"""NUMA topology from sysfs and the replica placement plan (numa_topology.py), and what the
launcher's `--instances auto` makes of it (numa_instances.py), on sysfs trees laid out here:
2 nodes x 4 cores with SMT, 1 node, offline CPUs, a memory-only node, a cpuset narrower than a node."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitfuse.launcher.numa_instances import AUTO, describe, instances_arg, resolve_instances
from splitfuse.utils.numa_topology import (Placement, format_cpulist, parse_cpulist, physical_cores, plan_replicas,
                                           read_nodes)


def _sysfs(tmp_path: Path, nodes: dict[int, str], siblings: dict[int, str], online: str) -> Path:
    root = tmp_path / "sys"
    for node, cpulist in nodes.items():
        d = root / "devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    (root / "devices/system/node/possible").write_text("0-7\n")  # a file beside the node directories
    for cpu, sib in siblings.items():
        d = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    (root / "devices/system/cpu").mkdir(parents=True, exist_ok=True)
    (root / "devices/system/cpu/online").write_text(online + "\n")
    return root


def _two_sockets_smt(tmp_path: Path, online: str = "0-15") -> Path:
    """Linux's usual numbering: node 0 has cores 0-3 (their SMT siblings 8-11), node 1 cores 4-7 (12-15)."""
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    return _sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, siblings, online)


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    assert format_cpulist({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_two_nodes_with_smt_one_replica_per_node_one_thread_per_core(tmp_path):
    root = _two_sockets_smt(tmp_path)
    plan = plan_replicas(root, allowed=set(range(16)))
    assert plan == [Placement(0, (0, 1, 2, 3, 8, 9, 10, 11), 4), Placement(1, (4, 5, 6, 7, 12, 13, 14, 15), 4)]
    assert physical_cores({0, 8, 1}, root) == [0, 1]
    count, params, placed = resolve_instances(AUTO, {"max_num_seqs": "8"}, root, allowed=set(range(16)))
    assert count == 2 and params == {"max_num_seqs": "8", "numa_nodes": "0,1"} and placed == plan
    assert "node 1: CPUs 4-7,12-15, 4 threads" in describe(plan)


def test_one_node_keeps_one_unplaced_replica(tmp_path):
    root = _sysfs(tmp_path, {0: "0-3"}, {c: str(c) for c in range(4)}, "0-3")
    count, params, plan = resolve_instances(AUTO, {}, root, allowed={0, 1, 2, 3})
    assert count == 1 and "numa_nodes" not in params
    assert plan == [Placement(0, (0, 1, 2, 3), 4)] and "one replica" in describe(plan)
    # A kernel without NUMA directories: every online CPU is node 0.
    bare = tmp_path / "bare"
    (bare / "devices/system/cpu").mkdir(parents=True)
    (bare / "devices/system/cpu/online").write_text("0-1\n")
    assert [(n.node, set(n.cpus)) for n in read_nodes(bare)] == [(0, {0, 1})]


def test_offline_cpus_and_memory_only_nodes_are_left_out(tmp_path):
    root = _two_sockets_smt(tmp_path, online="0-5,8-13")  # cores 6 and 7 offline with both threads
    (root / "devices/system/node/node2").mkdir()
    (root / "devices/system/node/node2/cpulist").write_text("\n")  # memory only (CXL, HBM)
    plan = plan_replicas(root, allowed=set(range(16)))
    assert [p.node for p in plan] == [0, 1]
    assert plan[1] == Placement(1, (4, 5, 12, 13), 2)


def test_a_cpuset_narrower_than_a_node(tmp_path):
    root = _two_sockets_smt(tmp_path)
    # Inside one node only: one replica, as on a single-node machine.
    count, params, plan = resolve_instances(AUTO, {}, root, allowed={0, 1, 8, 9})
    assert count == 1 and "numa_nodes" not in params and plan == [Placement(0, (0, 1, 8, 9), 2)]
    # Across both, unevenly: each replica gets the cores it may use there.
    plan = plan_replicas(root, allowed={0, 1, 2, 4, 12})
    assert plan == [Placement(0, (0, 1, 2), 3), Placement(1, (4, 12), 1)]


def test_counts_and_the_operators_own_nodes_pass_unchanged(tmp_path):
    root = _two_sockets_smt(tmp_path)
    assert resolve_instances(3, {}, root) == (3, {}, [])
    assert resolve_instances(AUTO, {"numa_nodes": "1,1,0"}, root)[0] == 3
    assert instances_arg("auto") == AUTO and instances_arg("2") == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="count >= 1 or auto"):
            instances_arg(bad)
