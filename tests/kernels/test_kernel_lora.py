"""lora_delta (batched multi-LoRA, shrink + expand) vs its torch reference.

The CPU interpreter runs bf16 here too: the kernel widens its operands to fp32 before its dots.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import require_device, tolerances

from splitfuse.kernels.reference import lora_delta_reference
from splitfuse.kernels.triton_lang.lora import lora_delta, lora_segments, plan_lora, slot_views

DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32", marks=pytest.mark.interpreter),
    pytest.param("cpu", torch.float16, id="cpu-fp16", marks=pytest.mark.interpreter),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16", marks=pytest.mark.interpreter),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.cuda),
]
NUM_SLOTS = 4


def _weights(n_in: int, rank: int, n_out: int, dtype: torch.dtype, device: str, seed: int,
             num_slots: int = NUM_SLOTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [S, in, R], b [S, R, out] scaled so deltas are O(1), scales [S] (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, n_in, rank, generator=gen) / n_in ** 0.5
    b = torch.randn(num_slots, rank, n_out, generator=gen) / rank ** 0.5
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return a.to(device, dtype), b.to(device, dtype), scales.to(device)


def _slot_ids(rows: int, seed: int, device: str) -> torch.Tensor:
    """Every slot and 'no adapter' (-1) present once rows allow, then random, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.arange(-1, NUM_SLOTS), torch.randint(-1, NUM_SLOTS, (max(0, rows - NUM_SLOTS - 1),),
                                                                generator=gen)])[:rows]
    return ids[torch.randperm(rows, generator=gen)].to(device)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("rows,n_in,rank,n_out", [
    (1, 64, 8, 96),
    (7, 96, 16, 576),
    (7, 576, 64, 64),  # `in` split over several programs (atomic adds)
    (64, 64, 8, 576),
    (64, 576, 16, 96),
    (5, 96, 96, 40),  # rank above one 64-wide block: the expand loops over rank blocks
])
def test_lora_delta_matches_reference(device, dtype, rows, n_in, rank, n_out):
    require_device(device)
    seed = rows * 1000 + n_in + rank
    a, b, scales = _weights(n_in, rank, n_out, dtype, device, seed)
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    ids = _slot_ids(rows, seed, device)
    out = lora_delta(x, ids, a, b, scales)
    ref = lora_delta_reference(x, ids, a, b, scales)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tolerances(dtype))
    assert not out[ids < 0].any(), "rows without an adapter must get a zero delta"
    if rows > 1:
        assert ref[ids >= 0].abs().amax() > 0.1  # the comparison above is not between zeros


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_lora_delta_accumulates_into_a_column_slice(device, dtype):
    """out = a part's columns of a wider base output (the engine's q/k/v parts), int32 ids, no
    scales (folded into b): added in place; the other columns and the adapter-less rows untouched."""
    require_device(device)
    a, b, _ = _weights(96, 16, 40, dtype, device, seed=3)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    ids = torch.tensor([2, -1, 0, 0, 3, -1, 1, 2, 0], dtype=torch.int32, device=device)
    base = torch.randn(9, 100, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    got, want = base.clone(), base.clone()
    assert lora_delta(x, ids, a, b, None, out=got[:, 30:70]).data_ptr() == got[:, 30:70].data_ptr()
    lora_delta_reference(x, ids, a, b, None, out=want[:, 30:70])
    torch.testing.assert_close(got, want, **tolerances(dtype))
    assert torch.equal(got[:, :30], base[:, :30]) and torch.equal(got[:, 70:], base[:, 70:])
    assert torch.equal(got[ids < 0], base[ids < 0])
    assert (got[ids >= 0, 30:70] - base[ids >= 0, 30:70]).abs().amax() > 0.1


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES[:3])
def test_zero_scale_slot_adds_nothing(device, dtype):
    require_device(device)
    a, b, scales = _weights(64, 8, 96, dtype, device, seed=6)
    scales[1] = 0.0
    ids = torch.tensor([1, 0, 1, 2, 1, 3, -1], device=device)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    out = lora_delta(x, ids, a, b, scales)
    assert not out[ids == 1].any()
    assert out[ids == 0].abs().amax() > 0.1
    torch.testing.assert_close(out, lora_delta_reference(x, ids, a, b, scales), **tolerances(dtype))


@pytest.mark.parametrize("rows,n_in", [(7, 96), (64, 576)])
def test_each_row_uses_its_own_slot(rows, n_in):
    """Swapping two slots' weights changes exactly those slots' rows (a kernel that ignored the
    ids, or read one slot's weights for all rows, fails here)."""
    require_device("cpu")
    a, b, scales = _weights(n_in, 16, 96, torch.float32, "cpu", seed=8)
    ids = _slot_ids(rows, seed=9, device="cpu")
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(10))
    out = lora_delta(x, ids, a, b, scales)
    perm = torch.tensor([1, 0, 2, 3])
    swapped = lora_delta(x, ids, a[perm], b[perm], scales[perm])
    torch.testing.assert_close(swapped, lora_delta_reference(x, ids, a[perm], b[perm], scales[perm]),
                               **tolerances(torch.float32))
    moved = (ids == 0) | (ids == 1)
    assert (swapped[moved] - out[moved]).abs().amax(dim=1).min() > 0.05  # every such row changed
    assert torch.equal(swapped[~moved], out[~moved])


