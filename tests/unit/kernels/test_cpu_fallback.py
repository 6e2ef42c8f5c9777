"""Without a C++ compiler the engine still runs: the CPU kernels are absent with a log line,
`attention_backend=auto` picks the torch path, and an explicit `cpu` is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run_without_compiler(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=str(tmp_path / "no-bin"), SPLITFUSE_KERNEL_CACHE=str(tmp_path / "cache"))
    env.pop("CXX", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow  # a fresh interpreter with an engine
def test_no_compiler_means_torch_path_with_a_log_line(tiny_llama, tmp_path):
    proc = _run_without_compiler(f"""
        import logging
        logging.basicConfig(level=logging.INFO)
        from splitfuse import LLM, SamplingParams
        from splitfuse.kernels.cpu.build import library
        assert library() is None
        llm = LLM({tiny_llama!r}, token_budget=16)
        assert llm.engine.runner.attention_backend == "torch", llm.engine.runner.attention_backend
        out = llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) == 4
        try:
            LLM({tiny_llama!r}, attention_backend="cpu")
        except ValueError as e:
            assert "cannot run here" in str(e) and "compiler" in str(e), e
        else:
            raise AssertionError("attention_backend='cpu' without a compiler did not fail")
        print("ok")
    """, tmp_path)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
    assert "C++ CPU kernels unavailable" in proc.stderr and "no C++ compiler" in proc.stderr
    assert "using the torch path" in proc.stderr


def test_build_script_does_not_fail_without_compiler(tmp_path):
    """`make install` runs the build script: no compiler must not fail the install."""
    proc = _run_without_compiler("import runpy; runpy.run_module('splitfuse.kernels.cpu.build', run_name='__main__')",
                                 tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "torch path will be used" in proc.stderr


def test_kernels_build_where_a_compiler_is_present():
    """The kernel tests skip without the library; on a machine with a compiler (CI) a failed
    build must fail here rather than hide behind those skips."""
    from splitfuse.kernels.cpu.build import compiler, library, unavailable_reason

    if compiler() is None:
        import pytest

        pytest.skip("no C++ compiler on this machine")
    assert library() is not None, unavailable_reason()


@pytest.mark.skipif(not any(os.path.exists(os.path.join(d, "g++")) for d in os.environ.get("PATH", "").split(":")),
                    reason="no g++")
def test_compiler_messages_in_utf8_under_an_ascii_locale(tmp_path):
    """Triton's Python stub runs with an ASCII locale while g++, in a UTF-8 environment, quotes
    names with curly quotes: a failed build is still a RuntimeError with the compiler's message
    (which the kernel loader turns into the torch path), not a UnicodeDecodeError."""
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f() { return undeclared_name; }\n")
    code = textwrap.dedent(f"""
        import locale
        from pathlib import Path
        locale.setlocale(locale.LC_CTYPE, "C")
        assert locale.getencoding().lower() in ("ascii", "ansi_x3.4-1968"), locale.getencoding()
        from splitfuse.kernels import toolchain
        try:
            toolchain.compile_library("g++", ["-shared", "-fPIC", {str(bad)!r}], Path({str(tmp_path / "out.so")!r}))
        except RuntimeError as e:
            print("RuntimeError", "undeclared_name" in str(e), "\\u2018" in str(e))
    """)
    env = dict(os.environ, LANG="C.UTF-8", LC_ALL="C.UTF-8", PYTHONUTF8="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["RuntimeError", "True", "True"], run.stdout + run.stderr[-2000:]
