"""The machine's compute and memory roofline, and the floors of a workload on it. Every matmul at
a dtype's GEMM peak takes the compute time; the decodes' K/V reads at the memory read rate take
the memory time; everything else is free. The strict floor is the larger of the two (an engine
that overlapped them perfectly): no engine computing in that dtype can finish faster here, so it
bounds the speed-up over a peer of that dtype that any engine could show. The additive floor is
their sum: what an engine that overlaps nothing would need at best. Used by offline_compare.py
(offline wall time) and run_all.py (served requests/s).

The rates are measured in the same run and raised to the best ever measured on this kind of CPU
with as many threads (`results/machine_peaks.json`, updated when a run measures better), so one
run disturbed by a neighbour cannot lower the floor.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.common.machine import cpu_flags, cpu_model, git_commit
from perf.common.paths import RESULTS

# The best rates measured on each kind of CPU (see Roofline.with_record).
MACHINE_PEAKS = RESULTS / "machine_peaks.json"

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


@dataclass(frozen=True)
class Floor:
    """The floor of a workload in one dtype, in seconds, and its two parts."""

    compute_s: float  # every matmul (decode attention excepted) at the dtype's GEMM peak
    memory_s: float  # the decodes' K/V reads at the memory read rate
    kv_gb: float  # those K/V reads, in GB

    @property
    def strict_s(self) -> float:
        """Compute and memory overlapped perfectly: no engine can beat it."""
        return max(self.compute_s, self.memory_s)

    @property
    def additive_s(self) -> float:
        """Nothing overlapped: what an engine that reads K/V between its matmuls would need."""
        return self.compute_s + self.memory_s

    def as_dict(self) -> dict[str, float]:
        return {"strict_s": self.strict_s, "additive_s": self.additive_s, "compute_s": self.compute_s,
                "memory_s": self.memory_s, "decode_kv_gb": self.kv_gb}


def workload_floor(model_dir: str, lengths: list[tuple[int, int]], dtype: str, gemm_peak_gflops: float,
                   read_gbs: float) -> Floor:
    """The floor of requests of (prompt, generated) lengths in `dtype` ("float32" or "bfloat16":
    weights, activations and KV cache)."""
    itemsize = 4 if dtype == "float32" else 2
    flops = sum(flops_per_request(model_dir, p, g) - decode_attention_flops(model_dir, p, g) for p, g in lengths)
    kv_gb = sum(decode_kv_bytes(model_dir, p, g, itemsize) for p, g in lengths) / 1e9
    return Floor(flops / 1e9 / gemm_peak_gflops, kv_gb / read_gbs, kv_gb)


# ------------------------------------------------------------------ the best rates seen here
def machine_key(threads: int) -> str:
    """The record's key: the CPU (model name with family and model numbers, which a VM's name alone
    may not tell apart), the SIMD flags that pick the kernels, and the thread count."""
    return f"{cpu_model()} | {' '.join(cpu_flags())} | {threads} threads"


def _valid_rate(entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("value"), (int, float))
            and math.isfinite(entry["value"]) and entry["value"] > 0)


def load_record(path: Path) -> dict[str, dict]:
    """The record's machines; a missing or unreadable file, or a malformed entry, is ignored with a
    warning (the next update rewrites it)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        warnings.warn(f"no record of machine peaks at {path}: starting one", stacklevel=2)
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the unreadable record of machine peaks {path} ({e}); it will be rewritten",
                      stacklevel=2)
        return {}
    machines = doc.get("machines") if isinstance(doc, dict) else None
    if not isinstance(machines, dict):
        warnings.warn(f"ignoring the record of machine peaks {path}: no 'machines' object; it will be rewritten",
                      stacklevel=2)
        return {}
    return machines


def _recorded(machine: dict) -> dict[str, dict]:
    """{"gemm_peak_gflops.<dtype>" | "read_gbs": {"value", "date", "commit"}} of one machine's
    entry, the malformed figures left out with a warning."""
    out: dict[str, dict] = {}
    peaks = machine.get("gemm_peak_gflops") if isinstance(machine, dict) else None
    figures = {**{f"gemm_peak_gflops.{d}": e for d, e in (peaks if isinstance(peaks, dict) else {}).items()},
               "read_gbs": machine.get("read_gbs") if isinstance(machine, dict) else None}
    for name, entry in figures.items():
        if _valid_rate(entry):
            out[name] = entry
        elif entry is not None:
            warnings.warn(f"ignoring the malformed recorded figure {name}: {entry!r}", stacklevel=3)
    return out


