"""Compile the C++ CPU kernels on this machine and load them.

All `csrc/*.cpp` files build into one shared library with the system C++ compiler and
`-march=native`, so the code is vectorised for the instruction set of the machine it runs on
(AVX-512 where the CPU has it, AVX2 elsewhere) without shipping per-ISA binaries. The library
goes to a cache directory under a name derived from the sources, the flags, the compiler and the
CPU's flags: a changed source, compiler or machine gets a new build, an unchanged one loads at
once. `make install` builds it ahead (`python -m splitfuse.kernels.cpu.build`); otherwise the
first `library()` call does.

SPLITFUSE_CPU_ISA=avx2 builds for `-march=x86-64-v3` (AVX2 and FMA, no AVX-512, no AVX-VNNI)
instead of the machine's own instruction set: an AVX-512 machine then runs the code path an
AVX2-only CPU (e.g. Zen 3) gets, which the test suite uses to cover both. What a loaded library
was built for is `library_isa()`, read from the library itself; the engine's choices that depend
on our kernels ask it, not /proc/cpuinfo. SPLITFUSE_CPU_KERNEL_CFLAGS adds further compiler flags.
Both are part of the cache key.

No compiler, or a failed build, is not an error: `library()` returns None with a log line and
the engine runs its plain torch path.

Built ahead (a container image, whose runtime has no compiler): without a compiler, a library
already in the cache directory for the same sources and flags (and, for -march=native, the same
CPU flags) loads, whichever compiler built it; `prebuilt()`. An x86-64-v3 (avx2) library loads
only on a CPU with every x86-64-v3 feature; elsewhere the torch path runs.

The kernels use OpenMP. torch ships its own `libgomp.so.1`; importing torch first makes the
library bind to that same runtime, so the kernels and torch's ops share one thread pool (and
`torch.set_num_threads` governs both).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch  # noqa: F401  (loads torch's libgomp before the library binds to one)

from splitfuse.kernels.toolchain import compile_library, compiler
from splitfuse.utils.cache_dir import cache_dir as splitfuse_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno",
         "-Wall", "-Wno-unknown-pragmas"]
_lock = threading.Lock()
_cached: tuple[ctypes.CDLL | None, str] | None = None
_flags: frozenset[str] | None = None


def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo reports for this CPU (empty where it cannot be read)."""
    global _flags
    if _flags is None:
        flags: frozenset[str] = frozenset()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
        except OSError:
            pass
        _flags = flags
    return _flags


def isa() -> str:
    """The widest vector instruction set this CPU reports, for logs and results."""
    flags = cpu_flags()
    if not flags:
        return "unknown"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512" + ("+bf16" if "avx512_bf16" in flags else "")
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


def cache_dir() -> Path:
    root = os.environ.get("SPLITFUSE_KERNEL_CACHE")
    if root:
        return Path(root)
    return splitfuse_cache_dir("cpu_kernels")


# SPLITFUSE_CPU_ISA -> the target flag. x86-64-v3 is the AVX2 + FMA level every AVX2 CPU we run on
# (Zen 2/3, Haswell and later) has.
ISA_TARGETS = {"native": "-march=native", "avx2": "-march=x86-64-v3"}


def requested_isa() -> str:
    """SPLITFUSE_CPU_ISA (native when unset); a value it does not know is an error."""
    name = os.environ.get("SPLITFUSE_CPU_ISA", "") or "native"
    if name not in ISA_TARGETS:
        raise RuntimeError(f"SPLITFUSE_CPU_ISA={name!r}: expected one of {', '.join(ISA_TARGETS)}")
    return name


def flags() -> list[str]:
    """The compiler flags: FLAGS, the target of SPLITFUSE_CPU_ISA, then any from
    SPLITFUSE_CPU_KERNEL_CFLAGS."""
    return FLAGS + [ISA_TARGETS[requested_isa()]] + os.environ.get("SPLITFUSE_CPU_KERNEL_CFLAGS", "").split()


def _source_key() -> str:
    """What the library's code depends on besides the compiler: the sources, the flags and, for
    -march=native, this CPU's flags (x86-64-v3 code does not depend on the CPU it was built on)."""
    h = hashlib.sha256()
    for src in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    h.update(" ".join(flags()).encode())
    if requested_isa() == "native":
        h.update(" ".join(sorted(cpu_flags())).encode())  # -march=native code is only valid on CPUs with these flags
    return h.hexdigest()[:16]


def _compiler_key(cxx: str) -> str:
    h = hashlib.sha256(cxx.encode())
    try:
        h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.encode())
    except (OSError, subprocess.SubprocessError):
        pass
    return h.hexdigest()[:8]


# The features -march=x86-64-v3 code may use, as /proc/cpuinfo names them (abm: LZCNT).
X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm", "xsave"})


def _unsupported() -> str | None:
    """Why a library for the requested ISA must not run on this CPU (None: it may)."""
    if requested_isa() == "avx2":
        missing = X86_64_V3 - cpu_flags()
        if cpu_flags() and missing:
            return f"SPLITFUSE_CPU_ISA=avx2 (x86-64-v3) code needs {', '.join(sorted(missing))}, which this CPU lacks"
    return None


