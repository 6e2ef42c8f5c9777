"""The Triton-lang attention kernels at a real model's sizes (Llama-3-8B's attention: 32 query heads
over 8 KV heads of 128, 16-token blocks), against the torch reference: CUDA only (the interpreter
would take hours), run by the GPU check (perf/gpu_check.py)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_test_utils import make_paged_batch, require_device, tolerances

from splitfuse.kernels import paged_attention, paged_attention_reference, paged_decode_attention_split_kv

CUDA_DTYPES = [pytest.param(torch.float16, id="fp16", marks=pytest.mark.cuda),
               pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.cuda)]
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 128, 16
# One token-budget step of a busy server: a 2,048-token prompt chunk after 1,024 cached tokens, a
# fresh 512-token prompt, and 30 decodes at contexts of 300 to 4,000 tokens.
MIXED_STEP = [(2048, 1024), (512, 0)] + [(1, 300 + 127 * i) for i in range(30)]
LONG_DECODES = [(1, 4000 + 997 * i) for i in range(8)]  # to ~11k tokens: the split-KV path's case


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "read a cache slot past seq_len (they hold NaN)"
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_a_mixed_step_at_llama3_8b_sizes(dtype):
    require_device("cuda")
    batch = make_paged_batch(MIXED_STEP, num_kv_heads=KV_HEADS, group=GROUP, head_dim=HEAD_DIM, block_size=BLOCK,
                             dtype=dtype, device="cuda")
    scale = 1.0 / math.sqrt(HEAD_DIM)
    _check(paged_attention(*batch.args(scale)), paged_attention_reference(*batch.args(scale)), dtype)


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_long_decodes_split_kv_at_llama3_8b_sizes(dtype):
    require_device("cuda")
    batch = make_paged_batch(LONG_DECODES, num_kv_heads=KV_HEADS, group=GROUP, head_dim=HEAD_DIM, block_size=BLOCK,
                             dtype=dtype, device="cuda", seed=1)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    ref = paged_attention_reference(*batch.args(scale))
    _check(paged_attention(*batch.args(scale)), ref, dtype)  # the kernel's own choice of splits
    out = paged_decode_attention_split_kv(batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc,
                                          batch.seq_lens, batch.block_tables, scale, batch.max_seq_len,
                                          num_splits=16)
    _check(out, ref, dtype)
