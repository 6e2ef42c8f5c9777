"""C++ paged attention and KV-cache write for CPUs (csrc/paged_attention.cpp), through ctypes.

One call covers a whole ragged batch of prompt chunks (at any offset: chunked prefill) and
decodes, with the engine's conventions (as `splitfuse.kernels.paged_attention_reference`):
  q                [T, Hq, D] float32 or bfloat16, last dim contiguous (token/head strides may be
                   anything)
  k_cache, v_cache float32 or bfloat16 (both the same; bf16 values are widened to fp32 as they
                   are read: half the memory traffic, fp32 arithmetic), or int8 codes with a
                   float32 scale per token and kv head (`kv_int8`: about a quarter of fp32's
                   bytes, K transposed only); the output is float32.
                   bf16 queries over a bf16 cache (a bf16 model): on CPUs with AVX-512 BF16
                   (`bf16_products()`), the query tiles of more than one token (prompt chunks)
                   multiply in bf16 with fp32 sums (vdpbf16ps: exact products, twice the
                   multiplies per instruction), and P is rounded to bf16 for P.V; decodes, and
                   every other case, keep fp32 products
  query_start_loc  int32 [B+1], seq_lens int32 [B] (context incl. the new tokens),
  block_tables     int32 [B, max_blocks] (rows may be padded with any ids past the used blocks)
  slot_mapping     int64 [T], slot = block_id * block_size + offset, < 0 = skip the token.
New token i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys 0..position
(and with `sliding_window`=W only keys with position - key < W). Any block size, head_dim 1..256
(multiples of 16 fastest; a tail of 8 vectorised, the rest scalar), Hq a multiple of Hkv.

Cache layout (`cache_shape`): [num_blocks, Hkv, block_size * D], one flat tile per (block, kv
head); the same shape for the K and the V tensor. The V tile is row-major [block_size, D]; the K
tile is stored transposed, [D, block_size], so Q.K^T loads 16 keys of one head dimension as one
vector (two on AVX2) and needs no horizontal sums. Measured (perf/kernels/bench_cpu_attention.py
--layouts, 2 threads, AVX2, Hq 8 / Hkv 4 / D 64 / block 16) against a row-major K tile that the
kernel transposes into L1 per 16 keys: write + attend per layer 1.36 vs 1.54 ms (16 decodes),
2.70 vs 3.30 ms (32 decodes), 2.68 vs 3.09 ms (a 128-token chunk + 16 decodes); 512-token chunks
2.5 vs 2.7 ms and 8.3 vs 8.2 ms (equal within the noise of a shared machine). The transposed K
tile costs more to write for decodes (one cache line per head dim instead of D / 16; 0.05 vs
0.015 ms for 32 tokens), which the attention gain covers many times. Only `write_kv_cache` and `paged_attention` know the transpose: fill
caches through `write_kv_cache`, or convert reference-layout caches with `from_reference_layout`.
`allocate_cache` gives a zeroed cache on transparent huge pages (fewer TLB misses; see there).

The library is compiled on the machine with -march=native (AVX-512 or AVX2 code paths).
ctypes releases the GIL during the calls. Threads: OpenMP on torch's libgomp (one thread pool),
`torch.get_num_threads()` of them unless `num_threads` is given (passed explicitly: in a thread
other than the one that called torch.set_num_threads, omp_get_max_threads() would still be the
OpenMP default). Safe to call from several Python threads at once (per-thread argument blocks and
scratch). Bad arguments raise ValueError (dtype, shape, strides; and, checked in C before any
work, query_start_loc / seq_lens consistency and block ids or slots outside the cache).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .build import Entries, bind, vector_width
from .kv_int8 import SCALE_BYTES

__all__ = ["K_ROW_MAJOR", "K_TRANSPOSED", "allocate_cache", "available", "bf16_products", "cache_shape",
           "from_reference_layout",
           "huge_page_empty", "kv_kind", "paged_attention", "plan", "to_reference_layout", "vector_width", "write_kv_cache"]

K_ROW_MAJOR = 0   # K tile [block_size, D] like V (kept to measure the layout choice)
K_TRANSPOSED = 1  # K tile [D, block_size]: the engine's layout

_ERRORS = {
    -1: "query_start_loc must start at 0, be non-decreasing and end at q.shape[0]",
    -2: "seq_lens[b] must be >= the number of new tokens of sequence b",
    -3: "block_tables has fewer columns than a sequence's seq_len needs",
    -4: "a block id in block_tables (or a slot in slot_mapping) lies outside the cache",
    -5: "sizes out of range (head_dim 1..256, num_heads a multiple of num_kv_heads, block_size > 0; "
        "int8 caches: K transposed only)",
    -6: "out of memory (kernel scratch or split-KV workspace)",
}

_ATTN_NARGS, _WRITE_NARGS = 29, 16  # int64 slots of the packed entry points (csrc/paged_attention.cpp)
_tls = threading.local()


@dataclass(frozen=True)
class _Kernels:
    attn: Callable
    write_f32: Callable
    write_bf16: Callable
    write_i8_f32: Callable
    write_i8_bf16: Callable
    bf16_products: bool


def _lookup(lib: ctypes.CDLL) -> _Kernels:
    i32, ptr = ctypes.c_int, ctypes.c_void_p
    return _Kernels(bind(lib, "sf_attn_paged_attention_f32_packed", i32, ptr, ctypes.c_float),
                    bind(lib, "sf_attn_write_kv_f32_packed", i32, ptr),
                    bind(lib, "sf_attn_write_kv_bf16_packed", i32, ptr),
                    bind(lib, "sf_attn_write_kv_i8_f32_packed", i32, ptr),
                    bind(lib, "sf_attn_write_kv_i8_bf16_packed", i32, ptr),
                    bool(bind(lib, "sf_attn_bf16_products", i32)()))


_entries = Entries("attention", _lookup)


def _arg_blocks():
    """This thread's preallocated argument arrays (one call at a time per thread; the GIL is
    released during the call, so another thread's call must not share them)."""
    try:
        return _tls.blocks
    except AttributeError:
        _tls.blocks = ((ctypes.c_int64 * _ATTN_NARGS)(), (ctypes.c_int64 * _WRITE_NARGS)())
        return _tls.blocks