def prebuilt() -> Path | None:
    """A library in cache_dir() for these sources and flags (and CPU, for native), by any compiler."""
    found = sorted(cache_dir().glob(f"libsplitfuse_cpu-{_source_key()}-*.so"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def build(force: bool = False) -> Path:
    """Compile the library if needed and return its path. Raises RuntimeError on failure."""
    reason = _unsupported()
    if reason:
        raise RuntimeError(reason)
    cxx = compiler()
    if cxx is None:
        found = None if force else prebuilt()
        if found is None:
            raise RuntimeError(f"no C++ compiler found (set CXX, or install g++), and no library built ahead "
                               f"for this CPU in {cache_dir()}")
        return found
    out = cache_dir() / f"libsplitfuse_cpu-{_source_key()}-{_compiler_key(cxx)}.so"
    if out.exists() and not force:
        return out
    if out.parent.is_dir() and not os.access(out.parent, os.W_OK) and not force:
        found = prebuilt()  # a read-only cache built ahead by another compiler (an image's)
        if found is not None:
            return found
    sources = [str(s) for s in sorted(CSRC.glob("*.cpp"))]
    args = [*flags(), "-I", str(CSRC), *sources]
    log.info("splitfuse: building CPU kernels (%s): %s %s", isa(), cxx, " ".join(args))
    try:
        compile_library(cxx, args, out)
    except RuntimeError as e:
        raise RuntimeError(f"CPU kernel build failed: {e}") from None
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (with the reason logged once) when it cannot be built.

    SPLITFUSE_CPU_KERNELS=0 disables it (the engine then runs its torch path)."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _load()
        return _cached[0]


T = TypeVar("T")


def bind(lib: ctypes.CDLL, name: str, restype: type | None, *argtypes: type) -> ctypes._CFuncPtr:
    """`lib`'s entry point `name` with its C signature set (see csrc/sf_api.h); AttributeError
    when the library lacks it. restype None: a void function."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


class Entries(Generic[T]):
    """The entry points one source file adds to the library, looked up once on first use (which
    builds the library): `lookup(lib)` finds them and sets their signatures. `get()` returns what
    it returned, or None when the library is missing or was built without that file (a symbol is
    absent)."""

    def __init__(self, what: str, lookup: Callable[[ctypes.CDLL], T]) -> None:
        self._what, self._lookup = what, lookup
        self._looked = False
        self._value: T | None = None

    def get(self) -> T | None:
        if not self._looked:
            lib = library()
            try:
                self._value = None if lib is None else self._lookup(lib)
            except AttributeError:  # a library built without this file
                self._value = None
            self._looked = True
        return self._value

    def available(self) -> bool:
        return self.get() is not None

    def need(self) -> T:
        value = self.get()
        if value is None:
            raise RuntimeError(f"splitfuse C++ CPU {self._what} kernels are unavailable; check available() first")
        return value


def unavailable_reason() -> str:
    library()
    return _cached[1] if _cached else ""


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("SPLITFUSE_CPU_KERNELS", "1") == "0":
        return None, "disabled by SPLITFUSE_CPU_KERNELS=0"
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        reason = str(e).splitlines()[0]
        log.warning("splitfuse: C++ CPU kernels unavailable, using the torch path: %s", reason)
        return None, reason
    bind(lib, "sf_build_isa", ctypes.c_int)
    log.info("splitfuse: C++ CPU kernels loaded (built for %s on a %s CPU, %s)", _isa_name(lib.sf_build_isa()),
             isa(), path.name)
    return lib, ""


# csrc/isa.cpp: sf_build_isa's bits.
_ISA_BITS = {"avx2": 1, "avx512": 2, "avx512_bf16": 4, "avx512_vnni": 8}


def vector_width() -> int:
    """Floats per vector the library was compiled for: 16 (AVX-512), 8 (AVX2), 4 (other)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the C++ CPU kernels are not available: {unavailable_reason()}")
    return int(bind(lib, "sf_ew_vector_width", ctypes.c_int)())


def _isa_name(bits: int) -> str:
    if bits & _ISA_BITS["avx512"]:
        return "avx512" + ("+bf16" if bits & _ISA_BITS["avx512_bf16"] else "")
    return "avx2" if bits & _ISA_BITS["avx2"] else "generic"


def library_isa() -> str | None:
    """The instruction set the loaded kernel library was compiled for (`isa()`'s names), or None
    without a library. It equals isa() unless SPLITFUSE_CPU_ISA narrowed the build."""
    lib = library()
    return None if lib is None else _isa_name(lib.sf_build_isa())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(build(force="--force" in sys.argv))
    except RuntimeError as e:
        # `make install` must not fail on a machine without a compiler: the torch path runs.
        print(f"splitfuse: CPU kernels not built, the torch path will be used: {e}", file=sys.stderr)
