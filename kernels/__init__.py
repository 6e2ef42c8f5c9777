"""Triton-lang kernels for the engine, each with a plain torch reference beside it.

Names are imported lazily (PEP 562 `__getattr__`): `import splitfuse.kernels` imports neither
triton nor a kernel module, so it works without triton and does not freeze triton's interpreter
choice (TRITON_INTERPRET is read when a kernel module is first imported). The `*_reference`
functions are pure torch and work on any device, with or without triton. `triton_runnable(device)`
says whether the Triton launchers can run there (CUDA, or CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS: dict[str, str] = {
    "paged_attention": "paged_attention",
    "paged_attention_reference": "paged_attention",
    "paged_decode_attention_split_kv": "paged_attention_split_kv",
    "choose_num_splits": "paged_attention_split_kv",
    "write_kv_cache": "kv_cache",
    "write_kv_cache_reference": "kv_cache",
    "rms_norm": "rms_norm",
    "rms_norm_reference": "rms_norm",
    "apply_rotary": "rotary",
    "apply_rotary_reference": "rotary",
    "silu_and_mul": "activation",
    "silu_and_mul_reference": "activation",
    "flash_attn_paged_attention": "flash_attn_backend",
    "paged_attention_flash": "flash_attn_backend",
    "flash_attn_supported": "flash_attn_backend",
    "HAS_TRITON": "_common",
    "triton_runnable": "_common",
}

__all__ = sorted(_EXPORTS)


class _KernelsPackage(types.ModuleType):
    # Several modules share their main function's name (rms_norm.rms_norm, ...). Importing such a
    # submodule makes Python bind it on the package, which would shadow the function; keep the
    # function instead (the module stays reachable through sys.modules and `from ... import`).
    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
