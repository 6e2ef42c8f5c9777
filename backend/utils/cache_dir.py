"""Where splitfuse keeps what it builds once and reuses: $XDG_CACHE_HOME/splitfuse/<what>
(~/.cache/splitfuse/<what> by default): compiled kernels, converted GGUF checkpoints, the
launcher's helper library."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(what: str) -> Path:
    """The cache directory for `what` (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitfuse" / what
