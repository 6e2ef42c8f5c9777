"""How long the launcher waits, by default, for tritonserver to report ready: a base for the
server, the stubs, torch's import and a kernel build, plus a rate per GB of checkpoint loaded.

The rate: SmolLM2-135M's 0.54 GB (float32) loaded in 12 s on a loaded 2-core Zen 4 with the
file in the page cache (22 s/GB, fixed costs included); 30 s/GB leaves room for a cold disk or
network volume at ~150 MB/s and for the packing of weights at load. Replicas load the same files
each and share the cores, so the bytes count once per replica. A GGUF file is converted before
tritonserver starts (outside this budget); its weights are read from the file at load, so the
file is what is counted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from splitfuse.models.gguf_checkpoint import gguf_source

READY_BASE_S = 600.0
READY_S_PER_GB = 30.0


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """Bytes of a checkpoint: a file's size, a GGUF conversion's source file's size (its folder
    holds no weights), or the sum of the files under a directory."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    source = gguf_source(p)
    if source is not None:
        return source.file.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def ready_timeout_for(nbytes: int, replicas: int = 1) -> float:
    """READY_BASE_S plus READY_S_PER_GB for each GB (1e9 bytes) every replica loads."""
    return READY_BASE_S + READY_S_PER_GB * replicas * nbytes / 1e9


def default_ready_timeout(model: str | os.PathLike, params: Mapping[str, str], replicas: int) -> tuple[float, int]:
    """(seconds, bytes counted) for the checkpoint, with a speculative draft model when one is set."""
    nbytes = checkpoint_bytes(model)
    draft = params.get("speculative_model", "")
    if draft and Path(draft).exists():
        nbytes += checkpoint_bytes(draft)
    return ready_timeout_for(nbytes, replicas), nbytes
