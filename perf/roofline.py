"""The machine's compute and memory roofline, and the floor of a workload on it: the shortest time
any engine computing in a dtype could take here (every matmul at that dtype's GEMM peak, the
decodes' K/V reads at the memory read rate, everything else free). A floor bounds the speed-up
over a peer of that dtype that any engine could show on this machine. Used by offline_compare.py
(offline wall time) and run_all.py (served requests/s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

def flops_per_request(model_dir: str, prompt_len: int, gen_len: int) -> float:
    """Matmul FLOPs of one request (weights 2*params per token, attention 4*ctx*H per layer,
    the LM head on sampled tokens only)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    per_token = 2 * layers * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter)
    tokens = prompt_len + gen_len
    attn = 4 * layers * heads * d * (prompt_len * prompt_len / 2 + gen_len * (prompt_len + gen_len / 2))
    return per_token * tokens + attn + 2 * h * c["vocab_size"] * gen_len


def decode_attention_flops(model_dir: str, prompt_len: int, gen_len: int) -> float:
    """The part of `flops_per_request`'s attention term spent by decode steps (memory-bound)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    d = c.get("head_dim") or c["hidden_size"] // heads
    return 4 * layers * heads * d * gen_len * (prompt_len + gen_len / 2)


def decode_kv_bytes(model_dir: str, prompt_len: int, gen_len: int, kv_itemsize: int) -> float:
    """K/V bytes the decode steps of one request must read: each generated token after the first
    reads the K and V of its whole context in every layer (a context of a few hundred tokens per
    sequence, hundreds of MB over a batch: DRAM, not cache)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    kv = c.get("num_key_value_heads", heads)
    d = c.get("head_dim") or c["hidden_size"] // heads
    contexts = sum(prompt_len + i for i in range(1, gen_len))
    return 2 * layers * kv * d * kv_itemsize * contexts


def read_bandwidth_gbs(threads: int) -> float:
    """Best memory read rate of `torch.sum` over 512 MB (far above the last-level cache) on
    transparent huge pages where the kernel offers them, as the engine's KV cache is."""
    import torch

    from splitfuse.kernels.cpu.paged_attention import huge_page_empty

    torch.set_num_threads(threads)
    x = huge_page_empty((128 << 20,)).fill_(1.0)
    x.sum()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def gemm_peak_gflops(threads: int, dtype: str = "float32") -> float:
    """Best oneDNN GEMM rate over a few large shapes (the compute roofline of this run)."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    best = 0.0
    for n, k, m in [(1536, 512, 512), (2048, 2048, 512), (4096, 1024, 256)]:
        w = torch.randn(n, k).to(dt)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        x = torch.randn(m, k).to(dt)
        for _ in range(3):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        reps = 10
        t = time.perf_counter()
        for _ in range(reps):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        best = max(best, 2 * n * k * m * reps / (time.perf_counter() - t) / 1e9)
    return best


def floor_seconds(model_dir: str, lengths: list[tuple[int, int]], dtype: str, gemm_peak_gflops: float,
                  read_gbs: float) -> tuple[float, float]:
    """The floor of requests of (prompt, generated) lengths in `dtype` ("float32" or "bfloat16":
    weights, activations and KV cache), and the decodes' K/V gigabytes in it."""
    itemsize = 4 if dtype == "float32" else 2
    flops = sum(flops_per_request(model_dir, p, g) - decode_attention_flops(model_dir, p, g) for p, g in lengths)
    kv_gb = sum(decode_kv_bytes(model_dir, p, g, itemsize) for p, g in lengths) / 1e9
    return flops / 1e9 / gemm_peak_gflops + kv_gb / read_gbs, kv_gb


@dataclass(frozen=True)
class Roofline:
    """The GEMM peak per dtype and the memory read rate of this machine on `threads` threads."""

    threads: int
    gemm_peak_gflops: dict[str, float]
    read_gbs: float

    @classmethod
    def measure(cls, threads: int, dtypes: list[str]) -> Roofline:
        """Measured in a child process. In this one the GEMMs would start an OpenMP pool on the
        calling thread, and an engine later stepped on its own thread in the same process (run_all's
        in-process `engine` systems) would then run throttled: with more OpenMP threads than cores
        libgomp stops spinning between parallel regions (a 14-sequence bf16 decode step measured
        6.7-6.8 -> 8.5-9.3 ms with a second pool alive)."""
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import roofline as r; "
                "t, ds = int(sys.argv[2]), json.loads(sys.argv[3]); "
                "print(json.dumps([{d: r.gemm_peak_gflops(t, d) for d in ds}, r.read_bandwidth_gbs(t)]))")
        out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(threads),
                              json.dumps(dtypes)], check=True, capture_output=True, text=True).stdout
        peaks, read = json.loads(out.strip().splitlines()[-1])
        return cls(threads, peaks, read)

    def remeasured(self) -> Roofline:
        """Measured again (after the systems ran), keeping the better figures: a rate disturbed by
        another process would understate the floor and overstate every share against it."""
        again = Roofline.measure(self.threads, list(self.gemm_peak_gflops))
        return Roofline(self.threads, {d: max(v, again.gemm_peak_gflops[d]) for d, v in self.gemm_peak_gflops.items()},
                        max(self.read_gbs, again.read_gbs))
