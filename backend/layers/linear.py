"""The one linear layer every projection goes through (attention, MLP, MoE experts, LM head).

Three ways to multiply float weights, chosen once at load (`EngineConfig.linear_backend`):

* `cpu`: our C++ kernel (`splitfuse.kernels.cpu.linear`) over the weight rearranged once into
  column blocks; the plain weight is then released. Every k loads a block's weights once for a
  strip of rows, so few rows (decodes) stream the weight at memory speed where oneDNN reaches
  about half of it. Measured on a 2-core Zen 4 (AVX-512 BF16, no AMX), the bench model's 32
  projections in bf16: 1 row 2.28 -> 1.27 ms, 8 rows 2.28 -> 1.44, 16 rows 3.10 -> 2.33,
  256 rows 30.2 -> 29.5 (both at the multiply peak); fp32 1 row 4.20 -> 2.16 ms; 4096x11008
  weights the same way.
* `onednn` (CPU): the weight is reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`) and every call runs `_linear_pointwise`. oneDNN
  detects the CPU's instruction set itself; MKL's `F.linear` picks slow code paths on AMD CPUs.
  The plain weight is then released (no second copy of the model's weights in memory).
* `torch`: `F.linear`, with one CPU refinement: with 2-64 rows MKL's `x @ W^T` reads the weight
  several times slower than memory allows, while `(W @ x^T)^T` streams it close to bandwidth
  (measured on a 2-core AMD EPYC: the 26M model's 32 weights, 4 rows 13.4 -> 5.4 ms). Weights of
  fewer than 64k elements keep F.linear (the transpose copy costs more than it saves).

`auto` is `cpu` where that kernel was measured ahead: the C++ library built with AVX-512 (and,
for bf16, AVX-512 BF16 dot products) on a CPU without AMX (whose tile units oneDNN uses for
large bf16 products); on AVX2 builds for bf16 (weights widened in registers; oneDNN has no bf16
there) and int8 (cpu_linear_preferred). Elsewhere `onednn` where torch has it for the dtype,
else `torch`.

With `EngineConfig.quantization="int8"` the projections run int8 kernels (int8_linear.py):
`CpuInt8Linear` (the C++ kernel) with the `cpu` backend on CPUs with AVX-512 VNNI or AVX2, else
`Int8Linear` (oneDNN); the LM head and the MoE router keep the float kernel (they decide tokens
and experts).

With `quantization="gguf"` or `"gguf-exact"` (a checkpoint converted from a GGUF file) the
projections whose blocks the file stores as Q4_0 / Q4_1 / Q8_0 run `CpuQ4Linear` (q4_linear.py)
over those blocks, packed; with `"q4_0"`, `"q4_1"` or `"q8_0"` every projection's float weight is
quantized into such blocks at load and runs the same kernel. The others, and every projection
where that kernel cannot run, keep the float kernel.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitfuse.kernels.cpu import linear as cpu_linear
from splitfuse.kernels.cpu.build import cpu_flags, library_isa
from splitfuse.layers.int8_linear import CpuInt8Linear, Int8Linear, cpu_int8_supported, int8_supported
from splitfuse.layers.q4_linear import (BLOCK_QUANTIZATIONS, LOAD_QUANTIZATIONS, BlockSource, CpuQ4Linear,
                                        block_source, q4_supported)

log = logging.getLogger(__name__)

_FEW_ROWS = 64
_MIN_WEIGHT_ELEMENTS = 1 << 16
# oneDNN picks its blocked layout for an expected row count; prompt chunks dominate the work.
_ONEDNN_ROWS_HINT = 128

LinearKernel = Callable[[torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The `torch` backend's product."""
    if (x.device.type == "cpu" and x.dim() == 2 and 1 < x.shape[0] <= _FEW_ROWS
            and weight.numel() >= _MIN_WEIGHT_ELEMENTS):
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class OneDnnLinear:
    """A weight packed once for oneDNN; calling it computes `x @ W^T + b`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ONEDNN_ROWS_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    @property
    def weight_bytes(self) -> dict[str, int]:
        itemsize = torch.empty((), dtype=self.packed.dtype).element_size()
        return {str(self.packed.dtype).removeprefix("torch."): itemsize * self.out_features * self.in_features}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class CpuLinear:
    """A weight packed once into the C++ kernel's column blocks; calling it computes `x @ W^T + b`,
    or for a gated (SwiGLU gate_up) weight [2I, K] silu(gate) * up [.., I] straight from the sums."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> None:
        self.in_features = weight.shape[1]
        self.packed = cpu_linear.pack_weight(weight, None if bias is None else bias.to(weight.dtype), gated=gated)
        self.out_features = self.packed.out_features

    @property
    def weight_bytes(self) -> dict[str, int]:
        data = self.packed.data
        return {str(data.dtype).removeprefix("torch."): data.numel() * data.element_size()}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return cpu_linear.linear(x, self.packed)
        out = cpu_linear.linear(x.reshape(-1, self.in_features), self.packed)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def addend_features(self) -> int:
        """The columns of `with_addend`'s addend: the unfused product's (2I for a gated weight)."""
        return 2 * self.out_features if self.packed.gated else self.out_features

    def with_addend(self, x: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
        """As calling it, with `addend` [rows of x, addend_features] (x's dtype) added to the sums
        before they are stored (a gated weight: before SwiGLU)."""
        flat = x.reshape(-1, self.in_features)
        out = cpu_linear.linear(flat, self.packed, addend=addend.reshape(flat.shape[0], self.addend_features))
        return out.view(*x.shape[:-1], self.out_features)


_FAST_CPU_WIDTH = 64  # block width of an AVX-512 build (the ISA the `cpu` kernel was measured on)


def cpu_linear_supported(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the C++ `cpu` linear kernel runs here for `dtype`."""
    if device.type != "cpu":
        return False, f"device {device.type} (the cpu linear kernel is for CPUs)"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"dtype {dtype} (the cpu linear kernel takes float32 and bfloat16)"
    if not cpu_linear.available():
        return False, "the C++ CPU kernels are not built"
    return True, ""


def cpu_linear_preferred(device: torch.device, dtype: torch.dtype, quantization: str = "none") -> tuple[bool, str]:
    """Whether `auto` picks the `cpu` kernel: where it runs and was measured ahead of oneDNN (the
    reason either way; empty for the AVX-512 case)."""
    ok, why = cpu_linear_supported(device, dtype)
    if not ok:
        return False, why
    if cpu_linear.block_width() != _FAST_CPU_WIDTH:
        # Below AVX-512 (AVX2: Zen 3) only where oneDNN is slow or absent. AVX2 build forced on a
        # Zen 5 (perf/results/2026-11-27-avx2-lowp/), bench model, 16 requests of 128 + 128 tokens, one thread:
        # fp32 (oneDNN) 4.41 s; bf16 here 3.44 s, through F.linear 21.05 s (oneDNN has no bf16
        # without AVX-512 / AVX-NE-CONVERT); int8 here 2.60 s, through oneDNN 3.09 s.
        if quantization == "int8" and cpu_int8_supported(dtype):
            return True, f"int8 on {cpu_linear.int8_products()} in the C++ kernel (built for {library_isa()})"
        if dtype is torch.bfloat16:
            return True, f"bf16 weights widened to fp32 in registers by the C++ kernel (built for {library_isa()})"
        return False, "the C++ kernels are built without AVX-512 (float32: oneDNN is faster on prompt chunks)"
    if dtype is torch.bfloat16:
        if not cpu_linear.native_bf16():
            return False, "no AVX-512 BF16 dot products"
        if "amx_bf16" in cpu_flags():
            return False, "AMX: oneDNN's tile kernels are faster for bf16"
    return True, ""


def native_bf16_cpu() -> tuple[bool, str]:
    """Whether bf16 runs at least as fast as float32 in the kernels the engine runs here, and what
    decides it: our C++ kernels' build (AVX-512 BF16 dot products; or, on AVX2 builds, bf16
    weights widened in registers, measured faster than float32 on decode-heavy work:
    cpu_linear_preferred), or AMX (oneDNN's tiles); without our kernels, the CPU's flags for oneDNN."""
    if "amx_bf16" in cpu_flags():
        return True, "AMX bf16 tiles"
    if cpu_linear.available():
        if cpu_linear.native_bf16():
            return True, "AVX-512 BF16 dot products in the C++ kernels"
        if library_isa() == "avx2":
            return True, "bf16 weights widened to fp32 in registers by the C++ kernels (AVX2)"
        return False, f"no bf16 dot products in the C++ kernels (built for {library_isa()})"
    if "avx512_bf16" in cpu_flags():
        return True, "AVX-512 BF16 (oneDNN)"
    return False, "no AVX-512 BF16 or AMX"


def onednn_supported(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether oneDNN linear runs here, found by packing and running a tiny weight."""
    if device.type != "cpu":
        return False, f"device {device.type} (oneDNN linear is for CPUs)"
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (mkldnn)"
    try:
        w = torch.ones(16, 16, dtype=dtype)
        out = OneDnnLinear(w, None)(torch.ones(2, 16, dtype=dtype))
        if not torch.equal(out, torch.full((2, 16), 16.0, dtype=dtype)):
            return False, "oneDNN linear gave a wrong result on a probe"
    except RuntimeError as e:  # e.g. bf16 on a CPU without AVX-512/AVX-NE-CONVERT
        return False, str(e).splitlines()[0]
    return True, ""


def resolve_linear_backend(requested: str, device: torch.device, dtype: torch.dtype, quantization: str = "none") -> str:
    if requested == "torch":
        return "torch"
    if requested == "cpu":
        ok, why = cpu_linear_supported(device, dtype)
        if not ok:
            raise ValueError(f"linear_backend='cpu' cannot run here: {why}")
        return "cpu"
    if requested == "auto":
        ok, why = cpu_linear_preferred(device, dtype, quantization)
        if ok:
            if why:
                log.info("splitfuse: linear_backend=auto -> cpu: %s", why)
            return "cpu"
        log.info("splitfuse: C++ cpu linear kernel not chosen (%s)", why)
    ok, why = onednn_supported(device, dtype)
    if ok:
        return "onednn"
    if requested == "onednn":
        raise ValueError(f"linear_backend='onednn' cannot run here: {why}")
    log.info("splitfuse: oneDNN linear not used (%s); using F.linear", why)
    return "torch"


def check_quantization(quantization: str, device: torch.device) -> None:
    """Raise a clear error when `quantization` cannot run on `device`."""
    if quantization == "int8":
        ok, why = int8_supported(device)
        if not ok:
            raise ValueError(f"quantization='int8' cannot run here: {why}")
    if quantization in BLOCK_QUANTIZATIONS and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} cannot run here: the GGUF block kernel is for CPUs "
                         f"(device {device.type})")


