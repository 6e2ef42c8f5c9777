"""Paged attention (single-pass and split-KV) vs the per-sequence torch reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_test_utils import DEVICE_DTYPES, make_paged_batch, require_device, tolerances

from splitfuse.kernels import paged_attention, paged_attention_reference
from splitfuse.kernels import choose_num_splits, paged_decode_attention_split_kv

# (new tokens, cached tokens) per sequence: prompt chunks with and without a cached prefix,
# decodes, and a first prompt chunk, in one step.
MIXED = [(332, 628), (1, 718), (1, 323), (180, 5), (224, 0)]
SMALL = [(5, 3), (1, 7), (9, 0), (1, 0), (17, 30)]
DECODES = [(1, 627), (1, 718), (1, 322), (1, 0), (1, 64)]


def check(batch, dtype, sliding_window=None, head_dim=None, **kwargs) -> None:
    scale = 1.0 / math.sqrt(head_dim or batch.q.shape[-1])
    out = paged_attention(*batch.args(scale), sliding_window, **kwargs)
    ref = paged_attention_reference(*batch.args(scale), sliding_window)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert not out.isnan().any(), "read a cache slot past seq_len (they hold NaN)"
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


# The full mixed batch; larger tiles keep the interpreter's per-op cost down (tiling is covered below).
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("block_size,group", [(4, 1), (16, 2), (16, 4), (4, 4)])
def test_mixed_ragged_batch(device, dtype, block_size, group):
    require_device(device)
    batch = make_paged_batch(MIXED, num_kv_heads=1, group=group, head_dim=32, block_size=block_size,
                             dtype=dtype, device=device)
    check(batch, dtype, block_m=128 if device == "cpu" else None)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_mixed_ragged_batch_default_tiles(device, dtype):
    require_device(device)
    batch = make_paged_batch(MIXED, num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=dtype, device=device)
    check(batch, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (24, 8), (16, 16), (64, 16), (128, 16), (32, 32),
                                                 (64, 64), (128, 4)])
def test_head_dims_and_block_sizes(device, dtype, head_dim, block_size):
    require_device(device)
    batch = make_paged_batch(SMALL, num_kv_heads=2, group=2, head_dim=head_dim, block_size=block_size,
                             dtype=dtype, device=device, seed=head_dim + block_size)
    check(batch, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("group,block_m,block_n", [(1, 16, 16), (2, 64, 64), (3, 32, 128), (4, 16, 16),
                                                   (8, 64, 64), (8, 16, 32)])
def test_gqa_and_tiles(device, dtype, group, block_m, block_n):
    require_device(device)
    batch = make_paged_batch(SMALL + [(40, 90)], num_kv_heads=2, group=group, head_dim=16, block_size=16,
                             dtype=dtype, device=device, seed=group)
    check(batch, dtype, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("window", [1, 7, 64, 100_000])
def test_sliding_window(device, dtype, window):
    require_device(device)
    batch = make_paged_batch(MIXED, num_kv_heads=1, group=2, head_dim=16, block_size=16, dtype=dtype,
                             device=device, seed=window)
    check(batch, dtype, sliding_window=window, block_m=128 if device == "cpu" else None)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_splits,group", [(2, 1), (3, 4), (8, 1), (8, 4)])
def test_split_kv_decode(device, dtype, num_splits, group):
    require_device(device)
    batch = make_paged_batch(DECODES, num_kv_heads=2, group=group, head_dim=32, block_size=16, dtype=dtype,
                             device=device, seed=num_splits)
    check(batch, dtype, num_splits=num_splits)
    if num_splits != 3:
        return
    # The public split-KV entry point gives the same answer, even when max_seq_len undershoots.
    scale = 1.0 / math.sqrt(32)
    out = paged_decode_attention_split_kv(batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                          batch.seq_lens, batch.block_tables, scale, batch.max_seq_len // 2,
                                          num_splits=num_splits)
    ref = paged_attention_reference(*batch.args(scale))
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("window", [5, 300])
def test_split_kv_decode_sliding_window(device, dtype, window):
    require_device(device)
    batch = make_paged_batch(DECODES, num_kv_heads=1, group=2, head_dim=16, block_size=8, dtype=dtype,
                             device=device, seed=window)
    check(batch, dtype, sliding_window=window, num_splits=4)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_auto_split_choice_matches_reference(device, dtype):
    require_device(device)
    batch = make_paged_batch([(1, 2047), (1, 1500)], num_kv_heads=1, group=2, head_dim=16, block_size=16,
                             dtype=dtype, device=device)
    from splitfuse.kernels.triton_lang._common import num_sms

    assert choose_num_splits(2, 1, batch.max_seq_len, num_sms(batch.q.device)) > 1  # the split path runs
    check(batch, dtype)


def test_choose_num_splits_heuristic():
    # Few (sequence, kv head) pairs and a long context: split to fill ~2 waves of SMs.
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 33
    assert choose_num_splits(1, 8, 1024, num_sms=132) == 4  # >= 256 keys per split
    assert choose_num_splits(8, 8, 4096, num_sms=132) == 5
    # Enough programs already, or a short context: no split.
    assert choose_num_splits(64, 8, 32768, num_sms=132) == 1
    assert choose_num_splits(1, 8, 300, num_sms=132) == 1
    # The window bounds the keys to split; the cap holds.
    assert choose_num_splits(1, 1, 32768, num_sms=132, sliding_window=512) == 2
    assert choose_num_splits(1, 1, 1 << 20, num_sms=1000) == 64


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_strided_q_and_out_buffer(device, dtype):
    """q as a view of a fused QKV projection, output written into a caller's buffer."""
    require_device(device)
    batch = make_paged_batch(SMALL, num_kv_heads=2, group=2, head_dim=16, block_size=4, dtype=dtype, device=device)
    t, hq, d = batch.q.shape
    qkv = torch.randn(t, hq + 4, d, device=device).to(dtype)
    qkv[:, :hq] = batch.q
    batch.q = qkv[:, :hq]
    out_buf = torch.zeros(t, hq + 1, d, device=device, dtype=dtype)
    out = paged_attention(*batch.args(d ** -0.5), out=out_buf[:, 1:])
    assert out.data_ptr() == out_buf[:, 1:].data_ptr()
    assert (out_buf[:, 0] == 0).all()
    ref = paged_attention_reference(*batch.args(d ** -0.5))
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


