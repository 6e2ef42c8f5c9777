"""The AVX2 code paths on an AVX-512 machine.

The kernels are compiled for the machine's own instruction set, so a test run covers only the
widest paths of the machine it runs on. On an AVX-512 machine this test runs the kernel,
decoder and linear-choice tests again in a subprocess that sees what an AVX2-only CPU (Zen 3)
sees: the library built with `SPLITFUSE_CPU_ISA=avx2` (-march=x86-64-v3), oneDNN capped at AVX2
(`ONEDNN_MAX_CPU_ISA`) and torch's own kernels too (`ATEN_CPU_CAPABILITY`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitfuse.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]
AVX2_ENV = {"SPLITFUSE_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
TESTS = ["tests/kernels/test_cpu_paged_attention.py", "tests/kernels/test_cpu_elementwise.py",
         "tests/kernels/test_cpu_linear.py", "tests/kernels/test_cpu_decoder.py",
         "tests/kernels/test_cpu_decoder_lora.py", "tests/unit/layers/test_linear.py",
         "tests/unit/layers/test_int8_linear.py", "tests/unit/engine/test_dtype_auto.py",
         "tests/models/test_low_precision_agreement.py"]
# What the AVX2 build offers and what the engine's `auto` choices take from it: bf16 weights
# widened in registers by our linear kernel (oneDNN has no bf16 below AVX-512 / AVX-NE-CONVERT),
# int8 through vpmaddubsw (exact), fp32 on oneDNN, and dtype=auto keeping bf16 checkpoints in bf16.
PROBE = ("from splitfuse.kernels.cpu import build, elementwise, linear, paged_attention as p; import torch; "
         "from splitfuse.layers.linear import resolve_linear_backend as r, native_bf16_cpu; c = torch.device('cpu'); "
         "print(build.library_isa(), p.vector_width(), elementwise.vector_width(), linear.block_width(), "
         "linear.native_bf16(), linear.has_int8(), linear.int8_products(), torch.backends.cpu.get_cpu_capability(), "
         "r('auto', c, torch.bfloat16), r('auto', c, torch.float32, 'int8'), r('auto', c, torch.float32), "
         "native_bf16_cpu()[0])")


@pytest.mark.slow  # a second kernel build and test run
@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")
def test_avx2_build_passes_the_kernel_tests():
    if "avx512f" not in build.cpu_flags():
        pytest.skip("this CPU has no AVX-512: the normal test run already covers its widest path")
    env = dict(os.environ, **AVX2_ENV)
    widths = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert widths.returncode == 0, widths.stderr[-2000:]
    assert widths.stdout.split()[-12:] == ["avx2", "8", "8", "32", "False", "True", "avx2_maddubs", "AVX2",
                                           "cpu", "cpu", "onednn", "True"], widths.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                         env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.slow  # another kernel build
@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")
def test_avx_vnni_int8_build_passes_the_linear_tests():
    """The AVX2 build with AVX-VNNI (Alder Lake, Zen 5 and later): int8 through the 256-bit vpdpbusd."""
    if not {"avx_vnni", "avx2", "fma"} <= build.cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI")
    env = dict(os.environ, **AVX2_ENV, SPLITFUSE_CPU_KERNEL_CFLAGS="-mavxvnni")
    probe = subprocess.run([sys.executable, "-c", "from splitfuse.kernels.cpu import linear; "
                                                  "print(linear.block_width(), linear.int8_products())"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-2:] == ["32", "avx_vnni"], probe.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "tests/kernels/test_cpu_linear.py", "tests/unit/layers/test_int8_linear.py"],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_an_unknown_isa_request_leaves_the_torch_path_with_the_reason():
    env = dict(os.environ, SPLITFUSE_CPU_ISA="avx9")
    probe = subprocess.run(
        [sys.executable, "-c", "from splitfuse.kernels.cpu import build; "
                               "print(build.library() is None, build.unavailable_reason())"],
        env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.startswith("True SPLITFUSE_CPU_ISA='avx9': expected one of native, avx2"), probe.stdout


@pytest.mark.slow  # the AVX2 build of the test above, reused (same file: same worker, one after the other)
@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")
def test_avx2_build_passes_the_quant4_tests():
    """The 4-bit block tests (and the chunked packing's) with the library built for x86-64-v3 (AVX2
    + FMA, 8-lane vectors, 32-column blocks): the code a Zen 3 runs."""
    if "avx512f" not in build.cpu_flags():
        pytest.skip("this CPU has no AVX-512: the normal run already covers its widest path")
    env = dict(os.environ, SPLITFUSE_CPU_ISA="avx2")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                          "tests/kernels/test_cpu_quant4.py", "tests/kernels/test_cpu_quant4_chunks.py"],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    probe = subprocess.run([sys.executable, "-c", "from splitfuse.kernels.cpu import build, linear, quant4; "
                                                  "print(build.library_isa(), linear.block_width(), "
                                                  "quant4.dot_products())"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert probe.stdout.split()[-3:] == ["avx2", "32", "avx2_maddubs"], probe.stdout + probe.stderr[-2000:]
