"""The systems run_all.py and offline_compare.py compare: their names, labels and plot styles.

A system is a base name, optionally with a token budget for our engine and a precision:
"prefill_first@2048", "splitfuse@256:bf16", "vllm_2c:bf16", "splitfuse@256:int8",
"splitfuse_r2@256:bf16".
"""

from __future__ import annotations

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

TRITON_POLICIES = ("splitfuse", "prefill_first", "orca")
# Our server with the llm model replicated (Triton instance_group count), each replica's engine
# on its share of the cores (num_threads = cores / replicas): no OpenMP team spans the cores the
# serving path also runs on. Base name -> (scheduler policy, replicas).
REPLICATED = {"splitfuse_r2": ("splitfuse", 2)}
# Every system that is our Triton server.
TRITON_SYSTEMS = (*TRITON_POLICIES, *REPLICATED)
# Our SplitFuse engine inside the benchmark's process (EngineLoop, no server): what serving costs.
ENGINE_SYSTEM = "engine"
BUDGETED = (*TRITON_SYSTEMS, ENGINE_SYSTEM)
SYSTEM_ORDER = ("splitfuse", "splitfuse_r2", "prefill_first", "orca", "engine", "vllm", "vllm_2c", "vllm_dp2",
                "llamacpp")
# llama.cpp's llama-server on the GGUF file our systems were converted from (perf/peers/llamacpp):
# all cores (-t), a slot per client (-np). It runs the file's own block types: no precision suffix.
LLAMACPP_SYSTEMS = ("llamacpp",)
VLLM_SYSTEMS = {
    # vLLM's own CPU defaults: on 2 cores it binds its OpenMP threads to core 0 and keeps core 1
    # for the API server (VLLM_CPU_OMP_THREADS_BIND=auto).
    "vllm": {},
    # Both cores for vLLM's compute threads, as our engine's torch threads use them.
    "vllm_2c": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
    # Two engine processes (data parallel), one core each: vLLM's counterpart of splitfuse_r2.
    "vllm_dp2": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
}
# vLLM server arguments beyond the environment. These systems are served only: offline_compare.py
# runs vLLM's LLM class, one engine.
VLLM_SERVER_ARGS = {"vllm_dp2": ["--data-parallel-size", "2"]}
LABELS = {
    "splitfuse": "SplitFuse (ours)",
    "splitfuse_r2": "SplitFuse (ours), 2 replicas",
    "prefill_first": "prefill_first (ours, vLLM-v0 style)",
    "orca": "orca (ours)",
    "engine": "SplitFuse engine in-process (no server)",
    "vllm": "vLLM-CPU 0.32.0",
    "vllm_2c": "vLLM-CPU 0.32.0 (2 compute cores)",
    "vllm_dp2": "vLLM-CPU 0.32.0 (2 data-parallel engines, 1 core each)",
    "llamacpp": "llama.cpp llama-server",
}
COLORS = {"splitfuse": "tab:blue", "splitfuse_r2": "tab:cyan", "prefill_first": "tab:orange", "orca": "tab:green",
          "engine": "tab:gray", "vllm": "tab:red", "vllm_2c": "tab:purple", "vllm_dp2": "tab:brown",
          "llamacpp": "tab:olive"}
MARKERS = {"splitfuse": "o", "splitfuse_r2": "p", "prefill_first": "x", "orca": "s", "engine": "D", "vllm": "^",
           "vllm_2c": "v", "vllm_dp2": "<", "llamacpp": ">"}
# Precisions after a colon ("" = float32): our engine's parameters for each, and vLLM's --dtype
# (vLLM-CPU has no int8 weight quantization of a float checkpoint). kvbf16: float32 weights and
# activations over a bf16 KV cache. int8-bf16: int8 weights in a bfloat16 model (bf16
# activations and KV cache), the int8 setting of CPUs with AVX-512 BF16.
PRECISIONS = {"": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
              "kvbf16": {"kv_cache_dtype": "bfloat16"},
              "int8-kvbf16": {"quantization": "int8", "kv_cache_dtype": "bfloat16"},
              "int8-bf16": {"quantization": "int8", "dtype": "bfloat16"}}
VLLM_DTYPES = {"": "float32", "bf16": "bfloat16"}
PRECISION_MARKERS = {"bf16": "P", "int8": "*", "kvbf16": "h", "int8-kvbf16": "X", "int8-bf16": "d"}


def _name_and_budget(system: str) -> str:
    return system.partition(":")[0]


def base_of(system: str) -> str:
    return _name_and_budget(system).split("@", 1)[0]


def budget_of(system: str) -> int | None:
    name = _name_and_budget(system)
    return int(name.split("@", 1)[1]) if "@" in name else None


def policy_of(system: str) -> str:
    """Our engine's scheduler_policy for one of our systems."""
    base = base_of(system)
    return "splitfuse" if base == ENGINE_SYSTEM else REPLICATED.get(base, (base, 1))[0]


def replicas_of(system: str) -> int:
    """How many engine replicas (llm model instances) the system serves with."""
    return REPLICATED.get(base_of(system), ("", 1))[1]


def precision_of(system: str) -> str:
    return system.partition(":")[2]


def float_twin(system: str) -> str:
    """The same system in float32: "splitfuse@256:int8" -> "splitfuse@256"."""
    return _name_and_budget(system)


def label_of(system: str) -> str:
    b, p = budget_of(system), precision_of(system)
    return LABELS[base_of(system)] + (f", budget {b}" if b else "") + (f", {p}" if p else "")


def color_of(system: str) -> str:
    return COLORS[base_of(system)]


def marker_of(system: str) -> str:
    return PRECISION_MARKERS.get(precision_of(system), MARKERS[base_of(system)])


def order_key(system: str) -> tuple:
    return (SYSTEM_ORDER.index(base_of(system)), budget_of(system) or 0, list(PRECISIONS).index(precision_of(system)))


def file_stem(system: str) -> str:
    return system.replace("@", "_b").replace(":", "_")


def check_precision(system: str, vllm: bool) -> None:
    """Raises ValueError for an unknown precision or one the system cannot run."""
    p = precision_of(system)
    if base_of(system) in LLAMACPP_SYSTEMS and p:
        raise ValueError(f"system {system!r}: llama.cpp runs the GGUF file's own types (no precision suffix)")
    if p not in PRECISIONS or (vllm and p not in VLLM_DTYPES):
        choices = list(VLLM_DTYPES if vllm else PRECISIONS)[1:]
        raise ValueError(f"system {system!r}: precision {p!r} not one of {choices}")
