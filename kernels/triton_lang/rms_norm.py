"""RMSNorm with an optional fused residual add, matching Hugging Face LlamaRMSNorm numerics.

HF: h = x.float(); h = h * rsqrt(mean(h**2) + eps); out = weight * h.to(x.dtype).
The residual add `x + residual` is rounded to x.dtype first (the model keeps its residual stream
in that dtype). The output dtype is the torch promotion of weight and x dtypes, as in HF.
x/residual: [..., H] (rows flattened) with a contiguous last dim; any H up to 65536; fp32/fp16/bf16.
"""

from __future__ import annotations

import torch

from ._common import check_launch, next_pow2, tl, triton


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, weight_ptr, residual_ptr, sum_out_ptr,
    stride_ot, stride_xt, stride_rt, stride_st, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(x_ptr.dtype.element_ty)  # round like the unfused model's add
        tl.store(sum_out_ptr + row * stride_st + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # HF casts back before the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)  # exact product, rounded once at the store
    tl.store(out_ptr + row * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`normed(x)`, or with `residual` the tuple `(normed(x + residual), x + residual)`. Not in place."""
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: x must be [..., H] and weight [H], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dim() != 2:  # flatten leading dims (a view when possible)
        res = rms_norm(x.reshape(-1, x.shape[-1]), weight, eps,
                       None if residual is None else residual.reshape(-1, x.shape[-1]))
        if residual is None:
            return res.view(*x.shape[:-1], -1)
        return res[0].view(*x.shape[:-1], -1), res[1].view(x.shape)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("rms_norm: residual must match x in shape and dtype")
    if x.stride(-1) != 1 or not weight.is_contiguous() or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm: x, residual and weight need a contiguous last dimension")
    if x.shape[1] > 65536:
        raise ValueError("rms_norm: hidden size > 65536 is not supported")
    check_launch("rms_norm", x, weight, *([residual] if residual is not None else []))
    t, h = x.shape
    out = torch.empty((t, h), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    sum_out = torch.empty_like(x) if residual is not None else None
    if t > 0:
        block = next_pow2(h)
        _rms_norm_kernel[(t,)](
            out, x, weight, residual if residual is not None else x, sum_out if sum_out is not None else x,
            out.stride(0), x.stride(0), residual.stride(0) if residual is not None else 0,
            sum_out.stride(0) if sum_out is not None else 0, h, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out if residual is None else (out, sum_out)
