"""rms_norm (plain and fused residual add) vs the HF-numerics reference."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, require_device

from splitfuse.kernels import rms_norm, rms_norm_reference


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # One rounding step at most (fp32 sum order of the variance differs from torch's mean).
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=1e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3)}[dtype]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("hidden", [16, 96, 1000, 4096])
@pytest.mark.parametrize("fused_add", [False, True])
def test_rms_norm(device, dtype, hidden, fused_add):
    require_device(device)
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
    residual = torch.randn(7, hidden, generator=gen).to(device=device, dtype=dtype) if fused_add else None
    out = rms_norm(x, weight, 1e-6, residual=residual)
    ref = rms_norm_reference(x, weight, 1e-6, residual=residual)
    if fused_add:
        (out, out_sum), (ref, ref_sum) = out, ref
        assert torch.equal(out_sum, ref_sum)  # the residual stream is exactly x + residual in dtype
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_rms_norm_fp32_weight_promotes_like_hf(device, dtype):
    require_device(device)
    x = torch.randn(3, 64, device=device).to(dtype)
    weight = torch.rand(64, device=device) + 0.5
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_rms_norm_strided_rows(device, dtype):
    require_device(device)
    base = torch.randn(5, 80, device=device).to(dtype)
    x = base[:, :48]  # row stride 80
    weight = torch.randn(48, device=device).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_rms_norm_leading_dims(device, dtype):
    require_device(device)
    x, r = torch.randn(2, 3, 32, device=device).to(dtype), torch.randn(2, 3, 32, device=device).to(dtype)
    w = torch.randn(32, device=device).to(dtype)
    out, summed = rms_norm(x, w, 1e-6, r)
    ref, ref_summed = rms_norm_reference(x, w, 1e-6, r)
    assert out.shape == x.shape and torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, ref, **_tol(dtype))


def test_reference_matches_transformers():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        norm = norm.to(dtype)
        x = torch.randn(4, 64).to(dtype)
        with torch.no_grad():
            assert torch.equal(rms_norm_reference(x, norm.weight, 1e-6), norm(x))
