"""The CPU attention path (TorchAttention) against the plain per-sequence reference.

TorchAttention keeps its cache head-major inside a block and gathers decode K/V in
sub-batches; both are checked here on mixed ragged batches, apart from the engine parity tests.
"""

from __future__ import annotations

import pytest
import torch

import splitfuse.layers.attention_torch as attention_module
from splitfuse.kernels.reference import paged_attention_reference, write_kv_cache_reference
from splitfuse.layers.attention import AttentionMetadata
from splitfuse.layers.attention_torch import TorchAttention

# (new tokens, cached tokens): prompt chunks with and without history, and decodes.
MIXED = [(332, 628), (1, 718), (1, 323), (180, 5), (224, 0), (1, 1), (1, 40), (1, 17)]


def _batch(pairs, num_kv_heads: int, block_size: int, seed: int = 0):
    """Token-major caches (the reference's layout) full of finite garbage, a shuffled block
    table, and the metadata of one step whose new tokens still have to be written."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 16
    q_lens = [n for n, _ in pairs]
    seq_lens = [n + c for n, c in pairs]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(pairs), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 3
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 3
    starts = torch.tensor([0] + q_lens).cumsum(0)
    slots = []
    for b, (n, c) in enumerate(pairs):
        pos = torch.arange(c, c + n)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=starts.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size,
    )
    return k_cache, v_cache, meta, q_lens, seq_lens


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.transpose(1, 2).contiguous()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("gather_bytes", [None, 1], ids=["one-gather", "per-seq-gathers"])
def test_write_and_attend_match_reference(block_size, num_kv_heads, group, window, gather_bytes, monkeypatch):
    if gather_bytes is not None:
        monkeypatch.setattr(attention_module, "_DECODE_GATHER_BYTES", gather_bytes)
    k_cache, v_cache, meta, q_lens, seq_lens = _batch(MIXED, num_kv_heads, block_size)
    gen = torch.Generator().manual_seed(1)
    tokens, head_dim = sum(q_lens), k_cache.shape[-1]
    q = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5

    backend = TorchAttention()
    shape = backend.cache_shape(k_cache.shape[0], block_size, num_kv_heads, head_dim)
    assert shape == (k_cache.shape[0], num_kv_heads, block_size, head_dim)
    k_hm, v_hm = _head_major(k_cache), _head_major(v_cache)
    backend.prepare(meta, q_lens, seq_lens, num_kv_heads)
    backend.write_kv(k, v, k_hm, v_hm, meta)
    out = backend.attend(q, k_hm, v_hm, meta, scale, window)

    write_kv_cache_reference(k, v, k_cache, v_cache, meta.slot_mapping)
    torch.testing.assert_close(k_hm, _head_major(k_cache), rtol=0, atol=0)
    torch.testing.assert_close(v_hm, _head_major(v_cache), rtol=0, atol=0)
    ref = paged_attention_reference(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                    scale, sliding_window=window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-5)


def test_workspace_is_reused_across_layers_and_steps():
    """The gather buffer is allocated by the first step and reused by later, no larger ones."""
    backend = TorchAttention()
    pointers = []
    for pairs in ([(1, 300), (1, 200)], [(1, 30)], [(1, 300), (1, 200)]):
        k_cache, v_cache, meta, q_lens, seq_lens = _batch(pairs, 2, 16)
        backend.prepare(meta, q_lens, seq_lens, 2)
        q = torch.randn(sum(q_lens), 2, k_cache.shape[-1])
        for _ in range(2):  # two layers
            backend.attend(q, _head_major(k_cache), _head_major(v_cache), meta, 0.25, None)
            pointers.append(backend._k_buf.data_ptr())
    assert len(set(pointers)) == 1