def test_plans_cover_both_shrink_paths():
    """The shapes above run the shrink both whole (one program over `in`) and split (atomic adds)."""
    assert plan_lora(64, 64, 8).split_k == 1
    assert plan_lora(7, 576, 64).split_k > 1 and plan_lora(1, 64, 8).split_k == 1
    big = plan_lora(4096, 4096, 16)  # prefill: enough row blocks, no split
    assert big.split_k == 1 and big.block_m == 64
    for rows, n_in in ((1, 576), (7, 4096), (16, 1000)):
        plan = plan_lora(rows, n_in, 16)
        assert plan.split_k > 1 and plan.k_per_split % plan.block_k == 0
        # all of `in` covered, and no split without work
        assert (plan.split_k - 1) * plan.k_per_split < n_in <= plan.split_k * plan.k_per_split


def test_stacked_layout_of_the_engine():
    """`slot_views` over backend/lora/stacks.py's stacks, one `lora_delta` per part into that
    part's output columns, gives each row its own adapter's per-part (x @ A) @ B (the call the
    engine makes on CUDA). Adapters of different ranks (zero-padded in the stacks), one leaving
    a part out."""
    require_device("cpu")
    from splitfuse.lora.adapter import BaseShape, LoraAdapter, LoraPart, ProjectionLora
    from splitfuse.lora.stacks import LoraStacks

    base = BaseShape(num_layers=1, hidden_size=64, q_size=64, kv_size=32, intermediate_size=96)
    gen = torch.Generator().manual_seed(11)
    offsets = base.part_offsets("qkv_proj")  # q 0:64, k 64:96, v 96:128

    def adapter(name: str, ranks: list[int]) -> LoraAdapter:
        parts, col = [], 0
        for j, r in enumerate(ranks):
            if r:
                parts.append(LoraPart(offsets[j], offsets[j + 1], col, col + r,
                                      torch.randn(r, offsets[j + 1] - offsets[j], generator=gen) / r ** 0.5))
                col += r
        proj = ProjectionLora(a=torch.randn(64, col, generator=gen) / 8, parts=parts, out_features=offsets[-1])
        return LoraAdapter(name, name, max(ranks), frozenset({"q_proj", "v_proj"}), {(0, "qkv_proj"): proj})

    adapters = [adapter("a", [8, 8, 8]), adapter("b", [16, 0, 4])]
    stacks = LoraStacks(adapters, base, max_loras=3, dtype=torch.float32, device=torch.device("cpu"))
    slot_of = {0: 2, 1: 0}  # adapter index -> slot (slot 1 empty)
    for i, s in slot_of.items():
        stacks.write(s, adapters[i])
    row_adapter = torch.tensor([1, -1, 0, 1, 0, 0, -1, 1])
    row_slot = torch.tensor([slot_of.get(int(i), -1) for i in row_adapter])
    x = torch.randn(8, 64, generator=gen)
    want = torch.randn(8, offsets[-1], generator=gen)
    got = want.clone()
    stacked = stacks.projections[(0, "qkv_proj")]
    segments = lora_segments(row_slot, stacks.max_loras)  # once per step, shared by every call
    for part in stacked.parts:
        a, b = slot_views(stacked.a[:, part.col_start:part.col_end], part.b, stacks.max_loras)
        lora_delta(x, row_slot, a, b, None, out=got[:, part.out_start:part.out_end], segments=segments)
    for row, i in enumerate(row_adapter.tolist()):
        if i < 0:
            continue
        proj = adapters[i].projections[(0, "qkv_proj")]
        for p in proj.parts:
            want[row, p.out_start:p.out_end] += (x[row] @ proj.a[:, p.rank_start:p.rank_end]) @ p.b
    torch.testing.assert_close(got, want, **tolerances(torch.float32))


def test_empty_batch_and_bad_shapes():
    require_device("cpu")
    a, b, scales = _weights(64, 8, 32, torch.float32, "cpu", seed=12)
    empty = lora_delta(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int64), a, b, scales)
    assert empty.shape == (0, 32)
    x, ids = torch.randn(3, 64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="a must be"):
        lora_delta(x, ids, a[:, :32], b, scales)
    with pytest.raises(ValueError, match="slot_ids"):
        lora_delta(x, ids.float(), a, b, scales)
    with pytest.raises(ValueError, match="out must be"):
        lora_delta(x, ids, a, b, scales, out=torch.zeros(3, 31))
    with pytest.raises(ValueError, match="segments are for"):
        lora_delta(x, ids, a, b, scales, segments=lora_segments(ids[:2], NUM_SLOTS))
    with pytest.raises(RuntimeError):  # a slot id past the stacks is an error, not silently skipped
        lora_delta(x, torch.tensor([0, NUM_SLOTS, -1]), a, b, scales)
    a0, b0, _ = _weights(0, 8, 32, torch.float32, "cpu", seed=13)
    assert not lora_delta(torch.zeros(3, 0), ids, a0, b0, scales).any()