_logged_q4_fallback: set[str] = set()


def _q4_kernel(weight: torch.Tensor, bias: torch.Tensor | None, blocks: BlockSource | None,
               swiglu: bool, quantization: str) -> CpuQ4Linear | None:
    """The packed GGUF block kernel for this projection, or None (with the reason logged once).
    A weight on the meta device was left unread by the loader for its blocks (on the CPU)."""
    ok, why = q4_supported(torch.device("cpu") if weight.is_meta else weight.device, weight.dtype)
    source = block_source(quantization, weight, blocks) if ok else None
    found = source() if source is not None else None
    if found is None:
        if not why and quantization in LOAD_QUANTIZATIONS:
            why = f"its input size {weight.shape[-1]} is not a multiple of 32"
        elif not why:
            why = ("no GGUF source file for this checkpoint" if source is None
                   else "its blocks are in a type the packed kernel does not take")
        if why not in _logged_q4_fallback:
            _logged_q4_fallback.add(why)
            log.warning("splitfuse: quantization=%s: a projection keeps the float kernel (%s)", quantization, why)
        return None
    kind, rows = found
    if rows.shape[0] != weight.shape[0]:
        raise ValueError(f"GGUF blocks of {rows.shape[0]} rows for a weight of {weight.shape[0]}")
    return CpuQ4Linear(kind, rows, bias, gated=swiglu, exact=quantization == "gguf-exact")


