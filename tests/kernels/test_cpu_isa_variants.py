"""The C++ CPU kernels' narrower code paths on this machine.

The kernels are compiled with -march=native, so a test run covers only the widest instruction
set of the machine it runs on. On an AVX-512 machine this test rebuilds the library without
AVX-512 (`SPLITFUSE_CPU_KERNEL_CFLAGS=-mno-avx512f`: the AVX2 build other machines get) and runs
the attention, elementwise and linear kernel tests against it in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitfuse.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")
def test_avx2_build_passes_the_kernel_tests():
    if "avx512f" not in build.cpu_flags():
        pytest.skip("this CPU has no AVX-512: the normal test run already covers its widest path")
    env = dict(os.environ, SPLITFUSE_CPU_KERNEL_CFLAGS="-mno-avx512f")
    widths = subprocess.run(
        [sys.executable, "-c", "from splitfuse.kernels.cpu import elementwise, linear, paged_attention as p; "
                               "print(p.vector_width(), elementwise.vector_width(), linear.block_width())"],
        env=env, capture_output=True, text=True, timeout=600)
    assert widths.returncode == 0, widths.stderr[-2000:]
    assert widths.stdout.split() == ["8", "8", "32"], widths.stdout
    tests = [str(ROOT / "tests/kernels" / f)
             for f in ("test_cpu_paged_attention.py", "test_cpu_elementwise.py", "test_cpu_linear.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