def test_input_validation():
    q = torch.zeros(3, 6, 16)
    cache = torch.zeros(4, 4, 4, 16)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    sl = torch.tensor([1, 2], dtype=torch.int32)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q, cache, cache, qsl, sl, bt, 1.0, 2, 2)
    with pytest.raises(ValueError, match="decode-only"):
        paged_attention(torch.zeros(3, 8, 16), cache, cache, qsl, sl, bt, 1.0, 2, 2, num_splits=2)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(torch.zeros(3, 8, 16), cache, cache, qsl, sl, bt, 1.0, 2, 2, sliding_window=0)


def test_reference_matches_dense_sdpa():
    """Pin the reference itself: one prompt with no cache equals causal SDPA."""
    batch = make_paged_batch([(37, 0)], num_kv_heads=2, group=2, head_dim=16, block_size=8,
                             dtype=torch.float32, device="cpu")
    ref = paged_attention_reference(*batch.args(0.25))
    k = batch.k_cache[batch.block_tables[0, :5].long()].reshape(-1, 2, 16)[:37].repeat_interleave(2, dim=1)
    v = batch.v_cache[batch.block_tables[0, :5].long()].reshape(-1, 2, 16)[:37].repeat_interleave(2, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        batch.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)


def test_empty_batch():
    require_device("cpu")
    cache = torch.zeros(2, 4, 1, 16)
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    out = paged_attention(torch.zeros(0, 2, 16), cache, cache, torch.zeros(1, dtype=torch.int32), empty_i32,
                          torch.zeros(0, 1, dtype=torch.int32), 1.0, 0, 0)
    assert out.shape == (0, 2, 16)
