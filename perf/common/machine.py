"""What machine a benchmark ran on, for the results files."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.common.paths import ROOT


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The model name with the CPU family and model numbers: a virtual machine's name may not tell
    generations apart (here "AMD EPYC" is Zen 4 as family 25 and Zen 5, with twice the AVX-512
    width per core, as family 26)."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def mem_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def cpu_flags() -> list[str]:
    """The SIMD flags that decide which kernels run (AVX2 / AVX-512 / AMX)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def git_commit(short: bool = True) -> str:
    """HEAD's commit ("-dirty" when tracked files differ from it), or "unknown" outside git."""
    try:
        args = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
        out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict:
    cpu = cpu_model()
    mem = mem_gib()
    commit = git_commit(short=False)
    # The serving code may not be committed yet: a digest of what was measured identifies it.
    digest = hashlib.sha256()
    files = 0
    # The C++ kernels' sources too: they are built at run time, and a change there alone is a
    # different engine.
    for pattern in ("backend/**/*.py", "kernels/**/*.py", "kernels/**/*.cpp", "kernels/**/*.h",
                    "model_repository/**/*"):
        for f in sorted(ROOT.glob(pattern)):
            if f.is_file() and "__pycache__" not in f.parts:
                digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
                files += 1
    versions = {}
    from importlib import metadata

    for dist in ("torch", "transformers", "tritonclient", "nvidia-pytriton"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "?"
    return {
        "cpu": cpu,
        "cpu_flags": " ".join(cpu_flags()),
        "cores": os.cpu_count(),
        "ram_gib": round(mem, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "git_commit": commit,
        "source_digest": f"sha256:{digest.hexdigest()[:16]} over {files} files of backend/, kernels/, model_repository/",
        "versions": versions,
    }
