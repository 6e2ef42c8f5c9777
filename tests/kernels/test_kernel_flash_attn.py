"""flash-attn wrapper: the support check everywhere, the kernel itself only on a capable GPU."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_test_utils import make_paged_batch, tolerances

from splitfuse.kernels.flash_attn import flash_attn_paged_attention, flash_attn_supported, paged_attention_flash
from splitfuse.kernels import paged_attention_reference


def test_supported_reports_a_reason():
    ok, reason = flash_attn_supported(torch.float16, 16, "cpu")
    assert not ok and reason
    ok, reason = flash_attn_supported(torch.float32, 256, "cpu")
    assert not ok and reason
    assert paged_attention_flash is flash_attn_paged_attention


def test_refuses_to_run_where_unsupported():
    batch = make_paged_batch([(3, 2)], num_kv_heads=1, group=1, head_dim=16, block_size=4, dtype=torch.float32,
                             device="cpu")
    with pytest.raises(RuntimeError, match="flash_attn_paged_attention"):
        flash_attn_paged_attention(*batch.args(0.25))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_flash_attn_matches_reference(dtype, sliding_window):
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    ok, reason = flash_attn_supported(dtype, 256, "cuda", 64)
    if not ok:
        pytest.skip(reason)
    batch = make_paged_batch([(332, 628), (1, 718), (1, 323), (180, 5), (224, 0)], num_kv_heads=2, group=4,
                             head_dim=64, block_size=256, dtype=dtype, device="cuda")
    scale = 1 / math.sqrt(64)
    out = flash_attn_paged_attention(*batch.args(scale), sliding_window)
    ref = paged_attention_reference(*batch.args(scale), sliding_window)
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
