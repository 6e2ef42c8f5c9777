"""Shared helpers for the Triton-lang kernels: an optional `triton` import and launch checks.

`triton` is optional: a CPU-only install must still import this package and use the torch
reference functions. When triton is missing, `triton.jit` below is a no-op decorator so the
kernel modules still import; their launchers then raise a clear error instead of failing on
import. Kernel modules use `from __future__ import annotations`, so `tl.constexpr`
annotations are never evaluated when triton is absent.

Interpreter mode (`TRITON_INTERPRET=1`) is decided by triton when a kernel is decorated, i.e.
when the kernel module is first imported; the package `__init__` imports kernel modules lazily
so that importing `splitfuse.kernels` does not freeze that choice.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: references work, launchers raise
    HAS_TRITON = False

    def _no_triton_jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = SimpleNamespace(jit=_no_triton_jit)  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]


def interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runnable(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device`.

    CUDA devices need triton; CPU tensors only work under the interpreter.
    """
    device = torch.device(device)
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


def check_launch(name: str, *tensors: torch.Tensor) -> None:
    """Raise a readable error before a launch that could not work."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{name}: all tensors must be on one device, got {t.device} and {device}")
    if not triton_runnable(device):
        if not HAS_TRITON:
            why = "triton is not installed"
        else:
            why = f"tensors on {device} need CUDA, or TRITON_INTERPRET=1 set before triton is imported"
        raise RuntimeError(f"{name}: cannot launch the Triton kernel ({why}); use the *_reference function")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; a small stand-in elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


__all__ = ["HAS_TRITON", "triton", "tl", "interpreting", "triton_runnable", "check_launch", "cdiv", "next_pow2",
           "num_sms"]
