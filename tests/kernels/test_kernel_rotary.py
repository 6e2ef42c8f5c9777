"""apply_rotary (in place) vs HF Llama's rotate-half reference."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, require_device

from splitfuse.kernels import apply_rotary, apply_rotary_reference


def _tables(max_pos: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 1, 64), (8, 8, 128), (3, 3, 24)])
def test_apply_rotary(device, dtype, num_heads, num_kv_heads, head_dim):
    require_device(device)
    gen = torch.Generator().manual_seed(head_dim)
    t = 13
    cos, sin = (x.to(device) for x in _tables(4096, head_dim))
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    # q and k as views of one fused QKV output (strided rows).
    qkv = torch.randn(t, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    v_before = qkv[:, num_heads + num_kv_heads:].clone()
    ref_q, ref_k = apply_rotary_reference(q.clone(), k.clone(), positions, cos, sin)
    out_q, out_k = apply_rotary(q, k, positions, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(qkv[:, num_heads + num_kv_heads:], v_before)  # neighbours untouched
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(out_q, ref_q, **tol)  # fp16/bf16: rounding mirrors HF's exactly
    torch.testing.assert_close(out_k, ref_k, **tol)


def test_reference_matches_transformers():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    cos, sin = _tables(64, 16)
    positions = torch.tensor([0, 5, 63, 7])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    ref_q, ref_k = apply_rotary_reference(q, k, positions, cos, sin)
    cos_full = torch.cat((cos, cos), -1)[positions][None]  # HF: [batch, seq, dim], heads on dim 1
    sin_full = torch.cat((sin, sin), -1)[positions][None]
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full, sin_full)
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1), atol=0, rtol=0)