def make_linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
                       quantization: str = "none", swiglu: bool = False,
                       gguf_blocks: BlockSource | None = None, addend: bool = False) -> LinearKernel:
    """The kernel for `backend` / `quantization`. `swiglu`: the weight is SwiGLU's gate_up [2I, K];
    a kernel that can (`fuses_swiglu`) then returns silu(gate) * up itself, others the product.
    `addend`: the caller adds to the product before the activation (LoRA deltas), so only a kernel
    that takes an addend into its sums (`CpuLinear.with_addend`) fuses the activation.
    `gguf_blocks`: reads the weight's blocks from its GGUF file (quantization="gguf" / "gguf-exact";
    "q4_0" / "q4_1" / "q8_0" quantize the weight instead)."""
    fuse_without_addend = swiglu and not addend
    if quantization in BLOCK_QUANTIZATIONS:
        kernel = _q4_kernel(weight, bias, gguf_blocks, fuse_without_addend, quantization)
        if kernel is not None:
            return kernel
    if weight.is_meta:
        raise ValueError(f"a weight left unread for its GGUF blocks cannot run the float kernels (quantization "
                         f"{quantization!r}, shape {tuple(weight.shape)})")
    if quantization == "int8":
        if backend == "cpu" and cpu_int8_supported(weight.dtype):
            return CpuInt8Linear(weight, bias, gated=fuse_without_addend)
        return Int8Linear(weight, bias)
    if backend == "cpu":
        return CpuLinear(weight, bias, gated=swiglu)
    if backend == "onednn":
        return OneDnnLinear(weight, bias)
    return lambda x: linear(x, weight, bias)


