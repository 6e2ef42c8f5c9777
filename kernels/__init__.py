"""Every kernel of the engine, each tested against its plain-torch reference.

    reference.py    plain torch, any device: what every kernel must compute (and the engine's
                    `torch` path)
    triton_lang/    Triton-lang kernels for GPUs (run on CPU under TRITON_INTERPRET=1 in tests):
                    paged attention (+ split-KV decode), KV write, RMSNorm, rotary, SiLU-and-mul,
                    and the flash-attn paged wrapper
    cpu/            C++ kernels for CPUs, compiled on the machine (`cpu/build.py`, OpenMP,
                    vectorised for the CPU found): paged attention + KV write, fused
                    elementwise ops, linear layers on blocked weights

Names are imported lazily (PEP 562 `__getattr__`): `import splitfuse.kernels` imports neither
triton nor a kernel module, so it works without triton and does not freeze triton's interpreter
choice (TRITON_INTERPRET is read when a kernel module is first imported). `triton_runnable(device)`
says whether the Triton launchers can run there (CUDA, or CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "paged_attention_reference": "reference",
    "write_kv_cache_reference": "reference",
    "rms_norm_reference": "reference",
    "apply_rotary_reference": "reference",
    "silu_and_mul_reference": "reference",
    "linear_reference": "reference",
    "int8_linear_reference": "reference",
    "lora_delta_reference": "reference",
    "paged_attention": "triton_lang.paged_attention",
    "paged_decode_attention_split_kv": "triton_lang.paged_attention_split_kv",
    "choose_num_splits": "triton_lang.paged_attention_split_kv",
    "write_kv_cache": "triton_lang.kv_cache",
    "rms_norm": "triton_lang.rms_norm",
    "apply_rotary": "triton_lang.rotary",
    "silu_and_mul": "triton_lang.activation",
    "flash_attn_paged_attention": "flash_attn",
    "paged_attention_flash": "flash_attn",
    "flash_attn_supported": "flash_attn",
    "lora_delta": "triton_lang.lora",
    "HAS_TRITON": "triton_lang._common",
    "triton_runnable": "triton_lang._common",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
