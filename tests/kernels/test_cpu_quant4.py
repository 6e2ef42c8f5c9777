"""The GGUF block linear kernel (kernels/cpu/quant4.py) against the `gguf` package's dequantization.

Weights are quantized with the `gguf` package itself where it quantizes the type (Q4_0, Q4_1,
Q8_0, Q5_0, Q5_1); the K-quants (Q4_K, Q5_K, Q6_K: no quantizer there) are random bytes with
sane fp16 scales, every 4-, 5- and 6-bit value and sub-block scale reached. `quant4.dequantize`
equals `gguf.quants.dequantize` exactly; the kernel's product equals the float32 C++ kernel's
over those dequantized weights bit for bit (the same widening, the same sequential multiply-add
chain over k), and so agrees with torch's fp32 matmul to its tolerance. The integer form
(form="dot": activations quantized per 32-k group, exact integer products) agrees with its
torch reference `quant4.dot_reference` (float64 sums) to float32 rounding of the group sums.
The forced-AVX2 run at the end repeats this file with the library built for x86-64-v3 (AVX2 +
FMA: what a Zen 3 runs; the integer form through vpmaddubsw).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of splitfuse-triton")

from splitfuse.kernels.cpu import build  # noqa: E402
from splitfuse.kernels.cpu import linear as cl  # noqa: E402
from splitfuse.kernels.cpu import gguf_blocks, quant4  # noqa: E402
from splitfuse.kernels.reference import silu_and_mul_reference  # noqa: E402

if not quant4.available():
    pytest.skip(f"C++ CPU kernels unavailable: {build.unavailable_reason() or 'no sf_q4_* symbols'}",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
DOT = quant4.dot_products() != "none"


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


OLD_KINDS = ("Q4_0", "Q4_1", "Q8_0")
NEW_KINDS = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _random_blocks(kind: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes as `kind` blocks [n, k / block k * bytes], the fp16 fields set to small scales."""
    bb, per = quant4.BLOCK_BYTES[kind], quant4.BLOCK_K[kind]
    b = torch.randint(0, 256, (n, k // per, bb), generator=g, dtype=torch.uint8)
    for at in gguf_blocks.FP16_FIELDS[kind]:
        scale = (torch.rand(n, k // per, generator=g) * 0.02).half()
        b[..., at:at + 2] = scale.view(torch.uint8).view(n, k // per, 2)
    return b.reshape(n, -1)


def _quantized(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(gguf blocks [n, k / block k * bytes] as uint8, the gguf package's dequantization [n, k])."""
    qt = getattr(gguf.GGMLQuantizationType, kind)
    if quant4.BLOCK_K[kind] > 32:
        rows = _random_blocks(kind, n, k, g)
    else:
        w = torch.randn(n, k, generator=g) * 0.1
        w[0, :] += 0.5  # an all-positive group: Q4_1's minimum away from zero
        rows = torch.from_numpy(gguf.quants.quantize(w.numpy(), qt)).view(torch.uint8).reshape(n, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), qt)).reshape(n, k)
    return rows, ref


@pytest.mark.parametrize("kind", quant4.KINDS)
def test_dequantize_matches_the_gguf_package(kind):
    rows, ref = _quantized(kind, 37, 512, _gen(kind))
    assert torch.equal(quant4.dequantize(kind, rows), ref)
    if kind not in quant4.QUANTIZE_KINDS:  # random bytes: every stored integer value comes up
        f = gguf_blocks.parse(kind, rows)
        assert f.q.unique().numel() == (256 if kind == "Q8_0" else 1 << (4 + gguf_blocks.HIGH_BITS.get(kind, 0)))
        if f.sc is not None:
            assert (f.sc.min().item(), f.sc.max().item()) == ((-128, 127) if kind == "Q6_K" else (0, 63))


@pytest.mark.parametrize("kind", quant4.QUANTIZE_KINDS)
def test_quantize_gives_the_gguf_packages_blocks(kind):
    w = torch.randn(37, 96, generator=_gen("quantize", kind))
    rows = quant4.quantize(kind, w)
    qt = getattr(gguf.GGMLQuantizationType, kind)
    assert torch.equal(rows, torch.from_numpy(gguf.quants.quantize(w.numpy(), qt)))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant4.quantize(kind, w[:, :40])


@pytest.mark.parametrize("form", [f for f in quant4.FORMS if f == "float" or DOT])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 300])
def test_lookup_rows_reads_the_packed_blocks(form, n):
    """A tied LM head's packed Q8_0 weight serves the embedding: any row, padding block or not,
    comes back as `dequantize` gives it."""
    rows, ref = _quantized("Q8_0", n, 96, _gen("lookup", form, n))
    packed = quant4.pack_quantized("Q8_0", rows, form=form)
    ids = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    assert torch.equal(quant4.lookup_rows(packed, ids), ref[ids.reshape(-1)])
    gated = quant4.pack_quantized("Q8_0", torch.cat([rows, rows]), gated=True, form=form)
    assert not quant4.can_lookup(gated)
    with pytest.raises(ValueError, match="an ungated weight"):
        quant4.lookup_rows(gated, ids)


@pytest.mark.parametrize("form", quant4.FORMS)
@pytest.mark.parametrize("kind", quant4.KINDS)
def test_lookup_rows_of_every_kind_in_either_form(kind, form):
    """Tied token_embd tables are Q6_K or Q8_0 in Q4_K_M files (Gemma 3, Llama 3.2 1B): the
    embedding reads the LM head's packed copy in whichever form the head runs, a padding block
    (72 = 64 + 8 columns, or 2 x 32 + 8) included, every column position of a block reached."""
    if form == "dot" and kind not in quant4.dot_kinds():
        pytest.skip(f"no integer form of {kind} in this build")
    rows, ref = _quantized(kind, 72, 512, _gen("lookup-kind", kind))
    packed = quant4.pack_quantized(kind, rows, form=form)
    assert quant4.can_lookup(packed)
    ids = torch.cat([torch.arange(72).flip(0), torch.tensor([71, 0, 64, 33, 71])])
    assert torch.equal(quant4.lookup_rows(packed, ids), ref[ids])


@pytest.mark.parametrize("kind", OLD_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 100])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (100, 96), (911, 512), (5, 64), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_the_float_kernel_over_the_dequantized_weight(kind, rows, out_features, in_features, bias):
    """Row counts around the register strip, partial column blocks, K of one group (32), of an
    odd number of groups (96: the last k pass is half), of several passes (1536)."""
    g = _gen(kind, rows, out_features, in_features, bias)
    blocks, w = _quantized(kind, out_features, in_features, g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    out = quant4.linear(x, quant4.pack_quantized(kind, blocks, b))
    assert torch.equal(out, cl.linear(x, cl.pack_weight(w, b)))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize("rows", [1, 3, 7, 13])
def test_k_quants_and_q5_equal_the_float_kernel(kind, rows):
    """K = 512 (two 256-k super-blocks, eight k passes), N = 72 (a partial column block with
    padding columns), rows around the register strips; a bias at odd row counts, the gated
    weight (36 + 36 rows: a partial gated block) at 7."""
    g = _gen("new", kind, rows)
    blocks, w = _quantized(kind, 72, 512, g)
    b = torch.randn(72, generator=g) if rows in (3, 13) else None
    x = torch.randn(rows, 512, generator=g)
    out = quant4.linear(x, quant4.pack_quantized(kind, blocks, b))
    assert torch.equal(out, cl.linear(x, cl.pack_weight(w, b)))
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    if rows == 7:
        gated = quant4.linear(x, quant4.pack_quantized(kind, blocks, gated=True))
        assert torch.equal(gated, cl.linear(x, cl.pack_weight(w, gated=True)))


@pytest.mark.parametrize("kind", OLD_KINDS)
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("inter", [1, 40, 1536])
def test_gated_weight_gives_silu_gate_times_up(kind, rows, inter):
    g = _gen("gated", kind, rows, inter)
    blocks, w = _quantized(kind, 2 * inter, 64, g)
    x = torch.randn(rows, 64, generator=g)
    out = quant4.linear(x, quant4.pack_quantized(kind, blocks, gated=True))
    assert torch.equal(out, cl.linear(x, cl.pack_weight(w, gated=True)))
    torch.testing.assert_close(out, silu_and_mul_reference(torch.nn.functional.linear(x, w)), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not DOT, reason="no integer form in this build (needs AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", OLD_KINDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (100, 96), (911, 512), (5, 64), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_integer_form_matches_its_reference(kind, rows, out_features, in_features, bias):
    """Strips of 4 (AVX-512) and 2 rows, partial blocks, K of one group, of a partial pass
    (512 = 2 passes of 256) and several passes; one row of zeros (scale 0) and one of a single
    large value (Q8_0 weights of -127 against activations of 127: the AVX2 sign trick's limit)."""
    g = _gen("dot", kind, rows, out_features, in_features, bias)
    blocks, _ = _quantized(kind, out_features, in_features, g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    x[0] = 0
    if rows > 1:
        x[1] = -1e-3
        x[1, ::7] = 40.0
    out = quant4.linear(x, quant4.pack_quantized(kind, blocks, b, form="dot"))
    ref = quant4.dot_reference(x, kind, blocks, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    if rows > 1:
        assert torch.equal(out[0], torch.zeros(out_features) if b is None else b)


@pytest.mark.skipif(not DOT, reason="no integer form in this build (needs AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", OLD_KINDS)
def test_integer_form_gated_and_close_to_the_float_model(kind):
    g = _gen("dot-gated", kind)
    blocks, w = _quantized(kind, 2 * 300, 576, g)
    x = torch.randn(16, 576, generator=g)
    out = quant4.linear(x, quant4.pack_quantized(kind, blocks, gated=True, form="dot"))
    ref = silu_and_mul_reference(quant4.dot_reference(x, kind, blocks))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # int8 activations per 32 values: within a few percent of the float product
    full = silu_and_mul_reference(torch.nn.functional.linear(x, w))
    assert (out - full).norm() / full.norm() < 0.02


@pytest.mark.skipif(not DOT, reason="no integer form in this build (needs AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize("rows", [3, 13])
def test_integer_form_of_k_quants_and_q5_matches_its_reference(kind, rows):
    """Exact integer sums per 32 k (Q6_K: per 16), each scaled by its (sub-)block's scale: the
    kernel equals dot_reference to float32 rounding of the scaled sums; gated too, and close to
    the dequantized float product."""
    g = _gen("dot-new", kind, rows)
    blocks, w = _quantized(kind, 72, 512, g)
    b = torch.randn(72, generator=g)
    x = torch.randn(rows, 512, generator=g)
    x[0, :40] = 0  # a group of zeros (scale 0)
    out = quant4.linear(x, quant4.pack_quantized(kind, blocks, b, form="dot"))
    ref = quant4.dot_reference(x, kind, blocks, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    full = torch.nn.functional.linear(x, w, b)
    assert (out - full).norm() / full.norm() < 0.02
    if rows != 3:
        return
    gated = quant4.linear(x, quant4.pack_quantized(kind, blocks, gated=True, form="dot"))
    ref = silu_and_mul_reference(quant4.dot_reference(x, kind, blocks))
    torch.testing.assert_close(gated, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(not DOT, reason="no integer form in this build (needs AVX-512 VNNI or AVX2)")
@pytest.mark.parametrize("kind", OLD_KINDS + NEW_KINDS)
@pytest.mark.parametrize("gated", [False, True])
def test_integer_form_one_row_equals_its_row_of_a_batch(kind, gated):
    """A lone row (a single sequence's decode) reads the packed records directly instead of
    through the pass buffer: each row alone gives its row of the batched product bit for bit,
    over a partial block, K of several passes (768 = 3 x 256) and the bias."""
    g = _gen("dot-row", kind, gated)
    blocks, _ = _quantized(kind, 2 * 75 if gated else 75, 768, g)
    b = None if gated else torch.randn(75, generator=g)
    packed = quant4.pack_quantized(kind, blocks, b, gated=gated, form="dot")
    x = torch.randn(4, 768, generator=g)
    x[2, 64:96] = 0  # a group of zeros (scale 0)
    batch = quant4.linear(x, packed)
    for r in range(4):
        alone = quant4.linear(x[r:r + 1], packed)
        assert torch.equal(alone[0], batch[r]), f"row {r}"
    assert torch.equal(quant4.linear(x[1:2], packed), quant4.linear(x[1:3], packed)[:1])


def test_strided_rows_and_given_output():
    g = _gen("strided")
    blocks, w = _quantized("Q4_1", 70, 64, g)
    packed = quant4.pack_quantized("Q4_1", blocks)
    x = torch.randn(9, 100, generator=g)[:, 10:74]
    out = torch.full((9, 80), -1.0)
    quant4.linear(x, packed, out=out[:, 5:75])
    assert torch.equal(out[:, 5:75], cl.linear(x.contiguous(), cl.pack_weight(w)))
    assert torch.all(out[:, :5] == -1) and torch.all(out[:, 75:] == -1)


def test_bad_inputs_raise():
    blocks, _ = _quantized("Q4_0", 8, 64, _gen("bad"))
    with pytest.raises(ValueError, match="unsupported block type"):
        quant4.pack_quantized("IQ4_NL", blocks)
    with pytest.raises(ValueError, match="whole 144-byte blocks"):  # K = 64: no whole 256-k super-block
        quant4.pack_quantized("Q4_K", torch.zeros(8, 72, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        quant4.pack_quantized("Q4_1", blocks)
    packed = quant4.pack_quantized("Q4_0", blocks)
    with pytest.raises(ValueError, match="columns"):
        quant4.linear(torch.zeros(2, 32), packed)
    with pytest.raises(ValueError, match="float32"):
        quant4.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="form"):
        quant4.pack_quantized("Q4_0", blocks, form="int4")
