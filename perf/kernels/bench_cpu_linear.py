"""Microbenchmark: the C++ linear kernel (`CpuLinear`) over a model's projections, as the engine
runs them: every layer's weights distinct, so that a deep model's weights come from memory at each
step as they do in the engine (one layer's weights called over and over stay in the caches and
flatter the kernel), and the four projections of a layer called in the engine's order.

    .venv/bin/python perf/kernels/bench_cpu_linear.py --model-dir models/smollm2-135m-instruct \
        --dtypes float32,bfloat16 --rows 512,64,24,1 --name smollm2

Shapes come from the checkpoint's config.json (hidden, intermediate, heads, layers); the weights
are random (the kernel's speed does not depend on them). For each dtype and row count: the best of
`--repeats` passes over all layers, its GFLOP/s, and its share of the GEMM peak on record for this
CPU and thread count (`perf/results/machine_peaks.json`, as `perf/engine/offline_compare.py` raises its
floors; measured now where the record has none), overall and per projection. Writes
perf/results/2026-11-27-linear/<name>.json with the machine, CPU flags, commit and command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common import paths  # noqa: E402
from perf.common.machine import machine_info  # noqa: E402
from perf.common.roofline import Roofline  # noqa: E402

from splitfuse.kernels.cpu import build  # noqa: E402
from splitfuse.layers.linear import CpuLinear  # noqa: E402

RESULTS = paths.RESULTS / "2026-11-27-linear"


def projections(config: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (packed output columns, input size, gated) of one decoder layer."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    return {"qkv": ((heads + 2 * kv) * d, h, False), "o": (h, heads * d, False),
            "gate_up": (2 * inter, h, True), "down": (h, inter, False)}


def run(shapes: dict[str, tuple[int, int, bool]], layers: int, dtype: torch.dtype, rows: int,
        repeats: int) -> tuple[float, dict[str, float]]:
    """Best wall time (s) of one pass over all layers, and each projection's time in that pass."""
    gen = torch.Generator().manual_seed(0)
    model = [[CpuLinear((torch.randn(n, k, generator=gen) * 0.05).to(dtype), None, gated=g)
              for n, k, g in shapes.values()] for _ in range(layers)]
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k, _ in shapes.values()}
    best, best_parts = float("inf"), {}
    for _ in range(repeats + 1):  # the first pass warms up
        parts = dict.fromkeys(shapes, 0.0)
        start = time.perf_counter()
        for layer in model:
            for name, lin in zip(shapes, layer):
                t = time.perf_counter()
                lin(inputs[lin.in_features])
                parts[name] += time.perf_counter() - t
        wall = time.perf_counter() - start
        if wall < best:
            best, best_parts = wall, parts
    return best, best_parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a checkpoint directory (its config.json gives the shapes)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="512,64,24,1", help="comma list of row counts (tokens per step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="linear")
    args = ap.parse_args()

    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    shapes, layers = projections(config), int(config["num_hidden_layers"])
    dtypes = args.dtypes.split(",")
    roof = Roofline.measure(args.threads, dtypes).with_record()
    torch.set_num_threads(args.threads)
    points = []
    for dt in dtypes:
        for rows in (int(r) for r in args.rows.split(",")):
            wall, parts = run(shapes, layers, getattr(torch, dt), rows, args.repeats)
            peak = roof.gemm_peak_gflops[dt]
            flop = {name: 2.0 * rows * n * k * layers for name, (n, k, _) in shapes.items()}
            gflops = sum(flop.values()) / wall / 1e9
            share = {name: round(flop[name] / parts[name] / 1e9 / peak, 3) for name in shapes}
            points.append({"dtype": dt, "rows": rows, "wall_ms": round(wall * 1e3, 3), "gflops": round(gflops, 1),
                           "share_of_peak": round(gflops / peak, 3), "share_by_projection": share})
            print(f"[linear] {dt:8s} {rows:4d} rows: {wall * 1e3:8.2f} ms over {layers} layers, {gflops:6.1f} GFLOP/s, "
                  f"{gflops / peak:.1%} of the {peak:.0f} GFLOP/s peak | "
                  + " ".join(f"{name} {s:.1%}" for name, s in share.items()), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(), "kernels_isa": build.library_isa(), "threads": args.threads,
        "model_dir": args.model_dir, "layers": layers, "projections": shapes, "roofline": roof.as_dict(),
        "points": points,
    }, indent=1))
    print(f"[linear] -> {out}")


if __name__ == "__main__":
    main()
