"""Every kernel compiles to a cubin for sm80/sm90 as its launcher launches it, even without a GPU.

Catches what the CPU interpreter cannot: code that interprets fine but does not compile, and
tiles that need more shared memory than an A100/H100 block has. Runs `cuda_compile_check.py`
in a subprocess because this test process has TRITON_INTERPRET=1 (kernels are interpreted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow  # compiles every kernel for CUDA targets
def test_kernels_compile_for_cuda_targets():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as exc:
        pytest.skip(f"triton has no NVIDIA backend here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("cuda_compile_check.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not results and ("ptxas" in proc.stderr or "CUDA" in proc.stderr):
        pytest.skip(f"no CUDA toolchain for offline compiles: {proc.stderr[-500:]}")
    assert results, proc.stderr[-3000:]
    failed = [r for r in results if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:6000]
    spilling = [f"{r['kernel']} {r['target']}: {r['spill_store_bytes']} B" for r in results
                if r.get("spill_store_bytes")]
    if spilling:
        warnings.warn("register spills: " + "; ".join(spilling))
    assert proc.returncode == 0, proc.stderr[-3000:]
