"""SwiGLU gate: silu(x[:, :I]) * x[:, I:] for a fused gate/up projection output x [T, 2I].

Numerics follow the unfused torch ops in x.dtype: silu is computed in fp32 and rounded to
x.dtype, then multiplied (exact in fp32) and rounded once. fp32/fp16/bf16, any I.
"""

from __future__ import annotations

import torch

from ._common import cdiv, check_launch, tl, triton


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_xt, stride_ot, n_inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)  # round like torch's silu
    tl.store(out_ptr + row * stride_ot + cols, (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I] = silu(gate) * up (new tensor)."""
    if x.dim() > 2 or x.dim() == 1:  # flatten leading dims
        flat = silu_and_mul(x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x[None])
        return flat.view(*x.shape[:-1], -1)
    if x.dim() != 2 or x.shape[1] % 2 != 0 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x must be [T, 2I] with a contiguous last dim, got {tuple(x.shape)}")
    check_launch("silu_and_mul", x)
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t > 0 and inter > 0:
        block = 1024
        _silu_and_mul_kernel[(t, cdiv(inter, block))](out, x, x.stride(0), out.stride(0), inter, BLOCK=block,
                                                       num_warps=4)
    return out
