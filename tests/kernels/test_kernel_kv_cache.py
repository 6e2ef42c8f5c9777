"""write_kv_cache vs its torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, require_device

from splitfuse.kernels import write_kv_cache, write_kv_cache_reference


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 16, 4), (2, 64, 16), (3, 24, 8), (8, 128, 32)])
def test_write_kv_cache(device, dtype, num_kv_heads, head_dim, block_size):
    require_device(device)
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, t = 9, 20
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[[3, 11]] = -1  # padding tokens are skipped
    # k/v as views of a fused QKV output: strided over tokens and heads.
    qkv = torch.randn(t, 3 * num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k, v = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slot_mapping = slots.to(device)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    write_kv_cache_reference(k, v, ref_k, ref_v, slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    kept = slots[slots >= 0]
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[kept.to(device)], k[slots.to(device) >= 0])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_write_kv_cache_casts_to_cache_dtype(device, dtype):
    require_device(device)
    k = torch.randn(5, 2, 16, device=device)  # fp32 rows into a lower-precision cache
    v = torch.randn(5, 2, 16, device=device)
    k_cache = torch.zeros(2, 4, 2, 16, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([0, 7, -1, 2, 5], device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    write_kv_cache_reference(k, v, ref_k, ref_v, slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_write_kv_cache_all_padding_and_empty():
    require_device("cpu")
    k_cache = torch.zeros(2, 4, 1, 16)
    v_cache = torch.zeros_like(k_cache)
    write_kv_cache(torch.ones(3, 1, 16), torch.ones(3, 1, 16), k_cache, v_cache, torch.full((3,), -1))
    write_kv_cache(torch.ones(0, 1, 16), torch.ones(0, 1, 16), k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()
