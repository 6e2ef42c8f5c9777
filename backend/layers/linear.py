"""The one linear layer every projection goes through (attention, MLP, MoE experts, LM head).

Two ways to multiply float weights, chosen once at load (`EngineConfig.linear_backend`):

* `onednn` (CPU): the weight is reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`) and every call runs `_linear_pointwise`. oneDNN
  detects the CPU's instruction set itself; MKL's `F.linear` picks slow code paths on AMD CPUs.
  The plain weight is then released (no second copy of the model's weights in memory).
* `torch`: `F.linear`, with one CPU refinement: with 2-64 rows MKL's `x @ W^T` reads the weight
  several times slower than memory allows, while `(W @ x^T)^T` streams it close to bandwidth
  (measured on a 2-core AMD EPYC: the 26M model's 32 weights, 4 rows 13.4 -> 5.4 ms). Weights of
  fewer than 64k elements keep F.linear (the transpose copy costs more than it saves).

`auto` is `onednn` on CPUs where torch has it for the dtype, else `torch`.

With `EngineConfig.quantization="int8"` the projections run `Int8Linear` (int8_linear.py)
instead; the LM head and the MoE router keep the float kernel (they decide tokens and experts).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitfuse.layers.int8_linear import Int8Linear, int8_supported

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


def resolve_linear_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    if requested == "torch":
        return "torch"
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


def make_linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
                       quantization: str = "none") -> LinearKernel:
    if quantization == "int8":
        return Int8Linear(weight, bias)
    if backend == "onednn":
        return OneDnnLinear(weight, bias)
    return lambda x: linear(x, weight, bias)


PACKED_KERNELS = (OneDnnLinear, Int8Linear)


def release_if_packed(kernel: LinearKernel, *params: nn.Parameter) -> None:
    """Free the plain weights' storage once a packed kernel holds its own copy of them."""
    if isinstance(kernel, PACKED_KERNELS):
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


class Linear(nn.Module):
    """Parameters named as nn.Linear's (checkpoints load unchanged); `prepare` picks the kernel
    once the weights are loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel: LinearKernel | None = None

    def prepare(self, backend: str, quantization: str = "none", release_weight: bool = True) -> None:
        """Build the kernel for `backend` (or `quantization`). With a packed kernel and
        `release_weight`, the plain weight's storage is freed (pass False for a weight shared
        with another module, such as a tied LM head)."""
        self.kernel = make_linear_kernel(self.weight, self.bias, backend, quantization)
        if release_weight:
            release_if_packed(self.kernel, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return linear(x, self.weight, self.bias)
        return self.kernel(x)

    def extra_repr(self) -> str:
        kind = "unprepared" if self.kernel is None else type(self.kernel).__name__
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kind}"
