"""kv_cache_memory_gb=auto (utils/memory_budget.py): the memory bound read from cgroup v2 (every
ancestor's memory.max), v1 (memory.limit_in_bytes) and /proc/meminfo trees laid out here; the
share of it the KV pool takes after the replicas' weights; and an engine sized that way, with
the figures in its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitfuse import LLM
from splitfuse.config import EngineConfig
from splitfuse.utils import memory_budget
from splitfuse.utils.memory_budget import (AUTO_KV_SHARE, MemoryBound, auto_kv_cache_bytes, cgroup_memory_limit,
                                           memory_bound)

GIB = 1 << 30


def _v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    (root / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    for rel, value in limits.items():
        (root / rel / "memory.max").write_text(value + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    return root, proc


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       65536000 kB\nMemFree:         1000 kB\nMemAvailable:   {available_kib} kB\n")
    return path


def test_v2_limit_of_the_process_or_the_smallest_ancestor(tmp_path):
    root, proc = _v2(tmp_path / "a", {"kubepods/pod1/ctr": str(24 * GIB), "kubepods": "max"})
    assert cgroup_memory_limit(root, proc) == MemoryBound(24 * GIB, "cgroup v2 memory.max")
    root, proc = _v2(tmp_path / "b", {"kubepods/pod1/ctr": "max", "kubepods/pod1": str(16 * GIB),
                                      "kubepods": str(64 * GIB)})
    assert cgroup_memory_limit(root, proc).bytes == 16 * GIB
    root, proc = _v2(tmp_path / "c", {"kubepods/pod1/ctr": "max"})
    assert cgroup_memory_limit(root, proc) is None


def test_v1_limit_and_its_unlimited_value(tmp_path):
    root = tmp_path / "cg"
    mem = root / "memory" / "docker" / "abc"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(f"{8 * GIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_memory_limit(root, proc) == MemoryBound(8 * GIB, "cgroup v1 memory.limit_in_bytes")
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_limit(root, proc) is None
    # No limit in the cgroup: the host's MemAvailable.
    assert memory_bound(root, proc, _meminfo(tmp_path, 3 * 1024 * 1024)) == MemoryBound(3 * GIB, "MemAvailable")


def test_the_auto_share_after_the_weights_divided_among_replicas():
    # 24 GiB limit, 8 GiB of weights: 70% of the 16 GiB left; two replicas: 70% of 8 GiB, halved.
    assert auto_kv_cache_bytes(24 * GIB, 8 * GIB, 1) == int(AUTO_KV_SHARE * 16 * GIB)
    assert auto_kv_cache_bytes(24 * GIB, 8 * GIB, 2) == int(AUTO_KV_SHARE * 8 * GIB) // 2
    with pytest.raises(ValueError, match=r"memory limit \(16.00 GiB\) does not hold 2 replica\(s\) of 8.00 GiB"):
        auto_kv_cache_bytes(16 * GIB, 8 * GIB, 2)


def test_auto_parses_and_its_limits_are_refused():
    assert EngineConfig.from_strings({"model": "/m", "kv_cache_memory_gb": "auto"}).kv_cache_memory_gb == "auto"
    assert EngineConfig.from_strings({"model": "/m", "kv_cache_memory_gb": "2.5"}).kv_cache_memory_gb == 2.5
    with pytest.raises(ValueError, match="kv_cache_memory_gb must be a number of GiB > 0 or auto, got 'lots'"):
        EngineConfig.from_strings({"model": "/m", "kv_cache_memory_gb": "lots"})
    with pytest.raises(ValueError, match="kv_cache_memory_gb=auto cannot be combined with tensor_parallel_size"):
        EngineConfig(model="/m", kv_cache_memory_gb="auto", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache_replicas must be a positive integer"):
        EngineConfig(model="/m", kv_cache_replicas=0)


def test_an_engine_sizes_its_pool_from_the_bound_after_its_weights(tiny_llama, tmp_path, monkeypatch, caplog):
    """The engine reads the bound through the module's paths: pointed at a tree without a cgroup
    limit and a MemAvailable of its weights + 64 MiB, two replicas get 70% of the rest, halved."""
    caplog.set_level("INFO", logger="splitfuse.engine.model_runner")
    with LLM(tiny_llama, kv_cache_memory_gb=1.0) as probe:
        weights = sum(probe.engine.runner.model.weight_memory().values())
        per_block = probe.engine.runner.kv_bytes_per_block()
    available = weights * 2 + 64 * (1 << 20)
    monkeypatch.setattr(memory_budget, "CGROUP_ROOT", tmp_path / "no-cgroup")
    monkeypatch.setattr(memory_budget, "MEMINFO", _meminfo(tmp_path, available // 1024))
    with LLM(tiny_llama, kv_cache_memory_gb="auto", kv_cache_replicas=2) as llm:
        expected = int(AUTO_KV_SHARE * (available // 1024 * 1024 - 2 * weights)) // 2 // per_block
        assert llm.engine.runner.num_kv_blocks == expected > 0
    lines = [r.getMessage() for r in caplog.records if "kv_cache_memory_gb=auto ->" in r.getMessage()]
    assert len(lines) == 1 and "70% of MemAvailable" in lines[0] and "2 replica(s)" in lines[0], lines
