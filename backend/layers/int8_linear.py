"""int8 linear layers for CPUs: weights quantized at load, activations per token at run time.

* Weights: symmetric, one scale per output channel (`w ~ q * scale`, q in [-127, 127]), quantized
  once at load from whatever precision the checkpoint has and packed for oneDNN
  (`torch.ops.onednn.qlinear_prepack`); the float weight is then released.
* Activations: symmetric, one scale per token (row), computed on every call, so a request's
  numbers never depend on what else shares its batch (a per-tensor scale would let one outlier
  token coarsen every other row).
* The product: oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_pointwise`, a maintained library
  that picks VNNI/AVX-512/AVX2 code itself) with unit activation scale and the weight scales
  applied inside; the per-token scales then multiply the rows and the bias is added in float32,
  in one pass that also narrows to the activation dtype (a bfloat16 model's rows go in and come
  out as bfloat16: int8 weights with bfloat16 activations).
  oneDNN takes activations as uint8 with a zero point, so a token's int8 values are shifted.

With the `cpu` linear backend `CpuInt8Linear` multiplies the same quantized values with the C++
kernel (AVX-512 VNNI's `vpdpbusd`, AVX-VNNI's 256-bit one, or on plain AVX2 `vpmaddubsw` over
|x - 128| and w * sign(x - 128), which cannot saturate: all three exact for 8-bit activations) (`splitfuse.kernels.cpu.linear.linear_int8`) instead: the
zero point, scales and bias are applied as the sums leave the registers (no float32 pass over the
output), few rows stream the weight at memory speed, and SwiGLU's gate is fused for gate_up.

Through oneDNN without VNNI (AVX2 only), int8 GEMMs multiply with `vpmaddubsw`, whose int16 pair sums
saturate when uint8 activations reach 255 against int8 weights of 127: there the activations keep
7 bits (values in [-63, 63], zero point 64). Which case applies is found by running a probe whose
exact result is known, not by reading CPU flags.
"""

from __future__ import annotations

import functools

import torch

from splitfuse.kernels.cpu import elementwise as cpu_elementwise
from splitfuse.kernels.cpu import linear as cpu_linear
from splitfuse.kernels.reference import dequantize_rows_reference, quantize_rows_reference

# Activations quantized to [-levels, levels], stored as uint8 around `zero_point`.
_FULL_RANGE = (127, 128)
_SEVEN_BIT = (63, 64)
# Activation dtypes the C++ quantize / dequantize kernels take.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its blocked layout for an expected row count; prompt chunks dominate the work.
_ROWS_HINT = 128


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [N, K] and float32 scales [N] with `weight ~ q * scale[:, None]`."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_per_token(x: torch.Tensor, levels: int, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 activations [M, K] (zero point `zero_point`) and float32 per-row scales [M, 1]:
    the C++ kernel (float32 or bfloat16 rows) when the library is built, else the torch reference."""
    if x.dtype in _KERNEL_DTYPES and cpu_elementwise.available():
        return cpu_elementwise.quantize_rows(x, levels, zero_point)
    return quantize_rows_reference(x, levels, zero_point)


def dequantize(acc: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The GEMM's float32 sums [M, N] times the row scales, plus the bias, in `dtype`: one C++ pass
    when the library is built, else the torch reference (both overwrite `acc`)."""
    if dtype in _KERNEL_DTYPES and cpu_elementwise.available():
        return cpu_elementwise.dequantize_rows(acc, scales, bias, dtype)
    return dequantize_rows_reference(acc, scales, bias, dtype)


def _onednn_int8_exact(levels: int, zero_point: int) -> bool:
    """Whether oneDNN's int8 GEMM is exact for activations of `levels` against weights of 127
    (the worst case for an int16 intermediate: every product at its largest)."""
    k, n = 256, 16
    x = torch.full((2, k), zero_point + levels, dtype=torch.uint8)
    w = torch.full((n, k), 127, dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(w, [2, k])
    out = torch.ops.onednn.qlinear_pointwise(x, 1.0, zero_point, packed, torch.ones(n), torch.zeros(n, dtype=torch.long),
                                             None, 1.0, 0, torch.float32, "none", [], "")
    return bool(torch.all(out == float(levels * 127 * k)))


@functools.lru_cache(maxsize=None)
def activation_range() -> tuple[int, int]:
    """(levels, zero point) of the activations on this CPU: 8 bits where the int8 GEMM cannot
    saturate, else 7 bits. Raises RuntimeError where oneDNN int8 does not run at all."""
    if _onednn_int8_exact(*_FULL_RANGE):
        return _FULL_RANGE
    if _onednn_int8_exact(*_SEVEN_BIT):
        return _SEVEN_BIT
    raise RuntimeError("oneDNN's int8 linear gave wrong results on a probe")


def int8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether int8 linear layers run here (and why not)."""
    if device.type != "cpu":
        return False, f"int8 quantization is implemented for CPUs (device {device.type})"
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (mkldnn)"
    try:
        activation_range()
    except RuntimeError as e:
        return False, str(e).splitlines()[0]
    return True, ""


class Int8Linear:
    """A weight quantized and packed once; calling it computes `x @ W^T + b` in int8."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        q, self.weight_scale = quantize_weight_per_channel(weight)
        self.packed = torch.ops.onednn.qlinear_prepack(q, [_ROWS_HINT, self.in_features])
        self.weight_zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.levels, self.zero_point = activation_range()

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Memory of the weight by dtype: int8 values and float32 scales."""
        return {"int8": self.out_features * self.in_features, "float32": 4 * self.out_features}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q, scale = quantize_per_token(rows, self.levels, self.zero_point)
        out = torch.ops.onednn.qlinear_pointwise(q, 1.0, self.zero_point, self.packed, self.weight_scale,
                                                 self.weight_zero_points, None, 1.0, 0, torch.float32,
                                                 "none", [], "")
        return dequantize(out, scale, self.bias, x.dtype).reshape(*x.shape[:-1], self.out_features)


def cpu_int8_supported(dtype: torch.dtype) -> bool:
    """Whether `CpuInt8Linear` runs here for activations of `dtype`."""
    return dtype in _KERNEL_DTYPES and cpu_linear.has_int8() and cpu_elementwise.available()


class CpuInt8Linear:
    """Int8Linear's quantization through the C++ int8 kernel; `gated`: SwiGLU's gate_up weight,
    calling it gives silu(gate) * up."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> None:
        self.in_features = weight.shape[1]
        q, scale = quantize_weight_per_channel(weight)
        self.packed = cpu_linear.pack_int8_weight(q, scale, bias, gated=gated)
        self.out_features = self.packed.out_features
        self.levels, self.zero_point = _FULL_RANGE  # every form of the kernel sums u8 x s8 products exactly

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Memory of the weight by dtype: int8 values, float32 scales (and int32 column sums)."""
        n = self.packed.scales.numel()
        return {"int8": self.packed.data.numel(), "float32": 4 * n, "int32": 4 * n}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q, scale = cpu_elementwise.quantize_rows(rows, self.levels, self.zero_point)
        out = cpu_linear.linear_int8(q, scale, self.zero_point, self.packed, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)
