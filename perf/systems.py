"""The systems run_all.py compares: their names, labels and plot styles.

A system is a base name, optionally with a token budget for our engine: "prefill_first@2048".
"""

from __future__ import annotations

TRITON_POLICIES = ("splitfuse", "prefill_first", "orca")
# Our SplitFuse engine inside the benchmark's process (EngineLoop, no server): what serving costs.
ENGINE_SYSTEM = "engine"
BUDGETED = (*TRITON_POLICIES, ENGINE_SYSTEM)
SYSTEM_ORDER = ("splitfuse", "prefill_first", "orca", "engine", "vllm", "vllm_2c")
VLLM_SYSTEMS = {
    # vLLM's own CPU defaults: on 2 cores it binds its OpenMP threads to core 0 and keeps core 1
    # for the API server (VLLM_CPU_OMP_THREADS_BIND=auto).
    "vllm": {},
    # Both cores for vLLM's compute threads, as our engine's torch threads use them.
    "vllm_2c": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
}
LABELS = {
    "splitfuse": "SplitFuse (ours)",
    "prefill_first": "prefill_first (ours, vLLM-v0 style)",
    "orca": "orca (ours)",
    "engine": "SplitFuse engine in-process (no server)",
    "vllm": "vLLM-CPU 0.32.0",
    "vllm_2c": "vLLM-CPU 0.32.0 (2 compute cores)",
}
COLORS = {"splitfuse": "tab:blue", "prefill_first": "tab:orange", "orca": "tab:green", "engine": "tab:gray",
          "vllm": "tab:red",
          "vllm_2c": "tab:purple"}
MARKERS = {"splitfuse": "o", "prefill_first": "x", "orca": "s", "engine": "D", "vllm": "^", "vllm_2c": "v"}


# A system is a base name, optionally with a token budget for our engine: "prefill_first@2048".
def base_of(system: str) -> str:
    return system.split("@", 1)[0]


def budget_of(system: str) -> int | None:
    return int(system.split("@", 1)[1]) if "@" in system else None


def label_of(system: str) -> str:
    b = budget_of(system)
    return LABELS[base_of(system)] + (f", budget {b}" if b else "")


def color_of(system: str) -> str:
    return COLORS[base_of(system)]


def marker_of(system: str) -> str:
    return MARKERS[base_of(system)]


def order_key(system: str) -> tuple:
    return (SYSTEM_ORDER.index(base_of(system)), budget_of(system) or 0)


def file_stem(system: str) -> str:
    return system.replace("@", "_b")