def _write_atomically(path: Path, doc: dict) -> None:
    """A run stopped mid-write, or a reader at the same time, never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _shown(path: str | None) -> str | None:
    """A path inside the repository as relative to it (results files move between checkouts)."""
    root = MACHINE_PEAKS.parents[2]
    return str(Path(path).resolve().relative_to(root)) if path and Path(path).resolve().is_relative_to(root) else path


RECORD_MEANING = ("the best rates ever measured by perf/common/roofline.py per CPU (model, family/model numbers, SIMD "
                  "flags) and thread count, each with the date and commit of its run; Roofline.with_record "
                  "raises a run's figures to these and records the ones it beat")


@dataclass(frozen=True)
class Roofline:
    """The GEMM peak per dtype and the memory read rate of this machine on `threads` threads."""

    threads: int
    gemm_peak_gflops: dict[str, float]
    read_gbs: float
    # After `with_record`: the figures this run measured, and those the record raised, by name
    # ("gemm_peak_gflops.<dtype>", "read_gbs") with the record's value, date and commit.
    measured: dict | None = None
    from_record: dict[str, dict] = field(default_factory=dict)
    record_file: str | None = None

    @classmethod
    def measure(cls, threads: int, dtypes: list[str]) -> Roofline:
        """Measured in a child process. In this one the GEMMs would start an OpenMP pool on the
        calling thread, and an engine later stepped on its own thread in the same process (run_all's
        in-process `engine` systems) would then run throttled: with more OpenMP threads than cores
        libgomp stops spinning between parallel regions (a 14-sequence bf16 decode step measured
        6.7-6.8 -> 8.5-9.3 ms with a second pool alive)."""
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from perf.common import roofline as r; "
                "t, ds = int(sys.argv[2]), json.loads(sys.argv[3]); "
                "print(json.dumps([{d: r.gemm_peak_gflops(t, d) for d in ds}, r.read_bandwidth_gbs(t)]))")
        out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2]), str(threads),
                              json.dumps(dtypes)], check=True, capture_output=True, text=True).stdout
        peaks, read = json.loads(out.strip().splitlines()[-1])
        return cls(threads, peaks, read)

    def remeasured(self) -> Roofline:
        """Measured again (after the systems ran), keeping the better figures: a rate disturbed by
        another process would understate the floor and overstate every share against it."""
        again = Roofline.measure(self.threads, list(self.gemm_peak_gflops))
        return Roofline(self.threads, {d: max(v, again.gemm_peak_gflops[d]) for d, v in self.gemm_peak_gflops.items()},
                        max(self.read_gbs, again.read_gbs))

    def with_record(self, path: Path = MACHINE_PEAKS) -> Roofline:
        """Each figure raised to the best on record for this CPU and thread count; the figures this
        run measured better are recorded (with today's date and the commit). Call it once, on the
        run's final figures: the record then only grows, and a floor never drops for one noisy run."""
        key = machine_key(self.threads)
        machines = load_record(path)
        mine = machines.get(key)
        on_record = _recorded(mine) if mine is not None else {}
        ours = {**{f"gemm_peak_gflops.{d}": v for d, v in self.gemm_peak_gflops.items()}, "read_gbs": self.read_gbs}
        stamp = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit()}
        best, from_record = {}, {}
        for name, value in ours.items():
            rec = on_record.get(name)
            if rec is not None and rec["value"] >= value:
                best[name], from_record[name] = rec["value"], rec
            else:
                best[name], on_record[name] = value, {"value": value, **stamp}
        entry = {"cpu": cpu_model(), "cpu_flags": " ".join(cpu_flags()), "threads": self.threads,
                 "gemm_peak_gflops": {n.split(".", 1)[1]: e for n, e in on_record.items()
                                      if n.startswith("gemm_peak_gflops.")},
                 "read_gbs": on_record["read_gbs"]}
        # Written when this run measured better, or when the file or this entry was missing or
        # malformed (rewritten from what could be read).
        if machines.get(key) != entry:
            machines[key] = entry
            _write_atomically(path, {"meaning": RECORD_MEANING, "machines": machines})
        return Roofline(self.threads, {d: best[f"gemm_peak_gflops.{d}"] for d in self.gemm_peak_gflops},
                        best["read_gbs"], measured={"gemm_peak_gflops": dict(self.gemm_peak_gflops),
                                                    "read_gbs": self.read_gbs},
                        from_record=from_record, record_file=str(path))

    def as_dict(self) -> dict:
        """For a results file: the figures the floors use, what this run measured, and which came
        from the record (file, key, each figure's value, date and commit)."""
        out = {"threads": self.threads, "gemm_peak_gflops": self.gemm_peak_gflops, "read_gbs": self.read_gbs}
        if self.measured is not None:
            out.update(measured=self.measured, from_record=self.from_record, record_key=machine_key(self.threads),
                       record_file=_shown(self.record_file))
        return out
