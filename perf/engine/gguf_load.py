#!/usr/bin/env python
"""Start the engine on a GGUF file and report what the start cost: time, peak resident memory
against the file's size, the weights held by kind, and the CPU.

The target (issue 57): peak RSS at start <= file size + 1 GB + the KV pool, under
quantization=gguf (each projection packed from its blocks, nothing held in float32 at full size).
The conversion into the GGUF cache (config and tokenizer only) is timed apart; run it twice to see
a start that finds the conversion. Not a test: the figures depend on the machine and its load.

    python perf/engine/gguf_load.py FILE.gguf                       # quantization=gguf
    python perf/engine/gguf_load.py FILE.gguf --quantization gguf-exact --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf/ is a package
from perf.common.machine import cpu_flags, cpu_model  # noqa: E402
from splitfuse.utils.process_memory import peak_resident_bytes as peak_rss_bytes  # noqa: E402
from splitfuse.utils.process_memory import resident_bytes as rss_bytes  # noqa: E402


def measure(gguf: Path, quantization: str, kv_gb: float, max_model_len: int) -> dict:
    from splitfuse import LLM
    from splitfuse.models.gguf_checkpoint import prepare_checkpoint

    before = rss_bytes()
    t = time.perf_counter()
    checkpoint = prepare_checkpoint(gguf)
    converted_s = time.perf_counter() - t
    t = time.perf_counter()
    llm = LLM(checkpoint, quantization=quantization, kv_cache_memory_gb=kv_gb, max_model_len=max_model_len,
              enable_prefix_caching=False)
    start_s = time.perf_counter() - t
    runner = llm.engine.runner
    weights = runner.model.weight_memory()
    kv_bytes = runner.num_kv_blocks * runner.kv_bytes_per_block()
    size = gguf.stat().st_size
    peak = peak_rss_bytes()
    out = {
        "file": str(gguf), "file_bytes": size, "quantization": quantization,
        "cpu": cpu_model(), "cpu_flags": " ".join(cpu_flags()), "threads": runner.config.num_threads or os.cpu_count(),
        "conversion_s": round(converted_s, 2), "engine_start_s": round(start_s, 2),
        "rss_before_bytes": before, "peak_rss_bytes": peak, "rss_after_bytes": rss_bytes(),
        "kv_pool_bytes": kv_bytes, "weight_bytes": weights, "weight_bytes_total": sum(weights.values()),
        "bound_bytes": size + (1 << 30) + kv_bytes,
    }
    out["within_bound"] = peak <= out["bound_bytes"]
    llm.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path, help="the .gguf file")
    p.add_argument("--quantization", default="gguf", choices=["gguf", "gguf-exact", "none"])
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="the KV pool (default 0.25)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    r = measure(a.gguf.resolve(), a.quantization, a.kv_cache_memory_gb, a.max_model_len)
    gb = 1e9
    print(f"CPU: {r['cpu']} [{r['cpu_flags']}], {r['threads']} threads")
    print(f"file: {r['file']} ({r['file_bytes'] / gb:.3f} GB), quantization={r['quantization']}")
    print(f"conversion (config, tokenizer): {r['conversion_s']:.2f} s; engine start: {r['engine_start_s']:.2f} s")
    print("weights held: " + ", ".join(f"{k} {v / gb:.3f} GB" for k, v in
                                       sorted(r["weight_bytes"].items(), key=lambda kv: -kv[1]) if v)
          + f" (total {r['weight_bytes_total'] / gb:.3f} GB)")
    print(f"peak RSS {r['peak_rss_bytes'] / gb:.3f} GB (before loading {r['rss_before_bytes'] / gb:.3f} GB, after "
          f"{r['rss_after_bytes'] / gb:.3f} GB); KV pool {r['kv_pool_bytes'] / gb:.3f} GB; bound file + 1 GiB + KV "
          f"= {r['bound_bytes'] / gb:.3f} GB: {'met' if r['within_bound'] else 'MISSED'}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