def available() -> bool:
    """Whether the C++ library built and loaded here."""
    return _entries.available()


def bf16_products() -> bool:
    """Whether prompt chunks of bf16 queries over a bf16 cache take bf16 products here (the
    library was built for a CPU with AVX-512 BF16)."""
    kernels = _entries.get()
    return kernels is not None and kernels.bf16_products


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """Shape of each of the K and V cache tensors: [num_blocks, Hkv, block_size * head_dim], or for
    int8 [num_blocks, Hkv, block_size * (head_dim + 4)] (each tile's codes, then its scales)."""
    return (num_blocks, num_kv_heads, block_size * _token_elems(head_dim, dtype))


_FP32, _BF16, _INT8, _INT32, _INT64 = torch.float32, torch.bfloat16, torch.int8, torch.int32, torch.int64
CACHE_DTYPES = (_FP32, _BF16, _INT8)


def _token_elems(head_dim: int, dtype: torch.dtype) -> int:
    """Cache elements per token of one tile: head_dim values, or int8 codes plus the scale's bytes."""
    return head_dim + SCALE_BYTES if dtype is _INT8 else head_dim


def kv_kind(dtype: torch.dtype) -> int:
    """The kernels' code for a cache dtype (csrc/paged_attention.cpp's kv_kind)."""
    return 2 if dtype is _INT8 else int(dtype is _BF16)


_MAX_WINDOW = 1 << 30  # any window longer than every context means "no window"


def window_arg(sliding_window: int | None) -> int:
    """The kernel's window argument for `sliding_window`: 0 for none, longer ones clamped."""
    return min(sliding_window, _MAX_WINDOW) if sliding_window else 0


