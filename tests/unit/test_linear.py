"""The few-rows CPU formulation of `linear` against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from splitfuse.layers.linear import Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64, 65, 200])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(320, 256), (80, 96)], ids=["large", "small"])
def test_linear_matches_f_linear(rows, bias, dtype, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    out = linear(x, w, b)
    assert out.shape == (rows, out_features) and out.dtype == dtype and out.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out, F.linear(x, w, b), **tol)


def test_linear_module_keeps_nn_linear_parameters():
    layer = Linear(8, 4, bias=True)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
