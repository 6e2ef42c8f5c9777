"""The systems run_all.py compares: their names, labels and plot styles.

A system is a base name, optionally with a token budget for our engine: "prefill_first@2048".
"""

from __future__ import annotations

TRITON_POLICIES = ("splitfuse", "prefill_first", "orca")
SYSTEM_ORDER = ("splitfuse", "prefill_first", "orca", "vllm", "vllm_2c")
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
    "vllm": "vLLM-CPU 0.32.0",
    "vllm_2c": "vLLM-CPU 0.32.0 (2 compute cores)",
}
COLORS = {"splitfuse": "tab:blue", "prefill_first": "tab:orange", "orca": "tab:green", "vllm": "tab:red",
          "vllm_2c": "tab:purple"}
MARKERS = {"splitfuse": "o", "prefill_first": "x", "orca": "s", "vllm": "^", "vllm_2c": "v"}


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
