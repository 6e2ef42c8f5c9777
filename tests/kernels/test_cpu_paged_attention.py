"""The C++ CPU paged attention + KV write (splitfuse.kernels.cpu.paged_attention) against the
plain-torch references: fp32, bf16 and int8 caches.

Batches come from (new tokens, cached tokens) pairs over a shuffled block pool; every cache slot
no sequence owns below its seq_len (spare blocks, block tails) holds NaN, so a kernel that lets
a key past seq_len reach the output shows NaN.
"""

from __future__ import annotations

import pytest
import torch

from splitfuse.kernels.cpu import paged_attention as cpu_pa

if not cpu_pa.available():
    from splitfuse.kernels.cpu.build import unavailable_reason

    pytest.skip(f"C++ CPU kernels unavailable: {unavailable_reason()}", allow_module_level=True)

from splitfuse.kernels import paged_attention_reference, write_kv_cache_reference
from splitfuse.kernels.cpu import kv_int8

TOL = {"atol": 2e-5, "rtol": 1e-4}


class Batch:
    def __init__(self, pairs, num_kv_heads, group, head_dim, block_size, seed=0, spare_blocks=3):
        gen = torch.Generator().manual_seed(seed)
        q_lens = [n for n, _ in pairs]
        seq_lens = [n + c for n, c in pairs]
        pages = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(pages) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen)  # non-contiguous, shuffled tables
        bt = torch.zeros(len(pairs), max(pages) + 2, dtype=torch.int32)
        k_ref = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
        v_ref = torch.full_like(k_ref, float("nan"))
        used = 0
        for b, (n_pages, seq_len) in enumerate(zip(pages, seq_lens)):
            blocks = perm[used:used + n_pages]
            used += n_pages
            bt[b, :n_pages] = blocks.to(torch.int32)
            # Padding beyond the used blocks: arbitrary valid ids (any block of the pool).
            bt[b, n_pages:] = torch.randint(0, num_blocks, (bt.shape[1] - n_pages,), generator=gen).to(torch.int32)
            pos = torch.arange(seq_len)
            k_ref[blocks[pos // block_size], pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim,
                                                                             generator=gen)
            v_ref[blocks[pos // block_size], pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim,
                                                                             generator=gen)
        self.q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
        self.k_ref, self.v_ref = k_ref, v_ref
        self.k_cache, self.v_cache = cpu_pa.from_reference_layout(k_ref, v_ref)
        self.qsl = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.block_tables = bt
        self.scale = head_dim ** -0.5
        self.block_size = block_size

    def reference(self, sliding_window=None):
        return paged_attention_reference(self.q, self.k_ref, self.v_ref, self.qsl, self.seq_lens, self.block_tables,
                                         self.scale, sliding_window=sliding_window)

    def run(self, sliding_window=None, **kw):
        return cpu_pa.paged_attention(self.q, self.k_cache, self.v_cache, self.qsl, self.seq_lens, self.block_tables,
                                      self.scale, sliding_window=sliding_window, **kw)

    def plan(self, sliding_window=None, **kw):
        return cpu_pa.plan(self.q, self.k_cache, self.v_cache, self.qsl, self.seq_lens, self.block_tables,
                           sliding_window, **kw)


# Prompt chunks at offset 0 and > 0 (chunked prefill) mixed with decodes, lengths that are not
# multiples of the 16-key tile or the block size.
MIXED = [(37, 0), (1, 50), (20, 45), (1, 1), (64, 130), (1, 17), (3, 0), (1, 160)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch(block_size, group, head_dim):
    b = Batch(MIXED, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size)
    ref = b.reference()
    torch.testing.assert_close(b.run(), ref, **TOL)
    torch.testing.assert_close(b.run(num_splits=1), ref, **TOL)


@pytest.mark.parametrize("head_dim", [40, 80, 33, 256])
def test_other_head_dims(head_dim):
    b = Batch(MIXED[:5], num_kv_heads=2, group=2, head_dim=head_dim, block_size=16, seed=1)
    torch.testing.assert_close(b.run(), b.reference(), **TOL)


@pytest.mark.parametrize("block_size", [1, 8, 12, 32, 64])
def test_other_block_sizes(block_size):
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=block_size, seed=2)
    torch.testing.assert_close(b.run(), b.reference(), **TOL)


@pytest.mark.parametrize("group,num_kv_heads", [(8, 1), (3, 2), (16, 1)])
def test_gqa_mqa(group, num_kv_heads):
    b = Batch([(50, 20), (1, 99), (1, 3), (17, 0)], num_kv_heads=num_kv_heads, group=group, head_dim=64,
              block_size=16, seed=3)
    torch.testing.assert_close(b.run(), b.reference(), **TOL)


@pytest.mark.parametrize("window", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_window(window, block_size):
    # Contexts well past the window: whole blocks fall out of it and must be skipped or masked.
    pairs = [(70, 0), (1, 300), (45, 150), (1, 20), (1, 64), (30, 200)]
    b = Batch(pairs, num_kv_heads=2, group=2, head_dim=64, block_size=block_size, seed=4)
    ref = b.reference(sliding_window=window)
    torch.testing.assert_close(b.run(sliding_window=window), ref, **TOL)
    torch.testing.assert_close(b.run(sliding_window=window, num_splits=3), ref, **TOL)


def test_split_kv_long_decode():
    # One sequence x one KV head x 3000 tokens: one work item, so two threads need a KV split.
    b = Batch([(1, 2999)], num_kv_heads=1, group=1, head_dim=64, block_size=16, seed=5)
    p = b.plan(num_threads=2)
    assert p["split_groups"] == 1 and p["max_splits"] > 1 and p["items"] == p["max_splits"], p
    assert b.plan(num_threads=1)["split_groups"] == 0  # a single thread gains nothing from splits
    assert b.plan(num_threads=2, num_splits=1)["split_groups"] == 0
    ref = b.reference()
    torch.testing.assert_close(b.run(num_threads=2), ref, **TOL)
    torch.testing.assert_close(b.run(num_splits=7), ref, **TOL)
    torch.testing.assert_close(b.run(num_splits=1), ref, **TOL)
    torch.testing.assert_close(b.run(num_splits=1000), ref, **TOL)  # capped at one 16-key tile each


def test_split_kv_auto_many_threads():
    # Few long decodes and a chunk: with 8 (virtual) threads the large items get split.
    b = Batch([(1, 1500), (1, 900), (24, 1000)], num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=6)
    p = b.plan(num_threads=8)
    assert p["split_groups"] > 0, p
    torch.testing.assert_close(b.run(num_threads=8), b.reference(), **TOL)


def test_split_kv_forced_chunks():
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, seed=7)
    assert b.plan(num_splits=4)["split_groups"] > 0
    torch.testing.assert_close(b.run(num_splits=4), b.reference(), **TOL)


@pytest.mark.parametrize("rows", [1, 2, 7, 13, 200])
def test_rows_per_tile(rows):
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, seed=8)
    assert b.plan(rows_per_tile=rows)["rows_per_tile"] == max(1, rows // 2) * 2
    torch.testing.assert_close(b.run(rows_per_tile=rows), b.reference(), **TOL)


def test_threads_deterministic():
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, seed=9)
    one = b.run(num_threads=1)
    two = b.run(num_threads=2)
    assert torch.equal(one, two)  # each output row is computed by one thread in a fixed order


def test_strided_q_and_out():
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, seed=10)
    t, hq, d = b.q.shape
    qkv = torch.randn(t, hq + 4, d)
    qkv[:, :hq] = b.q
    q = qkv[:, :hq]  # a view of a fused QKV output
    assert not q.is_contiguous()
    out_buf = torch.full((t, hq, d + 8), 7.0)
    out = out_buf[:, :, :d]
    res = cpu_pa.paged_attention(q, b.k_cache, b.v_cache, b.qsl, b.seq_lens, b.block_tables, b.scale, out=out)
    assert res.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, b.reference(), **TOL)
    assert (out_buf[:, :, d:] == 7.0).all()


