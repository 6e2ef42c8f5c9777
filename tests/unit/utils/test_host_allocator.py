"""host_allocator: once a CPU engine starts, freed activation buffers are reused, not faulted in again."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

# Allocate and free activation-sized buffers (1-12 MB, varying like a step's batch) in a fresh
# process, and count the page faults of the steps after a warm-up.
_STEPS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from splitfuse.utils.host_allocator import keep_freed_memory
    assert keep_freed_memory()
sizes = [(256 + 37 * i) % 700 + 64 for i in range(40)]
def step():
    bufs = [torch.empty(n, 4096).fill_(1.0) for n in sizes[:8]]
    for n in sizes[8:]:
        bufs.append(torch.empty(n, 4096).fill_(1.0))
        bufs.pop(0)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc tunables off
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


GLIBC = sys.platform.startswith("linux") and ctypes.util.find_library("c") is not None


@pytest.mark.slow  # a subprocess measuring page faults
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt is Linux-only")
def test_freed_buffers_are_reused_without_page_faults():
    default, kept = _faults("default"), _faults("keep")
    # With glibc's defaults these steps fault in their pages again every time (~400k faults
    # measured); kept, the heap serves them from pages already mapped.
    assert default > 10_000, f"the workload no longer exercises the allocator ({default} faults by default)"
    assert kept < default / 20, f"{kept} page faults with freed memory kept, {default} without"


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt is Linux-only")
def test_cpu_engine_start_applies_it(tiny_llama, monkeypatch):
    from splitfuse import LLM
    from splitfuse.utils import host_allocator

    monkeypatch.setattr(host_allocator, "_applied", None)
    LLM(tiny_llama, device="cpu")
    assert host_allocator._applied is True


# Allocate 240 MB in heap-sized blocks, free it: kept by the settings, then handed back.
_RELEASE = """
import ctypes, ctypes.util
from splitfuse.utils.host_allocator import keep_freed_memory, release_freed_memory
from splitfuse.utils.process_memory import resident_bytes
assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
base = resident_bytes()
blocks = [libc.malloc(8 << 20) for _ in range(30)]
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
for b in blocks:
    libc.free(b)
kept = resident_bytes()
assert release_freed_memory()
print(kept - base, resident_bytes() - base)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim is Linux-only")
def test_release_hands_kept_memory_back():
    """What the settings keep (packing's temporaries at start) goes back to the OS on release."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True, text=True, check=True, env=env)
    kept, released = (int(v) for v in out.stdout.split())
    assert kept > 200 << 20, f"the freed blocks were not kept ({kept >> 20} MB): the test no longer tests release"
    assert released < 40 << 20, f"{released >> 20} MB still resident after the release"
