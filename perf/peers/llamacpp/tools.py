"""Where build.sh put llama.cpp's tools, and the GGUF file a peer run uses.

`tool("llama-bench")` is the path of one built tool (native build; LLAMACPP_BIN overrides the
folder, e.g. the AVX2 build's). `gguf_file(model)` is the GGUF behind a benchmark's model: the
file itself, or the source recorded in a checkpoint that splitfuse converted from one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.common.paths import CACHE

BUILD_DIR = CACHE / "llamacpp" / "build"


def bin_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_BIN", BUILD_DIR / "bin"))


def tool(name: str) -> Path:
    """A built llama.cpp tool; raises FileNotFoundError saying how to build it."""
    path = bin_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build llama.cpp first (perf/peers/llamacpp/build.sh)")
    return path


def version() -> str:
    """What build.sh recorded (the sdist's version and llama-bench --version), after the build's
    folder name (build: -DGGML_NATIVE=ON; build-avx2: AVX2 + FMA only)."""
    f = bin_dir().parent / "VERSION.txt"
    recorded = " / ".join(line.strip() for line in f.read_text().splitlines() if line.strip()) if f.is_file() else "?"
    return f"{bin_dir().parent.name}: {recorded}"


def gguf_file(model: str | os.PathLike) -> Path:
    """The GGUF file of `model`: a .gguf path, or a checkpoint directory converted from one
    (its splitfuse_gguf.json names the source)."""
    p = Path(model)
    if p.suffix == ".gguf" and p.is_file():
        return p.resolve()
    marker = p / "splitfuse_gguf.json"
    if marker.is_file():
        src = Path(json.loads(marker.read_text())["source"])
        if src.is_file():
            return src
    raise FileNotFoundError(f"{model}: neither a .gguf file nor a checkpoint converted from one")


def server_cmd(gguf: Path, port: int, threads: int, slots: int, slot_ctx: int) -> list[str]:
    """llama-server on loopback with a slot per client, each slot `slot_ctx` tokens of context
    (-c is the total, split evenly among the slots)."""
    return [str(tool("llama-server")), "-m", str(gguf), "-t", str(threads), "-np", str(slots),
            "-c", str(slots * slot_ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
