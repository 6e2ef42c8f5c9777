"""The C++ compiler this machine offers, and building a shared library with it, for every part of
splitfuse built on the machine (the CPU kernels, the launcher's argument shim). No torch import:
the launcher uses it too."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else g++ or c++ on PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_library(cxx: str, args: list[str], out: Path) -> None:
    """Run `cxx args -o <tmp>` and move the result to `out`. Built under a temporary name in
    out's folder and renamed: concurrent builders (Triton instances, launchers, test workers)
    never load a half-written file. RuntimeError with the compiler's output when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    # The compiler's messages decoded as UTF-8 whatever this process's locale: Triton's Python
    # stub runs with an ASCII one, and g++ in a UTF-8 environment quotes names with curly quotes.
    proc = subprocess.run([cxx, *args, "-o", tmp], capture_output=True, text=True, encoding="utf-8",
                          errors="replace")
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
