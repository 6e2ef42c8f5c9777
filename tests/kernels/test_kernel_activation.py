"""silu_and_mul vs its torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, require_device

from splitfuse.kernels import silu_and_mul, silu_and_mul_reference


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("inter", [8, 100, 1024, 2 * 1024 + 37])
def test_silu_and_mul(device, dtype, inter):
    require_device(device)
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(6, 2 * inter, generator=gen) * 4).to(device=device, dtype=dtype)
    out = silu_and_mul(x)
    ref = silu_and_mul_reference(x)
    assert out.shape == (6, inter) and out.dtype == dtype
    # fp32 silu then two roundings, as torch does; exp differs by an ulp at most.
    tol = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
           torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}[dtype]
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_silu_and_mul_strided_rows(device, dtype):
    require_device(device)
    x = torch.randn(4, 40, device=device).to(dtype)[:, :32]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_silu_and_mul_leading_dims(device, dtype):
    require_device(device)
    x = torch.randn(2, 3, 40, device=device).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=1e-3, rtol=1e-3)