PACKED_KERNELS = (CpuLinear, OneDnnLinear, Int8Linear, CpuInt8Linear, CpuQ4Linear)


def fuses_swiglu(kernel: LinearKernel | None) -> bool:
    """Whether calling `kernel` already gives SwiGLU's silu(gate) * up (see make_linear_kernel)."""
    return isinstance(kernel, (CpuLinear, CpuInt8Linear, CpuQ4Linear)) and kernel.packed.gated


def swiglu(kernel: LinearKernel, x: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) through a gate_up kernel: fused where it can, else the product
    followed by `silu_and_mul`."""
    return kernel(x) if fuses_swiglu(kernel) else silu_and_mul(kernel(x))


def release_if_packed(kernel: LinearKernel, *params: nn.Parameter) -> None:
    """Free the plain weights' storage once a packed kernel holds its own copy of them."""
    if isinstance(kernel, PACKED_KERNELS):
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


class Linear(nn.Module):
    """Parameters named as nn.Linear's (checkpoints load unchanged); `prepare` picks the kernel
    once the weights are loaded.

    `silu_and_mul` makes it SwiGLU's fused gate_up projection (out_features = 2I, gate rows then
    up rows): forward then returns silu(gate) * up [.., I], computed inside the product where the
    kernel can (`cpu`), else by `silu_and_mul` after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel: LinearKernel | None = None
        self.silu_and_mul = silu_and_mul
        # LoRA (splitfuse.lora.batching.LoraProjection): adds the step's adapters' deltas to the
        # product; set before `prepare`: a SwiGLU projection then keeps the fused activation only
        # where its kernel takes the deltas before it (CpuLinear.with_addend), else leaves it out.
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Set by the loader for a checkpoint converted from a GGUF file: reads this weight's
        # quantized blocks from it (quantization="gguf" or "gguf-exact").
        self.gguf_blocks: BlockSource | None = None

    def prepare(self, backend: str, quantization: str = "none", release_weight: bool = True) -> None:
        """Build the kernel for `backend` (or `quantization`). With a packed kernel and
        `release_weight`, the plain weight's storage is freed (pass False for a weight shared
        with another module, such as a tied LM head)."""
        self.kernel = make_linear_kernel(self.weight, self.bias, backend, quantization,
                                         swiglu=self.silu_and_mul is not None, gguf_blocks=self.gguf_blocks,
                                         addend=self.lora is not None)
        if isinstance(self.kernel, CpuQ4Linear):
            self.gguf_blocks = None  # holds the GGUF file open; the kernel has its own copy
        if release_weight:
            release_if_packed(self.kernel, self.weight)

    def _unprepared(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._unprepared if self.kernel is None else self.kernel
        if self.lora is not None:
            if fuses_swiglu(kernel):  # the deltas go into the kernel's sums, before SwiGLU
                return self.lora.through(kernel, x)
            out = self.lora(x, kernel(x))  # the plain product (see prepare)
            return out if self.silu_and_mul is None else self.silu_and_mul(out)
        return kernel(x) if self.silu_and_mul is None else swiglu(kernel, x, self.silu_and_mul)

    def extra_repr(self) -> str:
        kind = "unprepared" if self.kernel is None else type(self.kernel).__name__
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"
