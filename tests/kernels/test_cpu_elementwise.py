"""C++ CPU elementwise kernels (kernels/cpu/elementwise.py) vs the plain-torch references.

Tolerances (fp32): rms_norm rtol=1e-6, atol=1e-6 (the sum of squares is accumulated in a
different order than torch's mean: ~2 ulp); the residual stream x + residual and rotary are
bit-exact (torch.equal); silu_and_mul rtol=1e-6, atol=1e-6 (a vectorised exp within ~1 ulp of
torch's).

bfloat16 (fp32 arithmetic, rounded to bf16 where torch's bf16 ops round): the residual stream
and rotary bit-exact; rms_norm and silu_and_mul within 2 bf16 ulps of torch: an fp32 difference
of a few ulps (the sum of squares' order, the exp) can cross a bf16 rounding boundary of the
intermediate, which the following product can widen to 2 ulps (2 of 2M elements here).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from splitfuse.kernels.cpu import elementwise as ew
from splitfuse.kernels.cpu.build import unavailable_reason
from splitfuse.kernels.reference import (apply_rotary_reference, dequantize_rows_reference, quantize_rows_reference,
                                         rms_norm_reference, silu_and_mul_reference)
from splitfuse.layers.rotary import rope_cos_sin, rope_inverse_frequencies

if not ew.available():
    pytest.skip(f"C++ CPU kernels unavailable: {unavailable_reason() or 'library lacks sf_ew_* symbols'}",
                allow_module_level=True)

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.fixture(params=["serial", "parallel"])
def threading_mode(request):
    """Run with the OpenMP split forced off and forced on (results must not depend on it)."""
    old = ew.get_parallel_threshold()
    ew.set_parallel_threshold(1 << 62 if request.param == "serial" else 0)
    yield request.param
    ew.set_parallel_threshold(old)


# ------------------------------------------------------------------------------------ rms_norm
@pytest.mark.parametrize("tokens", [1, 3, 17, 512])
@pytest.mark.parametrize("hidden", [64, 100, 512, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(tokens, hidden, with_residual):
    g = _gen(tokens, hidden, with_residual)
    x = torch.randn(tokens, hidden, generator=g) * 3
    w = 1 + 0.1 * torch.randn(hidden, generator=g)
    res = torch.randn(tokens, hidden, generator=g) if with_residual else None
    x0 = x.clone()
    r0 = res.clone() if res is not None else None
    got = ew.rms_norm(x, w, 1e-6, res)
    ref = rms_norm_reference(x, w, 1e-6, res)
    assert torch.equal(x, x0) and (res is None or torch.equal(res, r0))  # inputs untouched
    if with_residual:
        (got, got_sum), (ref, ref_sum) = got, ref
        assert torch.equal(got_sum, ref_sum)
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.5])
def test_rms_norm_eps_and_tiny_rows(eps):
    x = torch.randn(5, 96, generator=_gen(eps)) * 1e-3
    x[2] = 0  # all-zero row: 0 * rsqrt(eps) = 0
    w = torch.rand(96, generator=_gen(eps, 1)) + 0.5
    torch.testing.assert_close(ew.rms_norm(x, w, eps), rms_norm_reference(x, w, eps), **TOL)


def test_rms_norm_threading_gives_identical_results(threading_mode):
    g = _gen("threads")
    x, r = torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)
    w = torch.randn(512, generator=g)
    out, s = ew.rms_norm(x, w, 1e-6, r)
    ref, ref_s = rms_norm_reference(x, w, 1e-6, r)
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(out, ref, **TOL)
    ew.set_parallel_threshold(1 << 62)
    serial, _ = ew.rms_norm(x, w, 1e-6, r)
    assert torch.equal(out, serial)


@pytest.mark.parametrize("mode", ["out=x,residual_out=residual", "out=residual,residual_out=x", "given buffers"])
def test_rms_norm_in_place(mode):
    g = _gen(mode)
    x, r = torch.randn(9, 256, generator=g), torch.randn(9, 256, generator=g)
    w = torch.randn(256, generator=g)
    ref, ref_s = rms_norm_reference(x, w, 1e-6, r)
    if mode == "out=x,residual_out=residual":
        out, s = ew.rms_norm(x, w, 1e-6, r, out=x, residual_out=r)
        assert out is x and s is r
    elif mode == "out=residual,residual_out=x":
        out, s = ew.rms_norm(x, w, 1e-6, r, out=r, residual_out=x)
        assert out is r and s is x
    else:
        o, so = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        out, s = ew.rms_norm(x, w, 1e-6, r, out=o, residual_out=so)
        assert out is o and s is so
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(out, ref, **TOL)


def test_rms_norm_in_place_without_residual():
    x = torch.randn(4, 128, generator=_gen("ip"))
    w = torch.randn(128, generator=_gen("ipw"))
    ref = rms_norm_reference(x, w, 1e-6)
    assert ew.rms_norm(x, w, 1e-6, out=x) is x
    torch.testing.assert_close(x, ref, **TOL)


def test_rms_norm_strided_rows_and_leading_dims():
    g = _gen("strided")
    big = torch.randn(6, 700, generator=g)
    x = big[:, 100:612]  # row stride 700
    r_big = torch.randn(6, 600, generator=g)
    r = r_big[:, 50:562]
    w = torch.randn(512, generator=g)
    out_big = torch.zeros(6, 1024)
    out = out_big[:, 512:]
    got, s = ew.rms_norm(x, w, 1e-6, r, out=out)
    ref, ref_s = rms_norm_reference(x, w, 1e-6, r)
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(got, ref, **TOL)
    assert torch.equal(out_big[:, :512], torch.zeros(6, 512))  # nothing outside the view
    x3 = torch.randn(2, 3, 64, generator=g)
    w3 = torch.randn(64, generator=g)
    got3 = ew.rms_norm(x3, w3, 1e-6)
    assert got3.shape == x3.shape
    torch.testing.assert_close(got3, rms_norm_reference(x3, w3, 1e-6), **TOL)
    x1 = torch.randn(64, generator=g)
    torch.testing.assert_close(ew.rms_norm(x1, w3, 1e-6), rms_norm_reference(x1, w3, 1e-6), **TOL)
    empty = torch.empty(0, 64)
    assert ew.rms_norm(empty, w3, 1e-6).shape == (0, 64)


def test_rms_norm_rejects_bad_input():
    x, w, r = torch.randn(4, 64), torch.randn(64), torch.randn(4, 64)
    bad = [
        lambda: ew.rms_norm(x.double(), w, 1e-6),
        lambda: ew.rms_norm(x.bfloat16(), w, 1e-6),
        lambda: ew.rms_norm(x, w.double(), 1e-6),
        lambda: ew.rms_norm(x, torch.randn(32), 1e-6),
        lambda: ew.rms_norm(x, torch.randn(128)[::2], 1e-6),
        lambda: ew.rms_norm(x, w, 1e-6, torch.randn(3, 64)),
        lambda: ew.rms_norm(x, w, 1e-6, r.double()),
        lambda: ew.rms_norm(torch.randn(64, 4).t(), w, 1e-6),  # non-contiguous last dim
        lambda: ew.rms_norm(x, w, 1e-6, out=torch.empty(4, 63)),
        lambda: ew.rms_norm(x, w, 1e-6, out=torch.empty(4, 64, dtype=torch.float64)),
        lambda: ew.rms_norm(x, w, 1e-6, residual_out=torch.empty(4, 64)),
        lambda: ew.rms_norm(x, w, 1e-6, r, out=x, residual_out=x),
        lambda: ew.rms_norm(torch.randn(4, 0), torch.randn(0), 1e-6),
        lambda: ew.rms_norm(torch.tensor(1.0), w, 1e-6),
    ]
    for i, fn in enumerate(bad):
        with pytest.raises(ValueError):
            fn()
            pytest.fail(f"case {i} did not raise")


# -------------------------------------------------------------------------------------- rotary
def _tables(d: int, max_pos: int = 4096):
    return rope_cos_sin(rope_inverse_frequencies(d, 10000.0, None), max_pos)


def _fused_qkv(tokens: int, hq: int, hkv: int, d: int, g: torch.Generator):
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    return qkv, q, k


@pytest.mark.parametrize("tokens", [1, 3, 17, 512])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(8, 4), (4, 4), (32, 8)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
def test_rotary_strided_views_match_reference_exactly(tokens, d, heads):
    hq, hkv = heads
    g = _gen(tokens, d, heads)
    qkv, q, k = _fused_qkv(tokens, hq, hkv, d, g)
    qkv0 = qkv.clone()
    cos, sin = _tables(d)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    ref_q, ref_k = apply_rotary_reference(q, k, pos, cos, sin)
    got_q, got_k = ew.apply_rotary(q, k, pos, cos, sin)
    assert torch.equal(qkv, qkv0)  # not in place: inputs untouched
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("d", [2, 6, 64, 80, 128])
def test_rotary_in_place(d, threading_mode):
    tokens, hq, hkv = 33, 8, 2
    g = _gen("inplace", d)
    qkv, q, k = _fused_qkv(tokens, hq, hkv, d, g)
    v0 = qkv[:, (hq + hkv) * d:].clone()
    cos, sin = _tables(d, 100)
    pos = torch.randint(0, 100, (tokens,), generator=g)
    ref_q, ref_k = apply_rotary_reference(q, k, pos, cos, sin)
    got_q, got_k = ew.apply_rotary(q, k, pos, cos, sin, inplace=True)
    assert got_q is q and got_k is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v0)  # v untouched


def test_rotary_given_outputs_and_strided_tables():
    tokens, hq, hkv, d = 5, 4, 2, 64
    g = _gen("outs")
    q = torch.randn(tokens, hq, d, generator=g)
    k = torch.randn(tokens, hkv, d, generator=g)
    cos, sin = _tables(d, 64)
    cos_w, sin_w = torch.cat([cos, cos], 1)[:, :32], torch.cat([sin, sin], 1)[:, 32:]  # row stride 64
    pos = torch.tensor([0, 63, 5, 5, 17])
    q_buf, k_buf = torch.zeros(tokens, hq + 1, d), torch.zeros(tokens, hkv, 2 * d)
    got_q, got_k = ew.apply_rotary(q, k, pos, cos_w, sin_w, q_out=q_buf[:, 1:], k_out=k_buf[:, :, d:])
    ref_q, ref_k = apply_rotary_reference(q, k, pos, cos, sin)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(q_buf[:, 0], torch.zeros(tokens, d)) and torch.equal(k_buf[:, :, :d], torch.zeros(tokens, hkv, d))


def test_rotary_empty_batch():
    cos, sin = _tables(64, 8)
    q, k = torch.empty(0, 4, 64), torch.empty(0, 2, 64)
    got_q, got_k = ew.apply_rotary(q, k, torch.empty(0, dtype=torch.int64), cos, sin)
    assert got_q.shape == (0, 4, 64) and got_k.shape == (0, 2, 64)


@pytest.mark.parametrize("bad_pos", [-1, 64, 10**9])
@pytest.mark.parametrize("where", [0, 2, 3])
def test_rotary_position_out_of_range_raises_and_writes_nothing(bad_pos, where):
    cos, sin = _tables(64, 64)
    qkv, q, k = _fused_qkv(4, 2, 1, 64, _gen("oob"))
    qkv0 = qkv.clone()
    pos = torch.tensor([1, 2, 63, 3])
    pos[where] = bad_pos
    with pytest.raises(ValueError, match=rf"positions\[{where}\]"):
        ew.apply_rotary(q, k, pos, cos, sin, inplace=True)
    assert torch.equal(qkv, qkv0)


def test_rotary_rejects_bad_input():
    cos, sin = _tables(64, 16)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    pos = torch.tensor([0, 1, 2])
    bad = [
        lambda: ew.apply_rotary(q.double(), k, pos, cos, sin),
        lambda: ew.apply_rotary(q, k.bfloat16(), pos, cos, sin),
        lambda: ew.apply_rotary(q, torch.randn(3, 2, 32), pos, cos, sin),  # head_dim mismatch
        lambda: ew.apply_rotary(q, torch.randn(2, 2, 64), pos, cos, sin),  # token mismatch
        lambda: ew.apply_rotary(q[0], k, pos, cos, sin),
        lambda: ew.apply_rotary(torch.randn(3, 4, 63), torch.randn(3, 2, 63), pos, cos[:, :31], sin[:, :31]),
        lambda: ew.apply_rotary(torch.randn(3, 64, 4).transpose(1, 2), k, pos, cos, sin),  # strided head dim
        lambda: ew.apply_rotary(q, k, pos.int(), cos, sin),
        lambda: ew.apply_rotary(q, k, torch.tensor([0, 1]), cos, sin),
        lambda: ew.apply_rotary(q, k, pos, cos[:, :16], sin[:, :16]),
        lambda: ew.apply_rotary(q, k, pos, cos.double(), sin.double()),
        lambda: ew.apply_rotary(q, k, pos, cos, sin[:8]),
        lambda: ew.apply_rotary(q, k, pos, cos, sin, q_out=torch.empty(3, 5, 64)),
        lambda: ew.apply_rotary(q, k, pos, cos, sin, k_out=torch.empty(3, 2, 64, dtype=torch.float64)),
        lambda: ew.apply_rotary(q, k, pos, cos, sin, inplace=True, q_out=torch.empty_like(q)),
    ]
    for i, fn in enumerate(bad):
        with pytest.raises(ValueError):
            fn()
            pytest.fail(f"case {i} did not raise")


# -------------------------------------------------------------------------------- silu_and_mul
@pytest.mark.parametrize("tokens", [1, 3, 17, 512])
@pytest.mark.parametrize("inter", [1, 7, 64, 1536, 1537])
def test_silu_and_mul_matches_reference(tokens, inter):
    g = _gen(tokens, inter)
    x = torch.randn(tokens, 2 * inter, generator=g) * 5
    x0 = x.clone()
    got = ew.silu_and_mul(x)
    assert torch.equal(x, x0)
    torch.testing.assert_close(got, silu_and_mul_reference(x), **TOL)


def test_silu_accuracy_over_the_float_range():
    # gate sweeps the whole useful range (exp over/underflow at both ends), up = 1: pure silu.
    gate = torch.cat([torch.linspace(-120, 100, 400_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.72, -88.72,
                                                                         -103.9, -104.0, 3e38, -3e38])])
    x = torch.cat([gate, torch.ones_like(gate)])[None]
    got = ew.silu_and_mul(x)[0]
    ref = F.silu(gate)
    rel = ((got - ref).abs() / ref.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    assert rel < 5e-7, rel  # ~2-3 ulp
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_silu_special_values():
    gate = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 100.0, -100.0])
    x = torch.cat([gate, torch.ones_like(gate)])[None]
    torch.testing.assert_close(ew.silu_and_mul(x)[0], F.silu(gate), rtol=0, atol=0, equal_nan=True)


def test_silu_and_mul_out_strided_and_leading_dims(threading_mode):
    g = _gen("silu-out")
    big = torch.randn(40, 300, generator=g)
    x = big[:, 10:210]  # [40, 200], row stride 300
    out_big = torch.zeros(40, 150)
    out = out_big[:, 25:125]
    assert ew.silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOL)
    assert torch.equal(out_big[:, :25], torch.zeros(40, 25))
    x3 = torch.randn(2, 5, 14, generator=g)
    got3 = ew.silu_and_mul(x3)
    assert got3.shape == (2, 5, 7)
    torch.testing.assert_close(got3, silu_and_mul_reference(x3), **TOL)
    assert ew.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)


def test_silu_and_mul_rejects_bad_input():
    x = torch.randn(3, 8)
    bad = [
        lambda: ew.silu_and_mul(torch.randn(3, 7)),
        lambda: ew.silu_and_mul(torch.randn(3, 0)),
        lambda: ew.silu_and_mul(x.double()),
        lambda: ew.silu_and_mul(x.half()),
        lambda: ew.silu_and_mul(torch.randn(8, 3).t()),
        lambda: ew.silu_and_mul(x, out=torch.empty(3, 8)),
        lambda: ew.silu_and_mul(x, out=torch.empty(3, 4, dtype=torch.float64)),
        lambda: ew.silu_and_mul(torch.tensor(1.0)),
    ]
    for i, fn in enumerate(bad):
        with pytest.raises(ValueError):
            fn()
            pytest.fail(f"case {i} did not raise")


@pytest.mark.parametrize("tokens,inter", [(1, 14336), (1, 1000), (1, 517), (3, 4099)])
def test_silu_and_mul_column_chunks(tokens, inter, threading_mode):
    # Few rows and a wide row: the parallel path also splits rows into column chunks.
    x = torch.randn(tokens, 2 * inter, generator=_gen("chunks", tokens, inter)) * 4
    torch.testing.assert_close(ew.silu_and_mul(x), silu_and_mul_reference(x), **TOL)


# ------------------------------------------------------------------------------- quantize_rows
@pytest.mark.parametrize("rows,k", [(1, 512), (3, 33), (17, 1408), (64, 4096), (5, 7)])
@pytest.mark.parametrize("levels,zero_point", [(127, 128), (63, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_bit_identical_to_reference(rows, k, levels, zero_point, dtype, threading_mode):
    g = _gen("quant", rows, k)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
    # Ties at .5 after scaling (round half to even), a zero row and a row of one huge value.
    x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 3.5]) * (x[0].abs().max() / levels)
    if rows > 2:
        x[1] = 0.0
        x[2, 1:] = 0.0
    x = x.to(dtype)
    q, scales = ew.quantize_rows(x, levels, zero_point)
    q_ref, scales_ref = quantize_rows_reference(x, levels, zero_point)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q, q_ref)
    assert int(q.min()) >= zero_point - levels and int(q.max()) <= zero_point + levels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_strided_rows(dtype):
    x = torch.randn(6, 64, generator=_gen("quant-strided")).to(dtype)[:, 16:48]
    for got, want in zip(ew.quantize_rows(x, 127, 128), quantize_rows_reference(x, 127, 128)):
        assert torch.equal(got, want)


def test_quantize_rows_rejects_bad_input():
    bad = [
        lambda: ew.quantize_rows(torch.randn(2, 3, 4), 127, 128),
        lambda: ew.quantize_rows(torch.randn(3, 8).double(), 127, 128),
        lambda: ew.quantize_rows(torch.randn(8, 3).t(), 127, 128),
        lambda: ew.quantize_rows(torch.randn(3, 8), 127, 64),
        lambda: ew.quantize_rows(torch.randn(3, 8), 0, 64),
    ]
    for i, fn in enumerate(bad):
        with pytest.raises(ValueError):
            fn()
            pytest.fail(f"case {i} did not raise")


# ----------------------------------------------------------------------------- dequantize_rows
@pytest.mark.parametrize("rows,n", [(1, 512), (3, 33), (17, 1408), (64, 3072), (5, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rows_bit_identical_to_reference(rows, n, with_bias, dtype, threading_mode):
    g = _gen("dequant", rows, n, with_bias)
    # int8 GEMM sums are integers; any float32 must come through unchanged in arithmetic.
    acc = torch.randint(-(1 << 20), 1 << 20, (rows, n), generator=g).float()
    acc[0, :3] = torch.tensor([0.5, -1e-3, 7.25])
    scales = torch.rand(rows, 1, generator=g) * 1e-3
    bias = torch.randn(n, generator=g) if with_bias else None
    want = dequantize_rows_reference(acc.clone(), scales, bias, dtype)
    got = ew.dequantize_rows(acc, scales, bias, dtype)
    assert got.dtype is dtype and got.shape == (rows, n)
    assert torch.equal(got, want)
    if dtype is torch.float32:  # in place
        assert got.data_ptr() == acc.data_ptr()


def test_dequantize_rows_strided_rows():
    acc = torch.randn(6, 64, generator=_gen("dequant-strided"))[:, 8:40]
    scales, bias = torch.rand(6, 1), torch.randn(32)
    want = dequantize_rows_reference(acc.clone(), scales, bias, torch.bfloat16)
    assert torch.equal(ew.dequantize_rows(acc, scales, bias, torch.bfloat16), want)


def test_dequantize_rows_rejects_bad_input():
    acc = torch.randn(3, 8)
    bad = [
        lambda: ew.dequantize_rows(torch.randn(2, 3, 4), torch.ones(2, 1)),
        lambda: ew.dequantize_rows(acc.bfloat16(), torch.ones(3, 1)),
        lambda: ew.dequantize_rows(acc, torch.ones(2, 1)),
        lambda: ew.dequantize_rows(acc, torch.ones(3, 1).double()),
        lambda: ew.dequantize_rows(acc, torch.ones(3, 1), torch.ones(7)),
        lambda: ew.dequantize_rows(acc, torch.ones(3, 1), dtype=torch.float16),
    ]
    for i, fn in enumerate(bad):
        with pytest.raises(ValueError):
            fn()
            pytest.fail(f"case {i} did not raise")


# ------------------------------------------------------------------------------------ bfloat16
BF16_ULP = {"rtol": 2.0 ** -6, "atol": 1e-30}  # within two bf16 ulps of the reference


@pytest.mark.parametrize("tokens", [1, 3, 17, 512])
@pytest.mark.parametrize("hidden", [64, 100, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rms_norm_matches_reference(tokens, hidden, with_residual, threading_mode):
    g = _gen("bf16", tokens, hidden, with_residual)
    x = (torch.randn(tokens, hidden, generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
    res = torch.randn(tokens, hidden, generator=g).bfloat16() if with_residual else None
    ref = rms_norm_reference(x, w, 1e-6, res)
    if not with_residual:
        torch.testing.assert_close(ew.rms_norm(x, w, 1e-6), ref, **BF16_ULP)
        return
    # The engine's zero-allocation form: x receives the normed output, res the residual stream.
    (ref_out, ref_sum), x_, res_ = ref, x.clone(), res.clone()
    out, new_res = ew.rms_norm(x_, w, 1e-6, res_, out=x_, residual_out=res_)
    assert out is x_ and new_res is res_ and out.dtype is torch.bfloat16
    assert torch.equal(new_res, ref_sum)
    torch.testing.assert_close(out, ref_out, **BF16_ULP)


@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("d", [2, 64, 80, 128])
def test_bf16_rotary_strided_views_match_reference_exactly(tokens, d, threading_mode):
    g = _gen("bf16", tokens, d)
    hq, hk = 8, 2
    qkv = torch.randn(tokens, hq + 2 * hk, d, generator=g).bfloat16()
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
    cos, sin = rope_cos_sin(rope_inverse_frequencies(d, 10000.0, None), 64)
    pos = torch.randint(0, 64, (tokens,), generator=g)
    ref_q, ref_k = apply_rotary_reference(q, k, pos, cos, sin)
    got_q, got_k = ew.apply_rotary(q, k, pos, cos, sin, inplace=True)
    assert got_q.dtype is torch.bfloat16 and torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.parametrize("inter", [7, 64, 1537, 2816])
def test_bf16_silu_and_mul_matches_reference(tokens, inter, threading_mode):
    x = (torch.randn(tokens, 2 * inter, generator=_gen("bf16", tokens, inter)) * 4).bfloat16()
    got = ew.silu_and_mul(x)
    assert got.dtype is torch.bfloat16
    torch.testing.assert_close(got, silu_and_mul_reference(x), **BF16_ULP)


def test_bf16_calls_take_one_dtype():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="weight must be a contiguous bfloat16"):
        ew.rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="residual must be a bfloat16"):
        ew.rms_norm(x, torch.ones(64).bfloat16(), 1e-6, torch.randn(4, 64))
    with pytest.raises(ValueError, match="out must be a bfloat16"):
        ew.silu_and_mul(x, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ew.silu_and_mul(x.half())