def allocate_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A zeroed float32 cache tensor of `cache_shape(...)`, on transparent huge pages where Linux
    allows it (THP "enabled" = always or madvise). Attention reads the blocks of a sequence in
    block-table order, scattered over the pool: on 4 KiB pages nearly every K and V tile costs a
    TLB miss (a two-dimensional page walk in a VM). Measured on the 2-core VM, 32 decodes x 600
    tokens, caches rotating over 5 layers: 13.2 -> 14.3..16.3 GB/s with 2 threads, 7.3 -> 9.2 GB/s
    with one. Without THP this is torch.zeros (plus 2 MiB of alignment slack)."""
    return huge_page_empty(cache_shape(num_blocks, block_size, num_kv_heads, head_dim)).zero_()


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(shape) advised onto transparent huge pages: a 2 MiB-aligned view into a
    slightly larger buffer, madvise(MADV_HUGEPAGE)'d before anything touches it (the first
    writes then fault in 2 MiB pages). Best effort: without THP the pages stay 4 KiB."""
    huge = 1 << 21
    numel = 1
    for n in shape:
        numel *= n
    item = torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(numel + huge // item, dtype=dtype)
    off = (-buf.data_ptr() % huge) // item
    t = buf[off:off + numel].view(shape)
    nbytes = numel * item // huge * huge
    if nbytes:
        try:
            madvise = bind(ctypes.CDLL(None, use_errno=True), "madvise", ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            madvise(t.data_ptr(), nbytes, 14)  # MADV_HUGEPAGE; an error just leaves 4 KiB pages
        except (OSError, AttributeError):
            pass
    return t


def _check_cache(name: str, cache: torch.Tensor, head_dim: int) -> None:
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16 (or int8 codes and scales), got {cache.dtype}")
    if cache.dim() != 3 or not cache.is_contiguous() or not cache.is_cpu:
        raise ValueError(f"{name} must be a contiguous CPU tensor of cache_shape(...) = "
                         f"[num_blocks, Hkv, block_size * D], got {tuple(cache.shape)}")
    if cache.shape[2] % _token_elems(head_dim, cache.dtype) != 0:
        raise ValueError(f"{name} last dim {cache.shape[2]} is not {cache_shape(1, 1, 1, head_dim, cache.dtype)[2]}"
                         f" * block_size (head_dim {head_dim}, {cache.dtype})")


def _block_size(cache: torch.Tensor, head_dim: int) -> int:
    return cache.shape[2] // _token_elems(head_dim, cache.dtype)


def _raise(code: int, where: str) -> None:
    raise ValueError(f"{where}: {_ERRORS.get(code, f'error {code}')}")


def _caches_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> bool:
    shape = k_cache.shape
    return (k_cache.dtype in CACHE_DTYPES and v_cache.dtype is k_cache.dtype and len(shape) == 3
            and v_cache.shape == shape
            and shape[2] % _token_elems(head_dim, k_cache.dtype) == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.is_cpu and v_cache.is_cpu)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_layout: int = K_TRANSPOSED,
                   num_threads: int | None = None) -> None:
    """Scatter this step's k, v [T, Hkv, D] into the caches at `slot_mapping` (skipping < 0), in place.

    k and v may be strided views (e.g. of a fused QKV output): only their last dim must be contiguous.
    k, v and the caches share one dtype, float32 or bfloat16; or the caches are int8 (K transposed)
    and k, v float32 or bfloat16, quantized per token and head as `kv_int8.quantize` does.
    A slot past the cache raises ValueError (nothing is written then)."""
    kernels = _entries.need()
    int8 = k_cache.dtype is _INT8
    if int8:
        write = kernels.write_i8_f32 if k.dtype is _FP32 else kernels.write_i8_bf16
    else:
        write = kernels.write_f32 if k.dtype is _FP32 else kernels.write_bf16
    shape = k.shape
    ks, vs = k.stride(), v.stride()
    dtype_ok = (k.dtype in (_FP32, _BF16) and k_layout == K_TRANSPOSED) if int8 else k.dtype is k_cache.dtype
    if not (dtype_ok and v.dtype is k.dtype and len(shape) == 3 and v.shape == shape and ks[2] == 1
            and vs[2] == 1 and k.is_cpu and v.is_cpu and _caches_ok(k_cache, v_cache, shape[2])
            and k_cache.shape[1] == shape[1] and slot_mapping.dtype is _INT64 and slot_mapping.shape == shape[:1]
            and slot_mapping.is_contiguous() and slot_mapping.is_cpu):
        _check_write(k, v, k_cache, v_cache, slot_mapping, k_layout)
        raise ValueError("write_kv_cache: bad arguments")  # not reached: _check_write names the problem
    t, hkv, d = shape
    if t == 0:
        return
    args = _arg_blocks()[1]
    args[:] = (k.data_ptr(), ks[0], ks[1], v.data_ptr(), vs[0], vs[1], k_cache.data_ptr(), v_cache.data_ptr(),
               slot_mapping.data_ptr(), t, hkv, d, _block_size(k_cache, d), k_cache.shape[0], k_layout,
               num_threads or torch.get_num_threads())
    rc = write(args)
    if rc:
        _raise(rc, "write_kv_cache")


def _check_write(k, v, k_cache, v_cache, slot_mapping, k_layout) -> None:
    """The slow path of write_kv_cache's checks: raise a ValueError that names the problem."""
    if k_cache.dtype is _INT8 and k_layout != K_TRANSPOSED:
        raise ValueError("int8 caches are written with K transposed (k_layout K_TRANSPOSED) only")
    if k_cache.dtype is _INT8:
        if k.dtype not in (_FP32, _BF16) or v.dtype is not k.dtype:
            raise ValueError(f"k and v must be float32 or bfloat16 for int8 caches, got {k.dtype} / {v.dtype}")
    elif k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError(f"k and v must have the caches' dtype {k_cache.dtype}, got {k.dtype} / {v.dtype}")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} / {tuple(v.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or not (k.is_cpu and v.is_cpu):
        raise ValueError("k and v must be CPU tensors with a contiguous last (head_dim) dimension")
    t, hkv, d = k.shape
    _check_cache("k_cache", k_cache, d)
    _check_cache("v_cache", v_cache, d)
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != hkv:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit k {tuple(k.shape)}")
    if (slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,) or not slot_mapping.is_contiguous()
            or not slot_mapping.is_cpu):
        raise ValueError(f"slot_mapping must be a contiguous int64 CPU [T={t}] tensor, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def _batch_ok(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window) -> bool:
    qshape = q.shape
    if not ((q.dtype is _FP32 or q.dtype is _BF16) and len(qshape) == 3 and q.stride(2) == 1 and q.is_cpu
            and _caches_ok(k_cache, v_cache, qshape[2]) and qshape[1] % k_cache.shape[1] == 0):
        return False
    b = seq_lens.shape[0] if len(seq_lens.shape) == 1 else -1
    bshape = block_tables.shape
    return (query_start_loc.dtype is _INT32 and seq_lens.dtype is _INT32 and block_tables.dtype is _INT32
            and query_start_loc.shape == (b + 1,) and len(bshape) == 2 and bshape[0] == b
            and query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1
            and query_start_loc.is_cpu and seq_lens.is_cpu and block_tables.is_cpu
            and (sliding_window is None or sliding_window > 0))


def _check_batch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window) -> None:
    """The slow path of paged_attention's checks: raise a ValueError that names the problem."""
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.stride(2) != 1 or not q.is_cpu:
        raise ValueError(f"q must be a CPU [T, Hq, D] tensor with a contiguous last dim, got {tuple(q.shape)}")
    d = q.shape[2]
    _check_cache("k_cache", k_cache, d)
    _check_cache("v_cache", v_cache, d)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if q.shape[1] % k_cache.shape[1] != 0:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {k_cache.shape[1]}")
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (query_start_loc.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32):
        raise ValueError("query_start_loc, seq_lens and block_tables must be int32")
    if b < 0 or query_start_loc.shape != (b + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"query_start_loc must be [B+1], seq_lens [B], block_tables [B, max_blocks]; got "
                         f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}, {tuple(block_tables.shape)}")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(1) == 1):
        raise ValueError("query_start_loc, seq_lens and block_tables rows must be contiguous")
    if not (query_start_loc.is_cpu and seq_lens.is_cpu and block_tables.is_cpu):
        raise ValueError("query_start_loc, seq_lens and block_tables must be CPU tensors")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    sliding_window: int | None = None, out: torch.Tensor | None = None, *,
                    num_splits: int | None = None, rows_per_tile: int | None = None,
                    k_layout: int = K_TRANSPOSED, num_threads: int | None = None) -> torch.Tensor:
    """Causal attention of the new tokens `q` over their paged KV context; returns out [T, Hq, D].

    Keyword-only knobs (tests and tuning): `num_splits` None = automatic split-KV, 1 = never
    split, k > 1 = split every work item's key range into k parts (at most one per 16 keys);
    `rows_per_tile` query rows (tokens x group heads) per work item; `num_threads` overrides
    torch.get_num_threads()."""
    attn = _entries.need().attn
    if not _batch_ok(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window):
        _check_batch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window)
        raise ValueError("paged_attention: bad arguments")  # not reached: _check_batch names the problem
    t, hq, d = q.shape
    if out is None:
        out = torch.empty((t, hq, d), dtype=torch.float32)
    elif not (out.dtype is _FP32 and out.shape == q.shape and out.stride(2) == 1 and out.is_cpu):
        raise ValueError(f"out must be a float32 CPU tensor of q's shape {tuple(q.shape)} with a contiguous last dim")
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    qs, os_ = q.stride(), out.stride()
    kshape = k_cache.shape
    args = _arg_blocks()[0]
    args[:] = (q.data_ptr(), qs[0], qs[1], out.data_ptr(), os_[0], os_[1], k_cache.data_ptr(), v_cache.data_ptr(),
               query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
               block_tables.shape[1], b, t, hq, kshape[1], d, _block_size(k_cache, d), kshape[0],
               window_arg(sliding_window), k_layout, num_splits or 0,
               rows_per_tile or 0, num_threads or torch.get_num_threads(), 0, 0, kv_kind(k_cache.dtype),
               int(q.dtype is _BF16))
    rc = attn(args, scale)
    if rc:
        _raise(rc, "paged_attention")
    return out


def plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
         seq_lens: torch.Tensor, block_tables: torch.Tensor, sliding_window: int | None = None, *,
         num_splits: int | None = None, rows_per_tile: int | None = None,
         num_threads: int | None = None) -> dict[str, int]:
    """The work decomposition `paged_attention` would use for these arguments (nothing computed):
    work items, split (sequence, kv head, tile) groups, the largest split count, rows per tile."""
    attn = _entries.need().attn
    _check_batch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, sliding_window)
    t, hq, d = q.shape
    kshape = k_cache.shape
    stats = (ctypes.c_int64 * 4)()
    args = (ctypes.c_int64 * _ATTN_NARGS)(
        q.data_ptr(), q.stride(0), q.stride(1), 0, 0, 0, k_cache.data_ptr(), v_cache.data_ptr(),
        query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        block_tables.shape[1], seq_lens.shape[0], t, hq, kshape[1], d, _block_size(k_cache, d), kshape[0],
        window_arg(sliding_window), K_TRANSPOSED, num_splits or 0,
        rows_per_tile or 0, num_threads or torch.get_num_threads(), ctypes.addressof(stats), 1,
        kv_kind(k_cache.dtype), int(q.dtype is _BF16))
    rc = attn(args, 1.0)
    if rc:
        _raise(rc, "paged_attention")
    return {"items": stats[0], "split_groups": stats[1], "max_splits": stats[2], "rows_per_tile": stats[3]}


