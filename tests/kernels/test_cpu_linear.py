"""C++ CPU linear kernel (kernels/cpu/linear.py) vs the plain-torch reference.

float32: every output is one sequential fused multiply-add chain over k; torch sums in another
order, so outputs agree to a few fp32 ulps of the terms' magnitudes: rtol=1e-5, atol=1e-5 *
sqrt(K) (N(0, 1) data).
int8 (AVX-512 VNNI and AVX2 builds; the AVX2 path, vpmaddubsw on |x - 128| and w * sign(x - 128),
also runs in the forced-AVX2 run of test_cpu_isa_variants.py): bit-identical to the torch
reference (exact integer sums, then the same float32 scaling in the same order), for every uint8
activation and weights in [-127, 127].
Gated (SwiGLU gate_up, silu(gate) * up from the sums): bit-identical to the kernel's plain product
followed by the C++ silu_and_mul (the same rounding of each sum to the dtype, the same exp), so
within that kernel's tolerance of torch's silu_and_mul.
bfloat16: the same products summed in fp32 (in pairs with AVX-512 BF16), then one bf16 rounding:
within one bf16 ulp (2^-8 relative) of the rounded float32 reference, plus the fp32 difference
of the sums (which can tip a rounding); and the relative Frobenius error against float32
inputs bounded as for oneDNN's bf16 GEMM (tests/unit/layers/test_linear.py).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from splitfuse.kernels.cpu import elementwise as ew
from splitfuse.kernels.cpu import linear as cl
from splitfuse.kernels.cpu.build import unavailable_reason
from splitfuse.kernels.reference import (int8_linear_reference, linear_reference, quantize_rows_reference,
                                         silu_and_mul_reference)

if not cl.available():
    pytest.skip(f"C++ CPU kernels unavailable: {unavailable_reason() or 'library lacks sf_lin_* symbols'}",
                allow_module_level=True)

MAX_BF16_RELATIVE_ERROR = 5e-3


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = linear_reference(x, w, b)
    assert out.shape == ref.shape and out.dtype == x.dtype
    k = x.shape[1]
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, k ** 0.5))
    else:
        sums = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert torch.all((out.float() - sums).abs() <= sums.abs() * 2.0 ** -8 + 1e-5 * max(1.0, k ** 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64, 100])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (100, 37), (911, 512), (130, 1), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(dtype, rows, out_features, in_features, bias):
    """Row counts around the register strip (6 with AVX-512, 2 below), partial column blocks,
    odd K (bf16 pads the last pair), one-column inputs."""
    g = _gen(dtype, rows, out_features, in_features, bias)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    packed = cl.pack_weight(w, b)
    _check(cl.linear(x, packed), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_out(dtype):
    g = _gen("strided", dtype)
    w = torch.randn(70, 33, generator=g).to(dtype)
    big = torch.randn(9, 50, generator=g).to(dtype)
    x = big[:, 4:37]  # rows 50 apart
    out_big = torch.full((9, 90), 7.0, dtype=dtype)
    out = out_big[:, 10:80]
    assert cl.linear(x, cl.pack_weight(w), out=out) is out
    _check(out, x.contiguous(), w, None)
    assert torch.all(out_big[:, :10] == 7.0) and torch.all(out_big[:, 80:] == 7.0)  # nothing outside written


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_result_does_not_depend_on_threads_or_row_chunks(threads, dtype):
    """Few column blocks and many rows cut the rows into chunks over the threads; each output is
    still the same single sum."""
    g = _gen("threads", dtype)
    w = torch.randn(64, 256, generator=g).to(dtype)  # one column block
    x = torch.randn(97, 256, generator=g).to(dtype)
    packed = cl.pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cl.linear(x, packed)
    finally:
        torch.set_num_threads(before)
    row_by_row = torch.cat([cl.linear(x[i:i + 1], packed) for i in range(x.shape[0])])
    assert torch.equal(out, row_by_row)


@pytest.mark.parametrize("rows", [1, 2, 3, 7])
@pytest.mark.parametrize("in_features", [1, 2, 33, 512])
def test_bf16_weights_widen_to_the_fp32_values(rows, in_features):
    """bf16 weights widened in registers (the AVX2 path: shift / mask of each pair; AVX-512 BF16:
    vdpbf16ps) must multiply as the same values in fp32: the bf16 kernel against the fp32 kernel
    on the widened inputs, within one bf16 rounding of the output. Wide-range values with distinct
    even and odd k make a swapped, unshifted or unmasked half fail."""
    g = _gen("widen", rows, in_features)
    n = 70
    w = (torch.randn(n, in_features, generator=g) * torch.logspace(-3, 3, in_features)).bfloat16()
    x = (torch.randn(rows, in_features, generator=g) + torch.arange(in_features) % 2 * 3).bfloat16()
    out = cl.linear(x, cl.pack_weight(w)).float()
    wide = cl.linear(x.float(), cl.pack_weight(w.float()))
    scale = torch.nn.functional.linear(x.float().abs(), w.float().abs())
    assert torch.all((out - wide).abs() <= wide.abs() * 2.0 ** -8 + scale * 1e-6)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(160, 96), (1408, 512)])
def test_bf16_error_against_fp32(rows, out_features, in_features):
    g = _gen("bf16err", rows, out_features, in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    out = cl.linear(x.bfloat16(), cl.pack_weight(w.bfloat16(), b.bfloat16()))
    exact = torch.nn.functional.linear(x, w, b)
    rel = (out.float() - exact).norm() / exact.norm()
    assert rel < MAX_BF16_RELATIVE_ERROR, f"relative error {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 7, 64])
@pytest.mark.parametrize("inter,in_features", [(1536, 512), (100, 37), (5, 3), (33, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_equals_product_then_silu_and_mul(dtype, rows, inter, in_features, bias):
    """Whole and partial half-blocks (the last block's gate and up columns both padded)."""
    g = _gen("gated", dtype, rows, inter, in_features, bias)
    w = torch.randn(2 * inter, in_features, generator=g).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    product = cl.linear(x, cl.pack_weight(w, b))
    out = cl.linear(x, cl.pack_weight(w, b, gated=True))
    assert out.shape == (rows, inter) and out.dtype == dtype
    if ew.available():
        assert torch.equal(out, ew.silu_and_mul(product))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 * 2.0 ** -8, atol=1e-6)
    torch.testing.assert_close(out, silu_and_mul_reference(product), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("inter,in_features", [(1536, 512), (100, 37), (5, 3)])
@pytest.mark.parametrize("gated", [False, True])
def test_addend_equals_the_product_plus_it(dtype, rows, inter, in_features, gated):
    """An addend (the Python layers' LoRA deltas) goes into the sums as `product + addend` in the
    dtype rounds it, and for a gated weight before SwiGLU; whole and partial blocks."""
    g = _gen("addend", dtype, rows, inter, in_features, gated)
    w = torch.randn(2 * inter, in_features, generator=g).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    addend = torch.randn(rows, 2 * inter + 3, generator=g).to(dtype)[:, :2 * inter]  # strided rows
    plus = cl.linear(x, cl.pack_weight(w, b)) + addend
    out = cl.linear(x, cl.pack_weight(w, b, gated=gated), addend=addend)
    if gated:
        assert out.shape == (rows, inter)
        if ew.available():
            assert torch.equal(out, ew.silu_and_mul(plus))
    else:
        assert torch.equal(out, plus)
    with pytest.raises(ValueError, match="addend"):
        cl.linear(x, cl.pack_weight(w, b, gated=gated), addend=addend[:, :inter + 1])


def test_empty_rows():
    packed = cl.pack_weight(torch.randn(10, 4))
    assert cl.linear(torch.empty(0, 4), packed).shape == (0, 10)


def test_pack_layout():
    """The documented layout: float32 [blocks, K, NB]; bf16 [blocks, ceil(K/2), NB, 2], zero padded."""
    nb = cl.block_width()
    w = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    p = cl.pack_weight(w).data
    assert p.shape == (1, 5, nb) and torch.equal(p[0, :, :3], w.t()) and not p[0, :, 3:].any()
    p = cl.pack_weight(w.bfloat16()).data
    assert p.shape == (1, 3, nb, 2)
    assert p[0, 1, 2].tolist() == [w[2, 2].item(), w[2, 3].item()] and p[0, 2, 0, 1].item() == 0


def test_bad_inputs_raise():
    packed = cl.pack_weight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="columns"):
        cl.linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match="CPU matrix"):
        cl.linear(torch.randn(2, 4).bfloat16(), packed)
    with pytest.raises(ValueError, match="contiguous last"):
        cl.linear(torch.randn(4, 2).t(), packed)
    with pytest.raises(ValueError, match="out must be"):
        cl.linear(torch.randn(2, 4), packed, out=torch.empty(2, 7))
    with pytest.raises(ValueError, match="bias"):
        cl.pack_weight(torch.randn(8, 4), torch.randn(7))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cl.pack_weight(torch.randn(8, 4).half())
    with pytest.raises(ValueError, match="even number of rows"):
        cl.pack_weight(torch.randn(7, 4), gated=True)


