"""The CPU budget (cpu_budget.py): the affinity mask bounded by the cgroup's CPU quota, read from
cgroup v2 (every ancestor's cpu.max) and v1 (cfs quota / period) trees laid out here."""

from __future__ import annotations

import os
from pathlib import Path

from splitfuse.utils import cpu_budget
from splitfuse.utils.cpu_budget import cgroup_cpu_limit


def _v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    for rel, value in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(value + "\n")
    (root / "kubepods" / "pod1" / "ctr").mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    return root, proc


def test_v2_quota_of_the_process_or_an_ancestor(tmp_path):
    root, proc = _v2(tmp_path, {"kubepods/pod1/ctr": "400000 100000", "kubepods": "max 100000"})
    assert cgroup_cpu_limit(root, proc) == 4.0
    root, proc = _v2(tmp_path / "b", {"kubepods/pod1/ctr": "max 100000", "kubepods/pod1": "250000 100000"})
    assert cgroup_cpu_limit(root, proc) == 2.5
    root, proc = _v2(tmp_path / "c", {"kubepods/pod1/ctr": "max 100000"})
    assert cgroup_cpu_limit(root, proc) is None


def test_v1_cfs_quota(tmp_path):
    root = tmp_path / "cg"
    cpu = root / "cpu,cpuacct" / "docker" / "abc"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("150000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(root, proc) == 1.5
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_limit(root, proc) is None


def test_available_cpus_takes_the_smaller_and_rounds_a_fraction_up(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_budget, "cgroup_cpu_limit", lambda: 0.5)
    assert cpu_budget.available_cpus() == 1
    monkeypatch.setattr(cpu_budget, "cgroup_cpu_limit", lambda: cores + 8.0)
    assert cpu_budget.available_cpus() == cores
    monkeypatch.setattr(cpu_budget, "cgroup_cpu_limit", lambda: None)
    assert cpu_budget.available_cpus() == cores
