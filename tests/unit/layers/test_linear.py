"""The linear backends against F.linear: the few-rows CPU formulation, oneDNN with packed weights and
the C++ `cpu` kernel (its numerics in detail: tests/kernels/test_cpu_linear.py)."""

import pytest
import torch
import torch.nn.functional as F

from splitfuse.kernels.reference import silu_and_mul_reference
from splitfuse.layers.linear import (CpuLinear, Linear, OneDnnLinear, cpu_linear_preferred, cpu_linear_supported,
                                     fuses_swiglu, linear, onednn_supported, resolve_linear_backend)


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
    for p in layer.parameters():  # torch.empty: whatever the memory held, NaN included
        torch.nn.init.normal_(p)
    x = torch.randn(5, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


ONEDNN_OK, ONEDNN_WHY = onednn_supported(torch.device("cpu"), torch.float32)
needs_onednn = pytest.mark.skipif(not ONEDNN_OK, reason=f"oneDNN linear unavailable: {ONEDNN_WHY}")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(160, 96, generator=gen)
    b = torch.randn(160, generator=gen) if bias else None
    out = OneDnnLinear(w, b)(x)
    assert out.shape == (rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)



ONEDNN_BF16_OK, ONEDNN_BF16_WHY = onednn_supported(torch.device("cpu"), torch.bfloat16)
# The bf16 GEMM against fp32 (relative Frobenius error of the output, N(0, 1) data): inputs and
# output each rounded to bf16 (2^-9 relative), products summed in fp32. Measured 2.9-3.1e-3.
MAX_BF16_RELATIVE_ERROR = 5e-3


@pytest.mark.skipif(not ONEDNN_BF16_OK, reason=f"oneDNN bf16 linear unavailable: {ONEDNN_BF16_WHY}")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(160, 96), (1408, 512)])
def test_onednn_bf16_linear_error_against_fp32(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    out = OneDnnLinear(w.bfloat16(), b.bfloat16())(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # fp32 sums of the bf16 inputs' products: the output differs by its one bf16 rounding.
    rounded = F.linear(x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float())
    assert torch.all((out.float() - rounded).abs() <= rounded.abs() * 2.0 ** -8 + 1e-2)
    exact = F.linear(x, w, b)
    rel = (out.float() - exact).norm() / exact.norm()
    assert rel < MAX_BF16_RELATIVE_ERROR, f"relative error {rel:.2e}"

@needs_onednn
def test_prepare_packs_and_releases_the_plain_weight():
    layer = Linear(32, 48, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepare("onednn")
    assert isinstance(layer.kernel, OneDnnLinear) and layer.weight.numel() == 0
    x = torch.randn(7, 32)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)

    shared = Linear(32, 48, bias=False)
    shared.prepare("onednn", release_weight=False)  # e.g. an LM head tied to the embedding
    assert shared.weight.shape == (48, 32)


def test_torch_backend_keeps_the_weight():
    layer = Linear(32, 48, bias=False)
    torch.nn.init.normal_(layer.weight)  # (uninitialised memory may hold NaNs)
    layer.prepare("torch")
    assert layer.weight.shape == (48, 32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


CPU_OK, CPU_WHY = cpu_linear_supported(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not CPU_OK, reason=f"cpu linear kernel unavailable: {CPU_WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_packs_releases_and_matches(dtype):
    layer = Linear(48, 80, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.to(dtype)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepare("cpu")
    assert isinstance(layer.kernel, CpuLinear) and layer.weight.numel() == 0
    x = torch.randn(2, 3, 48).to(dtype)  # leading dims are flattened and restored
    out = layer(x)
    assert out.shape == (2, 3, 80) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out, F.linear(x, w, b), **tol)
    assert layer.kernel.weight_bytes == {str(dtype).removeprefix("torch."): layer.kernel.packed.data.numel()
                                         * layer.kernel.packed.data.element_size()}


@pytest.mark.parametrize("backend", ["cpu", "onednn", "torch"])
def test_swiglu_layer_matches_product_then_silu_and_mul(backend):
    """A gate_up Linear given silu_and_mul returns silu(gate) * up on every backend (fused into the
    product on `cpu`), before and after prepare."""
    if backend == "cpu" and not CPU_OK:
        pytest.skip(CPU_WHY)
    if backend == "onednn" and not ONEDNN_OK:
        pytest.skip(ONEDNN_WHY)
    layer = Linear(40, 2 * 24, bias=True, silu_and_mul=silu_and_mul_reference)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(5, 40)
    want = silu_and_mul_reference(F.linear(x, w, b))
    torch.testing.assert_close(layer(x), want)
    layer.prepare(backend)
    assert fuses_swiglu(layer.kernel) == (backend == "cpu")
    out = layer(x)
    assert out.shape == (5, 24)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_resolve_linear_backend():
    cpu = torch.device("cpu")
    assert resolve_linear_backend("torch", cpu, torch.float32) == "torch"
    for dtype in (torch.float32, torch.bfloat16):
        if cpu_linear_preferred(cpu, dtype)[0]:
            assert resolve_linear_backend("auto", cpu, dtype) == "cpu"
        elif dtype == torch.float32:
            assert resolve_linear_backend("auto", cpu, dtype) == ("onednn" if ONEDNN_OK else "torch")
    if CPU_OK:
        assert resolve_linear_backend("cpu", cpu, torch.float32) == "cpu"
    with pytest.raises(ValueError, match="cannot run here"):
        resolve_linear_backend("cpu", cpu, torch.float16)
    if not onednn_supported(cpu, torch.bfloat16)[0] and not cpu_linear_preferred(cpu, torch.bfloat16)[0]:
        assert resolve_linear_backend("auto", cpu, torch.bfloat16) == "torch"  # e.g. AVX2-only CPUs
        with pytest.raises(ValueError, match="cannot run here"):
            resolve_linear_backend("onednn", cpu, torch.bfloat16)
