"""Where perf/ keeps things: the repository root, the results, and the git-ignored tool folders
(`perf/.cache/`, `perf/.venv-vllm/`, `perf/.venv-genai/`), which stay at perf/'s top level."""

from __future__ import annotations

from pathlib import Path

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

PERF = Path(__file__).resolve().parent.parent
ROOT = PERF.parent
RESULTS = PERF / "results"
CACHE = PERF / ".cache"
VENV_VLLM = PERF / ".venv-vllm"
VENV_GENAI = PERF / ".venv-genai"
