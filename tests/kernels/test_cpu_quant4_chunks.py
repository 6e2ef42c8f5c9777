"""Packing GGUF blocks a few column blocks at a time (`quant4.pack_quantized`'s `chunk_weights`,
which bounds the packing's temporaries on a 128k-row LM head) gives the same bytes as packing the
whole tensor at once: every kind, both forms, gated (gate and up rows of a block far apart in
the tensor) and not, with padding columns in the last block, and the bias in the same order."""

from __future__ import annotations

import zlib

import pytest
import torch

from splitfuse.kernels.cpu import build, gguf_blocks, quant4

if not quant4.available():
    pytest.skip(f"C++ CPU kernels unavailable: {build.unavailable_reason() or 'no sf_q4_* symbols'}",
                allow_module_level=True)

WHOLE = 1 << 62  # one chunk: the whole tensor


def _rows(kind: str, n: int, k: int, seed: str) -> torch.Tensor:
    """Random `kind` blocks [n, k / block k * bytes] with finite fp16 scales."""
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    bb, per = quant4.BLOCK_BYTES[kind], quant4.BLOCK_K[kind]
    b = torch.randint(0, 256, (n, k // per, bb), generator=g, dtype=torch.uint8)
    for at in gguf_blocks.FP16_FIELDS[kind]:
        b[..., at:at + 2] = (torch.rand(n, k // per, generator=g) * 0.02).half().view(torch.uint8).view(n, -1, 2)
    return b.reshape(n, -1)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("form", quant4.FORMS)
@pytest.mark.parametrize("kind", quant4.KINDS)
def test_chunked_packing_equals_whole_packing(kind, form, gated):
    if form == "dot" and kind not in quant4.dot_kinds():
        pytest.skip(f"no integer form of {kind} in this build")
    nb = quant4._entries.need().lib.sf_q4_block_width()
    k = 256
    n = 2 * (2 * nb + 7) if gated else 3 * nb + 5  # whole blocks and a padded one
    rows = _rows(kind, n, k, f"{kind}{form}{gated}")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    whole = quant4.pack_quantized(kind, rows, bias, gated=gated, form=form, chunk_weights=WHOLE)
    assert whole.data.shape[0] >= 3  # several column blocks, so the chunks below split the tensor
    for chunk in (1, 2 * nb * k):  # one column block a chunk (at least one); two blocks
        chunked = quant4.pack_quantized(kind, rows, bias, gated=gated, form=form, chunk_weights=chunk)
        assert chunked.data.shape == whole.data.shape
        assert torch.equal(chunked.data, whole.data), chunk
        assert torch.equal(chunked.bias, whole.bias)
        assert (chunked.out_features, chunked.in_features) == (whole.out_features, whole.in_features)
    # and the packing is the kernel's: its product equals the dequantized weight's (float form)
    if form == "float" and not gated:
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
        ref = x.double() @ quant4.dequantize(kind, rows).double().T + bias.double()
        torch.testing.assert_close(quant4.linear(x, chunked).double(), ref, rtol=1e-4, atol=1e-4)