def test_empty_and_zero_length_sequences():
    b = Batch([(5, 3)], num_kv_heads=1, group=2, head_dim=64, block_size=16)
    q = b.q[:0]
    out = cpu_pa.paged_attention(q, b.k_cache, b.v_cache, torch.zeros(1, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 64)
    # A sequence with no new tokens in the batch is skipped.
    qsl = torch.tensor([0, 0, 5], dtype=torch.int32)
    seq_lens = torch.tensor([4, 8], dtype=torch.int32)
    bt = torch.cat([b.block_tables, b.block_tables])
    out = cpu_pa.paged_attention(b.q, b.k_cache, b.v_cache, qsl, seq_lens, bt, b.scale)
    torch.testing.assert_close(out, b.reference(), **TOL)


@pytest.mark.parametrize("pattern", ["random", "chunks"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_write_kv_cache(block_size, pattern):
    num_blocks, hkv, d, t = 12, 2, 64, 30
    gen = torch.Generator().manual_seed(11)
    k_ref = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_ref = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    k_cache, v_cache = cpu_pa.from_reference_layout(k_ref, v_ref)
    assert k_cache.shape == cpu_pa.cache_shape(num_blocks, block_size, hkv, d)
    # k, v as strided views of a fused QKV output; distinct slots, some -1 (padding).
    qkv = torch.randn(t, 4 + 2 * hkv, d, generator=gen)
    k, v = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    if pattern == "random":  # decode-like: one token per sequence, anywhere
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
        slots[::7] = -1
    else:  # prompt chunks: consecutive positions from mid-block offsets over shuffled blocks
        blocks = torch.randperm(num_blocks, generator=gen)
        pos = torch.cat([torch.arange(3, 3 + 17), torch.arange(block_size - 1, block_size - 1 + 13)])
        seq = torch.cat([torch.zeros(17, dtype=torch.long), torch.ones(13, dtype=torch.long)])
        table = blocks.view(2, -1)  # two sequences' block tables
        slots = table[seq, pos // block_size] * block_size + pos % block_size
        slots[[5, 6, 25]] = -1
    cpu_pa.write_kv_cache(k, v, k_cache, v_cache, slots)
    write_kv_cache_reference(k, v, k_ref, v_ref, slots)
    k_back, v_back = cpu_pa.to_reference_layout(k_cache, v_cache, block_size)
    assert torch.equal(k_back, k_ref) and torch.equal(v_back, v_ref)


@pytest.mark.parametrize("block_size,head_dim", [(8, 72), (16, 64), (32, 36)])
def test_k_row_major_layout(block_size, head_dim):
    # The alternative layout (K tiles like V, transposed into L1 by the kernel), kept for the
    # layout measurement in perf/kernels/bench_cpu_attention.py: same results through both functions.
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=head_dim, block_size=block_size, seed=13)
    k, v = cpu_pa.from_reference_layout(b.k_ref, b.v_ref, k_layout=cpu_pa.K_ROW_MAJOR)
    out = cpu_pa.paged_attention(b.q, k, v, b.qsl, b.seq_lens, b.block_tables, b.scale, k_layout=cpu_pa.K_ROW_MAJOR)
    torch.testing.assert_close(out, b.reference(), **TOL)
    nb, bs, hkv, d = b.k_ref.shape
    for layout in (cpu_pa.K_ROW_MAJOR, cpu_pa.K_TRANSPOSED):
        k_cache = torch.zeros(cpu_pa.cache_shape(nb, bs, hkv, d))
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(5, nb * bs - 3)  # runs from mid-block offsets, across blocks
        cpu_pa.write_kv_cache(b.k_ref.reshape(-1, hkv, d)[5:-3], b.v_ref.reshape(-1, hkv, d)[5:-3], k_cache, v_cache,
                              slots, k_layout=layout)
        k_back, v_back = cpu_pa.to_reference_layout(k_cache, v_cache, bs, k_layout=layout)
        flat_k, flat_v = k_back.reshape(-1, hkv, d), v_back.reshape(-1, hkv, d)
        torch.testing.assert_close(flat_k[5:-3], b.k_ref.reshape(-1, hkv, d)[5:-3], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(flat_v[5:-3], b.v_ref.reshape(-1, hkv, d)[5:-3], rtol=0, atol=0, equal_nan=True)
        assert (flat_k[:5] == 0).all() and (flat_k[-3:] == 0).all()


def test_allocate_cache():
    c = cpu_pa.allocate_cache(300, 16, 2, 64)  # 2.4 MiB: at least one 2 MiB page when THP is on
    assert c.shape == cpu_pa.cache_shape(300, 16, 2, 64) and c.dtype == torch.float32 and c.is_contiguous()
    assert c.data_ptr() % (1 << 21) == 0 and not c.any()


def test_write_then_attend():
    # Fill an empty cache through write_kv_cache (as the engine does), then attend.
    b = Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, seed=12)
    k_cache = torch.zeros(cpu_pa.cache_shape(b.k_ref.shape[0], 16, 2, 64))
    v_cache = torch.zeros_like(k_cache)
    nb, bs, hkv, d = b.k_ref.shape
    slots = torch.arange(nb * bs)
    k_all, v_all = b.k_ref.reshape(-1, hkv, d), b.v_ref.reshape(-1, hkv, d)
    cpu_pa.write_kv_cache(k_all, v_all, k_cache, v_cache, slots)
    out = cpu_pa.paged_attention(b.q, k_cache, v_cache, b.qsl, b.seq_lens, b.block_tables, b.scale)
    torch.testing.assert_close(out, b.reference(), **TOL)


def test_bad_inputs():
    b = Batch([(5, 3), (1, 9)], num_kv_heads=2, group=2, head_dim=64, block_size=16)
    args = {"q": b.q, "k_cache": b.k_cache, "v_cache": b.v_cache, "query_start_loc": b.qsl, "seq_lens": b.seq_lens,
            "block_tables": b.block_tables, "scale": b.scale}

    def call(**over):
        cpu_pa.paged_attention(**{**args, **over})

    call()
    bad = [
        {"q": b.q.double()},
        {"q": b.q.half()},
        {"k_cache": b.k_ref},  # reference layout (4-D)
        {"v_cache": b.v_cache.double()},
        {"k_cache": b.k_cache[:, :1]},  # 4 query heads over 1 kv head: different shape from v_cache
        {"q": torch.randn(6, 3, 64)},  # 3 heads over 2 kv heads
        {"q": torch.randn(6, 4, 48)},  # block_size * 48 does not divide the cache row
        {"seq_lens": b.seq_lens.long()},
        {"query_start_loc": b.qsl[:-1]},
        {"block_tables": b.block_tables.long()},
        {"block_tables": b.block_tables[:1]},
        {"query_start_loc": torch.tensor([0, 5, 7], dtype=torch.int32)},  # does not end at T = 6
        {"seq_lens": torch.tensor([4, 9], dtype=torch.int32)},  # 5 new tokens in a 4-token context
        {"block_tables": torch.full_like(b.block_tables, 10_000)},  # block id outside the cache
        {"block_tables": b.block_tables[:, :0]},  # too few columns for seq_len
        {"sliding_window": 0},
        {"out": torch.empty(6, 4, 32)},
    ]
    for over in bad:
        with pytest.raises(ValueError):
            call(**over)
    big = torch.zeros(cpu_pa.cache_shape(4, 16, 2, 512))  # head_dim 512 > 256
    with pytest.raises(ValueError, match="head_dim"):
        call(q=torch.randn(6, 4, 512), k_cache=big, v_cache=big)
    k = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    cpu_pa.write_kv_cache(k, k, b.k_cache.clone(), b.v_cache.clone(), slots)
    for kk, sl in [(k.double(), slots), (k, slots.int()), (k, slots[:2]), (k[:, :1], slots),
                   (k, torch.tensor([0, 1, 10_000]))]:
        with pytest.raises(ValueError):
            cpu_pa.write_kv_cache(kk, kk, b.k_cache.clone(), b.v_cache.clone(), sl)


# ---------------------------------------------------------------------------- bfloat16 caches
def _as_bf16(b: Batch, k_layout: int = cpu_pa.K_TRANSPOSED) -> Batch:
    """The batch with its cache values rounded to bf16: the kernel reads the bf16 cache, the
    reference the same values in fp32 (so only the arithmetic order differs)."""
    b.k_ref, b.v_ref = b.k_ref.bfloat16().float(), b.v_ref.bfloat16().float()
    b.k_cache, b.v_cache = cpu_pa.from_reference_layout(b.k_ref.bfloat16(), b.v_ref.bfloat16(), k_layout=k_layout)
    assert b.k_cache.dtype == torch.bfloat16
    return b


@pytest.mark.parametrize("block_size", [4, 12, 16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_bf16_cache_mixed_batch(block_size, group):
    b = _as_bf16(Batch(MIXED, num_kv_heads=2, group=group, head_dim=64, block_size=block_size, seed=21))
    ref = b.reference()
    out = b.run()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(b.run(num_splits=3), ref, **TOL)


@pytest.mark.parametrize("head_dim", [36, 40, 72, 128])
def test_bf16_cache_read_in_place_any_head_dim(head_dim):
    # Blocks of 16 with K transposed: the strips widen bf16 as they load it (vector body, 8-wide
    # and scalar head-dim tails), also when a long decode is split across threads.
    pairs = [(1, 700), (23, 40), (1, 5), (9, 0)]
    b = _as_bf16(Batch(pairs, num_kv_heads=2, group=2, head_dim=head_dim, block_size=16, seed=24))
    ref = b.reference()
    torch.testing.assert_close(b.run(), ref, **TOL)
    torch.testing.assert_close(b.run(num_splits=4), ref, **TOL)


@pytest.mark.parametrize("window", [5, 37])
@pytest.mark.parametrize("block_size", [4, 16])
def test_bf16_cache_sliding_window(window, block_size):
    pairs = [(70, 0), (1, 300), (45, 150), (1, 20)]
    b = _as_bf16(Batch(pairs, num_kv_heads=2, group=2, head_dim=80, block_size=block_size, seed=22))
    torch.testing.assert_close(b.run(sliding_window=window), b.reference(sliding_window=window), **TOL)


def test_bf16_cache_k_row_major():
    b = _as_bf16(Batch(MIXED, num_kv_heads=2, group=2, head_dim=64, block_size=16, seed=23), cpu_pa.K_ROW_MAJOR)
    out = cpu_pa.paged_attention(b.q, b.k_cache, b.v_cache, b.qsl, b.seq_lens, b.block_tables, b.scale,
                                 k_layout=cpu_pa.K_ROW_MAJOR)
    torch.testing.assert_close(out, b.reference(), **TOL)


@pytest.mark.parametrize("k_layout", [cpu_pa.K_TRANSPOSED, cpu_pa.K_ROW_MAJOR])
@pytest.mark.parametrize("block_size", [4, 16])
def test_bf16_write_kv_cache_is_exact(block_size, k_layout):
    num_blocks, hkv, d, t = 10, 2, 64, 40
    gen = torch.Generator().manual_seed(24)
    k_ref = torch.randn(num_blocks, block_size, hkv, d, generator=gen).bfloat16()
    v_ref = torch.randn(num_blocks, block_size, hkv, d, generator=gen).bfloat16()
    k_cache, v_cache = cpu_pa.from_reference_layout(k_ref, v_ref, k_layout=k_layout)
    qkv = torch.randn(t, 4 + 2 * hkv, d, generator=gen).bfloat16()
    k, v = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    slots = torch.cat([torch.arange(3, 3 + 20), torch.randperm(num_blocks * block_size, generator=gen)[:40]])
    slots = slots.unique(sorted=False)[:t]
    slots[::9] = -1
    cpu_pa.write_kv_cache(k, v, k_cache, v_cache, slots, k_layout=k_layout)
    write_kv_cache_reference(k, v, k_ref, v_ref, slots)
    k_back, v_back = cpu_pa.to_reference_layout(k_cache, v_cache, block_size, k_layout=k_layout)
    assert torch.equal(k_back, k_ref) and torch.equal(v_back, v_ref)


# bf16 queries (a bf16 model) over a bf16 cache: prompt chunks take bf16 products where the CPU
# has AVX-512 BF16 (exact products, fp32 sums, P rounded to bf16 for P.V); decodes keep fp32 ones.
BF16_PRODUCTS = cpu_pa.bf16_products()
# Bound on |out - fp32 reference| with P rounded to bf16 (8 significant bits), for these N(0, 1)
# K/V: measured up to 3.5e-3 over the cases below.
BF16_PRODUCT_ATOL = 8e-3


@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: not a multiple of 32, fp32 products
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 32, 4])  # 4: gathered tiles, fp32 products
@pytest.mark.parametrize("window", [None, 5, 37])
def test_bf16_queries(block_size, group, head_dim, window):
    # Chunks at odd offsets and windows make key ranges start and end mid-pair; the NaN-filled
    # tails of the cache show a pair partner outside the range leaking into the output.
    pairs = MIXED + [(100, 33), (2, 7)]
    b = _as_bf16(Batch(pairs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size, seed=5))
    b.q = b.q.bfloat16().float()
    ref = b.reference(sliding_window=window)
    fp32_q = b.run(sliding_window=window)
    b.q = b.q.bfloat16()
    out = b.run(sliding_window=window)
    assert out.dtype == torch.float32 and not out.isnan().any()
    split = b.run(sliding_window=window, num_splits=3)  # (P rounds against each partition's own max)
    decode_rows = torch.cat([torch.arange(b.qsl[i], b.qsl[i + 1]) for i, (n, _) in enumerate(pairs) if n == 1])
    # Decodes: fp32 products on the same (exactly widened) queries, whatever the CPU.
    torch.testing.assert_close(out[decode_rows], fp32_q[decode_rows], rtol=0, atol=0)
    if BF16_PRODUCTS and block_size % 16 == 0 and head_dim % 32 == 0:
        for o in (out, split):
            err = (o - ref).abs()
            assert err.max() <= BF16_PRODUCT_ATOL and err.mean() <= 5e-4, f"max {err.max():.2e} mean {err.mean():.2e}"
        assert (out - fp32_q).abs().max() > 1e-5, "the prompt chunks did not take the bf16 products"
    else:
        for o in (out, split):
            torch.testing.assert_close(o, ref, **TOL)
        torch.testing.assert_close(out, fp32_q, rtol=0, atol=0)


def test_bf16_dtype_mismatches_are_refused():
    b = _as_bf16(Batch([(5, 3), (1, 9)], num_kv_heads=2, group=2, head_dim=64, block_size=16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_pa.paged_attention(b.q, b.k_cache.half(), b.v_cache.half(), b.qsl, b.seq_lens, b.block_tables, b.scale)
    with pytest.raises(ValueError):
        cpu_pa.paged_attention(b.q, b.k_cache, b.v_cache.float(), b.qsl, b.seq_lens, b.block_tables, b.scale)
    with pytest.raises(ValueError, match="dtype"):
        k = torch.randn(2, 2, 64)
        cpu_pa.write_kv_cache(k, k, b.k_cache, b.v_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize("pairs", [[(1, 300), (1, 41), (1, 7)], [(40, 0), (1, 33), (29, 70)]],
                         ids=["decodes", "prompt-chunks"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_bf16_cache_equals_fp32_cache_of_the_widened_values(pairs, head_dim):
    """fp32 queries over a bf16 cache are the fp32 kernel over the same values widened: decodes
    widen in the strips' loads, prompt chunks (more than two register strips) below AVX-512 widen
    each tile once into L1. The same fp32 arithmetic either way, so the outputs are identical: a
    wrongly widened lane (shift, order, tail) changes them."""
    b = _as_bf16(Batch(pairs, num_kv_heads=2, group=4, head_dim=head_dim, block_size=16, seed=31))
    wide_k, wide_v = cpu_pa.from_reference_layout(b.k_ref, b.v_ref)
    assert wide_k.dtype == torch.float32
    out = b.run()
    wide = cpu_pa.paged_attention(b.q, wide_k, wide_v, b.qsl, b.seq_lens, b.block_tables, b.scale)
    assert torch.equal(out, wide)


# ---------------------------------------------------------------------------- int8 caches
# Codes with a float32 scale per token and kv head (splitfuse.kernels.cpu.kv_int8). Decodes read
# the codes in place (widened in registers, scales on the scores and on P); prompt chunks and
# blocks that are not a multiple of 16 keys dequantize tiles into L1 first.
# Bound on |out - float reference| for these N(0, 1) K/V (per-token scales: code steps of
# max|x| / 127 ~ 0.02): measured up to 0.019, mean 1.5e-3, over the cases below.
INT8_ATOL, INT8_MEAN = 0.05, 4e-3


def _as_int8(b: Batch) -> tuple[Batch, torch.Tensor]:
    """The batch over int8 caches, and its reference on the float values (before quantizing);
    b.reference() then runs on the dequantized values, so only the arithmetic order differs."""
    float_ref = b.reference()
    b.k_cache, b.v_cache = kv_int8.from_reference_layout(b.k_ref, b.v_ref)
    b.k_ref, b.v_ref = kv_int8.to_reference_layout(b.k_cache, b.v_cache, b.block_size)
    assert b.k_cache.dtype == torch.int8
    return b, float_ref


def _check_int8(out, same_values_ref, float_ref):
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, same_values_ref, **TOL)
    err = (out - float_ref).abs()
    assert err.max() <= INT8_ATOL and err.mean() <= INT8_MEAN, f"max {err.max():.2e} mean {err.mean():.2e}"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_int8_cache_mixed_batch(block_size, group):
    pairs = MIXED + [(1, 400)]  # a long decode: split across the threads (and forced below)
    b, float_ref = _as_int8(Batch(pairs, num_kv_heads=2, group=group, head_dim=64, block_size=block_size, seed=41))
    ref = b.reference()
    for out in (b.run(), b.run(num_splits=3), b.run(num_splits=1, num_threads=1)):
        _check_int8(out, ref, float_ref)


@pytest.mark.parametrize("window", [5, 37])
@pytest.mark.parametrize("block_size", [4, 16])
def test_int8_cache_sliding_window(window, block_size):
    pairs = [(40, 0), (1, 200), (25, 90), (1, 20), (3, 40)]
    b = Batch(pairs, num_kv_heads=2, group=2, head_dim=80, block_size=block_size, seed=42)
    float_ref = b.reference(sliding_window=window)
    b, _ = _as_int8(b)
    _check_int8(b.run(sliding_window=window), b.reference(sliding_window=window), float_ref)
    _check_int8(b.run(sliding_window=window, num_splits=2), b.reference(sliding_window=window), float_ref)


@pytest.mark.parametrize("head_dim", [40, 128])
def test_int8_cache_bf16_queries_and_head_dim_tails(head_dim):
    # A bf16 model over an int8 cache: fp32 products on the widened queries; head dims with 8-wide
    # and scalar tails in the in-place strips.
    b, _ = _as_int8(Batch([(1, 90), (20, 33), (1, 5)], num_kv_heads=2, group=2, head_dim=head_dim, block_size=16,
                          seed=43))
    b.q = b.q.bfloat16()
    ref = paged_attention_reference(b.q.float(), b.k_ref, b.v_ref, b.qsl, b.seq_lens, b.block_tables, b.scale)
    torch.testing.assert_close(b.run(), ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_int8_write_kv_cache_is_exact(block_size, dtype):
    """The kernel's quantizing write gives the reference quantization's codes and scales, byte
    for byte (fp32 and bf16 inputs, strided views, runs and scattered slots, skipped tokens)."""
    num_blocks, hkv, d, t = 10, 2, 64, 40
    gen = torch.Generator().manual_seed(44)
    k_ref = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_ref = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    k_cache, v_cache = kv_int8.from_reference_layout(k_ref, v_ref)
    qkv = (torch.randn(t, 4 + 2 * hkv, d, generator=gen) * 3).to(dtype)
    qkv[5, 4] = 0  # an all-zero row: scale 0, codes 0
    k, v = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    slots = torch.cat([torch.arange(3, 3 + 20), torch.randperm(num_blocks * block_size, generator=gen)[:40]])
    slots = slots.unique(sorted=False)[:t]
    slots[::9] = -1
    cpu_pa.write_kv_cache(k, v, k_cache, v_cache, slots)
    write_kv_cache_reference(k.float(), v.float(), k_ref, v_ref, slots)
    want_k, want_v = kv_int8.from_reference_layout(k_ref, v_ref)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    codes, scales = kv_int8.quantize(k[5, 0])
    assert scales.item() == 0 and not codes.any()


def test_int8_cache_refusals():
    b, _ = _as_int8(Batch([(5, 3), (1, 9)], num_kv_heads=2, group=2, head_dim=64, block_size=16))
    with pytest.raises(ValueError, match="K transposed"):
        cpu_pa.paged_attention(b.q, b.k_cache, b.v_cache, b.qsl, b.seq_lens, b.block_tables, b.scale,
                               k_layout=cpu_pa.K_ROW_MAJOR)
    k = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="K transposed"):
        cpu_pa.write_kv_cache(k, k, b.k_cache, b.v_cache, torch.tensor([0, 1]), k_layout=cpu_pa.K_ROW_MAJOR)
    with pytest.raises(ValueError, match="float32 or bfloat16 for int8 caches"):
        cpu_pa.write_kv_cache(b.k_cache[:2, :, :64], b.k_cache[:2, :, :64], b.k_cache, b.v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32 or bfloat16 \\(or int8"):
        cpu_pa.write_kv_cache(k.half(), k.half(), b.k_cache.half(), b.v_cache.half(), torch.tensor([0, 1]))
    assert cpu_pa.cache_shape(3, 16, 2, 64, torch.int8) == (3, 2, 16 * 68)
