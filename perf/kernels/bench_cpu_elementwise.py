"""Microbenchmark: the C++ CPU elementwise kernels vs the engine's torch path (us per call).

    .venv/bin/python perf/kernels/bench_cpu_elementwise.py [--threads 2] [--tokens 1 16 128 512]
        [--threshold N] [--sweep-threshold] [--repeats 15] [--calls 40]

Shapes of the benchmark model (hidden 512, intermediate 1536, Hq 8, Hkv 4, head_dim 64), fp32.
Each number is the minimum over `--repeats` batches of `--calls` calls (the machine is shared:
the minimum is the least disturbed estimate; the median is printed beside it). Rows:
  rms_norm        x [T, 512]                        torch reference vs C++ (new output)
  rms_norm+res    x, residual [T, 512]              torch vs C++ new outputs vs C++ in place
                                                    (out=x, residual_out=residual)
  rotary          q, k strided views of qkv [T, 1024]  torch (new q, k) vs C++ new contiguous
                                                    q, k vs C++ in place
  rotary+contig   as the model consumes it: rotate, then q.contiguous() (the attention input)
  silu_and_mul    x [T, 3072] -> [T, 1536]          torch vs C++ (new) vs C++ (out=)
--sweep-threshold times the C++ kernels at several OpenMP thresholds (elements per call above
which rows are split over threads) to choose the default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from splitfuse.kernels.cpu import elementwise as ew
from splitfuse.kernels.reference import apply_rotary_reference, rms_norm_reference, silu_and_mul_reference
from splitfuse.layers.rotary import rope_cos_sin, rope_inverse_frequencies

HIDDEN, INTER, HQ, HKV, D = 512, 1536, 8, 4, 64


def timeit(fn, repeats: int, calls: int) -> tuple[float, float]:
    """(min, median) us per call over `repeats` batches of `calls` calls."""
    for _ in range(5):
        fn()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return min(per), statistics.median(per)


def cases(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    res = torch.randn(tokens, HIDDEN, generator=gen)
    w = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    x_ip, res_ip = x.clone(), res.clone()  # in-place variants (values drift; timing only)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen)
    q = qkv[:, : HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D: (HQ + HKV) * D].view(tokens, HKV, D)
    cos, sin = rope_cos_sin(rope_inverse_frequencies(D, 10000.0, None), 4096)
    pos = torch.randint(0, 4096, (tokens,), generator=gen)
    g = torch.randn(tokens, 2 * INTER, generator=gen)
    g_out = torch.empty(tokens, INTER)

    def rot_torch_contig():
        qq, kk = apply_rotary_reference(q, k, pos, cos, sin)
        return qq.contiguous(), kk

    def rot_cpp_contig():
        qq, kk = ew.apply_rotary(q, k, pos, cos, sin)
        return qq.contiguous(), kk

    def rot_cpp_inplace_contig():
        qq, kk = ew.apply_rotary(q, k, pos, cos, sin, inplace=True)
        return qq.contiguous(), kk

    return [
        ("rms_norm", [("torch", lambda: rms_norm_reference(x, w, 1e-6)),
                      ("c++", lambda: ew.rms_norm(x, w, 1e-6))]),
        ("rms_norm+res", [("torch", lambda: rms_norm_reference(x, w, 1e-6, res)),
                          ("c++", lambda: ew.rms_norm(x, w, 1e-6, res)),
                          ("c++ inplace", lambda: ew.rms_norm(x_ip, w, 1e-6, res_ip, out=x_ip, residual_out=res_ip))]),
        ("rotary", [("torch", lambda: apply_rotary_reference(q, k, pos, cos, sin)),
                    ("c++", lambda: ew.apply_rotary(q, k, pos, cos, sin)),
                    ("c++ inplace", lambda: ew.apply_rotary(q, k, pos, cos, sin, inplace=True))]),
        ("rotary+contig", [("torch", rot_torch_contig), ("c++", rot_cpp_contig),
                           ("c++ inplace", rot_cpp_inplace_contig)]),
        ("silu_and_mul", [("torch", lambda: silu_and_mul_reference(g)),
                          ("c++", lambda: ew.silu_and_mul(g)),
                          ("c++ out=", lambda: ew.silu_and_mul(g, out=g_out))]),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--threshold", type=int, default=None, help="OpenMP threshold (elements) for the C++ kernels")
    ap.add_argument("--sweep-threshold", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    if not ew.available():
        print("C++ CPU kernels unavailable", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    if args.threshold is not None:
        ew.set_parallel_threshold(args.threshold)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vector width {ew.vector_width()} floats, "
          f"OpenMP threshold {ew.get_parallel_threshold()} elements")
    if args.sweep_threshold:
        default = ew.get_parallel_threshold()
        thresholds = [0, 4096, 16384, 32768, 65536, 131072, 1 << 62]
        print("us per call (min/median) by threshold:", ", ".join(map(str, thresholds)))
        for t in args.tokens:
            for name, impls in cases(t):
                for label, fn in impls:
                    if not label.startswith("c++") or name == "rotary+contig":
                        continue
                    cells = []
                    for th in thresholds:
                        ew.set_parallel_threshold(th)
                        lo, med = timeit(fn, args.repeats, args.calls)
                        cells.append(f"{lo:7.1f}/{med:<7.1f}")
                    print(f"T={t:<4} {name:<14} {label:<12} " + " ".join(cells), flush=True)
        ew.set_parallel_threshold(default)
        return 0
    print(f"{'T':>4} {'op':<14} {'impl':<12} {'min us':>9} {'median':>9} {'speedup(min)':>12}")
    for t in args.tokens:
        for name, impls in cases(t):
            base = None
            for label, fn in impls:
                lo, med = timeit(fn, args.repeats, args.calls)
                base = base or lo
                print(f"{t:>4} {name:<14} {label:<12} {lo:9.1f} {med:9.1f} {base / lo:11.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
