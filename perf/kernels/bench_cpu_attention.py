#!/usr/bin/env python
"""Microbenchmark: the C++ CPU paged-attention kernel vs the engine's torch path (TorchAttention).

Both run the same batch over the same paged K/V content, each in its own cache layout; the
torch path is timed as the engine calls it per layer (`write_kv`, `attend`; `prepare` runs
once per step, outside the timing). Default shapes are the benchmark model's: Hq 8, Hkv 4,
head_dim 64, block 16, fp32, 2 threads.

Cases: decodes (16 and 32 sequences x ~600 tokens of context), one 512-token prompt chunk at
offset 0 and at offset 512, and a mixed batch (a 128-token chunk at offset 384 + 16 decodes
at ~600). Reported: ms per call, GFLOP/s for batches with a prompt chunk (4 * q_len * avg_ctx
* Hq * D flops, avg_ctx = keys a query sees: offset + (q_len + 1) / 2; the mixed batch counts
its decodes' flops too) and GB/s of K/V read for decodes (every cached K/V byte once). Each
timed call reads a different "layer"'s caches (copies totalling --layers-mb, more than the
last-level cache), as a forward pass does. The variants of a case are timed in alternating
rounds and each reports its best round (other processes on a shared machine only slow rounds
down), so compare numbers within a line.

    python perf/kernels/bench_cpu_attention.py                   # C++ vs torch, all cases
    python perf/kernels/bench_cpu_attention.py --threads 1 --cases decode32,prefill512@0
    python perf/kernels/bench_cpu_attention.py --layouts         # K transposed vs row-major K (+ L1 transpose)
    python perf/kernels/bench_cpu_attention.py --rows 24,48,96   # query rows per work item
    python perf/kernels/bench_cpu_attention.py --thp             # caches on transparent huge pages
    python perf/kernels/bench_cpu_attention.py --bf16            # fp32 vs bf16 KV cache (same values), and bf16 q
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from splitfuse.kernels.cpu import paged_attention as cpu_pa
from splitfuse.layers.attention import AttentionMetadata

try:
    from splitfuse.layers.attention_torch import TorchAttention
except ImportError:  # before the backends moved to their own modules
    from splitfuse.layers.attention import TorchAttention


def _cases(gen: torch.Generator) -> dict[str, list[tuple[int, int]]]:
    """name -> [(new tokens, cached tokens) per sequence]."""
    def ctx(n: int) -> list[int]:  # ~600 tokens of context, +-32
        return torch.randint(568, 633, (n,), generator=gen).tolist()

    return {
        "decode16": [(1, c) for c in ctx(16)],
        "decode32": [(1, c) for c in ctx(32)],
        "prefill512@0": [(512, 0)],
        "prefill512@512": [(512, 512)],
        "mixed128@384+16d": [(128, 384)] + [(1, c) for c in ctx(16)],
    }


class Batch:
    """A ragged batch over `layers` copies of a shuffled paged cache, in the torch layout and
    in the C++ kernel's layouts."""

    def __init__(self, pairs, hq, hkv, d, bs, layers_bytes, gen, k_layouts, thp=False, bf16=False):
        self.pairs = pairs
        q_lens = [n for n, _ in pairs]
        seq_lens = [n + c for n, c in pairs]
        pages = [-(-s // bs) for s in seq_lens]
        nb = sum(pages) + 8
        perm = torch.randperm(nb, generator=gen)
        bt = torch.zeros(len(pairs), max(pages), dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages):
            bt[b, :n] = perm[used:used + n].to(torch.int32)
            used += n
        positions = torch.cat([torch.arange(c, c + n) for n, c in pairs])
        seq_of_token = torch.repeat_interleave(torch.arange(len(pairs)), torch.tensor(q_lens))
        slot_mapping = bt[seq_of_token, positions // bs].long() * bs + positions % bs
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        self.meta = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=qsl,
                                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
                                      max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=bs)
        self.q_lens, self.seq_lens, self.hkv, self.hq, self.d = q_lens, seq_lens, hkv, hq, d
        t = sum(q_lens)
        self.q = torch.randn(t, hq, d, generator=gen)
        self.k_new = torch.randn(t, hkv, d, generator=gen)
        self.v_new = torch.randn(t, hkv, d, generator=gen)
        self.n_layers = max(1, -(-layers_bytes // (2 * nb * bs * hkv * d * 4)))
        self.cpu_caches = {lay: [] for lay in k_layouts}
        self.bf16_caches = []  # K transposed, bf16 (with --bf16)
        self.torch_caches = []
        def place(t: torch.Tensor) -> torch.Tensor:  # optionally a copy on transparent huge pages
            if not thp:
                return t
            return cpu_pa.huge_page_empty(tuple(t.shape)).copy_(t)

        for _ in range(self.n_layers):
            k_ref = torch.randn(nb, bs, hkv, d, generator=gen)
            v_ref = torch.randn(nb, bs, hkv, d, generator=gen)
            if bf16:  # the same values in both caches
                k_ref, v_ref = k_ref.bfloat16().float(), v_ref.bfloat16().float()
                self.bf16_caches.append(cpu_pa.from_reference_layout(k_ref.bfloat16(), v_ref.bfloat16()))
            for lay in k_layouts:
                k, v = cpu_pa.from_reference_layout(k_ref, v_ref, k_layout=lay)
                self.cpu_caches[lay].append((place(k), place(v)))
            self.torch_caches.append((place(k_ref.permute(0, 2, 1, 3).contiguous()),
                                      place(v_ref.permute(0, 2, 1, 3).contiguous())))

    def kv_bytes_read(self, itemsize: int = 4) -> int:
        return sum(self.seq_lens) * self.hkv * self.d * itemsize * 2

    def flops(self) -> float:
        return sum(4.0 * n * (c + (n + 1) / 2) * self.hq * self.d for n, c in self.pairs)

    def rate(self, ms: float, itemsize: int = 4) -> str:
        if max(self.q_lens) == 1:
            return f"{self.kv_bytes_read(itemsize) / ms / 1e6:6.1f} GB/s"
        return f"{self.flops() / ms / 1e6:6.1f} GFLOP/s"

    # Timed functions (argument: layer index).
    def ours(self, k_layout=cpu_pa.K_TRANSPOSED, rows=None, bf16=False, q_bf16=False):
        out = torch.empty_like(self.q)
        m = self.meta
        scale = self.d ** -0.5
        q = self.q.bfloat16() if q_bf16 else self.q

        def fn(i):
            k, v = self.bf16_caches[i] if bf16 else self.cpu_caches[k_layout][i]
            cpu_pa.paged_attention(q, k, v, m.query_start_loc, m.seq_lens, m.block_tables, scale, out=out,
                                   rows_per_tile=rows, k_layout=k_layout)
        return fn

    def ours_write(self, k_layout=cpu_pa.K_TRANSPOSED):
        def fn(i):
            k, v = self.cpu_caches[k_layout][i]
            cpu_pa.write_kv_cache(self.k_new, self.v_new, k, v, self.meta.slot_mapping, k_layout=k_layout)
        return fn

    def ours_step(self, k_layout=cpu_pa.K_TRANSPOSED):
        """write + attend of one layer, as the engine runs them (the write warms the last blocks)."""
        w, a = self.ours_write(k_layout), self.ours(k_layout)

        def fn(i):
            w(i)
            a(i)
        return fn

    def torch_path(self):
        backend = TorchAttention()
        backend.prepare(self.meta, self.q_lens, self.seq_lens, self.hkv)
        scale = self.d ** -0.5

        def attend(i):
            k, v = self.torch_caches[i]
            return backend.attend(self.q, k, v, self.meta, scale, None)

        def write(i):
            k, v = self.torch_caches[i]
            backend.write_kv(self.k_new, self.v_new, k, v, self.meta)
        return attend, write


def time_interleaved(fns: dict, n_layers: int, rounds: int, calls: int) -> dict:
    """Best (over `rounds` alternating rounds) mean ms per call of each function."""
    for fn in fns.values():
        for i in range(2):
            fn(i % n_layers)
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i % n_layers)
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3 / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cases", default="all", help="comma-separated case names")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--layers-mb", type=int, default=96, help="K/V bytes the timed calls rotate over")
    p.add_argument("--thp", action="store_true",
                   help="caches of both paths on transparent huge pages (as cpu_pa.allocate_cache gives)")
    p.add_argument("--layouts", action="store_true", help="compare the K layouts (no torch path)")
    p.add_argument("--rows", default=None, help="comma-separated rows_per_tile values to compare (no torch path)")
    p.add_argument("--bf16", action="store_true", help="compare an fp32 and a bf16 KV cache (no torch path)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    if not cpu_pa.available():
        sys.exit("C++ CPU kernels unavailable")
    from splitfuse.kernels.cpu.build import isa

    gen = torch.Generator().manual_seed(0)
    cases = _cases(gen)
    if args.cases != "all":
        cases = {k: cases[k] for k in args.cases.split(",")}
    print(f"# isa={isa()} threads={args.threads} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"block={args.block_size} fp32{' THP' if args.thp else ''}; best of {args.rounds} rounds x {args.calls} calls")
    T, R = cpu_pa.K_TRANSPOSED, cpu_pa.K_ROW_MAJOR
    layouts = (T, R) if args.layouts else (T,)

    for name, pairs in cases.items():
        b = Batch(pairs, args.heads, args.kv_heads, args.head_dim, args.block_size, args.layers_mb << 20, gen,
                  layouts, thp=args.thp, bf16=args.bf16)
        if args.bf16:
            r = time_interleaved({"fp32": b.ours(), "bf16": b.ours(bf16=True), "bq": b.ours(bf16=True, q_bf16=True)},
                                 b.n_layers, args.rounds, args.calls)
            m = b.meta
            outs = [cpu_pa.paged_attention(q, k, v, m.query_start_loc, m.seq_lens, m.block_tables,
                                           args.head_dim ** -0.5)
                    for q, (k, v) in ((b.q, b.cpu_caches[T][0]), (b.q, b.bf16_caches[0]),
                                      (b.q.bfloat16(), b.bf16_caches[0]))]
            # bf16 q: a bf16 model's queries (prompt chunks take bf16 products where the CPU has
            # AVX-512 BF16); its difference is against fp32 q rounded to bf16 over the same cache.
            ref_bq = cpu_pa.paged_attention(b.q.bfloat16().float(), *b.bf16_caches[0], m.query_start_loc, m.seq_lens,
                                            m.block_tables, args.head_dim ** -0.5)
            print(f"{name:<18} fp32 cache {r['fp32']:7.3f} ms ({b.rate(r['fp32'])})   bf16 cache {r['bf16']:7.3f} ms "
                  f"({b.rate(r['bf16'], 2)})   x{r['fp32'] / r['bf16']:4.2f}   "
                  f"max|diff| {(outs[0] - outs[1]).abs().max().item():.1e}   bf16 q {r['bq']:7.3f} ms "
                  f"({b.rate(r['bq'], 2)})   x{r['bf16'] / r['bq']:4.2f} over bf16 cache   "
                  f"max|diff| {(outs[2] - ref_bq).abs().max().item():.1e}")
        elif args.layouts:
            r = time_interleaved({"T": b.ours(T), "R": b.ours(R), "wT": b.ours_write(T), "wR": b.ours_write(R),
                                  "sT": b.ours_step(T), "sR": b.ours_step(R)}, b.n_layers, args.rounds, args.calls)
            print(f"{name:<18} K transposed {r['T']:7.3f} ms ({b.rate(r['T'])})   K row-major {r['R']:7.3f} ms "
                  f"({b.rate(r['R'])})   write {r['wT']:.3f} / {r['wR']:.3f} ms   write+attend {r['sT']:.3f} / "
                  f"{r['sR']:.3f} ms")
        elif args.rows:
            rows = [int(x) for x in args.rows.split(",")]
            r = time_interleaved({x: b.ours(rows=x) for x in rows}, b.n_layers, args.rounds, args.calls)
            print(f"{name:<18} " + "   ".join(f"rows {x}: {r[x]:7.3f} ms ({b.rate(r[x])})" for x in rows))
        else:
            attend, write = b.torch_path()
            r = time_interleaved({"ours": b.ours(), "torch": attend, "ours_w": b.ours_write(), "torch_w": write},
                                 b.n_layers, args.rounds, args.calls)
            k, v = b.cpu_caches[T][0]
            m = b.meta
            a = cpu_pa.paged_attention(b.q, k, v, m.query_start_loc, m.seq_lens, m.block_tables, args.head_dim ** -0.5)
            diff = (a - attend(0)).abs().max().item()  # same K/V (both wrote the same new rows)
            print(f"{name:<18} torch {r['torch']:7.3f} ms ({b.rate(r['torch'])})   C++ {r['ours']:7.3f} ms "
                  f"({b.rate(r['ours'])})   x{r['torch'] / r['ours']:4.2f}   write torch {r['torch_w']:.3f} / "
                  f"C++ {r['ours_w']:.3f} ms   max|diff| {diff:.1e}")


if __name__ == "__main__":
    main()
