#!/usr/bin/env python
"""Micro-benchmarks of the Triton-lang kernels in `splitfuse.kernels` (needs a CUDA GPU).

Sections
  decode      decode-only paged attention over contexts x batch sizes: achieved bandwidth
              (K/V bytes read / time) in GB/s and as a share of the device's HBM peak, with the
              split-KV heuristic on (auto) and off (num_splits=1); baselines: torch SDPA over a
              contiguous cache, flash-attn's `flash_attn_with_kvcache` (contiguous) and our
              flash-attn paged wrapper (page size 256), where flash-attn imports.
  prefill     causal prefill attention TFLOP/s, with no cached prefix and as a SplitFuse chunk
              on top of a cached prefix; baselines: SDPA (is_causal) and flash_attn_varlen_func.
  elementwise rms_norm (+ fused add), silu_and_mul, rotary, write_kv_cache vs the torch references.

Results go to perf/results/bench_kernels_<device>.json and .md.
HBM peak comes from a table keyed by device name, or from --hbm-peak-gbs.

    python perf/kernels/bench_kernels.py                      # full sweep, Llama-3-8B attention shape, bf16
    python perf/kernels/bench_kernels.py --quick              # a few points per section
    python perf/kernels/bench_kernels.py --hbm-peak-gbs 3350 --sections decode

`--cpu-smoke` runs tiny shapes on CPU under TRITON_INTERPRET=1 to exercise this script itself;
its numbers mean nothing and it writes to a `_cpu-smoke` file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.paths import RESULTS  # noqa: E402


# Peak HBM bandwidth in GB/s (vendor figures), matched as substrings of
# torch.cuda.get_device_name(); more specific names first.
HBM_PEAK_GBS: list[tuple[str, float]] = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 80GB HBM3
    ("H800", 3350.0),
    ("H20", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40GB SXM4 / PCIe
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 6000 Ada", 960.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="decode,prefill,elementwise",
                   help="comma-separated subset of decode,prefill,elementwise")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size in tokens")
    p.add_argument("--contexts", type=ints, default=[1024, 2048, 4096, 8192, 16384, 32768],
                   help="decode context lengths")
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 64, 256], help="decode batch sizes")
    p.add_argument("--prefill-lens", type=ints, default=[512, 1024, 2048, 4096, 8192],
                   help="prefill sequence lengths (no cached prefix)")
    p.add_argument("--prefill-tokens", type=int, default=16384,
                   help="tokens per prefill step: max(1, this // len) sequences of each length")
    p.add_argument("--chunk", type=int, default=512, help="SplitFuse chunk size for the chunked-prefill rows")
    p.add_argument("--chunk-contexts", type=ints, default=[2048, 8192, 32768],
                   help="cached prefix lengths under one chunk")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size for the elementwise kernels")
    p.add_argument("--intermediate", type=int, default=14336, help="MLP size for silu_and_mul")
    p.add_argument("--tokens", type=int, default=4096, help="tokens for the elementwise kernels")
    p.add_argument("--hbm-peak-gbs", type=float, default=None, help="override the HBM peak of the table")
    p.add_argument("--max-cache-gib", type=float, default=None,
                   help="skip decode points whose K/V cache exceeds this (default: 45%% of free memory)")
    p.add_argument("--block-m", type=int, default=None, help="override paged_attention's query tile rows (tuning)")
    p.add_argument("--block-n", type=int, default=None, help="override paged_attention's key tile (tuning)")
    p.add_argument("--no-baselines", action="store_true", help="only time splitfuse kernels")
    p.add_argument("--quick", action="store_true", help="a few points per section")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="exercise this script on CPU under TRITON_INTERPRET=1 with tiny shapes (numbers meaningless)")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(args.sections) - {"decode", "prefill", "elementwise"}
    if bad:
        p.error(f"unknown sections: {sorted(bad)}")
    if args.cpu_smoke:
        args.dtype = "float16"
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size = 4, 2, 32, 16
        args.contexts, args.batches = [256, 600], [1, 3]
        args.prefill_lens, args.prefill_tokens = [64, 128], 128
        args.chunk, args.chunk_contexts = 32, [100]
        args.hidden, args.intermediate, args.tokens = 64, 96, 8
    elif args.quick:
        args.contexts, args.batches = [1024, 8192, 32768], [1, 16, 256]
        args.prefill_lens, args.chunk_contexts = [1024, 4096], [8192]
    return args


def hbm_peak_gbs(name: str) -> float | None:
    for key, gbs in HBM_PEAK_GBS:
        if key.lower() in name.lower():
            return gbs
    return None


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "device"


class Bench:
    """Timing and result bookkeeping shared by the sections."""

    def __init__(self, args: argparse.Namespace, torch, device) -> None:
        self.args, self.torch, self.device = args, torch, device
        self.dtype = getattr(torch, args.dtype)
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.results: dict[str, list[dict]] = {"decode": [], "prefill": [], "elementwise": []}

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds per call (triton's do_bench on CUDA: L2 flushed between calls)."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.args.warmup_ms, rep=self.args.rep_ms, return_mode="median"))
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def guarded(self, row: dict, label: str, fn: Callable[[], Any]) -> float | None:
        """Time fn into row[label + '_ms']; a failure (OOM, unsupported) is noted, not fatal."""
        try:
            ms = self.time_ms(fn)
        except Exception as exc:  # baselines may not support a shape; OOM on big points
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
            return None
        row[f"{label}_ms"] = round(ms, 5)
        return ms

    def free_bytes(self) -> int:
        if self.device.type == "cuda":
            return self.torch.cuda.mem_get_info(self.device)[0]
        return 8 << 30


def paged_cache(torch, num_seqs: int, seq_len: int, hkv: int, d: int, page: int, dtype, device):
    """A cache holding num_seqs sequences of seq_len tokens on shuffled pages, plus their block table."""
    pages = math.ceil(seq_len / page)
    num_blocks = num_seqs * pages
    k_cache = torch.randn(num_blocks, page, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_seqs, pages)
    return k_cache, v_cache, block_tables


def run_decode(b: Bench) -> None:
    torch, a, dev = b.torch, b.args, b.device
    from splitfuse.kernels import paged_attention
    from splitfuse.kernels.triton_lang._common import num_sms
    from splitfuse.kernels import choose_num_splits

    fa_fn, fa_paged = _flash_attn(b)
    hq, hkv, d, page = a.num_heads, a.num_kv_heads, a.head_dim, a.block_size
    limit = (a.max_cache_gib * 2**30) if a.max_cache_gib else 0.45 * b.free_bytes()
    scale = d ** -0.5
    for ctx in a.contexts:
        for bs in a.batches:
            kv_bytes = 2 * bs * math.ceil(ctx / page) * page * hkv * d * b.elem
            row: dict[str, Any] = {"context": ctx, "batch": bs, "kv_gib": round(kv_bytes / 2**30, 3)}
            b.results["decode"].append(row)
            if kv_bytes > limit:
                row["skipped"] = f"K/V cache {kv_bytes / 2**30:.1f} GiB > limit {limit / 2**30:.1f} GiB"
                continue
            # Bytes a decode step must move: all K/V once, plus q, out and the block table.
            moved = bs * ctx * hkv * d * 2 * b.elem + 2 * bs * hq * d * b.elem + bs * math.ceil(ctx / page) * 4
            row["splits_auto"] = choose_num_splits(bs, hkv, ctx, num_sms(dev))
            try:
                k_cache, v_cache, bt = paged_cache(torch, bs, ctx, hkv, d, page, b.dtype, dev)
            except Exception as exc:  # OOM despite the estimate
                row["skipped"] = f"{type(exc).__name__}"
                continue
            q = torch.randn(bs, hq, d, dtype=b.dtype, device=dev)
            qsl = torch.arange(bs + 1, dtype=torch.int32, device=dev)
            seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
            out = torch.empty_like(q)
            for label, splits in (("splitfuse_auto", None), ("splitfuse_nosplit", 1)):
                ms = b.guarded(row, label, lambda s=splits: paged_attention(
                    q, k_cache, v_cache, qsl, seq_lens, bt, scale, 1, ctx, out=out, num_splits=s,
                    block_m=a.block_m, block_n=a.block_n))
                if ms:
                    row[f"{label}_gbs"] = round(moved / (ms * 1e-3) / 1e9, 1)
            del k_cache, v_cache, bt
            if not a.no_baselines:
                _decode_baselines(b, row, q, ctx, moved, fa_fn, fa_paged)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            print(f"decode ctx={ctx:6d} B={bs:4d}: " + _fmt(row, "_gbs", "GB/s"), flush=True)


def _decode_baselines(b: Bench, row: dict, q, ctx: int, moved: int, fa_fn, fa_paged) -> None:
    torch, a, dev = b.torch, b.args, b.device
    bs, hq, d = q.shape
    hkv = a.num_kv_heads
    k = torch.randn(bs, hkv, ctx, d, dtype=b.dtype, device=dev)
    v = torch.randn_like(k)
    q4 = q.view(bs, hq, 1, d)
    F = torch.nn.functional
    ms = b.guarded(row, "sdpa", lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
    if ms:
        row["sdpa_gbs"] = round(moved / (ms * 1e-3) / 1e9, 1)
    del k, v
    if fa_fn is not None:
        # flash-attn's own decode path over a contiguous [B, ctx, Hkv, D] cache.
        kc = torch.randn(bs, ctx, hkv, d, dtype=b.dtype, device=dev)
        vc = torch.randn_like(kc)
        lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        ms = b.guarded(row, "flash_attn_kvcache",
                       lambda: fa_fn(q.view(bs, 1, hq, d), kc, vc, cache_seqlens=lens, causal=True))
        if ms:
            row["flash_attn_kvcache_gbs"] = round(moved / (ms * 1e-3) / 1e9, 1)
        del kc, vc
    if fa_paged is not None:
        kc, vc, bt = paged_cache(torch, bs, ctx, hkv, d, 256, b.dtype, dev)
        qsl = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        ms = b.guarded(row, "flash_attn_paged256",
                       lambda: fa_paged(q, kc, vc, qsl, lens, bt, d ** -0.5, 1, ctx))
        if ms:
            row["flash_attn_paged256_gbs"] = round(moved / (ms * 1e-3) / 1e9, 1)
        del kc, vc, bt


def run_prefill(b: Bench) -> None:
    torch, a, dev = b.torch, b.args, b.device
    from splitfuse.kernels import paged_attention

    hq, hkv, d, page = a.num_heads, a.num_kv_heads, a.head_dim, a.block_size
    scale = d ** -0.5
    # (new tokens per sequence, cached tokens, sequences)
    points = [(n, 0, max(1, a.prefill_tokens // n)) for n in a.prefill_lens]
    points += [(a.chunk, c, 1) for c in a.chunk_contexts]
    fa_varlen = _flash_attn_varlen(b)
    for new, cached, seqs in points:
        total = new + cached
        # Causal FLOPs: query i (0-based among the new ones) sees cached + i + 1 keys; QK^T and PV, 2 flop/MAC.
        flops = 4 * seqs * hq * d * (new * cached + new * (new + 1) / 2)
        row: dict[str, Any] = {"new_tokens": new, "cached": cached, "seqs": seqs}
        b.results["prefill"].append(row)
        k_cache, v_cache, bt = paged_cache(torch, seqs, total, hkv, d, page, b.dtype, dev)
        q = torch.randn(seqs * new, hq, d, dtype=b.dtype, device=dev)
        qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=dev)
        seq_lens = torch.full((seqs,), total, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        ms = b.guarded(row, "splitfuse", lambda: paged_attention(
            q, k_cache, v_cache, qsl, seq_lens, bt, scale, new, total, out=out, block_m=a.block_m, block_n=a.block_n))
        if ms:
            row["splitfuse_tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
        del k_cache, v_cache, bt
        if not a.no_baselines:
            F = torch.nn.functional
            qd = q.view(seqs, new, hq, d).transpose(1, 2)
            k = torch.randn(seqs, hkv, total, d, dtype=b.dtype, device=dev)
            v = torch.randn_like(k)
            if cached == 0:
                sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            else:  # bottom-right aligned causal mask for a chunk over a cached prefix
                mask = torch.ones(new, total, dtype=torch.bool, device=dev).tril(diagonal=cached)
                sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
            ms = b.guarded(row, "sdpa", sdpa)
            if ms:
                row["sdpa_tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
            del k, v
            if fa_varlen is not None:
                kf = torch.randn(seqs * total, hkv, d, dtype=b.dtype, device=dev)
                vf = torch.randn_like(kf)
                cu_k = torch.arange(0, seqs * total + 1, total, dtype=torch.int32, device=dev)
                ms = b.guarded(row, "flash_attn_varlen", lambda: fa_varlen(
                    q, kf, vf, qsl, cu_k, new, total, softmax_scale=scale, causal=True))
                if ms:
                    row["flash_attn_varlen_tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
                del kf, vf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"prefill new={new:5d} cached={cached:5d} seqs={seqs:3d}: " + _fmt(row, "_tflops", "TFLOP/s"),
              flush=True)


def run_elementwise(b: Bench) -> None:
    torch, a, dev = b.torch, b.args, b.device
    from splitfuse.kernels import (apply_rotary, apply_rotary_reference, rms_norm, rms_norm_reference,
                                   silu_and_mul, silu_and_mul_reference, write_kv_cache, write_kv_cache_reference)

    t, h, i = a.tokens, a.hidden, a.intermediate
    hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
    e = b.elem
    x = torch.randn(t, h, dtype=b.dtype, device=dev)
    res = torch.randn_like(x)
    w = torch.randn(h, dtype=b.dtype, device=dev)
    gate_up = torch.randn(t, 2 * i, dtype=b.dtype, device=dev)
    q = torch.randn(t, hq, d, dtype=b.dtype, device=dev)
    k = torch.randn(t, hkv, d, dtype=b.dtype, device=dev)
    pos = torch.randint(0, 8192, (t,), device=dev)
    cos = torch.randn(8192, d // 2, device=dev)
    sin = torch.randn(8192, d // 2, device=dev)
    pages = math.ceil(t / a.block_size) + 1
    kc = torch.zeros(pages, a.block_size, hkv, d, dtype=b.dtype, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(pages * a.block_size, device=dev)[:t]
    cases = [
        ("rms_norm", 2 * t * h * e, lambda: rms_norm(x, w, 1e-6), lambda: rms_norm_reference(x, w, 1e-6)),
        ("rms_norm+residual", 4 * t * h * e, lambda: rms_norm(x, w, 1e-6, res),
         lambda: rms_norm_reference(x, w, 1e-6, res)),
        ("silu_and_mul", 3 * t * i * e, lambda: silu_and_mul(gate_up), lambda: silu_and_mul_reference(gate_up)),
        ("apply_rotary", 2 * t * (hq + hkv) * d * e, lambda: apply_rotary(q, k, pos, cos, sin),
         lambda: apply_rotary_reference(q, k, pos, cos, sin)),
        ("write_kv_cache", 4 * t * hkv * d * e, lambda: write_kv_cache(k, k, kc, vc, slots),
         lambda: write_kv_cache_reference(k, k, kc, vc, slots)),
    ]
    for name, moved, kernel, ref in cases:
        row: dict[str, Any] = {"kernel": name, "tokens": t, "mb_moved": round(moved / 1e6, 2)}
        b.results["elementwise"].append(row)
        for label, fn in (("splitfuse", kernel), ("torch", ref)):
            if label == "torch" and a.no_baselines:
                continue
            ms = b.guarded(row, label, fn)
            if ms:
                row[f"{label}_gbs"] = round(moved / (ms * 1e-3) / 1e9, 1)
        print(f"elementwise {name:18s}: " + _fmt(row, "_gbs", "GB/s"), flush=True)


def _flash_attn(b: Bench):
    """(flash_attn_with_kvcache or None, our paged wrapper or None) when flash-attn can run here."""
    if b.args.no_baselines or b.device.type != "cuda":
        return None, None
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:
        return None, None
    from splitfuse.kernels.flash_attn import flash_attn_paged_attention, flash_attn_supported

    ok, _ = flash_attn_supported(b.dtype, 256, b.device, b.args.head_dim)
    return flash_attn_with_kvcache, (flash_attn_paged_attention if ok else None)


def _flash_attn_varlen(b: Bench):
    if b.args.no_baselines or b.device.type != "cuda":
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def _fmt(row: dict, suffix: str, unit: str) -> str:
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    parts = [f"{k[:-len(suffix)]}={v}" for k, v in row.items() if k.endswith(suffix)]
    errors = [k[:-6] for k in row if k.endswith("_error")]
    return (", ".join(parts) + f" {unit}") + (f"  (failed: {', '.join(errors)})" if errors else "")


def write_results(b: Bench, meta: dict) -> tuple[Path, Path]:
    a = b.args
    a.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_kernels_{slug(meta['device_name'])}" + ("_cpu-smoke" if a.cpu_smoke else "")
    json_path, md_path = a.out_dir / f"{stem}.json", a.out_dir / f"{stem}.md"
    json_path.write_text(json.dumps({"meta": meta, **b.results}, indent=1) + "\n")
    peak = meta["hbm_peak_gbs"]
    lines = [f"# Kernel benchmarks: {meta['device_name']}", "",
             f"{meta['timestamp']}; torch {meta['torch']}, triton {meta['triton']}, flash-attn "
             f"{meta['flash_attn'] or 'absent'}; {a.dtype}; Hq={a.num_heads} Hkv={a.num_kv_heads} D={a.head_dim} "
             f"page={a.block_size}; HBM peak {peak or 'unknown'} GB/s ({meta['hbm_peak_source']}).", ""]
    if b.results["decode"]:
        cols = ["splitfuse_auto", "splitfuse_nosplit", "sdpa", "flash_attn_kvcache", "flash_attn_paged256"]
        lines += ["## Decode attention (GB/s; % of HBM peak for splitfuse auto)", "",
                  "| context | batch | splits | " + " | ".join(cols) + " | % peak |",
                  "|---:|---:|---:|" + "---:|" * (len(cols) + 1)]
        for r in b.results["decode"]:
            if "skipped" in r:
                lines.append(f"| {r['context']} | {r['batch']} | - | skipped: {r['skipped']} |" + " |" * len(cols))
                continue
            vals = [str(r.get(f"{c}_gbs", "-")) for c in cols]
            share = f"{100 * r['splitfuse_auto_gbs'] / peak:.0f}%" if peak and r.get("splitfuse_auto_gbs") else "-"
            lines.append(f"| {r['context']} | {r['batch']} | {r.get('splits_auto', '-')} | " + " | ".join(vals)
                         + f" | {share} |")
        lines.append("")
    if b.results["prefill"]:
        cols = ["splitfuse", "sdpa", "flash_attn_varlen"]
        lines += ["## Prefill attention (TFLOP/s, causal FLOPs)", "",
                  "| new tokens | cached | seqs | " + " | ".join(cols) + " |", "|---:|---:|---:|" + "---:|" * len(cols)]
        for r in b.results["prefill"]:
            vals = [str(r.get(f"{c}_tflops", "-")) for c in cols]
            lines.append(f"| {r['new_tokens']} | {r['cached']} | {r['seqs']} | " + " | ".join(vals) + " |")
        lines.append("")
    if b.results["elementwise"]:
        lines += ["## Elementwise kernels (GB/s of compulsory traffic)", "",
                  "| kernel | tokens | MB moved | splitfuse | torch |", "|---|---:|---:|---:|---:|"]
        for r in b.results["elementwise"]:
            lines.append(f"| {r['kernel']} | {r['tokens']} | {r['mb_moved']} | {r.get('splitfuse_gbs', '-')} | "
                         f"{r.get('torch_gbs', '-')} |")
        lines.append("")
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if args.cpu_smoke:
        device = torch.device("cpu")
        name = "cpu"
    else:
        if not torch.cuda.is_available():
            print("bench_kernels: no CUDA GPU is available (torch.cuda.is_available() is False); these "
                  "benchmarks need one. Nothing was measured. (--cpu-smoke only exercises the script.)",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
    try:
        import triton
    except ImportError:
        print("bench_kernels: the `triton` package is not installed.", file=sys.stderr)
        return 2
    try:
        import flash_attn
        fa_version = getattr(flash_attn, "__version__", "unknown")
    except Exception:
        fa_version = None
    peak = args.hbm_peak_gbs or (hbm_peak_gbs(name) if device.type == "cuda" else None)
    meta = {
        "device_name": name,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "flash_attn": fa_version,
        "python": platform.python_version(),
        "hbm_peak_gbs": peak,
        "hbm_peak_source": "--hbm-peak-gbs" if args.hbm_peak_gbs else ("table" if peak else "unknown"),
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    print(f"bench_kernels on {name}: HBM peak {peak or 'unknown'} GB/s ({meta['hbm_peak_source']})", flush=True)
    b = Bench(args, torch, device)
    torch.manual_seed(0)
    runners = {"decode": run_decode, "prefill": run_prefill, "elementwise": run_elementwise}
    for section in args.sections:
        runners[section](b)
    json_path, md_path = write_results(b, meta)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