needs_int8 = pytest.mark.skipif(not cl.has_int8(), reason="the int8 kernel needs a build with AVX-512 VNNI or AVX2")


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 100])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (100, 37), (911, 512), (130, 1), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_matches_reference(dtype, rows, out_features, in_features, bias):
    """K not a multiple of 4 (the last quad padded), partial column blocks, activations at the
    ends of the uint8 range."""
    g = _gen("int8", dtype, rows, out_features, in_features, bias)
    wq = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    ws = torch.rand(out_features, generator=g) * 0.1
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    xq, xs = quantize_rows_reference(x, 127, 128)
    xq[0, 0] = 255
    xq[-1, -1] = 0
    out = cl.linear_int8(xq, xs, 128, cl.pack_int8_weight(wq, ws, b), dtype)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    assert torch.equal(out, int8_linear_reference(xq, xs, 128, wq, ws, b, dtype))


@needs_int8
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("xval", [0, 1, 127, 128, 129, 254, 255])
def test_int8_exact_at_the_saturating_extremes(rows, xval):
    """Every activation at one value against weights of +-127: the AVX2 path's int16 pair sums
    (vpmaddubsw) would saturate for |x - 128| = 128 or 255 x 127 if the operands were not
    arranged to fit. Exact against the reference, in float32 (sums up to 128 x 127 x K)."""
    g = _gen("int8sat", rows, xval)
    k, n = 1027, 70
    wq = torch.where(torch.rand(n, k, generator=g) < 0.5, 127, -127).to(torch.int8)
    wq[1] = 127
    wq[2] = -127
    ws = torch.ones(n)
    xq = torch.full((rows, k), xval, dtype=torch.uint8)
    for zp in (128, 64, 0):
        out = cl.linear_int8(xq, torch.ones(rows), zp, cl.pack_int8_weight(wq, ws), torch.float32)
        assert torch.equal(out, int8_linear_reference(xq, torch.ones(rows, 1), zp, wq, ws, None, torch.float32))