def from_reference_layout(k_ref: torch.Tensor, v_ref: torch.Tensor, *,
                          k_layout: int = K_TRANSPOSED) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches in the reference layout [num_blocks, block_size, Hkv, D] -> this kernel's layout
    (bfloat16 stays bfloat16, anything else becomes float32)."""
    nb, bs, hkv, d = k_ref.shape
    dtype = _BF16 if k_ref.dtype is _BF16 else _FP32
    k = k_ref.permute(0, 2, 3, 1) if k_layout == K_TRANSPOSED else k_ref.permute(0, 2, 1, 3)
    v = v_ref.permute(0, 2, 1, 3)
    return (k.to(dtype).contiguous().reshape(nb, hkv, bs * d), v.to(dtype).contiguous().reshape(nb, hkv, bs * d))


def to_reference_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, *,
                        k_layout: int = K_TRANSPOSED) -> tuple[torch.Tensor, torch.Tensor]:
    """This kernel's caches -> the reference layout [num_blocks, block_size, Hkv, D]."""
    nb, hkv, n = k_cache.shape
    d = n // block_size
    if k_layout == K_TRANSPOSED:
        k = k_cache.view(nb, hkv, d, block_size).permute(0, 3, 1, 2)
    else:
        k = k_cache.view(nb, hkv, block_size, d).permute(0, 2, 1, 3)
    v = v_cache.view(nb, hkv, block_size, d).permute(0, 2, 1, 3)
    return k.contiguous(), v.contiguous()
