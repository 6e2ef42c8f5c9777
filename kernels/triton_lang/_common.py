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


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  sliding_window: int | None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head_dim mismatch: q {d}, cache {k_cache.shape[3]}")
    if d > 256:
        raise ValueError(f"head_dim {d} > 256 is not supported")
    if hq % hkv != 0:
        raise ValueError(f"num_heads {hq} must be a multiple of num_kv_heads {hkv}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1 or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError("query_start_loc must be [B+1] and block_tables [B, max_blocks] for seq_lens [B]")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1):
        raise ValueError("query_start_loc, seq_lens and block_tables rows must be contiguous")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")


def dot_precision(dtype: torch.dtype) -> str:
    # fp32: three TF32 passes give ~fp32 accuracy on tensor cores (plain "ieee" FMA dots spill
    # registers badly); fp16/bf16 ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def pick_num_warps(block_m: int, block_d: int, dtype: torch.dtype) -> int:
    # 4 warps spill registers on sm80 from a 64 x 128 tile up (checked with ptxas -v); fp32 needs 8 too.
    return 8 if block_m * block_d >= 64 * 128 or dtype == torch.float32 else 4


__all__ = ["HAS_TRITON", "triton", "tl", "interpreting", "triton_runnable", "check_launch", "cdiv", "next_pow2",
           "num_sms",
           "check_attention_inputs", "dot_precision", "pick_num_warps"]
