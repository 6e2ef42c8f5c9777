"""Shared helpers for the kernel tests: device/dtype parametrization and paged-batch builders.

CPU cases run the Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no CUDA); CUDA cases (fp16/bf16) are marked `cuda` and skip without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from splitfuse.kernels.triton_lang._common import interpreting  # noqa: E402

# (device, dtype) pairs: the interpreter has no bf16, so CPU runs fp32/fp16.
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32", marks=pytest.mark.interpreter),
    pytest.param("cpu", torch.float16, id="cpu-fp16", marks=pytest.mark.interpreter),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.cuda),
]


def require_device(device: str) -> None:
    """Skip cleanly when the kernels cannot run on `device` here."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if device == "cpu" and not interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 set before triton is imported")


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: dict(atol=2e-5, rtol=1e-4),
        torch.float16: dict(atol=3e-3, rtol=1e-2),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def args(self, scale: float) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                scale, self.max_query_len, self.max_seq_len)


def make_paged_batch(pairs: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device: str, seed: int = 0,
                     spare_blocks: int = 3) -> PagedBatch:
    """A ragged batch from (new tokens, cached tokens) pairs over a shuffled paged cache.

    Every cache slot that no sequence owns below its seq_len (spare blocks, page tails) holds
    NaN, so a kernel that reads past seq_len shows up as NaN in its output.
    """
    gen = torch.Generator().manual_seed(seed)
    q_lens = [n for n, _ in pairs]
    seq_lens = [n + c for n, c in pairs]
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(pairs), max(pages), dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, (n_pages, seq_len) in enumerate(zip(pages, seq_lens)):
        blocks = perm[used:used + n_pages]
        used += n_pages
        block_tables[b, :n_pages] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        k_cache[blocks[pos // block_size], pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim,
                                                                           generator=gen)
        v_cache[blocks[pos // block_size], pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim,
                                                                           generator=gen)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PagedBatch(
        q=q.to(device=device, dtype=dtype), k_cache=k_cache.to(device=device, dtype=dtype),
        v_cache=v_cache.to(device=device, dtype=dtype), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=block_tables.to(device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )
