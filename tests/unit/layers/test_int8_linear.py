"""int8 linear layers: weight and per-token activation quantization, the oneDNN int8 GEMM against
exact integer arithmetic, the error against fp32 within a stated bound, batch invariance, and how
the model prepares and reports quantized weights."""

import pytest
import torch
import torch.nn.functional as F

from splitfuse.config import EngineConfig
from splitfuse.layers.int8_linear import (CpuInt8Linear, Int8Linear, activation_range, cpu_int8_supported,
                                          int8_supported, quantize_per_token, quantize_weight_per_channel)
from splitfuse.layers.linear import Linear, check_quantization

INT8_OK, INT8_WHY = int8_supported(torch.device("cpu"))
needs_int8 = pytest.mark.skipif(not INT8_OK, reason=f"int8 linear unavailable: {INT8_WHY}")
INT8_KERNELS = (Int8Linear, CpuInt8Linear)

# Relative (Frobenius) error of int8 products against fp32 for normal inputs (per-token scales
# follow each row's largest of K values, so it grows slowly with K): measured 0.9-1.2% with 8-bit
# and 1.4-2.0% with 7-bit activations for K = 64..4096.
MAX_RELATIVE_ERROR = {127: 0.015, 63: 0.025}


def test_weight_quantization_per_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g) * torch.linspace(0.01, 10, 48)[:, None]
    w[3] = 0.0  # an all-zero channel must not divide by zero
    q, scale = quantize_weight_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max()) == 127
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.all(q[3] == 0)


def test_quantize_per_token_scales_each_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 0.0, -50.0], [0.0, 0.0, 0.0]])
    q, scale = quantize_per_token(x, 127, 128)
    assert q.dtype == torch.uint8 and scale.shape == (3, 1)
    torch.testing.assert_close(scale[:2, 0], torch.tensor([2.0 / 127, 100.0 / 127]))
    assert q[0, 1] == 1 and q[1, 0] == 255 and torch.all(q[2] == 128)


@needs_int8
def test_activation_range_is_exact_on_this_cpu():
    levels, zero_point = activation_range()
    assert (levels, zero_point) in ((127, 128), (63, 64))


@needs_int8
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (512, 1408), (1408, 512)])
def test_int8_linear_equals_exact_integer_arithmetic(rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g) * torch.rand(rows, 1, generator=g) * 5
    layer = Int8Linear(w, b)
    out = layer(x)
    qw, sw = quantize_weight_per_channel(w)
    qx, sx = quantize_per_token(x, layer.levels, layer.zero_point)
    exact = ((qx.double() - layer.zero_point) @ qw.double().t()) * sx.double() * sw.double() + b.double()
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
    rel = (out - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm()
    assert rel < MAX_RELATIVE_ERROR[layer.levels], f"relative error {rel:.4f}"


@needs_int8
@pytest.mark.parametrize("rows", [1, 64])
def test_int8_linear_bfloat16_activations(rows):
    """A bfloat16 model's rows: quantized from bf16 as their exact fp32 copy would be, the same
    integer product, and the result rounded to bf16 once."""
    g = torch.Generator().manual_seed(7 + rows)
    w, b = torch.randn(1408, 512, generator=g), torch.randn(1408, generator=g)
    x = (torch.randn(rows, 512, generator=g) * 3).bfloat16()
    layer = Int8Linear(w, b)
    out = layer(x)
    assert out.dtype is torch.bfloat16 and out.shape == (rows, 1408)
    assert torch.equal(out, layer(x.float()).bfloat16())
    qw, sw = quantize_weight_per_channel(w)
    qx, sx = quantize_per_token(x, layer.levels, layer.zero_point)
    exact = ((qx.double() - layer.zero_point) @ qw.double().t()) * sx.double() * sw.double() + b.double()
    torch.testing.assert_close(out.double(), exact, rtol=2.0 ** -7, atol=1e-3)


@needs_int8
def test_int8_linear_rows_do_not_depend_on_their_batch():
    """Per-token scales: a row's result is the same alone or beside a row 1000x larger."""
    g = torch.Generator().manual_seed(1)
    layer = Int8Linear(torch.randn(256, 128, generator=g), None)
    x = torch.randn(8, 128, generator=g)
    x[5] *= 1000.0
    batched = layer(x)
    for i in range(8):
        assert torch.equal(batched[i], layer(x[i:i + 1])[0])


@needs_int8
@pytest.mark.parametrize("backend", ["onednn", "cpu"])
def test_linear_prepare_int8_releases_weight_and_keeps_shapes(backend):
    kernel = {"onednn": Int8Linear, "cpu": CpuInt8Linear}[backend]
    if backend == "cpu" and not cpu_int8_supported(torch.float32):
        pytest.skip("the C++ int8 kernel needs AVX-512 VNNI or AVX2")
    layer = Linear(32, 48, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepare(backend, "int8")
    assert isinstance(layer.kernel, kernel) and layer.weight.numel() == 0
    x = torch.randn(2, 3, 32)
    out = layer(x)
    assert out.shape == (2, 3, 48)
    rel = (out - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm()
    assert rel < MAX_RELATIVE_ERROR[layer.kernel.levels]


@pytest.mark.skipif(not cpu_int8_supported(torch.float32), reason="the C++ int8 kernel needs AVX-512 VNNI or AVX2")
@pytest.mark.skipif(activation_range() != (127, 128),
                    reason="oneDNN's int8 keeps 7-bit activations here (AVX2), the C++ kernel 8 (its exactness: "
                           "tests/kernels/test_cpu_linear.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("gated", [False, True])
def test_cpu_int8_linear_equals_onednn_int8_linear(dtype, rows, gated):
    """The C++ VNNI kernel computes what oneDNN's int8 GEMM and the dequantize pass compute, bit
    for bit (the same integer sums, scaled in the same order); gated, what the product followed by
    the C++ silu_and_mul gives."""
    from splitfuse.kernels.cpu import elementwise

    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(2 * 96, 136, generator=g).to(dtype), torch.randn(2 * 96, generator=g).to(dtype)
    x = (torch.randn(rows, 136, generator=g) * 3).to(dtype)
    want = Int8Linear(w, b)(x)
    if gated:
        want = elementwise.silu_and_mul(want)
    out = CpuInt8Linear(w, b, gated=gated)(x)
    assert out.dtype == dtype and torch.equal(out, want)


@needs_int8
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_model_quantizes_projections_but_not_head_or_router(arch, tiny_model_factory):
    from splitfuse.layers.moe import Experts, SparseMoeBlock
    from splitfuse.llm import LLM

    path = tiny_model_factory(arch)
    runner = LLM(path, quantization="int8").engine.runner
    model = runner.model
    assert not isinstance(model.lm_head.kernel, INT8_KERNELS)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.kernel, INT8_KERNELS)
    mlp = layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        assert not isinstance(mlp.gate.kernel, INT8_KERNELS)  # the router
        assert isinstance(mlp.experts, Experts)
        assert all(isinstance(k, INT8_KERNELS) for k in mlp.experts.gate_up + mlp.experts.down)
    memory = model.weight_memory()
    assert memory["int8"] > 0
    assert "int8" in runner.weight_memory_summary()
    fp32 = LLM(path).engine.runner.model.weight_memory()
    # Every quantized weight went from 4 bytes to 1 (plus a float32 scale per output channel).
    assert "int8" not in fp32
    assert sum(fp32.values()) - sum(memory.values()) > 0.9 * 3 * memory["int8"]


def test_quantization_config_is_checked():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="int8"):
        check_quantization("int8", torch.device("cuda"))
    check_quantization("none", torch.device("cuda"))