@needs_int8
def test_int8_refuses_minus_128_weights():
    w = torch.zeros(8, 4, dtype=torch.int8)
    w[3, 1] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        cl.pack_int8_weight(w, torch.ones(8))


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gated_and_strided(dtype):
    g = _gen("int8g", dtype)
    wq = torch.randint(-127, 128, (2 * 70, 45), generator=g, dtype=torch.int8)
    ws = torch.rand(2 * 70, generator=g) * 0.1
    big = torch.randint(0, 256, (9, 60), generator=g, dtype=torch.uint8)
    xq, xs = big[:, 5:50], torch.rand(9, 1, generator=g)
    plain = cl.linear_int8(xq, xs, 128, cl.pack_int8_weight(wq, ws), dtype)
    torch.testing.assert_close(plain, int8_linear_reference(xq.contiguous(), xs, 128, wq, ws, None, dtype),
                               rtol=0, atol=0)
    out = cl.linear_int8(xq, xs, 128, cl.pack_int8_weight(wq, ws, gated=True), dtype)
    assert out.shape == (9, 70)
    if ew.available():
        assert torch.equal(out, ew.silu_and_mul(plain))


@needs_int8
def test_int8_bad_inputs_raise():
    packed = cl.pack_int8_weight(torch.ones(8, 4, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="uint8"):
        cl.linear_int8(torch.ones(2, 5, dtype=torch.uint8), torch.ones(2), 128, packed, torch.float32)
    with pytest.raises(ValueError, match="xscales"):
        cl.linear_int8(torch.ones(2, 4, dtype=torch.uint8), torch.ones(3), 128, packed, torch.float32)
    with pytest.raises(ValueError, match="output dtype"):
        cl.linear_int8(torch.ones(2, 4, dtype=torch.uint8), torch.ones(2), 128, packed, torch.float16)
    with pytest.raises(ValueError, match="int8 CPU matrix"):
        cl.pack_int8_weight(torch.ones(8, 4), torch.ones(8))
